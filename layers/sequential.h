// A model is a sequence of layers followed by a loss: the form GPipe partitions. The
// same object is the unpartitioned reference (forward_backward) and the source of the
// pipeline's cells (contiguous ranges of its layers).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer.h"
#include "layers/loss.h"

namespace gpipe {
namespace layers {

// A weight used by two layers, such as a language model's output head tied to its
// token embedding. In a pipeline the two usually sit on different stages (the first
// and the last), so each layer keeps its own copy, as Megatron-LM does: equal at the
// start, and kept equal by giving both the sum of their gradients before every
// optimizer step, so that both take the same step. The copy is left out of the
// parameter count and of the gradient norm.
struct Tie {
  int owner_layer = 0;
  Parameter* owner = nullptr;
  int copy_layer = 0;
  Parameter* copy = nullptr;
};

class Sequential {
 public:
  Sequential(Shape input_shape, DType dtype) : Sequential(std::move(input_shape), dtype, dtype) {}
  // input_dtype: int32 for a model that starts from token ids.
  Sequential(Shape input_shape, DType dtype, DType input_dtype)
      : input_shape_(std::move(input_shape)), dtype_(dtype), input_dtype_(input_dtype) {}

  // Appends a layer; its input shape must equal the current output shape. `name`, if
  // given, is what checkpoints call the layer ("wte", "h.0", "lm_head": letters, digits,
  // '_' and '.', unique in the model), so that a model of one's own keeps its names in
  // any partition; without one it is "layers.<index>".
  Layer& add(std::unique_ptr<Layer> layer, const std::string& name = "");
  template <typename L, typename... Args>
  L& emplace(Args&&... args) {
    return static_cast<L&>(add(std::make_unique<L>(std::forward<Args>(args)...)));
  }
  void set_loss(std::unique_ptr<Loss> loss) { loss_ = std::move(loss); }
  // Every layer's and the loss's tensor group (Layer::set_collectives), for a model built
  // as one member of a group (layers::ModelSpec::member).
  void set_collectives(TensorCollectives* group);
  TensorCollectives* collectives() const { return collectives_; }  // the last set (nullptr: none)
  // Sets the model's tensor group for as long as it lives, then the one it had back (a
  // probe on shapes asks a group that only answers with shapes).
  class CollectivesFor {
   public:
    CollectivesFor(Sequential& model, TensorCollectives* group) : model_(model), before_(model.collectives()) {
      model_.set_collectives(group);
    }
    ~CollectivesFor() { model_.set_collectives(before_); }
    CollectivesFor(const CollectivesFor&) = delete;
    CollectivesFor& operator=(const CollectivesFor&) = delete;

   private:
    Sequential& model_;
    TensorCollectives* before_;
  };

  int size() const { return static_cast<int>(layers_.size()); }
  // The layer's name in checkpoints: its own, or "layers.<i>".
  std::string layer_name(int i) const;
  // "<layer_name(i)>.<name>": a parameter's or buffer's name in checkpoints, in the
  // gradient checks and in named_parameters.
  std::string qualified_name(int i, const std::string& name) const { return layer_name(i) + "." + name; }
  // Names layer i (see add).
  void set_layer_name(int i, const std::string& name);
  Layer& layer(int i) { return *layers_.at(i); }
  const Layer& layer(int i) const { return *layers_.at(i); }
  Loss& loss();
  bool has_loss() const { return loss_ != nullptr; }
  const Shape& input_shape() const { return input_shape_; }
  const Shape& output_shape() const;
  DType dtype() const { return dtype_; }
  DType input_dtype() const { return input_dtype_; }
  DType output_dtype() const { return layers_.empty() ? input_dtype_ : layers_.back()->dtype(); }

  // Per-layer costs for a batch; the loss is counted with the last layer. Each layer's
  // is checked first (check_cost in layer.h): a wrong one is a UserError naming it.
  std::vector<LayerCost> costs(int64_t batch) const;
  // ("layers.3.weight" or "lm_head.weight": qualified_name, parameter) in layer order.
  std::vector<std::pair<std::string, Parameter*>> named_parameters();
  int64_t parameter_count();  // tied copies counted once
  void zero_grad();
  // Makes `copy` (of layer copy_layer) a tied copy of `owner` (of layer owner_layer):
  // same shape and type, its value overwritten with the owner's.
  void tie(int owner_layer, Parameter& owner, int copy_layer, Parameter& copy);
  const std::vector<Tie>& ties() const { return ties_; }
  bool is_tied_copy(const Parameter* p) const;
  // After the whole mini-batch's backward, on the backend holding both parameters of
  // every tie: each gets the sum of the two gradients (the executor does the same
  // across stages).
  void sum_tied_gradients(Backend& be);
  // The same for one tie.
  static void sum_tied_gradient(Backend& be, const Tie& t);
  // Every layer's end_step (see Layer::end_step), on one backend.
  void end_step(Backend& be);

  // The unpartitioned reference: forward and backward of the whole batch on one
  // backend, adding into the gradients. Returns the loss scaled by `scale`.
  double forward_backward(Backend& be, const Tensor& x, const Tensor& targets, double scale,
                          const ForwardArgs& args = {});

 private:
  Shape input_shape_;
  DType dtype_;
  DType input_dtype_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<std::string> names_;  // per layer; empty: "layers.<i>"
  std::unique_ptr<Loss> loss_;
  std::vector<Tie> ties_;
  TensorCollectives* collectives_ = nullptr;
};

// The model's input made from data: float data for a model whose input is a narrow type
// (bfloat16) rounded to it, on the host, as a first layer's output would be; anything
// else as it is. The executor and the profiler feed the model through this.
Tensor model_input(const Sequential& model, const Tensor& data);

}  // namespace layers
}  // namespace gpipe
