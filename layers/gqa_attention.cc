#include "layers/gqa_attention.h"

#include <sstream>

#include "layers/attention.h"
#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// Children of the layer's Context, in forward order; its own saved: {qkv, probs}.
enum Child { kQ, kK, kV, kO, kChildren };

Context* child(Context* ctx, Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; }

const GqaAttentionOptions& checked(const GqaAttentionOptions& o) {
  const std::string what = "gqa_attention: ";
  if (o.dim <= 0 || o.heads <= 0 || o.kv_heads <= 0 || o.seq_len <= 0) {
    throw UserError(what + "dim, heads, kv_heads and the sequence length must be positive, got dim=" +
                    std::to_string(o.dim) + ", heads=" + std::to_string(o.heads) + ", kv_heads=" +
                    std::to_string(o.kv_heads) + ", seq_len=" + std::to_string(o.seq_len));
  }
  if (o.dim % o.heads != 0) {
    throw UserError(what + std::to_string(o.dim) + " channels do not split into " + std::to_string(o.heads) +
                    " heads; choose heads that divide the embedding dim");
  }
  if (o.heads % o.kv_heads != 0) {
    throw UserError(what + "kv_heads=" + std::to_string(o.kv_heads) + " does not divide heads=" +
                    std::to_string(o.heads) + "; each key/value head serves an equal group of query heads, so "
                    "choose kv_heads dividing heads (heads for multi-head attention, 1 for multi-query)");
  }
  if (o.rope && (o.dim / o.heads) % 2 != 0) {
    throw UserError(what + "rotary embeddings rotate pairs of a head's channels, and the head width " +
                    std::to_string(o.dim / o.heads) + " (dim " + std::to_string(o.dim) + " / " +
                    std::to_string(o.heads) + " heads) is odd; choose dim and heads with an even dim / heads");
  }
  const int members = o.shard.size;
  if (o.shard.rank < 0 || o.shard.rank >= members || o.heads % members != 0 ||
      (o.kv_heads % members != 0 && members % o.kv_heads != 0)) {
    throw UserError(what + std::to_string(o.heads) + " heads and " + std::to_string(o.kv_heads) +
                    " kv heads do not both split over a tensor group of " + std::to_string(members) +
                    "; each member keeps the query heads of its share and the key/value heads they use: make heads "
                    "a multiple of the group's size, and kv_heads a multiple or a divisor of it (then each "
                    "key/value head is replicated over the members it serves), or split over fewer devices");
  }
  if (o.rope && !(o.rope_base > 1.0)) {
    throw UserError(what + "rope_base must be greater than 1, got " + std::to_string(o.rope_base) +
                    "; LLaMA uses 10000");
  }
  return o;
}

LinearOptions projection(const GqaAttentionOptions& o, int64_t out, uint64_t seed, TensorSplit split) {
  LinearOptions l(o.dim, out);
  l.leading = {o.seq_len};
  l.bias = false;
  l.dtype = o.dtype;
  l.seed = seed;
  l.split = split;
  return l;
}

// q, k and v: column-parallel by heads, their input gradients summed once by the layer.
TensorSplit by_heads(const GqaAttentionOptions& o) {
  return o.shard.as(TensorSplitKind::kColumn, 1, /*sum_input_grad=*/false);
}

// k and v: by heads too, or over a group larger than the key/value heads, member r's
// block r / (T / KV) of KV (each head held by the T / KV members it serves; whole for
// KV = 1).
TensorSplit kv_by_heads(const GqaAttentionOptions& o) {
  const int T = o.shard.size, KV = static_cast<int>(o.kv_heads);
  if (T <= KV) return by_heads(o);
  return {TensorSplitKind::kColumn, o.shard.rank / (T / KV), KV, 1, /*sum_input_grad=*/false};
}

int64_t kv_width(const GqaAttentionOptions& o) { return o.heads > 0 ? o.kv_heads * (o.dim / o.heads) : 0; }

// Per rotated pair: the angle t base^(-2i/D) (a power, and a sine and a cosine of it,
// each counted as 25 like the exponential in layers/swiglu.cc's count, and the product
// by t) and the rotation (4 products, 2 sums): 82, i.e. 41 per element.
constexpr double kRopeFlopsPerElement = 41;

}  // namespace

// The positions a member holds outside the split core: all, or under sequence
// parallelism its share (layers/tensor_parallel.h).
static int64_t positions(const GqaAttentionOptions& o) { return o.shard.positions(o.seq_len, "gqa_attention"); }

