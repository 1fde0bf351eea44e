#include "layers/transformer.h"

#include <initializer_list>
#include <sstream>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// Children of the block's Context, in forward order.
enum Child { kLn1, kAttn, kLn2, kFc1, kGelu, kFc2, kDrop, kChildren };

Context* child(Context* ctx, Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; }

const TransformerBlockOptions& checked(const TransformerBlockOptions& o) {
  if (o.mlp_ratio <= 0) {
    throw UserError("transformer_block: mlp_ratio must be positive, got " + std::to_string(o.mlp_ratio));
  }
  return o;  // dim, heads and dropout are checked by the sub-layers
}

// The positions a member holds between the split regions: all, or under sequence
// parallelism its share (layers/tensor_parallel.h).
int64_t positions(const TransformerBlockOptions& o) { return o.shard.positions(o.seq_len, "transformer_block"); }

LayerNormOptions norm(const TransformerBlockOptions& o) {
  LayerNormOptions n({positions(o), o.dim});
  n.dtype = o.dtype;
  return n;
}

AttentionOptions attention(const TransformerBlockOptions& o) {
  AttentionOptions a(o.dim, o.heads, o.seq_len);
  a.dropout = o.dropout;
  a.dtype = o.dtype;
  a.seed = mix_seed(o.seed, 1);
  a.shard = o.shard;
  return a;
}

LinearOptions fc(const TransformerBlockOptions& o, int64_t in, int64_t out, uint64_t seed, TensorSplitKind split) {
  LinearOptions l(in, out);
  l.leading = {o.seq_len};
  l.dtype = o.dtype;
  l.seed = seed;
  l.split = o.shard.as(split);
  return l;
}

DropoutOptions dropout(const TransformerBlockOptions& o) {
  DropoutOptions d({positions(o), o.dim}, o.dropout);
  d.dtype = o.dtype;
  d.seed = mix_seed(o.seed, 4);
  d.element_offset = o.shard.first_position(o.seq_len, "transformer_block") * o.dim;
  return d;
}

void prefix(const std::vector<Parameter*>& params, const std::string& name) {
  for (Parameter* p : params) p->name = name + "." + p->name;
}

}  // namespace

TransformerBlock::TransformerBlock(const TransformerBlockOptions& opts)
    : Layer({positions(opts), opts.dim}, {positions(opts), opts.dim}, opts.dtype),
      opts_(checked(opts)),
      ln1_(norm(opts)),
      attn_(attention(opts)),
      ln2_(norm(opts)),
      fc1_(fc(opts, opts.dim, opts.mlp_ratio * opts.dim, mix_seed(opts.seed, 2), TensorSplitKind::kColumn)),
      gelu_(fc1_.output_shape(), opts.dtype),  // the member's block of the hidden features
      fc2_(fc(opts, opts.mlp_ratio * opts.dim, opts.dim, mix_seed(opts.seed, 3), TensorSplitKind::kRow)),
      drop_(dropout(opts)) {
  prefix(ln1_.parameters(), "ln1");
  prefix(attn_.parameters(), "attn");
  prefix(ln2_.parameters(), "ln2");
  prefix(fc1_.parameters(), "fc1");
  prefix(fc2_.parameters(), "fc2");
  // The norms run on the member's positions: their gradients are partial sums.
  mark_sequence_partial(ln1_.parameters(), opts.shard.sequence_split());
  mark_sequence_partial(ln2_.parameters(), opts.shard.sequence_split());
}

std::string TransformerBlock::describe() const {
  std::ostringstream os;
  os << "transformer_block(" << opts_.dim << ", " << opts_.heads << " heads, mlp x" << opts_.mlp_ratio;
  if (opts_.dropout > 0) os << ", dropout " << opts_.dropout;
  if (opts_.shard.split()) os << ", member " << opts_.shard.rank << "/" << opts_.shard.size;
  os << ")";
  return os.str();
}

void TransformerBlock::set_collectives(TensorCollectives* group) {
  attn_.set_collectives(group);
  fc1_.set_collectives(group);
  fc2_.set_collectives(group);
}

std::vector<Parameter*> TransformerBlock::parameters() {
  std::vector<Parameter*> out;
  for (Layer* l : std::initializer_list<Layer*>{&ln1_, &attn_, &ln2_, &fc1_, &fc2_}) {
    for (Parameter* p : l->parameters()) out.push_back(p);
  }
  return out;
}

