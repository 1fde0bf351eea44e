#include "layers/layernorm.h"

#include "runtime/error.h"

namespace gpipe {
namespace layers {

LayerNorm::LayerNorm(const LayerNormOptions& opts)
    : Layer(opts.shape, opts.shape, opts.dtype), opts_(opts), channels_(opts.shape.empty() ? 0 : opts.shape.back()) {
  if (channels_ <= 0) {
    throw UserError("layernorm: needs an input with a feature dimension, got " + shape_str(opts.shape) +
                    " per sample");
  }
  if (!(opts.eps > 0.0)) throw UserError("layernorm: eps must be positive, got " + std::to_string(opts.eps));
  weight_ = constant_parameter("weight", {channels_}, 1.0);
  bias_ = constant_parameter("bias", {channels_}, 0.0);
}

std::string LayerNorm::describe() const { return "layernorm" + shape_str(input_shape_); }

LayerCost LayerNorm::cost(int64_t batch) const {
  const double C = static_cast<double>(channels_);
  const double R = static_cast<double>(batch * shape_numel(input_shape_)) / C;  // rows normalised
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  // Per row, as kernels/cpu_transformer_ops.cc counts them: sum (C), variance (3C),
  // y = (x - mean) rstd gamma + beta (4C), and 5 scalar ops for mean and rstd.
  c.forward_flops = R * (8 * C + 5);
  // Per row: the two means (6C + 2), then xhat, dgamma, dbeta and dx (10C); the
  // gradients of gamma and beta are added into the parameters once (2C).
  c.backward_flops = R * (16 * C + 2) + 2 * C;
  // dx comes out of the same pass as dgamma and dbeta, so no flop is skipped when the
  // caller does not need it.
  c.input_grad_flops = 0;
  c.forward_bytes = es * (2 * R * C + 2 * C + 2 * R);
  c.backward_bytes = es * (3 * R * C + 2 * R + 5 * C);
  c.param_bytes = static_cast<int64_t>(es * 2 * C);
  c.output_bytes = static_cast<int64_t>(es * R * C);
  const double stats = static_cast<double>(dtype_size(master_dtype(dtype_)));  // float32 in a bf16 or fp16 model
  c.saved_bytes = static_cast<int64_t>(es * R * C + stats * 2 * R);  // x, mean, rstd
  return c;
}

Tensor LayerNorm::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  const int64_t rows = x.numel() / channels_;
  Tensor y = be.empty(x.shape(), dtype_);   // (B, ..., C)
  // The statistics in float32 in a bf16 or fp16 model (master_dtype): kept for backward.
  Tensor mean = be.empty({rows}, master_dtype(dtype_));  // (R)
  Tensor rstd = be.empty({rows}, master_dtype(dtype_));  // (R)
  be.layernorm(x, weight_.compute(), bias_.compute(), opts_.eps, y, mean, rstd);
  if (ctx != nullptr) ctx->saved = {x, mean, rstd};
  return y;
}

Tensor LayerNorm::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  const Tensor& x = ctx.saved.at(0);
  Tensor dx = be.empty(x.shape(), dtype_);  // always written by the op; dropped if not needed
  be.layernorm_backward(dy, x, weight_.compute(), ctx.saved.at(1), ctx.saved.at(2), dx, weight_.grad, bias_.grad);
  return need_dx ? dx : Tensor();
}

}  // namespace layers
}  // namespace gpipe
