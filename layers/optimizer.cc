#include "layers/optimizer.h"

#include <cmath>
#include <cstddef>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

namespace {
std::vector<Tensor> zeros_like(const std::vector<Parameter*>& params) {
  std::vector<Tensor> out;
  for (Parameter* p : params) out.push_back(backend_for(p->value.device()).zeros(p->value.shape(), p->value.dtype()));
  return out;
}

// Calls step(backend, [begin, end)) for each run of consecutive parameters on one device
// (a stage's parameters are one run): one multi-tensor call per run.
template <typename F>
void for_device_runs(const std::vector<Parameter*>& params, F&& step) {
  for (size_t begin = 0; begin < params.size();) {
    const Device device = params[begin]->value.device();
    size_t end = begin + 1;
    while (end < params.size() && params[end]->value.device() == device) ++end;
    step(backend_for(device), begin, end);
    begin = end;
  }
}

std::vector<Tensor> values(const std::vector<Parameter*>& params, size_t begin, size_t end) {
  std::vector<Tensor> out;
  for (size_t i = begin; i < end; ++i) out.push_back(params[i]->value);
  return out;
}

std::vector<Tensor> grads(const std::vector<Parameter*>& params, size_t begin, size_t end) {
  std::vector<Tensor> out;
  for (size_t i = begin; i < end; ++i) out.push_back(params[i]->grad);
  return out;
}

std::vector<Tensor> slice(const std::vector<Tensor>& xs, size_t begin, size_t end) {
  return std::vector<Tensor>(xs.begin() + static_cast<std::ptrdiff_t>(begin),
                             xs.begin() + static_cast<std::ptrdiff_t>(end));
}
}  // namespace

Sgd::Sgd(std::vector<Parameter*> params, const SgdParams& p) : Optimizer(std::move(params)), p_(p), lr_(p.lr) {
  if (p_.momentum != 0.0) momentum_ = zeros_like(params_);
  momentum_.resize(params_.size());
}

void Optimizer::step() {
  const StepScalarValues s = step_scalars();
  size_t run = 0;
  for_device_runs(params_, [&](Backend& be, size_t begin, size_t end) {
    if (run_scalars_.size() <= run) run_scalars_.emplace_back();
    Tensor& scalars = run_scalars_[run++];
    if (!scalars.defined() || !(scalars.device() == be.device())) scalars = be.empty({kStepScalarCount}, DType::kF64);
    be.write_step_scalars(s, scalars);
    apply_run(be, begin, end, scalars);
  });
  stepped();
}

void Optimizer::apply(const Tensor& scalars) {
  for_device_runs(params_, [&](Backend& be, size_t begin, size_t end) {
    GPIPE_CHECK(be.device() == scalars.device(), "an optimizer step with its scalars on " + scalars.device().str() +
                                                     " and parameters on " + be.device().str());
    apply_run(be, begin, end, scalars);
  });
}

StepScalarValues Sgd::step_scalars() const {
  SgdParams now = p_;
  now.lr = lr_;
  return sgd_step_scalars(now, steps_ + 1);
}

void Sgd::apply_run(Backend& be, size_t begin, size_t end, const Tensor& scalars) {
  be.sgd_step_all(values(params_, begin, end), grads(params_, begin, end), slice(momentum_, begin, end), p_, scalars);
}

std::vector<OptimizerSlot> Sgd::slots(size_t i) {
  if (p_.momentum == 0.0) return {};
  return {{".momentum_buffer", &momentum_.at(i)}};
}

std::vector<OptimizerSlot> Adam::slots(size_t i) { return {{".exp_avg", &m_.at(i)}, {".exp_avg_sq", &v_.at(i)}}; }

Adam::Adam(std::vector<Parameter*> params, const AdamParams& p)
    : Optimizer(std::move(params)), m_(zeros_like(params_)), v_(zeros_like(params_)), p_(p), lr_(p.lr) {}

StepScalarValues Adam::step_scalars() const {
  AdamParams now = p_;
  now.lr = lr_;
  return adam_step_scalars(now, steps_ + 1);
}

void Adam::apply_run(Backend& be, size_t begin, size_t end, const Tensor& scalars) {
  be.adam_step_all(values(params_, begin, end), grads(params_, begin, end), slice(m_, begin, end),
                   slice(v_, begin, end), p_, scalars);
}

std::unique_ptr<Optimizer> make_optimizer(std::vector<Parameter*> params, const OptimizerConfig& c) {
  if (c.type == "sgd") {
    SgdParams p;
    p.lr = c.lr;
    p.momentum = c.momentum;
    p.weight_decay = c.weight_decay;
    p.nesterov = c.nesterov;
    if (p.nesterov && p.momentum <= 0) throw UserError("optimizer.nesterov needs optimizer.momentum > 0");
    return std::make_unique<Sgd>(std::move(params), p);
  }
  if (c.type == "adam" || c.type == "adamw") {
    AdamParams p;
    p.lr = c.lr;
    p.beta1 = c.beta1;
    p.beta2 = c.beta2;
    p.eps = c.eps;
    p.weight_decay = c.weight_decay;
    p.decoupled = c.type == "adamw";
    return std::make_unique<Adam>(std::move(params), p);
  }
  throw UserError("optimizer.type: unknown optimizer '" + c.type + "'; valid: sgd, adam, adamw");
}

std::vector<std::string> optimizer_slot_suffixes(const OptimizerConfig& c) {
  if (c.type == "adam" || c.type == "adamw") return {".exp_avg", ".exp_avg_sq"};
  if (c.momentum != 0.0) return {".momentum_buffer"};
  return {};
}

double LrSchedule::at(int step) const {
  if (warmup_steps > 0 && step < warmup_steps) return base_lr * (step + 1) / warmup_steps;
  if (kind == "constant") return base_lr;
  // cosine: from base_lr right after warmup to min_lr at the last step.
  const int span = std::max(1, total_steps - warmup_steps - 1);
  const double t = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + std::cos(M_PI * t));
}

}  // namespace layers
}  // namespace gpipe
