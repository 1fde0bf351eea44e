#include "examples/custom_layer/rmsnorm.h"

#include "layers/registry.h"
#include "runtime/error.h"

namespace example {

using gpipe::Backend;
using gpipe::Tensor;
using gpipe::layers::Context;
using gpipe::layers::ForwardArgs;
using gpipe::layers::LayerCost;

RmsNorm::RmsNorm(const RmsNormOptions& opts)
    : Layer(opts.shape, opts.shape, opts.dtype), eps_(opts.eps), channels_(opts.shape.empty() ? 0 : opts.shape.back()) {
  if (channels_ <= 0) {
    throw gpipe::UserError("my_rmsnorm: needs an input with a feature dimension, got " + gpipe::shape_str(opts.shape) +
                           " per sample");
  }
  if (!(eps_ > 0)) throw gpipe::UserError("my_rmsnorm: eps must be positive, got " + std::to_string(eps_));
  // Parameters are created on the CPU; the executor moves them to the stage's device.
  weight_ = constant_parameter("weight", {channels_}, 1.0);
}

std::string RmsNorm::describe() const { return "my_rmsnorm" + gpipe::shape_str(input_shape_); }

// Exact counts of what forward_impl and backward_impl below ask the backend to do, with
// R = rows normalised and C = channels. The balancer splits the model by these.
LayerCost RmsNorm::cost(int64_t batch) const {
  const double C = static_cast<double>(channels_);
  const double R = static_cast<double>(batch * gpipe::shape_numel(input_shape_)) / C;
  const double es = static_cast<double>(gpipe::dtype_size(dtype_));
  LayerCost c;
  // row_inverse_rms (2 per element, 3 per row), scale_rows, scale_columns.
  c.forward_flops = 4 * R * C + 3 * R;
  // dg: xhat again, dy * xhat, its column sums added into dg (3RC + 2C); dx:
  // scale_columns, row_dot (2RC + R), scale_rows, axpy (2RC), scale_rows.
  c.input_grad_flops = 7 * R * C + R;
  c.backward_flops = 3 * R * C + 2 * C + c.input_grad_flops;
  // Every op reads its inputs and writes its output once.
  c.forward_bytes = es * (5 * R * C + 2 * R + C);
  c.backward_bytes = es * (17 * R * C + 4 * R + 3 * C);
  c.param_bytes = static_cast<int64_t>(es * C);
  c.output_bytes = static_cast<int64_t>(es * R * C);
  c.saved_bytes = static_cast<int64_t>(es * (R * C + R));  // x and the inverse RMS
  return c;
}

Tensor RmsNorm::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  const int64_t rows = x.numel() / channels_;
  Tensor rstd = be.empty({rows}, gpipe::master_dtype(dtype_));  // (R): 1 / sqrt(mean(x^2) + eps), float32 in a bf16 model
  be.row_inverse_rms(x, eps_, rstd);
  Tensor y = be.empty(x.shape(), dtype_);  // (B, ..., C)
  be.scale_rows(x, rstd, y);               // xhat = x * rstd
  be.scale_columns(y, weight_.compute(), y);   // y = xhat * g
  if (ctx != nullptr) ctx->saved = {x, rstd};  // exactly what backward needs
  return y;
}

// With xhat = x rstd and gdy = dy g:
//   dg += sum over rows of dy * xhat
//   dx  = rstd * (gdy - xhat * mean_c(gdy * xhat))
Tensor RmsNorm::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  const Tensor& x = ctx.saved.at(0);
  const Tensor& rstd = ctx.saved.at(1);
  const int64_t rows = x.numel() / channels_;
  Tensor xhat = be.empty(x.shape(), dtype_);  // (B, ..., C)
  be.scale_rows(x, rstd, xhat);
  Tensor t = be.empty(x.shape(), dtype_);  // (B, ..., C): scratch
  be.mul(dy, xhat, t);
  // Parameter gradients are accumulated (beta = 1): the executor sums the micro-batches.
  be.bias_grad(t.reshape({rows, channels_}), weight_.grad, /*beta=*/1.0);
  if (!need_dx) return Tensor();
  Tensor gdy = be.empty(x.shape(), dtype_);  // (B, ..., C)
  be.scale_columns(dy, weight_.compute(), gdy);
  Tensor dot = be.empty({rows}, gpipe::master_dtype(dtype_));  // (R): mean_c(gdy * xhat)
  be.row_dot(gdy, xhat, 1.0 / static_cast<double>(channels_), dot);
  be.scale_rows(xhat, dot, t);
  be.axpy(-1.0, t, gdy);
  be.scale_rows(gdy, rstd, gdy);  // dx, in place
  return gdy;
}

void register_rmsnorm() {
  gpipe::layers::register_layer("my_rmsnorm", [](gpipe::layers::LayerArgs& args, const gpipe::Shape& input,
                                              gpipe::DType dtype, uint64_t /*seed*/) {
    RmsNormOptions o(input);
    o.eps = args.get_double("eps", 1e-6);
    o.dtype = dtype;
    return std::unique_ptr<gpipe::layers::Layer>(std::make_unique<RmsNorm>(o));
  });
}

}  // namespace example
