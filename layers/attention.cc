#include "layers/attention.h"

#include <sstream>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// Children of the layer's Context, in forward order.
enum Child { kQkv, kProj, kDrop, kChildren };

Context* child(Context* ctx, Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; }

LinearOptions projection(const AttentionOptions& o, int64_t out, uint64_t seed, TensorSplit split) {
  LinearOptions l(o.dim, out);
  l.leading = {o.seq_len};
  l.dtype = o.dtype;
  l.seed = seed;
  l.split = split;
  return l;
}

// The positions a member holds between the split regions: all, or under sequence
// parallelism its share (layers/tensor_parallel.h).
int64_t positions(const AttentionOptions& o) { return o.shard.positions(o.seq_len, "attention"); }

DropoutOptions dropout_options(const AttentionOptions& o) {
  DropoutOptions d({positions(o), o.dim}, o.dropout);  // on the projection's output
  d.dtype = o.dtype;
  d.seed = mix_seed(o.seed, 3);
  d.element_offset = o.shard.first_position(o.seq_len, "attention") * o.dim;
  return d;
}

const AttentionOptions& checked(const AttentionOptions& o) {
  if (o.dim <= 0 || o.heads <= 0 || o.seq_len <= 0) {
    throw UserError("attention: dim, heads and the sequence length must be positive, got dim=" +
                    std::to_string(o.dim) + ", heads=" + std::to_string(o.heads) +
                    ", seq_len=" + std::to_string(o.seq_len));
  }
  if (o.dim % o.heads != 0) {
    throw UserError("attention: " + std::to_string(o.dim) + " channels do not split into " +
                    std::to_string(o.heads) + " heads; choose heads that divide the embedding dim");
  }
  if (o.shard.rank < 0 || o.shard.rank >= o.shard.size || o.heads % o.shard.size != 0) {
    throw UserError("attention: " + std::to_string(o.heads) + " heads do not split over a tensor group of " +
                    std::to_string(o.shard.size) + "; make heads a multiple of the group's size or split over fewer "
                    "devices");
  }
  return o;
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(const AttentionOptions& opts)
    : Layer({positions(checked(opts)), opts.dim}, {positions(opts), opts.dim}, opts.dtype),
      opts_(opts),
      // Split by heads: q, k and v are three parts of the qkv projection's outputs.
      qkv_(projection(opts, 3 * opts.dim, mix_seed(opts.seed, 1), opts.shard.as(TensorSplitKind::kColumn, 3))),
      proj_(projection(opts, opts.dim, mix_seed(opts.seed, 2), opts.shard.as(TensorSplitKind::kRow))),
      drop_(dropout_options(opts)) {
  for (Parameter* p : qkv_.parameters()) p->name = "qkv." + p->name;
  for (Parameter* p : proj_.parameters()) p->name = "proj." + p->name;
}

std::string CausalSelfAttention::describe() const {
  std::ostringstream os;
  os << "attention(" << opts_.dim << ", " << opts_.heads << " heads";
  if (opts_.dropout > 0) os << ", dropout " << opts_.dropout;
  if (opts_.shard.split()) os << ", member " << opts_.shard.rank << "/" << opts_.shard.size;
  os << ")";
  return os.str();
}

void CausalSelfAttention::set_collectives(TensorCollectives* group) {
  qkv_.set_collectives(group);
  proj_.set_collectives(group);
}

std::vector<Parameter*> CausalSelfAttention::parameters() {
  std::vector<Parameter*> out = qkv_.parameters();
  for (Parameter* p : proj_.parameters()) out.push_back(p);
  return out;
}

LayerCost attention_core_cost(int64_t batch, int64_t seq_len, int64_t dim, int64_t heads, DType dtype) {
  const double B = static_cast<double>(batch), T = static_cast<double>(seq_len);
  const double C = static_cast<double>(dim), H = static_cast<double>(heads), D = C / H;
  const double es = static_cast<double>(dtype_size(dtype));
  const double bh = B * H;
  const double kept = T * (T + 1) / 2;  // unmasked scores per (batch, head)
  LayerCost core;
  // q k^T and probs v over the full (T, T): the kernels compute the masked upper
  // triangle too (one GEMM per head beats T small ones), so it is counted. Softmax:
  // max, subtract, exp, sum and scale per kept score, one reciprocal per row.
  core.forward_flops = bh * (2 * T * T * D + 5 * kept + T + 2 * T * T * D);
  // Backward, per (batch, head), as kernels/cpu_transformer_ops.cc runs it: four full
  // products, dprobs = dout v^T, dq = ds k, dk = ds^T q and dv = probs^T dout, each
  // reading its two operands and writing its result (an operand of (T, D) or (T, T));
  // between them the softmax Jacobian, a dot product and p (dp - dot) per kept score,
  // which reads probs and dprobs there and writes the whole (T, T) row of ds, zeros
  // included. Two parts: the products are bound by their flops, the Jacobian by its
  // bytes, and a roofline over their sum would hide the second (see CostPart).
  const CostPart products{false, bh * 8 * T * T * D, es * bh * (8 * T * D + 4 * T * T)};
  const CostPart jacobian{false, bh * 4 * kept, es * bh * (2 * kept + T * T)};
  core.backward_flops = products.flops + jacobian.flops;
  core.forward_bytes = es * (3 * B * T * C + bh * T * T + B * T * C);
  core.backward_bytes = products.bytes + jacobian.bytes;
  core.backward_parts = {products, jacobian};
  core.saved_bytes = static_cast<int64_t>(es * (3 * B * T * C + bh * T * T));  // qkv, probs
  return core;
}

LayerCost fused_attention_core_cost(int64_t batch, int64_t seq_len, int64_t dim, int64_t heads, int64_t kv_heads,
                                   DType dtype) {
  LayerCost core = attention_core_cost(batch, seq_len, dim, heads, dtype);
  const double B = static_cast<double>(batch), T = static_cast<double>(seq_len);
  const double C = static_cast<double>(dim), H = static_cast<double>(heads), D = C / H;
  const double KC = static_cast<double>(kv_heads) * D;
  const double es = static_cast<double>(dtype_size(dtype));
  const double bh = B * H;
  // The FLOPs are the exact path's: the backward's recompute of the scores and softmax
  // is not useful work (MFU leaves recompute out), and it is not priced either.
  // Kept: q, k, v, the output and one float32 log-sum-exp per row and head (counted per
  // tensor, as saved_bytes is: the output is also the output projection's input).
  core.saved_bytes = static_cast<int64_t>(es * (2 * B * T * C + 2 * B * T * KC) + 4 * bh * T);
  return core;
}

LayerCost CausalSelfAttention::cost(int64_t batch) const {
  // This member's heads.
  const LayerCost core = attention_core_cost(batch, opts_.seq_len, opts_.dim / opts_.shard.size,
                                             opts_.heads / opts_.shard.size, dtype_);
  LayerCost c;
  c += qkv_.cost(batch);
  c += core;
  c += proj_.cost(batch);
  c += drop_.cost(batch);
  // Only the qkv projection's dx is skipped without need_dx: everything else feeds
  // the parameter gradients too. W is the two projections' weight gradients (summed
  // above); the core's backward and the projections' dx are B.
  c.input_grad_flops = qkv_.cost(batch).input_grad_flops;
  c.output_bytes = drop_.cost(batch).output_bytes;
  return c;
}

Tensor CausalSelfAttention::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  // This member's heads and channels (all of them unsplit).
  const int64_t B = x.size(0), T = opts_.seq_len, C = opts_.dim / opts_.shard.size, H = opts_.heads / opts_.shard.size;
  if (ctx != nullptr) ctx->children.assign(kChildren, Context{});
  Tensor qkv = qkv_.forward(be, x, child(ctx, kQkv), args);  // (B, T, 3C)
  Tensor probs = be.empty({B, H, T, T}, dtype_);             // (B, H, T, T)
  Tensor att = be.empty({B, T, C}, dtype_);                  // (B, T, C), heads side by side
  be.attention(qkv, static_cast<int>(H), probs, att);
  if (ctx != nullptr) ctx->saved = {qkv, probs};
  Tensor y = proj_.forward(be, att, child(ctx, kProj), args);  // (B, T, C)
  return drop_.forward(be, y, child(ctx, kDrop), args);
}

