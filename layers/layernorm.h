// Layer normalisation over the last dimension with a learned scale ("weight", ones)
// and shift ("bias", zeros), as torch.nn.LayerNorm: a transformer's normaliser, which
// unlike batch norm does not mix samples, so micro-batching cannot change it.
#pragma once

#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct LayerNormOptions {
  explicit LayerNormOptions(Shape shape) : shape(std::move(shape)) {}
  Shape shape;  // per sample, normalised over shape.back()
  double eps = 1e-5;
  DType dtype = DType::kF32;
};

class LayerNorm : public Layer {
 public:
  explicit LayerNorm(const LayerNormOptions& opts);
  std::string type() const override { return "layernorm"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  LayerNormOptions opts_;
  int64_t channels_;
  Parameter weight_;  // (C), gamma
  Parameter bias_;    // (C), beta
};

}  // namespace layers
}  // namespace gpipe
