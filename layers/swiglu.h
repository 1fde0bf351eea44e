// The SwiGLU feed-forward block of LLaMA-style models (Shazeer, "GLU Variants Improve
// Transformer"): y = down(silu(gate(x)) * up(x)) over the last dimension, with gate and
// up (dim -> hidden) and down (hidden -> dim) linear layers without biases; parameters
// "gate.weight", "up.weight", "down.weight" (LLaMA's w1, w3, w2). Inputs (batch,
// *leading, dim) are treated as rows of dim, as Linear's. Backward splits into B (input
// gradients, the gating's) and W (the three weight gradients), so zero bubble defers W.
// Written from backend ops (Backend::unary for silu, mul), so it runs on every backend.
#pragma once

#include "layers/linear.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

struct SwiGLUOptions {
  SwiGLUOptions(int64_t dim, int64_t hidden) : dim(dim), hidden(hidden) {}
  int64_t dim, hidden;
  Shape leading;  // per-sample dimensions before the features, e.g. {T} for (T, C) inputs
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Split over a tensor group by the hidden features (Megatron's): gate and up
  // column-parallel, down row-parallel; one sum forward (down's), one backward (the
  // gate's and up's input gradients, added first). Under sequence parallelism
  // (shard.sequence) leading is the whole sequence's and input and output are this
  // member's positions: gathered once before gate and up, down reduce-scatters to them.
  TensorShard shard;
};

class SwiGLU : public Layer {
 public:
  explicit SwiGLU(const SwiGLUOptions& opts);
  std::string type() const override { return "swiglu"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;  // gate.weight, up.weight, down.weight
  bool splits_backward() const override { return true; }
  void set_collectives(TensorCollectives* group) override;
  // forward(x) + residual (of the output's shape and type), the sum in the last
  // projection's op (Linear::forward_add): a residual block's, without a pass of its own.
  Tensor forward_add(Backend& be, const Tensor& x, const Tensor& residual, Context* ctx, const ForwardArgs& args = {});

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  // forward, with the residual added by the last projection where one is given.
  Tensor forward_with(Backend& be, const Tensor& x, const Tensor* residual, Context* ctx, const ForwardArgs& args);
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  SwiGLUOptions opts_;
  TensorCollectives* group_ = nullptr;
  Linear gate_;  // (*leading, dim) -> (*leading, hidden)
  Linear up_;    // (*leading, dim) -> (*leading, hidden)
  Linear down_;  // (*leading, hidden) -> (*leading, dim)
};

}  // namespace layers
}  // namespace gpipe
