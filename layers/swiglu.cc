#include "layers/swiglu.h"

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// Children of the layer's Context, in forward order; its own saved: {a, b}.
enum Child { kGate, kUp, kDown, kChildren };

Context* child(Context* ctx, Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; }

LinearOptions projection(const SwiGLUOptions& o, int64_t in, int64_t out, uint64_t seed, TensorSplit split) {
  if (o.dim <= 0 || o.hidden <= 0) {
    throw UserError("swiglu: dim and hidden must be positive, got dim=" + std::to_string(o.dim) +
                    ", hidden=" + std::to_string(o.hidden));
  }
  LinearOptions l(in, out);
  l.leading = o.leading;
  l.bias = false;
  l.dtype = o.dtype;
  l.seed = seed;
  l.split = split;
  return l;
}

Shape with_last(Shape leading, int64_t last) {
  leading.push_back(last);
  return leading;
}

// The input's and output's leading dimensions: under sequence parallelism this member's
// share of the positions (the first).
Shape leading_here(const SwiGLUOptions& o) {
  Shape l = o.leading;
  if (o.shard.sequence_split()) {
    if (l.empty()) {
      throw UserError("swiglu: sequence parallelism splits the positions, and this layer's input has none; set "
                      "pipeline.sequence_parallel: false");
    }
    l[0] = o.shard.positions(l[0], "swiglu");
  }
  return l;
}

// The gating's operations per element, as the elementwise layers count theirs
// (layers/activation.cc): the exponential as 25 (fast_expf's count; the unary kernels
// call the math library's), sigmoid 1 / (1 + e) or e / (1 + e) with its branch 28, silu's
// product 1, the gate's product 1: forward 30. Backward: silu recomputed (29), its slope
// s (1 + x (1 - s)) 4 more and times ds 1, ds = dg * b 1, db = dg * s 1: 36; plus the
// sum of the two input gradients, 1 (only with dx).
constexpr double kGateForwardFlops = 30, kGateBackwardFlops = 36;

}  // namespace

SwiGLU::SwiGLU(const SwiGLUOptions& opts)
    : Layer(with_last(leading_here(opts), opts.dim), with_last(leading_here(opts), opts.dim), opts.dtype),
      opts_(opts),
      gate_(projection(opts, opts.dim, opts.hidden, mix_seed(opts.seed, 1),
                       opts.shard.as(TensorSplitKind::kColumn, 1, /*sum_input_grad=*/false))),
      up_(projection(opts, opts.dim, opts.hidden, mix_seed(opts.seed, 2),
                     opts.shard.as(TensorSplitKind::kColumn, 1, /*sum_input_grad=*/false))),
      down_(projection(opts, opts.hidden, opts.dim, mix_seed(opts.seed, 3), opts.shard.as(TensorSplitKind::kRow))) {
  gate_.weight().name = "gate.weight";
  up_.weight().name = "up.weight";
  down_.weight().name = "down.weight";
}

std::string SwiGLU::describe() const {
  const std::string member =
      opts_.shard.split() ? ", member " + std::to_string(opts_.shard.rank) + "/" + std::to_string(opts_.shard.size) : "";
  return "swiglu(" + std::to_string(opts_.dim) + ", hidden " + std::to_string(opts_.hidden) + member + ")";
}

void SwiGLU::set_collectives(TensorCollectives* group) {
  group_ = group;
  for (Linear* l : {&gate_, &up_, &down_}) l->set_collectives(group);
}

std::vector<Parameter*> SwiGLU::parameters() { return {&gate_.weight(), &up_.weight(), &down_.weight()}; }

