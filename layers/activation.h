// Elementwise activations: ReLU keeps its output for backward, GELU its input.
#pragma once

#include "layers/layer.h"

namespace gpipe {
namespace layers {

class Relu : public Layer {
 public:
  Relu(const Shape& shape, DType dtype = DType::kF32) : Layer(shape, shape, dtype) {}
  std::string type() const override { return "relu"; }
  std::string describe() const override { return "relu" + shape_str(input_shape_); }
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
};

class Gelu : public Layer {
 public:
  Gelu(const Shape& shape, DType dtype = DType::kF32) : Layer(shape, shape, dtype) {}
  std::string type() const override { return "gelu"; }
  std::string describe() const override { return "gelu" + shape_str(input_shape_); }
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
};

}  // namespace layers
}  // namespace gpipe
