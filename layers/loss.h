// Losses close the model on the last stage. A loss is scaled by the caller so that the
// sum over micro-batches equals the mean over the whole mini-batch: each micro-batch
// passes scale = 1 / (samples in the mini-batch), however the batch was split.
#pragma once

#include <memory>
#include <string>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string type() const = 0;
  // logits: (batch, *input_shape); targets: int32 (batch). Returns the scaled loss (1).
  virtual Tensor forward(Backend& be, const Tensor& logits, const Tensor& targets, double scale,
                         Context* ctx) = 0;
  // d(scaled loss)/d logits.
  virtual Tensor backward(Backend& be, const Context& ctx) = 0;
  virtual LayerCost cost(int64_t batch) const = 0;
};

// Softmax over the last dimension of (batch, classes) logits, then the negative
// log-likelihood of the target class. Targets equal to ignore_index contribute
// nothing (and their count should be left out of the scale).
class SoftmaxCrossEntropy : public Loss {
 public:
  SoftmaxCrossEntropy(int64_t classes, DType dtype = DType::kF32, int ignore_index = -100)
      : classes_(classes), dtype_(dtype), ignore_index_(ignore_index) {}
  std::string type() const override { return "softmax_cross_entropy"; }
  Tensor forward(Backend& be, const Tensor& logits, const Tensor& targets, double scale, Context* ctx) override;
  Tensor backward(Backend& be, const Context& ctx) override;
  LayerCost cost(int64_t batch) const override;
  int ignore_index() const { return ignore_index_; }

 private:
  int64_t classes_;
  DType dtype_;
  int ignore_index_;
};

}  // namespace layers
}  // namespace gpipe
