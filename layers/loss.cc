#include "layers/loss.h"

#include <algorithm>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

int64_t Loss::correct(Backend& be, const Tensor& logits, const Tensor& targets) {
  const int64_t classes = logits.shape().back(), rows = logits.numel() / classes;
  return be.argmax_correct(logits.reshape({rows, classes}), targets.reshape({rows}), -100);
}

int64_t SoftmaxCrossEntropy::correct(Backend& be, const Tensor& logits, const Tensor& targets) {
  const int64_t rows = logits.numel() / classes_;
  return be.argmax_correct(logits.reshape({rows, classes_}), targets.reshape({rows}), ignore_index_);
}

SoftmaxCrossEntropy::SoftmaxCrossEntropy(Shape sample_shape, DType dtype, int ignore_index)
    : sample_shape_(std::move(sample_shape)), classes_(sample_shape_.empty() ? 0 : sample_shape_.back()),
      dtype_(dtype), ignore_index_(ignore_index) {
  if (classes_ < 1) throw UserError("softmax_cross_entropy needs logits with a class dimension");
}

Tensor SoftmaxCrossEntropy::forward(Backend& be, const Tensor& logits_in, const Tensor& targets_in,
                                    const LossScale& scale, Context* ctx) {
  check_batch(logits_in, sample_shape_, dtype_, "softmax_cross_entropy", "logits");
  Shape want{logits_in.size(0)};
  want.insert(want.end(), sample_shape_.begin(), sample_shape_.end() - 1);
  if (targets_in.dtype() != DType::kI32 || targets_in.shape() != want) {
    throw UserError("softmax_cross_entropy: targets " + targets_in.str() + " must be int32 " + shape_str(want) +
                    ", one class per row of the logits " + logits_in.str());
  }
  const Tensor logits = logits_in.reshape({logits_in.numel() / classes_, classes_});  // (R, C)
  const Tensor targets = targets_in.reshape({logits.size(0)});                        // (R)
  // The softmax and the loss in float32 in a bf16 or fp16 model (master_dtype); the logits'
  // gradient in the model's type.
  Tensor probs = be.empty(logits.shape(), master_dtype(dtype_));                      // (R, C)
  Tensor loss = be.empty({1}, master_dtype(dtype_));
  be.softmax_xent(logits, targets, scale, ignore_index_, probs, loss);
  remember(scale);
  if (ctx != nullptr) {
    // saved: probs, targets, and the scale as a one-element host tensor.
    ctx->saved = {probs, targets, Tensor::from_vector<double>({scale.value}, {1})};
  }
  return loss;
}

Tensor SoftmaxCrossEntropy::backward(Backend& be, const Context& ctx) {
  const Tensor& probs = ctx.saved.at(0);  // (R, C)
  const LossScale scale = for_backward(ctx.saved.at(2).data<double>()[0]);
  Tensor dlogits = be.empty(probs.shape(), dtype_);
  be.softmax_xent_backward(probs, ctx.saved.at(1), scale, ignore_index_, dlogits);
  Shape out{probs.size(0) / shape_numel(Shape(sample_shape_.begin(), sample_shape_.end() - 1))};
  out.insert(out.end(), sample_shape_.begin(), sample_shape_.end());
  return dlogits.reshape(out);
}

LayerCost SoftmaxCrossEntropy::cost(int64_t batch) const {
  const double n = static_cast<double>(batch * shape_numel(sample_shape_));
  const int64_t rows = batch * shape_numel(sample_shape_) / classes_;
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  c.forward_flops = 5 * n;  // max, exp, sum, divide, log
  c.backward_flops = 2 * n;
  c.forward_bytes = 2 * es * n;
  c.backward_bytes = 2 * es * n;
  c.output_bytes = static_cast<int64_t>(dtype_size(master_dtype(dtype_)));  // the loss, float32 in a bf16 or fp16 model
  c.saved_bytes = static_cast<int64_t>(static_cast<double>(dtype_size(master_dtype(dtype_))) * n + 4 * rows);  // probs, labels
  return c;
}

int64_t SoftmaxCrossEntropy::counted_targets(const Tensor& targets) const {
  const int32_t* t = targets.data<int32_t>();
  return std::count_if(t, t + targets.numel(), [&](int32_t v) { return v != ignore_index_; });
}

VocabParallelCrossEntropy::VocabParallelCrossEntropy(Shape sample_shape, int64_t vocab, TensorShard shard,
                                                     DType dtype, int ignore_index)
    : sample_shape_(std::move(sample_shape)), classes_(sample_shape_.empty() ? 0 : sample_shape_.back()), vocab_(vocab),
      shard_(shard), dtype_(dtype), ignore_index_(ignore_index) {
  if (classes_ < 1 || shard.size < 1 || shard.rank < 0 || shard.rank >= shard.size ||
      classes_ * shard.size != vocab) {
    throw UserError("softmax_cross_entropy split over a tensor group of " + std::to_string(shard.size) + ": " +
                    std::to_string(classes_) + " logits a member do not make a vocabulary of " +
                    std::to_string(vocab) + "; make the vocabulary a multiple of the group's size");
  }
}

TensorCollectives& VocabParallelCrossEntropy::group() const {
  if (group_ == nullptr || group_->size() != shard_.size || group_->rank() != shard_.rank) {
    throw Error("softmax_cross_entropy split over a tensor group of " + std::to_string(shard_.size) +
                " was not given its member " + std::to_string(shard_.rank) + "'s group (set_collectives)");
  }
  return *group_;
}