GqaAttention::GqaAttention(const GqaAttentionOptions& opts)
    : Layer({positions(checked(opts)), opts.dim}, {positions(opts), opts.dim}, opts.dtype),
      opts_(opts),
      q_(projection(opts, opts.dim, mix_seed(opts.seed, 1), by_heads(opts))),
      k_(projection(opts, kv_width(opts), mix_seed(opts.seed, 2), kv_by_heads(opts))),
      v_(projection(opts, kv_width(opts), mix_seed(opts.seed, 3), kv_by_heads(opts))),
      o_(projection(opts, opts.dim, mix_seed(opts.seed, 4), opts.shard.as(TensorSplitKind::kRow))) {
  q_.weight().name = "q.weight";
  k_.weight().name = "k.weight";
  v_.weight().name = "v.weight";
  o_.weight().name = "o.weight";
  k_.weight().shard_replicas = v_.weight().shard_replicas = static_cast<int>(kv_replicas());
}

std::string GqaAttention::describe() const {
  std::ostringstream os;
  os << "gqa_attention(" << opts_.dim << ", " << opts_.heads << " heads, " << opts_.kv_heads << " kv heads";
  if (!opts_.rope) os << ", no rope";
  if (opts_.rope && opts_.rope_base != 10000.0) os << ", rope base " << opts_.rope_base;
  if (opts_.shard.split()) os << ", member " << opts_.shard.rank << "/" << opts_.shard.size;
  os << ")";
  return os.str();
}

void GqaAttention::set_collectives(TensorCollectives* group) {
  group_ = group;
  for (Linear* l : {&q_, &k_, &v_, &o_}) l->set_collectives(group);
}

std::vector<Parameter*> GqaAttention::parameters() {
  return {&q_.weight(), &k_.weight(), &v_.weight(), &o_.weight()};
}

LayerCost GqaAttention::cost(int64_t batch) const {
  const double rows = static_cast<double>(batch * opts_.seq_len);
  // This member's heads (all of them unsplit).
  const int64_t members = opts_.shard.size, dim = opts_.dim / members;
  const double C = static_cast<double>(dim), KC = static_cast<double>(kv_heads_here() * (opts_.dim / opts_.heads));
  const double es = static_cast<double>(dtype_size(dtype_));
  const double n = rows * C;  // elements of q, and of the attention's output (this member's channels)
  const double whole = rows * static_cast<double>(opts_.dim);  // of x and y, whole on every member
  LayerCost c;
  c += q_.cost(batch);
  c += k_.cost(batch);
  c += v_.cost(batch);
  // The core: the fused operand's pack and its gradients' group sums around attention.
  // What the context keeps: the fused path's where this layer's device runs it for its
  // dtype (the CPU's while the model is planned, before the executor moves the layer; the
  // planner's probe answers for the plan's devices itself).
  c += fused_attention_available(device(), dtype_, opts_.dim / opts_.heads)
           ? fused_attention_core_cost(batch, opts_.seq_len, dim, heads_here(), kv_heads_here(), dtype_)
           : attention_core_cost(batch, opts_.seq_len, dim, heads_here(), dtype_);
  c += o_.cost(batch);
  // Forward: rope on q and k in place (read, write), pack_qkv (reads q, k, v, writes qkv).
  const double rotated = opts_.rope ? rows * (C + KC) : 0;
  c.forward_flops += kRopeFlopsPerElement * rotated;
  c.forward_bytes += 2 * es * rotated + es * (rows * (C + 2 * KC) + 3 * n);
  // B: pack_qkv_backward (reads dqkv, writes dq, dk, dv; H/KV - 1 sums per element of dk
  // and dv), rope_backward on dq and dk in place, then dx = the q projection's dx plus
  // k's and v's (two axpys, only with dx).
  const CostPart unpack{false, 2 * (n - rows * KC), es * (3 * n + rows * (C + 2 * KC))};
  const CostPart unrope{false, kRopeFlopsPerElement * rotated, 2 * es * rotated};
  const CostPart sums{false, 2 * whole, 2 * 3 * es * whole};  // dx is whole (the group's sum comes after)
  // Replicated key/value heads (kv_replicas > 1): each W of k and v fills all KV heads'
  // blocks of its gradient with zeros (writes) and adds its own back (an axpy), in the
  // gradient's type (sum_replicated_kv).
  const double kv_block = KC * static_cast<double>(opts_.dim);  // one head's k (or v) weight elements here
  const double gs = static_cast<double>(dtype_size(master_dtype(dtype_)));
  const CostPart replicated{true, 2 * kv_block,
                            2 * gs * (static_cast<double>(opts_.kv_heads) * kv_block + 3 * kv_block)};
  c.backward_parts = backward_parts(c);
  for (const CostPart& p : {unpack, unrope, sums}) {
    if (p.flops == 0 && p.bytes == 0) continue;
    c.backward_parts.push_back(p);
    c.backward_flops += p.flops;
    c.backward_bytes += p.bytes;
  }
  if (kv_replicas() > 1) {
    c.backward_parts.push_back(replicated);
    c.backward_flops += replicated.flops;
    c.backward_bytes += replicated.bytes;
    c.weight_grad_flops += replicated.flops;
    c.weight_grad_bytes += replicated.bytes;
  }
  // Without dx the three input projections' dx and their sum are skipped; the output
  // projection's dx, the core's backward, the unpacking and the rotation feed the
  // weight gradients. W is the four weight gradients (summed above).
  c.input_grad_flops =
      q_.cost(batch).input_grad_flops + k_.cost(batch).input_grad_flops + v_.cost(batch).input_grad_flops + 2 * whole;
  c.output_bytes = static_cast<int64_t>(es * static_cast<double>(batch * positions(opts_) * opts_.dim));
  return c;
}

