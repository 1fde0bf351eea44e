// Inverted dropout with a counter-based mask: element e of sample s is dropped by a
// pure function of (layer seed, step, s, e) (Backend::dropout), so the mask is the
// same however the mini-batch is split into micro-batches and when a checkpointed
// micro-batch is recomputed. Backward regenerates the mask instead of storing it.
#pragma once

#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct DropoutOptions {
  DropoutOptions(Shape shape, double p) : shape(std::move(shape)), p(p) {}
  Shape shape;  // per sample
  double p;     // probability of dropping an element, in [0, 1)
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Where this layer's elements start in the whole sample: 0, or for a
  // sequence-parallel member's positions (layers/tensor_parallel.h) the first of them
  // times the features. The mask is the unsplit sample's there.
  int64_t element_offset = 0;
};

class Dropout : public Layer {
 public:
  explicit Dropout(const DropoutOptions& opts);
  std::string type() const override { return "dropout"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  double p() const { return opts_.p; }
  // Whether forward is the identity for these arguments (not training, or p == 0): it
  // returns x itself and saves nothing, and backward returns dy itself.
  bool identity(const ForwardArgs& args) const { return !args.training || opts_.p == 0.0; }
  // The mask's key for an optimizer step: mix_seed(seed, step), the step taken from the
  // step's scalars when there are some (ForwardArgs::step_scalars).
  DropoutKey key(uint64_t step, const Tensor& step_scalars = {}) const;

 private:
  // Identity (returning x itself, saving nothing) when args.training is false or p == 0.
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  DropoutOptions opts_;
  // The last training forward's step scalars and step, for a backward's key of that step
  // (a step's forwards and backwards share them); another step's backward, or none given,
  // takes the step kept in its context: the same key.
  Tensor step_scalars_;
  uint64_t step_scalars_step_ = 0;
};

}  // namespace layers
}  // namespace gpipe
