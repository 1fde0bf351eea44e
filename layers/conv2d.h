// Conv2d: a 2-D convolution on per-sample (C, H, W) images, batched as NCHW, with its
// backward split into B (dx) and W (dw, db).
#pragma once

#include <string>
#include <vector>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct Conv2dOptions {
  Conv2dOptions(Shape input, int64_t out, int kernel) : input(std::move(input)), out(out), kernel(kernel) {}
  Shape input;  // (C, H, W) per sample
  int64_t out;  // K, output channels
  int kernel;   // R = S
  int stride = 1;
  int pad = 0;  // zeros on every side
  bool bias = true;
  DType dtype = DType::kF32;
  uint64_t seed = 0;
};

// y = conv(x, W) + b, W (K, C, R, S) as in PyTorch. Weights are He-uniform in
// [-sqrt(6/fan_in), sqrt(6/fan_in)], fan_in = C R S (as Linear here; variance 2/fan_in
// suits the ReLUs that follow; torch.nn.Conv2d's default bound is 1/sqrt(fan_in));
// biases uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)], as PyTorch.
class Conv2d : public Layer {
 public:
  explicit Conv2d(const Conv2dOptions& opts);
  std::string type() const override { return "conv2d"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;
  bool splits_backward() const override { return true; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  const Conv2dOptions& options() const { return opts_; }

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  Conv2dOptions opts_;
  Parameter weight_;  // (K, C, R, S)
  Parameter bias_;    // (K)
};

}  // namespace layers
}  // namespace gpipe