VocabParallelCrossEntropy::Rows VocabParallelCrossEntropy::rows_and_maxima(Backend& be, const Tensor& logits_in) {
  const Tensor narrow = logits_in.reshape({logits_in.numel() / classes_, classes_});  // (R, V / T)
  const DType master = master_dtype(dtype_);
  Rows r{narrow, be.empty({narrow.size(0)}, master)};
  if (dtype_ != master) {
    r.logits = be.empty(narrow.shape(), master);
    be.cast(narrow, r.logits);
  }
  be.reduce_rows(Reduce::kMax, r.logits, r.rowmax);
  group().all_reduce_max(be, r.rowmax);  // the shift of every member's exponentials
  return r;
}

Tensor VocabParallelCrossEntropy::forward(Backend& be, const Tensor& logits_in, const Tensor& targets_in,
                                          const LossScale& scale, Context* ctx) {
  check_batch(logits_in, sample_shape_, dtype_, "softmax_cross_entropy", "logits");
  const int64_t rows = logits_in.numel() / classes_;
  Shape want{logits_in.size(0)};
  want.insert(want.end(), sample_shape_.begin(), sample_shape_.end() - 1);
  if (targets_in.dtype() != DType::kI32 || targets_in.shape() != want) {
    throw UserError("softmax_cross_entropy: targets " + targets_in.str() + " must be int32 " + shape_str(want) +
                    ", one class per row of the logits " + logits_in.str());
  }
  const Tensor targets = targets_in.reshape({rows});
  const DType master = master_dtype(dtype_);
  const auto [logits, rowmax] = rows_and_maxima(be, logits_in);
  const int64_t first = shard_.rank * classes_;
  Tensor sums = be.empty({2 * rows}, master);  // each row's sum of exponentials, then its label's logit
  be.softmax_xent_slice_sums(logits, targets, first, vocab_, ignore_index_, rowmax, sums);
  group().all_reduce_sum(be, sums);
  Tensor lse = be.empty({rows}, master);
  Tensor loss = be.empty({1}, master);
  be.softmax_xent_slice_loss(sums, rowmax, targets, ignore_index_, scale, lse, loss);
  remember(scale);
  if (ctx != nullptr) ctx->saved = {logits, targets, lse, Tensor::from_vector<double>({scale.value}, {1})};
  return loss;
}

Tensor VocabParallelCrossEntropy::backward(Backend& be, const Context& ctx) {
  const Tensor& logits = ctx.saved.at(0);  // (R, V / T), in the master type
  const LossScale scale = for_backward(ctx.saved.at(3).data<double>()[0]);
  Tensor d = be.empty(logits.shape(), logits.dtype());
  be.softmax_xent_slice_backward(logits, ctx.saved.at(1), shard_.rank * classes_, ignore_index_, ctx.saved.at(2), scale,
                                 d);
  Tensor dlogits = d;
  if (dtype_ != logits.dtype()) {  // the gradient in the model's type
    dlogits = be.empty(d.shape(), dtype_);
    be.cast(d, dlogits);
  }
  Shape out{logits.size(0) / shape_numel(Shape(sample_shape_.begin(), sample_shape_.end() - 1))};
  out.insert(out.end(), sample_shape_.begin(), sample_shape_.end());
  return dlogits.reshape(out);
}

LayerCost VocabParallelCrossEntropy::cost(int64_t batch) const {
  // This member's columns, as SoftmaxCrossEntropy counts its own; the per-row steps and
  // the collectives' two values a row are left out.
  const double n = static_cast<double>(batch * shape_numel(sample_shape_));
  const int64_t rows = batch * shape_numel(sample_shape_) / classes_;
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  c.forward_flops = 5 * n;
  c.backward_flops = 3 * n;
  c.forward_bytes = 2 * es * n;
  c.backward_bytes = 2 * es * n;
  c.output_bytes = static_cast<int64_t>(dtype_size(master_dtype(dtype_)));
  c.saved_bytes = static_cast<int64_t>(static_cast<double>(dtype_size(master_dtype(dtype_))) * (n + rows) + 4 * rows);
  return c;
}

int64_t VocabParallelCrossEntropy::correct(Backend& be, const Tensor& logits_in, const Tensor& targets) {
  const DType master = master_dtype(dtype_);
  const auto [logits, rowmax] = rows_and_maxima(be, logits_in);
  const int64_t rows = logits.size(0);
  // Each member's first column holding the row's maximum (vocab where none does),
  // negated so that the group's max is the smallest column: the first, as argmax takes it.
  Tensor index = be.empty({rows}, master);
  be.first_column_equal(logits, rowmax, shard_.rank * classes_, vocab_, index);
  be.scale(index, -1.0);
  group().all_reduce_max(be, index);
  group().await_queued();  // the host reads it back now: a member that is gone ends the job
  if (index.is_meta()) return 0;  // on shapes (planning what the group is asked): no count to read
  Tensor host = Tensor::empty({rows}, master, Device::cpu());
  copy_tensor(index, host);
  Tensor labels = Tensor::empty({rows}, DType::kI32, Device::cpu());
  copy_tensor(targets.reshape({rows}), labels);
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double column = -(master == DType::kF64 ? host.data<double>()[r] : static_cast<double>(host.data<float>()[r]));
    const int32_t label = labels.data<int32_t>()[r];
    n += label != ignore_index_ && static_cast<double>(label) == column;
  }
  return n;
}

int64_t VocabParallelCrossEntropy::counted_targets(const Tensor& targets) const {
  const int32_t* t = targets.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) n += t[i] != ignore_index_;
  return n;
}

}  // namespace layers
}  // namespace gpipe
