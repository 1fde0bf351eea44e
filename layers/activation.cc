#include "layers/activation.h"

namespace gpipe {
namespace layers {

namespace {
// An elementwise op over n values per sample: `fwd`/`bwd` flops per element.
LayerCost elementwise_cost(int64_t batch, const Shape& shape, DType dtype, double fwd, double bwd) {
  const double n = static_cast<double>(batch * shape_numel(shape));
  const double es = static_cast<double>(dtype_size(dtype));
  LayerCost c;
  c.forward_flops = fwd * n;
  c.backward_flops = bwd * n;
  c.input_grad_flops = bwd * n;  // no parameters: backward is all input gradient
  c.forward_bytes = 2 * es * n;
  c.backward_bytes = 3 * es * n;
  c.output_bytes = static_cast<int64_t>(es * n);
  c.saved_bytes = static_cast<int64_t>(es * n);
  return c;
}
}  // namespace

LayerCost Relu::cost(int64_t batch) const { return elementwise_cost(batch, input_shape_, dtype_, 1, 1); }

Tensor Relu::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  Tensor y = be.empty(x.shape(), dtype_);
  be.relu(x, y);
  if (ctx != nullptr) ctx->saved = {y};
  return y;
}

Tensor Relu::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(dy.shape(), dtype_);
  be.relu_backward(ctx.saved.at(0), dy, dx);
  return dx;
}

// The float kernels' operations per element (kernels/cpu_backend.cc), counting every
// add, multiply, divide, compare-and-select and the exponent's integer steps, as a
// vector unit issues them: fast_expf 25, fast_erff 44 (one fast_expf in it).
// Forward x Phi(x): 48. Backward dy (Phi(x) + x phi(x)): Phi 47, phi 28 (one
// fast_expf), 2 to combine and 1 for dy: 78.
LayerCost Gelu::cost(int64_t batch) const { return elementwise_cost(batch, input_shape_, dtype_, 48, 78); }

Tensor Gelu::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  Tensor y = be.empty(x.shape(), dtype_);
  be.gelu(x, y);
  if (ctx != nullptr) ctx->saved = {x};
  return y;
}

Tensor Gelu::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(dy.shape(), dtype_);
  be.gelu_backward(ctx.saved.at(0), dy, dx);
  return dx;
}

}  // namespace layers
}  // namespace gpipe
