// An example of a layer of one's own: RMSNorm (Zhang & Sennrich, 2019), the normaliser
// of LLaMA-style transformers. gpipe has it built in (layers/rmsnorm.h, type rmsnorm);
// this copy shows how a user writes one, registered as type my_rmsnorm since a built-in
// type name cannot be registered again. Over the last dimension:
//
//   y = x / sqrt(mean(x^2) + eps) * g        g: (C), learned, starts at ones
//
// It is written against the Backend interface only (no loops over memory, no BLAS or
// CUDA), so the same code runs on CPU and CUDA stages. docs/WRITING_LAYERS.md walks
// through it; this file and rmsnorm.cc are the source of truth.
#pragma once

#include "layers/layer.h"

namespace example {

struct RmsNormOptions {
  explicit RmsNormOptions(gpipe::Shape shape) : shape(std::move(shape)) {}
  gpipe::Shape shape;  // per sample, normalised over shape.back()
  double eps = 1e-6;
  gpipe::DType dtype = gpipe::DType::kF32;
};

class RmsNorm : public gpipe::layers::Layer {
 public:
  explicit RmsNorm(const RmsNormOptions& opts);
  std::string type() const override { return "my_rmsnorm"; }
  std::string describe() const override;
  gpipe::layers::LayerCost cost(int64_t batch) const override;
  std::vector<gpipe::layers::Parameter*> parameters() override { return {&weight_}; }
  gpipe::layers::Parameter& weight() { return weight_; }

 private:
  gpipe::Tensor forward_impl(gpipe::Backend& be, const gpipe::Tensor& x, gpipe::layers::Context* ctx,
                             const gpipe::layers::ForwardArgs& args) override;
  gpipe::Tensor backward_impl(gpipe::Backend& be, const gpipe::Tensor& dy, const gpipe::layers::Context& ctx,
                              bool need_dx) override;
  double eps_;
  int64_t channels_;                 // C
  gpipe::layers::Parameter weight_;  // (C), g
};

// Makes `type: my_rmsnorm` (option `eps`) available to YAML configs. Call once, at start.
void register_rmsnorm();

}  // namespace example
