// Optimizers own their per-parameter state and update parameters in place on the
// parameters' own device. One step per mini-batch, after gradients of all
// micro-batches have been accumulated. Learning-rate schedules are plain functions
// of the step.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct OptimizerConfig {
  std::string type = "sgd";  // sgd | adam | adamw
  double lr = 0.01;
  double weight_decay = 0.0;
  double momentum = 0.0;  // sgd
  bool nesterov = false;  // sgd
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
};

// One piece of a parameter's optimizer state, named as PyTorch's state_dict names it
// (the checkpoint stores it as "<parameter name><suffix>").
struct OptimizerSlot {
  std::string suffix;  // ".momentum_buffer", ".exp_avg", ".exp_avg_sq"
  Tensor* value = nullptr;
};

// A step reads its learning rate and count from the step's scalars on the device
// (kernels/step_scalars.h), so that its launches are the same at every step: the host
// writes them before the step (step_scalars()), the update reads them, and the count
// advances once the host knows that the step was not skipped (an overflow, bad data).
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One whole step, decided on the host: the scalars written for each device of the
  // parameters, the update, the count advanced.
  void step();
  // The update of the pipeline's optimizer step (pipeline/executor): every parameter on
  // `scalars`' device, which hold step_scalars()' values, and perhaps the norm's
  // scale and skip (kernels/step_scalars.h). The count is not advanced: stepped() does.
  void apply(const Tensor& scalars);
  // The next step's scalars (step steps() + 1) with this optimizer's part (kStepNumber,
  // kStepLr, and for Adam its decay and bias corrections), the others initial.
  virtual StepScalarValues step_scalars() const = 0;
  void stepped() { set_steps(steps() + 1); }
  virtual void set_lr(double lr) = 0;
  const std::vector<Parameter*>& params() const { return params_; }
  // For checkpoints: parameter i's state (on its device), and the steps taken, which
  // decide Adam's bias correction and SGD's first momentum step.
  virtual std::vector<OptimizerSlot> slots(size_t param) = 0;
  virtual int64_t steps() const = 0;
  virtual void set_steps(int64_t steps) = 0;

 protected:
  explicit Optimizer(std::vector<Parameter*> params) : params_(std::move(params)) {}
  // The update of parameters [begin, end), all on be's device, one multi-tensor call.
  virtual void apply_run(Backend& be, size_t begin, size_t end, const Tensor& scalars) = 0;
  std::vector<Parameter*> params_;

 private:
  std::vector<Tensor> run_scalars_;  // step(): each device run's scalars, made once and rewritten
};

// SGD with momentum, Nesterov and weight decay, as torch.optim.SGD (dampening 0).
class Sgd : public Optimizer {
 public:
  Sgd(std::vector<Parameter*> params, const SgdParams& p);
  StepScalarValues step_scalars() const override;
  void set_lr(double lr) override { lr_ = lr; }
  std::vector<OptimizerSlot> slots(size_t param) override;  // momentum_buffer, with momentum
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  void apply_run(Backend& be, size_t begin, size_t end, const Tensor& scalars) override;
  std::vector<Tensor> momentum_;  // one buffer per parameter, on its device
  SgdParams p_;  // as configured, the same at every step: the update reads lr_ from the step's scalars
  double lr_;
  int64_t steps_ = 0;
};

// Adam (L2 weight decay in the gradient, as torch.optim.Adam) or AdamW (decoupled
// weight decay, as torch.optim.AdamW).
class Adam : public Optimizer {
 public:
  Adam(std::vector<Parameter*> params, const AdamParams& p);
  StepScalarValues step_scalars() const override;
  void set_lr(double lr) override { lr_ = lr; }
  std::vector<OptimizerSlot> slots(size_t param) override;  // exp_avg, exp_avg_sq
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  void apply_run(Backend& be, size_t begin, size_t end, const Tensor& scalars) override;
  std::vector<Tensor> m_, v_;
  AdamParams p_;  // as configured, the same at every step: the update reads lr_ from the step's scalars
  double lr_;
  int64_t steps_ = 0;
};

// Throws UserError for an unknown type, listing the valid ones.
std::unique_ptr<Optimizer> make_optimizer(std::vector<Parameter*> params, const OptimizerConfig& c);
// The slots' suffixes an optimizer of this config keeps per parameter (without making one).
std::vector<std::string> optimizer_slot_suffixes(const OptimizerConfig& c);

// Learning rate at a step: linear warmup from 0 over `warmup_steps`, then constant or
// cosine decay to `min_lr` at `total_steps`.
struct LrSchedule {
  std::string kind = "constant";  // constant | cosine
  double base_lr = 0.01;
  int warmup_steps = 0;
  int total_steps = 1;
  double min_lr = 0.0;
  double at(int step) const;
};

}  // namespace layers
}  // namespace gpipe
