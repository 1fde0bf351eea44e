// Optimizers own their per-parameter state and update parameters in place on the
// parameters' own device. One step per mini-batch, after gradients of all
// micro-batches have been accumulated.
#pragma once

#include <string>
#include <vector>

#include "kernels/backend.h"
#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct OptimizerSpec {
  std::string type = "sgd";
  SgdParams sgd;
};

class Sgd {
 public:
  Sgd(std::vector<Parameter*> params, const SgdParams& p);
  void step();
  const SgdParams& params() const { return p_; }
  void set_lr(double lr) { p_.lr = lr; }

 private:
  std::vector<Parameter*> params_;
  std::vector<Tensor> momentum_;  // one buffer per parameter, on its device
  SgdParams p_;
  bool first_ = true;
};

}  // namespace layers
}  // namespace gpipe
