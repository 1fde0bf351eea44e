#include "layers/optimizer.h"

namespace gpipe {
namespace layers {

Sgd::Sgd(std::vector<Parameter*> params, const SgdParams& p) : params_(std::move(params)), p_(p) {
  for (Parameter* prm : params_) {
    momentum_.push_back(p_.momentum != 0.0 ? backend_for(prm->value.device()).zeros(prm->value.shape(),
                                                                                    prm->value.dtype())
                                           : Tensor());
  }
}

void Sgd::step() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter* prm = params_[i];
    backend_for(prm->value.device()).sgd_step(prm->value, prm->grad, momentum_[i], p_, first_);
  }
  first_ = false;
}

}  // namespace layers
}  // namespace gpipe
