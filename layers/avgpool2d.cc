#include "layers/avgpool2d.h"

#include "layers/image_shape.h"
#include "runtime/error.h"

namespace gpipe {
namespace layers {

AvgPool2dOptions AvgPool2dOptions::global_pool(Shape input) {
  const int kernel = input.size() == 3 ? static_cast<int>(input[1]) : 0;
  AvgPool2dOptions o(std::move(input), kernel);
  o.global = true;
  return o;
}

namespace {
AvgPool2dOptions resolved(AvgPool2dOptions o) {
  if (o.stride == 0) o.stride = o.kernel;
  return o;
}

Shape avgpool_output(const AvgPool2dOptions& o) {
  if (o.global) {
    check_chw(o.input, "global_avgpool");
    if (o.input[1] != o.input[2]) {
      throw UserError("global_avgpool: the " + shape_str(o.input) +
                      " input's plane is not square, and the pooling window is; make height equal width");
    }
    return {o.input[0], 1, 1};
  }
  const std::string who = "avgpool2d(" + window_str(o.kernel, o.stride, 0) + ")";
  check_chw(o.input, who);
  if (o.kernel < 1 || o.stride < 1) throw UserError(who + ": kernel and stride must be positive");
  if (o.input[1] < o.kernel || o.input[2] < o.kernel) {
    throw UserError(who + ": the window does not fit in the " + shape_str(o.input) + " input; use a smaller kernel");
  }
  return {o.input[0], out_extent(o.input[1], o.kernel, o.stride, 0), out_extent(o.input[2], o.kernel, o.stride, 0)};
}
}  // namespace

AvgPool2d::AvgPool2d(const AvgPool2dOptions& opts)
    : Layer(opts.input, avgpool_output(resolved(opts)), opts.dtype),
      kernel_(opts.kernel),
      stride_(resolved(opts).stride),
      global_(opts.global) {}

std::string AvgPool2d::describe() const {
  if (global_) return "global_avgpool(" + std::to_string(kernel_) + "x" + std::to_string(kernel_) + ")";
  return "avgpool2d(" + window_str(kernel_, stride_, 0) + ")";
}

LayerCost AvgPool2d::cost(int64_t batch) const {
  const double in = static_cast<double>(batch * shape_numel(input_shape_));
  const double out = static_cast<double>(batch * shape_numel(output_shape_));
  const double window = static_cast<double>(kernel_) * kernel_, es = elem_size(dtype_);
  LayerCost c;
  c.forward_flops = window * out;         // window - 1 adds and one scaling per output
  c.backward_flops = (window + 1) * out;  // one scaling per output, one add per window value
  c.input_grad_flops = c.backward_flops;
  c.forward_bytes = es * (in + out);
  c.backward_bytes = es * (out + in);
  c.output_bytes = static_cast<int64_t>(es * out);
  c.saved_bytes = 0;  // backward needs only the shapes
  return c;
}

Tensor AvgPool2d::forward_impl(Backend& be, const Tensor& x, Context*, const ForwardArgs&) {
  Tensor y = be.empty(batched(x.size(0), output_shape_), dtype_);  // (N, C, P, Q)
  be.avgpool2d(x, kernel_, stride_, y);
  return y;
}

Tensor AvgPool2d::backward_impl(Backend& be, const Tensor& dy, const Context&, bool need_dx) {
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(batched(dy.size(0), input_shape_), dtype_);  // (N, C, H, W)
  be.avgpool2d_backward(dy, kernel_, stride_, dx);
  return dx;
}

}  // namespace layers
}  // namespace gpipe