LayerCost TransformerBlock::cost(int64_t batch) const {
  const double n = static_cast<double>(batch * positions(opts_) * opts_.dim);  // elements of x (its positions here)
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  for (const Layer* l : std::initializer_list<const Layer*>{&ln1_, &attn_, &ln2_, &fc1_, &gelu_, &fc2_, &drop_}) {
    c += l->cost(batch);
  }
  // The two residual adds, each a copy and an axpy; backward adds the residual's
  // gradient twice. Only the last of those is skipped without need_dx: the
  // sub-layers' dx all feed parameter gradients (ln1's dx comes out of its
  // parameter pass anyway). W is the weight gradients of attention's projections and
  // of fc1 and fc2 (summed above); the layer norms take theirs in B.
  c.forward_flops += 2 * n;
  c.backward_flops += 2 * n;
  c.input_grad_flops = n;
  c.forward_bytes += 2 * (2 * es * n + 3 * es * n);
  c.backward_bytes += 2 * 3 * es * n;
  for (int add = 0; add < 2; ++add) c.backward_parts.push_back({false, n, 3 * es * n});  // B's two axpys
  c.output_bytes = static_cast<int64_t>(es * n);
  return c;
}

Tensor TransformerBlock::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  if (ctx != nullptr) ctx->children.assign(kChildren, Context{});
  // h = x + attn(ln1(x)), summed into the attention branch's output: x is saved by
  // ln1's context (and maybe by the previous layer's), so it is never written, while
  // the branch's output (the projection's, or its dropout's) is a fresh tensor no
  // context keeps. One pass (an axpy) instead of a copy of x and an axpy; the sum is
  // the same bit for bit (x + a = a + x).
  Tensor a = ln1_.forward(be, x, child(ctx, kLn1), args);  // (B, T, C)
  a = attn_.forward(be, a, child(ctx, kAttn), args);        // (B, T, C)
  be.axpy(1.0, x, a);
  const Tensor h = a;                                       // (B, T, C)
  // y = h + drop(fc2(gelu(fc1(ln2(h))))), likewise into the MLP branch's fresh output
  // (h is saved by ln2's context).
  Tensor m = ln2_.forward(be, h, child(ctx, kLn2), args);  // (B, T, C)
  m = fc1_.forward(be, m, child(ctx, kFc1), args);         // (B, T, 4C)
  m = gelu_.forward(be, m, child(ctx, kGelu), args);       // (B, T, 4C)
  m = fc2_.forward(be, m, child(ctx, kFc2), args);         // (B, T, C)
  m = drop_.forward(be, m, child(ctx, kDrop), args);       // (B, T, C)
  be.axpy(1.0, h, m);
  return m;                                                // (B, T, C)
}

Tensor TransformerBlock::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  std::vector<Context>& ch = ctx.children;
  // dh = dy + d(mlp branch). ln2's dx is a fresh tensor owned here, so the residual's
  // gradient is added into it in place.
  Tensor g = drop_.backward_input(be, dy, ch.at(kDrop));  // (B, T, C)
  g = fc2_.backward_input(be, g, ch.at(kFc2));            // (B, T, 4C)
  g = gelu_.backward_input(be, g, ch.at(kGelu));          // (B, T, 4C)
  g = fc1_.backward_input(be, g, ch.at(kFc1));            // (B, T, C)
  Tensor dh = ln2_.backward_input(be, g, ch.at(kLn2));    // (B, T, C)
  be.axpy(1.0, dy, dh);
  // dx = dh + d(attention branch); ln1 still runs for its parameter gradients.
  g = attn_.backward_input(be, dh, ch.at(kAttn));              // (B, T, C)
  Tensor dx = ln1_.backward_input(be, g, ch.at(kLn1), need_dx);  // (B, T, C), fresh
  // W needs only the linear layers' contexts (inside attention and the MLP).
  for (int c : {kLn1, kLn2, kGelu, kDrop}) ch.at(c) = {};
  if (!need_dx) return Tensor();
  be.axpy(1.0, dh, dx);
  return dx;
}

// The weight gradients the sub-layers deferred (the layer norms took theirs in B).
void TransformerBlock::backward_weight_impl(Backend& be, Context& ctx) {
  std::vector<Context>& ch = ctx.children;
  fc2_.backward_weight(be, ch.at(kFc2));
  fc1_.backward_weight(be, ch.at(kFc1));
  attn_.backward_weight(be, ch.at(kAttn));
}

void TransformerBlock::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  fc2_.backward_weight(be, children_at(ctxs, kFc2));
  fc1_.backward_weight(be, children_at(ctxs, kFc1));
  attn_.backward_weight(be, children_at(ctxs, kAttn));
}

}  // namespace layers
}  // namespace gpipe
