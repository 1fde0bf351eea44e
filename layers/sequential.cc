#include "layers/sequential.h"

#include <algorithm>
#include <cctype>

#include <cmath>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

std::string Sequential::layer_name(int i) const {
  const std::string& n = names_.at(i);
  return n.empty() ? "layers." + std::to_string(i) : n;
}

void Sequential::set_layer_name(int i, const std::string& name) {
  const std::string what = "layer " + std::to_string(i) + " (" + layers_.at(i)->describe() + ")";
  const bool ok_chars = std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
  });
  if (name.empty() || !ok_chars || name.front() == '.' || name.back() == '.') {
    throw UserError(what + ": name '" + name + "' must be letters, digits, '_' and inner '.', e.g. h.0 or lm_head");
  }
  for (int j = 0; j < size(); ++j) {
    if (j != i && layer_name(j) == name) {
      throw UserError(what + ": name '" + name + "' is layer " + std::to_string(j) + "'s already; names are unique");
    }
  }
  names_.at(i) = name;
  layers_.at(i)->name_ = name;
}

Layer& Sequential::add(std::unique_ptr<Layer> layer, const std::string& name) {
  const Shape& want = output_shape();
  if (layer->input_shape() != want || layer->input_dtype() != output_dtype()) {
    // Both ends by the names the user gave them: this layer, and the one whose output it receives.
    const std::string producer =
        layers_.empty() ? "the model's input is"
                        : layers_.back()->name_for_errors() + " outputs";
    throw UserError("layer " + std::to_string(layers_.size()) + (name.empty() ? "" : " '" + name + "'") + " (" +
                    layer->describe() + ", type '" + layer->type() + "') takes " + dtype_name(layer->input_dtype()) +
                    shape_str(layer->input_shape()) + " per sample, but " + producer + " " +
                    dtype_name(output_dtype()) + shape_str(want) + "; fix its input size or type");
  }
  layer->index_ = static_cast<int>(layers_.size());
  layers_.push_back(std::move(layer));
  names_.emplace_back();
  if (!name.empty()) set_layer_name(size() - 1, name);
  return *layers_.back();
}

void Sequential::set_collectives(TensorCollectives* group) {
  collectives_ = group;
  for (auto& l : layers_) l->set_collectives(group);
  if (loss_) loss_->set_collectives(group);
}

Loss& Sequential::loss() {
  if (!loss_) throw UserError("the model has no loss; add one (model.loss in YAML, set_loss in C++)");
  return *loss_;
}

const Shape& Sequential::output_shape() const {
  return layers_.empty() ? input_shape_ : layers_.back()->output_shape();
}

std::vector<LayerCost> Sequential::costs(int64_t batch) const {
  std::vector<LayerCost> out;
  for (const auto& l : layers_) {
    out.push_back(l->cost(batch));
    check_cost(*l, batch, out.back());  // a layer of one's own with a wrong cost() is named here
  }
  if (loss_ && !out.empty()) {
    const LayerCost lc = loss_->cost(batch);
    for (double v : {lc.forward_flops, lc.backward_flops, lc.forward_bytes, lc.backward_bytes}) {
      if (!(v >= 0) || !std::isfinite(v)) {
        throw UserError("the loss (" + loss_->type() + "): cost(" + std::to_string(batch) + ") has a count of " +
                        std::to_string(v) + "; every count must be finite and non-negative; fix the loss's cost()");
      }
    }
    LayerCost& last = out.back();
    last.backward_parts = backward_parts(last);
    last.backward_parts.push_back({false, lc.backward_flops, lc.backward_bytes});  // in B: it makes dy
    last.forward_flops += lc.forward_flops;
    last.backward_flops += lc.backward_flops;
    last.forward_bytes += lc.forward_bytes;
    last.backward_bytes += lc.backward_bytes;
    last.saved_bytes += lc.saved_bytes;
  }
  return out;
}

std::vector<std::pair<std::string, Parameter*>> Sequential::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (Parameter* p : layers_[i]->parameters()) out.emplace_back(qualified_name(static_cast<int>(i), p->name), p);
  }
  return out;
}

int64_t Sequential::parameter_count() {
  int64_t n = 0;
  for (auto& np : named_parameters()) {
    if (!is_tied_copy(np.second)) n += np.second->value.numel();
  }
  return n;
}

void Sequential::tie(int owner_layer, Parameter& owner, int copy_layer, Parameter& copy) {
  GPIPE_CHECK(owner_layer >= 0 && owner_layer < size() && copy_layer >= 0 && copy_layer < size(),
              "tie: layer index outside the model");
  if (owner.value.shape() != copy.value.shape() || owner.value.dtype() != copy.value.dtype()) {
    throw UserError("cannot tie " + qualified_name(copy_layer, copy.name) + " " + copy.value.str() + " to " +
                    qualified_name(owner_layer, owner.name) + " " + owner.value.str() +
                    ": a tied weight needs the same shape and type in both layers");
  }
  for (const Tie& t : ties_) {
    if (t.owner == &owner || t.copy == &owner || t.copy == &copy) {
      throw UserError("cannot tie " + qualified_name(copy_layer, copy.name) + " to " +
                      qualified_name(owner_layer, owner.name) + ": one of them is tied already; a weight "
                      "can be shared by two layers only");
    }
  }
  if (!owner.value.is_meta() && !copy.value.is_meta()) {  // a model built on shapes has no values to tie
    backend_for(copy.value.device()).copy(owner.value, copy.value);
    copy.refresh(backend_for(copy.value.device()));
  }
  ties_.push_back({owner_layer, &owner, copy_layer, &copy});
}

bool Sequential::is_tied_copy(const Parameter* p) const {
  for (const Tie& t : ties_) {
    if (t.copy == p) return true;
  }
  return false;
}

void Sequential::sum_tied_gradients(Backend& be) {
  for (const Tie& t : ties_) sum_tied_gradient(be, t);
}

void Sequential::sum_tied_gradient(Backend& be, const Tie& t) {
  be.axpy(1.0, t.copy->grad, t.owner->grad);
  be.copy(t.owner->grad, t.copy->grad);
}

void Sequential::end_step(Backend& be) {
  for (auto& l : layers_) l->end_step(be);
}

void Sequential::zero_grad() {
  for (auto& np : named_parameters()) backend_for(np.second->grad.device()).fill(np.second->grad, 0.0);
}

double Sequential::forward_backward(Backend& be, const Tensor& x, const Tensor& targets, double scale,
                                    const ForwardArgs& args) {
  std::vector<Context> ctx(layers_.size());
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) h = layers_[i]->forward(be, h, &ctx[i], args);
  Context loss_ctx;
  Tensor loss = this->loss().forward(be, h, targets, scale, &loss_ctx);
  Tensor g = loss_->backward(be, loss_ctx);
  for (size_t i = layers_.size(); i-- > 0;) g = layers_[i]->backward(be, g, ctx[i], i > 0);
  return be.item(loss);
}

Tensor model_input(const Sequential& model, const Tensor& data) {
  const DType want = model.input_dtype();
  if (!is_narrow(want) || data.dtype() == want) return data;
  Tensor narrow = Tensor::empty(data.shape(), want, Device::cpu());
  backend_for(Device::cpu()).cast(data, narrow);
  return narrow;
}

}  // namespace layers
}  // namespace gpipe
