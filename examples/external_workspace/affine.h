// A layer of this project's own, outside gpipe's tree: a learned per-feature scale and
// shift, y = x * g + b over the last dimension (g starts at ones, b at zeros). Written
// against gpipe's Backend interface, so it runs on CPU and CUDA stages alike.
#pragma once

#include "layers/layer.h"

namespace my_project {

class Affine : public gpipe::layers::Layer {
 public:
  Affine(gpipe::Shape shape, gpipe::DType dtype);
  std::string type() const override { return "affine"; }
  std::string describe() const override { return "affine" + gpipe::shape_str(input_shape_); }
  gpipe::layers::LayerCost cost(int64_t batch) const override;
  std::vector<gpipe::layers::Parameter*> parameters() override { return {&scale_, &shift_}; }
  gpipe::layers::Parameter& scale() { return scale_; }

 private:
  gpipe::Tensor forward_impl(gpipe::Backend& be, const gpipe::Tensor& x, gpipe::layers::Context* ctx,
                             const gpipe::layers::ForwardArgs& args) override;
  gpipe::Tensor backward_impl(gpipe::Backend& be, const gpipe::Tensor& dy, const gpipe::layers::Context& ctx,
                              bool need_dx) override;
  int64_t channels_;
  gpipe::layers::Parameter scale_, shift_;  // (C) each
};

// `type: affine` in YAML.
void register_affine();

}  // namespace my_project
