// Losses close the model on the last stage. A loss is scaled by the caller so that the
// sum over micro-batches equals the mean over the whole mini-batch: each micro-batch
// passes scale = 1 / (samples in the mini-batch), however the batch was split.
#pragma once

#include <memory>
#include <string>

#include "layers/layer.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string type() const = 0;
  // logits: (batch, *input_shape); targets: int32 (batch, *input_shape minus its last
  // dimension). Returns the scaled loss (1). scale: a value, or in the executor's training
  // steps also its slot in the step's scalars (LossScale, kernels/backend.h), which the
  // loss's ops then read when they run.
  virtual Tensor forward(Backend& be, const Tensor& logits, const Tensor& targets, const LossScale& scale,
                         Context* ctx) = 0;
  // d(scaled loss)/d logits.
  virtual Tensor backward(Backend& be, const Context& ctx) = 0;
  virtual LayerCost cost(int64_t batch) const = 0;
  // How many of the host targets count towards the mean (all, unless some are
  // ignored): the loss of a mini-batch is the sum over them divided by this count.
  virtual int64_t counted_targets(const Tensor& targets) const { return targets.numel(); }
  // The tensor group a split loss sums over (VocabParallelCrossEntropy); nothing otherwise.
  virtual void set_collectives(TensorCollectives* /*group*/) {}
  // How many rows of logits have their largest entry (the first on ties) at their
  // target's column, over the counted targets (evaluation's accuracy); a host value. The
  // default: Backend::argmax_correct with PyTorch's ignore_index, -100.
  virtual int64_t correct(Backend& be, const Tensor& logits, const Tensor& targets);

 protected:
  // The last forward's factor, with its step scalars: a backward whose context saved the
  // same value reads it from there too (a step's forwards and backwards share it); any
  // other takes its saved value. The same factor either way.
  void remember(const LossScale& scale) { last_scale_ = scale; }
  LossScale for_backward(double saved) const {
    return last_scale_.from_device() && last_scale_.value == saved ? last_scale_ : LossScale(saved);
  }

 private:
  LossScale last_scale_;
};

// Softmax over the last dimension of the logits, then the negative log-likelihood of
// the target class: (batch, classes) logits with (batch) targets, or (batch, T,
// classes) with (batch, T) for a language model. Targets equal to ignore_index
// contribute nothing (and their count should be left out of the scale).
class SoftmaxCrossEntropy : public Loss {
 public:
  // sample_shape: logits per sample, classes last.
  SoftmaxCrossEntropy(Shape sample_shape, DType dtype = DType::kF32, int ignore_index = -100);
  SoftmaxCrossEntropy(int64_t classes, DType dtype = DType::kF32, int ignore_index = -100)
      : SoftmaxCrossEntropy(Shape{classes}, dtype, ignore_index) {}
  std::string type() const override { return "softmax_cross_entropy"; }
  Tensor forward(Backend& be, const Tensor& logits, const Tensor& targets, const LossScale& scale,
                 Context* ctx) override;
  Tensor backward(Backend& be, const Context& ctx) override;
  LayerCost cost(int64_t batch) const override;
  int64_t counted_targets(const Tensor& targets) const override;  // those != ignore_index
  int64_t correct(Backend& be, const Tensor& logits, const Tensor& targets) override;
  int ignore_index() const { return ignore_index_; }

 private:
  Shape sample_shape_;
  int64_t classes_;
  DType dtype_;
  int ignore_index_;
};

// Softmax cross-entropy over logits split by the vocabulary over a tensor group
// (Megatron's vocab-parallel cross-entropy): each member holds columns [r V/T, (r+1) V/T)
// of the logits (a column-parallel output projection's), and the loss is computed
// without gathering them: the rows' largest logits (the group's max), then each row's
// sum of exponentials and its label's logit (the group's sum: one all-reduce of 2 values
// a row), then the loss on every member alike. The gradient is each member's columns of
// softmax - onehot: no collective. Equal to SoftmaxCrossEntropy of the whole logits.
class VocabParallelCrossEntropy : public Loss {
 public:
  // sample_shape: this member's logits per sample, its V/T classes last; vocab: V.
  VocabParallelCrossEntropy(Shape sample_shape, int64_t vocab, TensorShard shard, DType dtype = DType::kF32,
                            int ignore_index = -100);
  std::string type() const override { return "softmax_cross_entropy"; }
  Tensor forward(Backend& be, const Tensor& logits, const Tensor& targets, const LossScale& scale,
                 Context* ctx) override;
  Tensor backward(Backend& be, const Context& ctx) override;
  LayerCost cost(int64_t batch) const override;
  int64_t counted_targets(const Tensor& targets) const override;  // those != ignore_index
  void set_collectives(TensorCollectives* group) override { group_ = group; }
  // The group's argmax: the row maxima's max, then the smallest column holding it.
  int64_t correct(Backend& be, const Tensor& logits, const Tensor& targets) override;
  int ignore_index() const { return ignore_index_; }

 private:
  TensorCollectives& group() const;
  // This member's logits as (R, V / T) in the master type (float32 in a bf16 or fp16
  // model, as SoftmaxCrossEntropy), and each row's largest logit over the group.
  struct Rows {
    Tensor logits, rowmax;
  };
  Rows rows_and_maxima(Backend& be, const Tensor& logits_in);
  Shape sample_shape_;
  int64_t classes_;  // this member's
  int64_t vocab_;
  TensorShard shard_;
  DType dtype_;
  int ignore_index_;
  TensorCollectives* group_ = nullptr;
};

}  // namespace layers
}  // namespace gpipe
