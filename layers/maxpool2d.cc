#include "layers/maxpool2d.h"

#include <algorithm>

#include "layers/image_shape.h"
#include "runtime/error.h"

namespace gpipe {
namespace layers {

namespace {
MaxPool2dOptions resolved(MaxPool2dOptions o) {
  if (o.stride == 0) o.stride = o.kernel;
  return o;
}

std::string maxpool_name(const MaxPool2dOptions& o) {
  return "maxpool2d(" + window_str(o.kernel, o.stride, o.pad) + ")";
}

Shape maxpool_output(const MaxPool2dOptions& o) {
  const std::string who = maxpool_name(o);
  check_chw(o.input, who);
  if (o.kernel < 1 || o.stride < 1 || o.pad < 0 || o.pad > o.kernel / 2) {
    throw UserError(who + ": kernel and stride must be positive and pad between 0 and kernel / 2 (" +
                    std::to_string(std::max(0, o.kernel / 2)) + "), so that no window holds only padding");
  }
  if (o.input[1] + 2 * o.pad < o.kernel || o.input[2] + 2 * o.pad < o.kernel) {
    throw UserError(who + ": the window does not fit in the " + shape_str(o.input) + " input; use a smaller kernel");
  }
  return {o.input[0], out_extent(o.input[1], o.kernel, o.stride, o.pad),
          out_extent(o.input[2], o.kernel, o.stride, o.pad)};
}
}  // namespace

MaxPool2d::MaxPool2d(const MaxPool2dOptions& opts)
    : Layer(opts.input, maxpool_output(resolved(opts)), opts.dtype),
      kernel_(opts.kernel),
      stride_(resolved(opts).stride),
      pad_(opts.pad) {}

std::string MaxPool2d::describe() const { return "maxpool2d(" + window_str(kernel_, stride_, pad_) + ")"; }

LayerCost MaxPool2d::cost(int64_t batch) const {
  const double N = static_cast<double>(batch), C = input_shape_[0], H = input_shape_[1], W = input_shape_[2];
  const double P = output_shape_[1], Q = output_shape_[2];
  const double es = elem_size(dtype_);
  const double in = N * C * H * W, out = N * C * P * Q;
  // One comparison per real value of each window but its first (padding is skipped).
  const double values = N * C *
                        static_cast<double>(covered(input_shape_[1], output_shape_[1], kernel_, stride_, pad_)) *
                        static_cast<double>(covered(input_shape_[2], output_shape_[2], kernel_, stride_, pad_));
  LayerCost c;
  c.forward_flops = values - out;
  c.backward_flops = out;  // one add per output gradient into its argmax
  c.input_grad_flops = out;
  c.forward_bytes = es * (in + out) + 4 * out;   // x, y, int32 argmax
  c.backward_bytes = es * (out + in) + 4 * out;  // dy, dx, argmax
  c.output_bytes = static_cast<int64_t>(es * out);
  c.saved_bytes = static_cast<int64_t>(4 * out);  // argmax only: backward needs no values
  return c;
}

Tensor MaxPool2d::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  const Shape out = batched(x.size(0), output_shape_);
  Tensor y = be.empty(out, dtype_);            // (N, C, P, Q)
  Tensor argmax = be.empty(out, DType::kI32);  // (N, C, P, Q), flat h W + w per plane
  be.maxpool2d(x, kernel_, stride_, pad_, y, argmax);
  if (ctx != nullptr) ctx->saved = {argmax};
  return y;
}

Tensor MaxPool2d::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(batched(dy.size(0), input_shape_), dtype_);  // (N, C, H, W)
  be.maxpool2d_backward(dy, ctx.saved.at(0), dx);
  return dx;
}

}  // namespace layers
}  // namespace gpipe
