#include "layers/loss.h"

#include "runtime/error.h"

namespace gpipe {
namespace layers {

Tensor SoftmaxCrossEntropy::forward(Backend& be, const Tensor& logits, const Tensor& targets, double scale,
                                    Context* ctx) {
  check_batch(logits, {classes_}, dtype_, "softmax_cross_entropy", "logits");
  if (targets.dtype() != DType::kI32 || targets.dim() != 1 || targets.size(0) != logits.size(0)) {
    throw UserError("softmax_cross_entropy: targets " + targets.str() + " must be int32 with one label per row of " +
                    logits.str());
  }
  Tensor probs = be.empty(logits.shape(), dtype_);  // (B, C)
  Tensor loss = be.empty({1}, dtype_);
  be.softmax_xent(logits, targets, scale, ignore_index_, probs, loss);
  if (ctx != nullptr) {
    // saved: probs, targets, and the scale as a one-element host tensor.
    ctx->saved = {probs, targets, Tensor::from_vector<double>({scale}, {1})};
  }
  return loss;
}

Tensor SoftmaxCrossEntropy::backward(Backend& be, const Context& ctx) {
  const Tensor& probs = ctx.saved.at(0);
  const double scale = ctx.saved.at(2).data<double>()[0];
  Tensor dlogits = be.empty(probs.shape(), dtype_);
  be.softmax_xent_backward(probs, ctx.saved.at(1), scale, ignore_index_, dlogits);
  return dlogits;
}

LayerCost SoftmaxCrossEntropy::cost(int64_t batch) const {
  const double n = static_cast<double>(batch * classes_);
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  c.forward_flops = 5 * n;  // max, exp, sum, divide, log
  c.backward_flops = 2 * n;
  c.forward_bytes = 2 * es * n;
  c.backward_bytes = 2 * es * n;
  c.output_bytes = static_cast<int64_t>(es);
  c.saved_bytes = static_cast<int64_t>(es * n + 4 * batch);
  return c;
}

}  // namespace layers
}  // namespace gpipe
