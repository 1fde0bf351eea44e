// Flatten: (C, H, W) (or any per-sample shape) -> (C H W), a view; the bridge from the
// image layers to the linear ones.
#pragma once

#include <string>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

class Flatten : public Layer {
 public:
  Flatten(const Shape& input, DType dtype = DType::kF32);
  std::string type() const override { return "flatten"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
};

}  // namespace layers
}  // namespace gpipe
