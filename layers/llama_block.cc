#include "layers/llama_block.h"

#include <initializer_list>
#include <sstream>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// Children of the block's Context, in forward order.
enum Child { kNorm1, kAttn, kNorm2, kFfn, kDropAttn, kDropFfn, kChildren };

Context* child(Context* ctx, Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; }

// The positions a member holds between the split regions: all, or under sequence
// parallelism its share (layers/tensor_parallel.h).
int64_t positions(const LlamaBlockOptions& o) { return o.shard.positions(o.seq_len, "llama_block"); }

RmsNormOptions norm(const LlamaBlockOptions& o) {
  RmsNormOptions n({positions(o), o.dim});
  n.eps = o.eps;
  n.dtype = o.dtype;
  return n;
}

GqaAttentionOptions attention(const LlamaBlockOptions& o) {
  GqaAttentionOptions a(o.dim, o.heads, o.seq_len);
  a.kv_heads = o.kv_heads;
  a.rope_base = o.rope_base;
  a.dtype = o.dtype;
  a.seed = mix_seed(o.seed, 1);
  a.shard = o.shard;
  return a;
}

SwiGLUOptions ffn(const LlamaBlockOptions& o) {
  SwiGLUOptions f(o.dim, o.hidden);
  f.leading = {o.seq_len};
  f.dtype = o.dtype;
  f.seed = mix_seed(o.seed, 2);
  f.shard = o.shard;
  return f;
}

DropoutOptions dropout(const LlamaBlockOptions& o, uint64_t branch) {
  DropoutOptions d({positions(o), o.dim}, o.dropout);
  d.dtype = o.dtype;
  d.seed = mix_seed(o.seed, branch);
  d.element_offset = o.shard.first_position(o.seq_len, "llama_block") * o.dim;
  return d;
}

void prefix(const std::vector<Parameter*>& params, const std::string& name) {
  for (Parameter* p : params) p->name = name + "." + p->name;
}

}  // namespace

// dim, heads, kv_heads, hidden and eps are checked by the sub-layers, whose messages
// name the option.
LlamaBlock::LlamaBlock(const LlamaBlockOptions& opts)
    : Layer({positions(opts), opts.dim}, {positions(opts), opts.dim}, opts.dtype),
      opts_(opts),
      norm1_(norm(opts)),
      attn_(attention(opts)),
      norm2_(norm(opts)),
      ffn_(ffn(opts)),
      drop_attn_(dropout(opts, 3)),
      drop_ffn_(dropout(opts, 4)) {
  prefix(norm1_.parameters(), "norm1");
  prefix(attn_.parameters(), "attn");
  prefix(norm2_.parameters(), "norm2");
  prefix(ffn_.parameters(), "ffn");
  // The norms run on the member's positions: their gradients are partial sums.
  mark_sequence_partial(norm1_.parameters(), opts.shard.sequence_split());
  mark_sequence_partial(norm2_.parameters(), opts.shard.sequence_split());
}

std::string LlamaBlock::describe() const {
  std::ostringstream os;
  os << "llama_block(" << opts_.dim << ", " << opts_.heads << " heads, " << opts_.kv_heads << " kv heads, hidden "
     << opts_.hidden;
  if (opts_.dropout > 0) os << ", dropout " << opts_.dropout;
  if (opts_.shard.split()) os << ", member " << opts_.shard.rank << "/" << opts_.shard.size;
  os << ")";
  return os.str();
}

void LlamaBlock::set_collectives(TensorCollectives* group) {
  attn_.set_collectives(group);
  ffn_.set_collectives(group);
}

std::vector<Parameter*> LlamaBlock::parameters() {
  std::vector<Parameter*> out;
  for (Layer* l : std::initializer_list<Layer*>{&norm1_, &attn_, &norm2_, &ffn_}) {
    for (Parameter* p : l->parameters()) out.push_back(p);
  }
  return out;
}