Tensor CausalSelfAttention::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  const Tensor& qkv = ctx.saved.at(0);    // (B, T, 3C)
  const Tensor& probs = ctx.saved.at(1);  // (B, H, T, T)
  Tensor g = drop_.backward_input(be, dy, ctx.children.at(kDrop));   // (B, T, C)
  Tensor datt = proj_.backward_input(be, g, ctx.children.at(kProj));  // (B, T, C)
  Tensor dqkv = be.empty(qkv.shape(), dtype_);                        // (B, T, 3C)
  be.attention_backward(datt, qkv, probs, static_cast<int>(opts_.heads / opts_.shard.size), dqkv);
  Tensor dx = qkv_.backward_input(be, dqkv, ctx.children.at(kQkv), need_dx);
  // W needs only the projections' contexts: the scores (B, H, T, T) can go now.
  ctx.saved.clear();
  ctx.children.at(kDrop) = {};
  return dx;
}

void CausalSelfAttention::backward_weight_impl(Backend& be, Context& ctx) {
  proj_.backward_weight(be, ctx.children.at(kProj));
  qkv_.backward_weight(be, ctx.children.at(kQkv));
}

void CausalSelfAttention::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  proj_.backward_weight(be, children_at(ctxs, kProj));
  qkv_.backward_weight(be, children_at(ctxs, kQkv));
}

}  // namespace layers
}  // namespace gpipe
