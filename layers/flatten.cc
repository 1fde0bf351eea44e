#include "layers/flatten.h"

#include "layers/image_shape.h"
#include "runtime/error.h"

namespace gpipe {
namespace layers {

namespace {
const Shape& checked_flatten_input(const Shape& in) {
  if (in.empty()) throw UserError("flatten: the input is already one value per sample; remove the flatten layer");
  return in;
}
}  // namespace

Flatten::Flatten(const Shape& input, DType dtype) : Layer(checked_flatten_input(input), {shape_numel(input)}, dtype) {}

std::string Flatten::describe() const {
  return "flatten(" + shape_str(input_shape_) + " -> " + std::to_string(output_shape_[0]) + ")";
}

// A view: no flops and no traffic. The output is counted, as it is what a stage
// boundary placed here would send.
LayerCost Flatten::cost(int64_t batch) const {
  LayerCost c;
  c.output_bytes = static_cast<int64_t>(elem_size(dtype_) * static_cast<double>(batch * output_shape_[0]));
  return c;
}

Tensor Flatten::forward_impl(Backend&, const Tensor& x, Context*, const ForwardArgs&) {
  return x.reshape({x.size(0), output_shape_[0]});  // (N, C H W)
}

Tensor Flatten::backward_impl(Backend&, const Tensor& dy, const Context&, bool need_dx) {
  if (!need_dx) return Tensor();
  return dy.reshape(batched(dy.size(0), input_shape_));  // (N, C, H, W)
}

}  // namespace layers
}  // namespace gpipe
