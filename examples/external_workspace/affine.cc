#include "affine.h"

#include "layers/registry.h"

namespace my_project {

using gpipe::Tensor;

Affine::Affine(gpipe::Shape shape, gpipe::DType dtype)
    : Layer(shape, shape, dtype), channels_(shape.empty() ? 0 : shape.back()) {
  if (channels_ <= 0) throw gpipe::UserError("affine: needs a feature dimension, got " + gpipe::shape_str(shape));
  scale_ = constant_parameter("scale", {channels_}, 1.0);
  shift_ = constant_parameter("shift", {channels_}, 0.0);
}

gpipe::layers::LayerCost Affine::cost(int64_t batch) const {
  const double n = static_cast<double>(batch * gpipe::shape_numel(input_shape_));  // R x C elements
  const double C = static_cast<double>(channels_), es = static_cast<double>(gpipe::dtype_size(dtype_));
  gpipe::layers::LayerCost c;
  c.forward_flops = 2 * n;                         // scale, shift
  c.input_grad_flops = n;                          // dx = dy * g
  c.backward_flops = 3 * n + 4 * C + c.input_grad_flops;  // dy * x and the two column sums into dg, db
  c.forward_bytes = es * (4 * n + 2 * C);
  c.backward_bytes = es * (6 * n + 6 * C);
  c.param_bytes = static_cast<int64_t>(2 * C * es);
  c.output_bytes = static_cast<int64_t>(n * es);
  c.saved_bytes = static_cast<int64_t>(n * es);  // x
  return c;
}

Tensor Affine::forward_impl(gpipe::Backend& be, const Tensor& x, gpipe::layers::Context* ctx,
                            const gpipe::layers::ForwardArgs&) {
  Tensor y = be.empty(x.shape(), dtype_);
  be.scale_columns(x, scale_.compute(), y);
  Tensor rows = y.reshape({x.numel() / channels_, channels_});  // (R, C), a view of y
  be.add_bias(rows, shift_.compute());
  if (ctx != nullptr) ctx->saved = {x};
  return y;
}

Tensor Affine::backward_impl(gpipe::Backend& be, const Tensor& dy, const gpipe::layers::Context& ctx, bool need_dx) {
  const Tensor& x = ctx.saved.at(0);
  const int64_t rows = x.numel() / channels_;
  Tensor t = be.empty(x.shape(), dtype_);
  be.mul(dy, x, t);
  be.bias_grad(t.reshape({rows, channels_}), scale_.grad, /*beta=*/1.0);   // dg += sum_r dy x
  be.bias_grad(dy.reshape({rows, channels_}), shift_.grad, /*beta=*/1.0);  // db += sum_r dy
  if (!need_dx) return Tensor();
  be.scale_columns(dy, scale_.compute(), t);  // dx = dy g
  return t;
}

void register_affine() {
  gpipe::layers::register_layer("affine", [](gpipe::layers::LayerArgs&, const gpipe::Shape& in, gpipe::DType dtype,
                                             uint64_t) -> std::unique_ptr<gpipe::layers::Layer> {
    return std::make_unique<Affine>(in, dtype);
  });
}

}  // namespace my_project