Tensor GqaAttention::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  return forward_with(be, x, nullptr, ctx, args);
}

Tensor GqaAttention::forward_add(Backend& be, const Tensor& x, const Tensor& residual, Context* ctx,
                                 const ForwardArgs& args) {
  check_batch(x, input_shape_, input_dtype_, describe(), "input");
  return forward_with(be, x, &residual, ctx, args);
}

Tensor GqaAttention::forward_with(Backend& be, const Tensor& x, const Tensor* residual, Context* ctx,
                                  const ForwardArgs& args) {
  // This member's heads and channels (all of them unsplit).
  const int64_t B = x.size(0), T = opts_.seq_len, C = opts_.dim / opts_.shard.size;
  const int H = static_cast<int>(heads_here()), KV = static_cast<int>(kv_heads_here());
  if (ctx != nullptr) ctx->children.assign(kChildren, Context{});
  // Under sequence parallelism x is this member's positions: all of them, gathered once
  // for the three projections.
  const Tensor xw = opts_.shard.gather_positions(be, group_, x, describe());  // (B, T, dim)
  Tensor q = q_.forward(be, xw, child(ctx, kQ), args);  // (B, T, C)
  Tensor k = k_.forward(be, xw, child(ctx, kK), args);  // (B, T, KV D)
  const Tensor v = v_.forward(be, xw, child(ctx, kV), args);  // (B, T, KV D)
  if (opts_.rope) {
    be.rope(q, H, opts_.rope_base, q);  // fresh outputs no context keeps: in place
    be.rope(k, KV, opts_.rope_base, k);
  }
  Tensor att = be.empty({B, T, C}, dtype_);  // (B, T, C), heads side by side
  if (be.has_fused_attention(dtype_, {B, T, H, KV, C / H})) {
    // Flash attention (a GPU's cuDNN, 16-bit): keeps q, k, v, the output and one
    // log-sum-exp per row and head, not the probabilities; k and v are not repeated.
    Tensor stats = be.empty({B, H, T}, DType::kF32);  // (B, H, T)
    be.fused_attention(q, k, v, H, att, stats);
    if (ctx != nullptr) ctx->saved = {q, k, v, att, stats};
  } else {
    Tensor qkv = be.empty({B, T, 3 * C}, dtype_);  // (B, T, 3C), key/value heads repeated
    be.pack_qkv(q, k, v, H, qkv);
    Tensor probs = be.empty({B, H, T, T}, dtype_);  // (B, H, T, T)
    be.attention(qkv, H, probs, att);
    if (ctx != nullptr) ctx->saved = {qkv, probs};
  }
  if (residual != nullptr) return o_.forward_add(be, att, *residual, child(ctx, kO), args);  // (B, T, C)
  return o_.forward(be, att, child(ctx, kO), args);  // (B, T, C)
}

