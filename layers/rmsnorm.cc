#include "layers/rmsnorm.h"

#include <sstream>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

RmsNorm::RmsNorm(const RmsNormOptions& opts)
    : Layer(opts.shape, opts.shape, opts.dtype), opts_(opts), channels_(opts.shape.empty() ? 0 : opts.shape.back()) {
  if (channels_ <= 0) {
    throw UserError("rmsnorm: needs an input with a feature dimension, got " + shape_str(opts.shape) +
                    " per sample; put it after a layer with features (an embedding, a linear)");
  }
  if (!(opts.eps > 0.0)) {
    throw UserError("rmsnorm: eps must be positive, got " + std::to_string(opts.eps) + "; LLaMA uses 1e-5 or 1e-6");
  }
  weight_ = constant_parameter("weight", {channels_}, 1.0);
}

std::string RmsNorm::describe() const {
  std::ostringstream os;
  os << "rmsnorm" << shape_str(input_shape_);
  if (opts_.eps != 1e-6) os << ", eps " << opts_.eps;
  return os.str();
}

// Exact counts of what forward_impl and the two halves of backward below ask the
// backend to do, with R rows of C channels. Each op reads its inputs and writes its
// output once; the per-row factors (the inverse RMS, the row dots) are of the master
// type (float32 in a bf16 or fp16 model), everything of x's shape of the layer's.
LayerCost RmsNorm::cost(int64_t batch) const {
  const double C = static_cast<double>(channels_);
  const double R = static_cast<double>(batch * shape_numel(input_shape_)) / C;
  const double es = static_cast<double>(dtype_size(dtype_));
  const double ss = static_cast<double>(dtype_size(master_dtype(dtype_)));  // per-row statistics
  const double gs = static_cast<double>(dtype_size(master_dtype(dtype_)));  // dg, a master gradient
  LayerCost c;
  // row_inverse_rms (2 per element, 3 per row), scale_rows, scale_columns.
  c.forward_flops = 4 * R * C + 3 * R;
  c.forward_bytes = es * R * C + ss * R           // row_inverse_rms
                    + 2 * es * R * C + ss * R     // scale_rows
                    + 2 * es * R * C + es * C;    // scale_columns
  // B: xhat = scale_rows(x, rstd) (RC), gdy = scale_columns(dy, g) (RC), the row dots
  // (2RC + R), scale_rows(xhat, dot) (RC), the axpy (2RC), scale_rows by rstd (RC).
  // All of it is dx, so a first layer skips all of B.
  const CostPart b{false, 8 * R * C + R,
                   (2 * es * R * C + ss * R) + (2 * es * R * C + es * C) + (2 * es * R * C + ss * R) +
                       (2 * es * R * C + ss * R) + 3 * es * R * C + (2 * es * R * C + ss * R)};
  // W: xhat again (RC), dy * xhat (RC), its column sums added into dg (RC + 2C).
  const CostPart w{true, 3 * R * C + 2 * C, (2 * es * R * C + ss * R) + 3 * es * R * C + (es * R * C + 2 * gs * C)};
  c.backward_flops = b.flops + w.flops;
  c.input_grad_flops = b.flops;
  c.weight_grad_flops = w.flops;
  c.backward_bytes = b.bytes + w.bytes;
  c.weight_grad_bytes = w.bytes;
  c.backward_parts = {b, w};
  c.param_bytes = static_cast<int64_t>(es * C);
  c.output_bytes = static_cast<int64_t>(es * R * C);
  c.saved_bytes = static_cast<int64_t>(es * R * C + ss * R);  // x and the inverse RMS
  return c;
}

Tensor RmsNorm::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  const int64_t rows = x.numel() / channels_;
  Tensor rstd = be.empty({rows}, master_dtype(dtype_));  // (R): 1 / sqrt(mean(x^2) + eps)
  Tensor y = be.empty(x.shape(), dtype_);                // (B, ..., C) = x * rstd * g
  be.rmsnorm(x, weight_.compute(), opts_.eps, y, rstd);  // one kernel on a GPU
  if (ctx != nullptr) ctx->saved = {x, rstd};
  return y;
}

// With xhat = x rstd and gdy = dy g:  dx = rstd * (gdy - xhat * mean_c(gdy * xhat)).
// Keeps dy beside x and rstd for W.
Tensor RmsNorm::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  GPIPE_CHECK(ctx.saved.size() == 2, describe() + ": backward without its forward");
  const Tensor x = ctx.saved[0];
  const Tensor rstd = ctx.saved[1];
  ctx.saved.push_back(dy);
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(x.shape(), dtype_);  // (B, ..., C)
  be.rmsnorm_backward(dy, x, weight_.compute(), rstd, dx);
  return dx;
}

Tensor RmsNorm::backward_input_add(Backend& be, const Tensor& dy, Context& ctx, const Tensor& residual) {
  check_batch(dy, output_shape_, dtype_, describe(), "output gradient");
  GPIPE_CHECK(ctx.saved.size() == 2, describe() + ": backward without its forward");
  const Tensor x = ctx.saved[0];
  const Tensor rstd = ctx.saved[1];
  GPIPE_CHECK(residual.shape() == x.shape() && residual.dtype() == dtype_,
              describe() + ": a residual gradient " + residual.str() + " for an input " + x.str());
  ctx.saved.push_back(dy);
  Tensor dx = be.empty(x.shape(), dtype_);  // (B, ..., C)
  be.rmsnorm_backward_add(dy, x, weight_.compute(), rstd, residual, dx);
  return dx;
}

// dg += sum over rows of dy * xhat (accumulated: the executor sums the micro-batches).
void RmsNorm::backward_weight_impl(Backend& be, Context& ctx) {
  GPIPE_CHECK(ctx.saved.size() == 3, describe() + ": weight gradient without its backward_input");
  const Tensor& x = ctx.saved[0];
  const Tensor& rstd = ctx.saved[1];
  const Tensor& dy = ctx.saved[2];
  be.rmsnorm_weight_grad(dy, x, rstd, weight_.grad);
  ctx.saved.clear();
}

}  // namespace layers
}  // namespace gpipe