LayerCost LlamaBlock::cost(int64_t batch) const {
  const double n = static_cast<double>(batch * positions(opts_) * opts_.dim);  // elements of x (its positions here)
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  for (const Layer* l : std::initializer_list<const Layer*>{&norm1_, &attn_, &norm2_, &ffn_, &drop_attn_, &drop_ffn_}) {
    c += l->cost(batch);
  }
  // The two residual adds, each an axpy into the branch's fresh output (reads both,
  // writes one); backward adds the residual's gradient twice. Only the last of those
  // is skipped without need_dx, with norm1's dx: the other sub-layers' dx feed
  // parameter gradients. W is every sub-layer's W (summed above).
  c.forward_flops += 2 * n;
  c.forward_bytes += 2 * 3 * es * n;
  c.backward_flops += 2 * n;
  c.backward_bytes += 2 * 3 * es * n;
  for (int add = 0; add < 2; ++add) c.backward_parts.push_back({false, n, 3 * es * n});
  c.input_grad_flops = norm1_.cost(batch).input_grad_flops + n;  // the dropouts' dx feed parameter gradients
  c.output_bytes = static_cast<int64_t>(es * n);
  return c;
}

Tensor LlamaBlock::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  if (ctx != nullptr) ctx->children.assign(kChildren, Context{});
  // h = x + drop(attn(norm1(x))), summed into the branch's fresh output (the
  // projection's, or its dropout's; x is kept by norm1's context, so it is never written).
  // Where the dropout is the identity the output projection's op adds x
  // (Linear::forward_add): on a GPU in its epilogue, on the CPU the same axpy after it.
  Tensor a = norm1_.forward(be, x, child(ctx, kNorm1), args);  // (B, T, C)
  if (drop_attn_.identity(args)) {
    a = attn_.forward_add(be, a, x, child(ctx, kAttn), args);  // (B, T, C)
    a = drop_attn_.forward(be, a, child(ctx, kDropAttn), args);  // itself; its context saves nothing
  } else {
    a = attn_.forward(be, a, child(ctx, kAttn), args);           // (B, T, C)
    a = drop_attn_.forward(be, a, child(ctx, kDropAttn), args);  // (B, T, C)
    be.axpy(1.0, x, a);
  }
  const Tensor h = a;  // (B, T, C)
  // y = h + ffn(norm2(h)), likewise into the feed-forward's fresh output.
  Tensor m = norm2_.forward(be, h, child(ctx, kNorm2), args);  // (B, T, C)
  if (drop_ffn_.identity(args)) {
    m = ffn_.forward_add(be, m, h, child(ctx, kFfn), args);    // (B, T, C)
    m = drop_ffn_.forward(be, m, child(ctx, kDropFfn), args);  // itself
  } else {
    m = ffn_.forward(be, m, child(ctx, kFfn), args);           // (B, T, C)
    m = drop_ffn_.forward(be, m, child(ctx, kDropFfn), args);  // (B, T, C)
    be.axpy(1.0, h, m);
  }
  return m;  // (B, T, C)
}

Tensor LlamaBlock::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  std::vector<Context>& ch = ctx.children;
  GPIPE_CHECK(ch.size() == kChildren, describe() + ": backward without its forward");
  // dh = d(ffn branch) + dy, the residual's gradient added in norm2's op
  // (RmsNorm::backward_input_add: on a GPU in its kernel, on the CPU an axpy after it).
  Tensor g = drop_ffn_.backward_input(be, dy, ch[kDropFfn]);  // (B, T, C)
  g = ffn_.backward_input(be, g, ch[kFfn]);                     // (B, T, C)
  const Tensor dh = norm2_.backward_input_add(be, g, ch[kNorm2], dy);  // (B, T, C)
  // dx = d(attention branch) + dh, likewise in norm1's op.
  g = drop_attn_.backward_input(be, dh, ch[kDropAttn]);  // (B, T, C)
  g = attn_.backward_input(be, g, ch[kAttn]);             // (B, T, C)
  if (!need_dx) {
    norm1_.backward_input(be, g, ch[kNorm1], false);  // keeps g for W
    return Tensor();
  }
  return norm1_.backward_input_add(be, g, ch[kNorm1], dh);  // (B, T, C)
}

// Every sub-layer's deferred weight gradients, in backward order.
void LlamaBlock::backward_weight_impl(Backend& be, Context& ctx) {
  std::vector<Context>& ch = ctx.children;
  ffn_.backward_weight(be, ch.at(kFfn));
  norm2_.backward_weight(be, ch.at(kNorm2));
  attn_.backward_weight(be, ch.at(kAttn));
  norm1_.backward_weight(be, ch.at(kNorm1));
}

void LlamaBlock::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  ffn_.backward_weight(be, children_at(ctxs, kFfn));
  norm2_.backward_weight(be, children_at(ctxs, kNorm2));
  attn_.backward_weight(be, children_at(ctxs, kAttn));
  norm1_.backward_weight(be, children_at(ctxs, kNorm1));
}

}  // namespace layers
}  // namespace gpipe