Tensor GqaAttention::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  std::vector<Context>& ch = ctx.children;
  const bool fused = ctx.saved.size() == 5;  // q, k, v, out, stats (forward's fused_attention)
  GPIPE_CHECK((fused || ctx.saved.size() == 2) && ch.size() == kChildren,
              describe() + ": backward without its forward");
  const int H = static_cast<int>(heads_here()), KV = static_cast<int>(kv_heads_here());
  const int64_t B = ctx.saved[0].size(0), T = opts_.seq_len, C = opts_.dim / opts_.shard.size,
                KC = kv_heads_here() * (opts_.dim / opts_.heads);
  const Tensor datt = o_.backward_input(be, dy, ch[kO]);  // (B, T, C)
  Tensor dq = be.empty({B, T, C}, dtype_);   // (B, T, C)
  Tensor dk = be.empty({B, T, KC}, dtype_);  // (B, T, KV D): each group's sum
  Tensor dv = be.empty({B, T, KC}, dtype_);  // (B, T, KV D)
  if (fused) {
    const std::vector<Tensor>& s = ctx.saved;
    be.fused_attention_backward(datt, s[0], s[1], s[2], s[3], s[4], H, dq, dk, dv);
  } else {
    const Tensor& qkv = ctx.saved[0];    // (B, T, 3C)
    const Tensor& probs = ctx.saved[1];  // (B, H, T, T)
    Tensor dqkv = be.empty(qkv.shape(), dtype_);  // (B, T, 3C)
    be.attention_backward(datt, qkv, probs, H, dqkv);
    be.pack_qkv_backward(dqkv, H, dq, dk, dv);
  }
  ctx.saved.clear();  // W needs only the projections' contexts: the scores can go now
  if (opts_.rope) {
    be.rope_backward(dq, H, opts_.rope_base, dq);
    be.rope_backward(dk, KV, opts_.rope_base, dk);
  }
  Tensor dx = q_.backward_input(be, dq, ch[kQ], need_dx);
  if (!need_dx) {
    k_.backward_input(be, dk, ch[kK], false);
    v_.backward_input(be, dv, ch[kV], false);
    return Tensor();
  }
  k_.backward_input_add(be, dk, ch[kK], dx);  // dx += k's and v's input gradients, each in its product
  v_.backward_input_add(be, dv, ch[kV], dx);
  // Split: each member's share of dx, summed once (at this member's positions under
  // sequence parallelism).
  return opts_.shard.sum_to_positions(be, group_, dx, describe());
}

void GqaAttention::backward_weight_impl(Backend& be, Context& ctx) {
  std::vector<Context>& ch = ctx.children;
  o_.backward_weight(be, ch.at(kO));
  if (kv_replicas() > 1) {
    sum_replicated_kv(be, [&](Linear& l, int child) { l.backward_weight(be, ch.at(child)); });
  } else {
    v_.backward_weight(be, ch.at(kV));
    k_.backward_weight(be, ch.at(kK));
  }
  q_.backward_weight(be, ch.at(kQ));
}

// Each member's k and v weight gradients are its query heads' share of its key/value
// head's: this W's (weight_gradient(layer, child) adds them), computed apart from what
// the gradients hold, are summed over the members holding the head (each member's in its
// head's block of all KV heads, zeros elsewhere, summed over the group: a replicated
// head's members add up, the others add zeros) and added in.
void GqaAttention::sum_replicated_kv(Backend& be, const std::function<void(Linear&, int)>& weight_gradient) {
  const int64_t KV = opts_.kv_heads, g = opts_.shard.rank / kv_replicas();
  for (auto [layer, child] : {std::pair<Linear*, int>{&v_, kV}, {&k_, kK}}) {
    Parameter& w = layer->weight();
    const int64_t rows = w.grad.size(0);
    Tensor all = be.zeros({KV * rows, w.grad.size(1)}, w.grad.dtype());
    {
      // The step's gradient so far (a view the optimizer may share: kept, not replaced),
      // back in place however weight_gradient leaves.
      struct Restore {
        Parameter& w;
        Tensor held;
        ~Restore() { w.grad = held; }
      } restore{w, w.grad};
      w.grad = all.narrow_rows(g * rows, rows);  // this W's, into its head's block
      weight_gradient(*layer, child);
    }
    opts_.shard.sum(be, group_, all, describe());
    be.axpy(1.0, all.narrow_rows(g * rows, rows), w.grad);
  }
}

void GqaAttention::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  o_.backward_weight(be, children_at(ctxs, kO));
  if (kv_replicas() > 1) {
    sum_replicated_kv(be, [&](Linear& l, int child) { l.backward_weight(be, children_at(ctxs, child)); });
  } else {
    v_.backward_weight(be, children_at(ctxs, kV));
    k_.backward_weight(be, children_at(ctxs, kK));
  }
  q_.backward_weight(be, children_at(ctxs, kQ));
}

}  // namespace layers
}  // namespace gpipe
