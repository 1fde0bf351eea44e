// Convolutional layers on per-sample (C, H, W) images, batched as NCHW: Conv2d,
// BatchNorm2d, max and average pooling, Flatten, and ResNet's BasicBlock as one
// composite layer (so that a partition never cuts a residual connection).
//
// BatchNorm2d follows torchgpipe's deferred batch norm: in training each micro-batch
// is normalised with its own statistics, but the running statistics are updated once
// per mini-batch (Layer::end_step) as if the whole mini-batch had been seen at once.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layers/activation.h"
#include "layers/layer.h"
#include "layers/registry.h"

namespace gpipe {
namespace layers {

// Gives conv2d, batchnorm2d, maxpool2d, avgpool2d, global_avgpool, flatten and
// basic_block to `register_layer`: the registry (layers/registry.cc) adds them to its
// built-in types when it is first used.
void add_conv_layer_types(const std::function<void(const std::string&, LayerFactory)>& register_layer);

// ---- Conv2d

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
  Conv2dOptions opts_;
  Parameter weight_;  // (K, C, R, S)
  Parameter bias_;    // (K)
};

// ---- BatchNorm2d

struct BatchNorm2dOptions {
  explicit BatchNorm2dOptions(Shape input) : input(std::move(input)) {}
  Shape input;  // (C, H, W) per sample
  double eps = 1e-5;
  double momentum = 0.1;  // running = (1 - momentum) running + momentum batch, as PyTorch
  DType dtype = DType::kF32;
};

// Parameters "weight" (gamma, initialised 1) and "bias" (beta, 0), as PyTorch.
//
// Training forward: normalise with this micro-batch's statistics; unless it is a
// recompute, keep a copy of its mean, biased variance and value count. end_step folds
// all kept micro-batches into one exact mini-batch mean and variance (parallel-variance
// formula), updates the running statistics with the unbiased variance (n / (n - 1)) as
// PyTorch does, and forgets them. Statistics kept in a step whose end_step never ran
// (an executor step without the optimizer) are dropped by the next step's first
// forward rather than mixed into it. With data-parallel replicas, end_step sums the
// statistics over them first, so every replica's running statistics are those of the
// whole mini-batch.
// Evaluation forward (ForwardArgs::training false): normalise with the running
// statistics; such a forward has no backward.
//
// The running statistics are not parameters (nothing trains them), so Layer::to does
// not move them: forward and end_step move them to the backend's device when needed.
class BatchNorm2d : public Layer {
 public:
  explicit BatchNorm2d(const BatchNorm2dOptions& opts);
  std::string type() const override { return "batchnorm2d"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override { return {&gamma_, &beta_}; }
  std::vector<Buffer> buffers() override { return {{"running_mean", &running_mean_}, {"running_var", &running_var_}}; }
  Parameter& gamma() { return gamma_; }
  Parameter& beta() { return beta_; }
  const Tensor& running_mean() const { return running_mean_; }  // (C), initially 0
  const Tensor& running_var() const { return running_var_; }    // (C), initially 1
  // Micro-batches whose statistics wait for end_step.
  int pending_micro_batches() const { return static_cast<int>(kept_.size()); }

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  void end_step_impl(Backend& be, const ReplicaSum& replicas) override;
  void place_running_stats(Device device);

  struct Kept {
    Tensor mean, var;  // (C) on the device of the forward
    int64_t count;     // values per channel: N H W
  };
  BatchNorm2dOptions opts_;
  Parameter gamma_, beta_;             // (C)
  Tensor running_mean_, running_var_;  // (C)
  std::vector<Kept> kept_;
  uint64_t kept_step_ = 0;  // ForwardArgs::step of the kept micro-batches
};

// ---- Pooling

struct MaxPool2dOptions {
  MaxPool2dOptions(Shape input, int kernel) : input(std::move(input)), kernel(kernel) {}
  Shape input;     // (C, H, W)
  int kernel;      // square window
  int stride = 0;  // 0: the kernel size
  int pad = 0;     // at most kernel / 2; padding never wins (-infinity)
  DType dtype = DType::kF32;
};

class MaxPool2d : public Layer {
 public:
  explicit MaxPool2d(const MaxPool2dOptions& opts);
  std::string type() const override { return "maxpool2d"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  int kernel_, stride_, pad_;
};

struct AvgPool2dOptions {
  AvgPool2dOptions(Shape input, int kernel) : input(std::move(input)), kernel(kernel) {}
  // Global average pooling: one value per channel (kernel = the whole plane, which
  // must be square).
  static AvgPool2dOptions global_pool(Shape input);
  Shape input;     // (C, H, W)
  int kernel;      // square window, no padding
  int stride = 0;  // 0: the kernel size
  bool global = false;
  DType dtype = DType::kF32;
};

class AvgPool2d : public Layer {
 public:
  explicit AvgPool2d(const AvgPool2dOptions& opts);
  std::string type() const override { return global_ ? "global_avgpool" : "avgpool2d"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  int kernel_, stride_;
  bool global_;
};

// ---- Flatten: (C, H, W) (or any per-sample shape) -> (C H W), a view.

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

// ---- BasicBlock

struct BasicBlockOptions {
  BasicBlockOptions(Shape input, int64_t out) : input(std::move(input)), out(out) {}
  Shape input;  // (C, H, W)
  int64_t out;  // K
  int stride = 1;
  // false: no batch norm anywhere in the block, and the convolutions get biases
  // instead (a model whose outputs do not depend on the micro-batch split).
  bool batchnorm = true;
  DType dtype = DType::kF32;
  uint64_t seed = 0;
};

// ResNet's basic block (He et al. 2016; torchvision's BasicBlock):
//
//   x -> conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN -> (+) -> ReLU -> y
//   |                                                     ^
//   +------ identity, or conv1x1(stride) -> BN -----------+
//
// The shortcut is a projection when the shape changes (stride > 1 or C != K).
// Parameters are named as torchvision's: conv1, bn1, conv2, bn2, downsample.0 (the
// projection) and downsample.1 (its BN). The Context keeps one child per sub-layer.
class BasicBlock : public Layer {
 public:
  explicit BasicBlock(const BasicBlockOptions& opts);
  std::string type() const override { return "basic_block"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;
  std::vector<Buffer> buffers() override;  // bn1.running_mean, ...
  bool has_projection() const { return proj_conv_ != nullptr; }
  // Batch norms in forward order (bn1, bn2, then the projection's); empty without.
  std::vector<BatchNorm2d*> batchnorms();

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  void end_step_impl(Backend& be, const ReplicaSum& replicas) override;
  BasicBlockOptions opts_;
  std::unique_ptr<Conv2d> conv1_, conv2_, proj_conv_;
  std::unique_ptr<BatchNorm2d> bn1_, bn2_, proj_bn_;  // null without batch norm
  std::unique_ptr<Relu> relu1_, relu_out_;
};

}  // namespace layers
}  // namespace gpipe
