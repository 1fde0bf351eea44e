// BatchNorm2d follows torchgpipe's deferred batch norm: in training each micro-batch
// is normalised with its own statistics, but the running statistics are updated once
// per mini-batch (Layer::end_step) as if the whole mini-batch had been seen at once.
#pragma once

#include <string>
#include <vector>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

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
  // The statistics are kept and folded on the host (end_step): not a replayable step.
  bool capturable() const override { return false; }

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

}  // namespace layers
}  // namespace gpipe
