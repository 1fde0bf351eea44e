#include "layers/loss.h"

#include <algorithm>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

SoftmaxCrossEntropy::SoftmaxCrossEntropy(Shape sample_shape, DType dtype, int ignore_index)
    : sample_shape_(std::move(sample_shape)), classes_(sample_shape_.empty() ? 0 : sample_shape_.back()),
      dtype_(dtype), ignore_index_(ignore_index) {
  if (classes_ < 1) throw UserError("softmax_cross_entropy needs logits with a class dimension");
}

Tensor SoftmaxCrossEntropy::forward(Backend& be, const Tensor& logits_in, const Tensor& targets_in, double scale,
                                    Context* ctx) {
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
  if (ctx != nullptr) {
    // saved: probs, targets, and the scale as a one-element host tensor.
    ctx->saved = {probs, targets, Tensor::from_vector<double>({scale}, {1})};
  }
  return loss;
}

Tensor SoftmaxCrossEntropy::backward(Backend& be, const Context& ctx) {
  const Tensor& probs = ctx.saved.at(0);  // (R, C)
  const double scale = ctx.saved.at(2).data<double>()[0];
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

}  // namespace layers
}  // namespace gpipe
