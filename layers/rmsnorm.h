// RMSNorm (Zhang & Sennrich, 2019), the normaliser of LLaMA-style transformers, over the
// last dimension with a learned scale ("weight", ones) and no shift:
//
//   y = x / sqrt(mean(x^2) + eps) * g        g: (C)
//
// Written from backend ops (row_inverse_rms, scale_rows, scale_columns, row_dot), so it
// runs on every backend. Backward splits: B computes dx, W adds dg (from x, the inverse
// RMS and dy, which B keeps), so zero bubble can defer it. examples/custom_layer has the
// same layer written as a user's (type my_rmsnorm), doing all its backward at once.
#pragma once

#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct RmsNormOptions {
  explicit RmsNormOptions(Shape shape) : shape(std::move(shape)) {}
  Shape shape;  // per sample, normalised over shape.back()
  double eps = 1e-6;
  DType dtype = DType::kF32;
};

class RmsNorm : public Layer {
 public:
  explicit RmsNorm(const RmsNormOptions& opts);
  std::string type() const override { return "rmsnorm"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override { return {&weight_}; }
  Parameter& weight() { return weight_; }
  bool splits_backward() const override { return true; }  // dg in W
  // backward_input's dx plus a residual's gradient (of x's shape and type), in the norm's
  // op (Backend::rmsnorm_backward_add): on the CPU backward_input then axpy, bit for bit.
  Tensor backward_input_add(Backend& be, const Tensor& dy, Context& ctx, const Tensor& residual);

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  RmsNormOptions opts_;
  int64_t channels_;  // C
  Parameter weight_;  // (C), g
};

}  // namespace layers
}  // namespace gpipe