LayerCost SwiGLU::cost(int64_t batch) const {
  const double rows = static_cast<double>(batch * shape_numel(opts_.leading));
  // This member's hidden features (all of them unsplit).
  const double h = rows * static_cast<double>(opts_.hidden / opts_.shard.size), n = rows * static_cast<double>(opts_.dim);
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  c += gate_.cost(batch);
  c += up_.cost(batch);
  c += down_.cost(batch);
  // Forward: s = silu(a) reads a, writes s; g = s * b reads both, writes g.
  c.forward_flops += kGateForwardFlops * h;
  c.forward_bytes += es * (2 * h + 3 * h);
  // B: s = silu(a) again (2 h), ds = dg * b (3 h), db = dg * s (3 h), da from a and ds
  // (3 h); then dx = the gate's dx + the up's dx (an axpy: 3 n).
  c.backward_flops += kGateBackwardFlops * h + n;
  // Without dx (the model's first layer) the gate's and the up's dx and their sum are
  // skipped; the down projection's dx and the gating feed the weight gradients.
  c.input_grad_flops = gate_.cost(batch).input_grad_flops + up_.cost(batch).input_grad_flops + n;
  c.backward_bytes += es * 11 * h + es * 3 * n;
  c.backward_parts.push_back({false, kGateBackwardFlops * h, es * 11 * h});
  c.backward_parts.push_back({false, n, es * 3 * n});
  c.output_bytes = static_cast<int64_t>(es * static_cast<double>(batch * shape_numel(leading_here(opts_)) * opts_.dim));
  c.saved_bytes += static_cast<int64_t>(es * 2 * h);  // a and b, beside the projections' inputs
  return c;
}

Tensor SwiGLU::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  return forward_with(be, x, nullptr, ctx, args);
}

Tensor SwiGLU::forward_add(Backend& be, const Tensor& x, const Tensor& residual, Context* ctx,
                           const ForwardArgs& args) {
  check_batch(x, input_shape_, input_dtype_, describe(), "input");
  return forward_with(be, x, &residual, ctx, args);
}

Tensor SwiGLU::forward_with(Backend& be, const Tensor& x, const Tensor* residual, Context* ctx,
                            const ForwardArgs& args) {
  if (ctx != nullptr) ctx->children.assign(kChildren, Context{});
  // Under sequence parallelism x is this member's positions: all of them, gathered once.
  const Tensor xw = opts_.shard.gather_positions(be, group_, x, describe());
  const Tensor a = gate_.forward(be, xw, child(ctx, kGate), args);  // (B, *leading, hidden)
  const Tensor b = up_.forward(be, xw, child(ctx, kUp), args);      // (B, *leading, hidden)
  Tensor g = be.empty(a.shape(), dtype_);
  be.swiglu(a, b, g);  // g = silu(a) * b
  if (ctx != nullptr) ctx->saved = {a, b};
  if (residual != nullptr) return down_.forward_add(be, g, *residual, child(ctx, kDown), args);  // (B, *leading, dim)
  return down_.forward(be, g, child(ctx, kDown), args);  // (B, *leading, dim)
}

// B: dg = down's dx; ds = dg * b, db = dg * s, da = silu'(a) ds; dx = gate's dx + up's dx.
Tensor SwiGLU::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  std::vector<Context>& ch = ctx.children;
  GPIPE_CHECK(ctx.saved.size() == 2 && ch.size() == kChildren, describe() + ": backward without its forward");
  const Tensor& a = ctx.saved[0];
  const Tensor& b = ctx.saved[1];
  const Tensor dg = down_.backward_input(be, dy, ch[kDown]);  // (B, *leading, hidden)
  Tensor da = be.empty(a.shape(), dtype_);
  Tensor db = be.empty(a.shape(), dtype_);
  be.swiglu_backward(dg, a, b, da, db);
  Tensor dx = gate_.backward_input(be, da, ch[kGate], need_dx);
  ctx.saved.clear();  // W needs only the projections' contexts
  if (!need_dx) {
    up_.backward_input(be, db, ch[kUp], false);
    return Tensor();
  }
  up_.backward_input_add(be, db, ch[kUp], dx);  // dx += the up projection's input gradient, in its product
  // Split: each member's share of dx, summed once (at its positions under sequence parallelism).
  return opts_.shard.sum_to_positions(be, group_, dx, describe());
}

void SwiGLU::backward_weight_impl(Backend& be, Context& ctx) {
  std::vector<Context>& ch = ctx.children;
  down_.backward_weight(be, ch.at(kDown));
  up_.backward_weight(be, ch.at(kUp));
  gate_.backward_weight(be, ch.at(kGate));
}

void SwiGLU::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  down_.backward_weight(be, children_at(ctxs, kDown));
  up_.backward_weight(be, children_at(ctxs, kUp));
  gate_.backward_weight(be, children_at(ctxs, kGate));
}

}  // namespace layers
}  // namespace gpipe
