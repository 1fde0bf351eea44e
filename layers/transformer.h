// A GPT-2 transformer block as ONE layer, so the partitioner can cut a model between
// blocks: pre-LayerNorm residual attention, then a pre-LayerNorm residual MLP,
//
//   h = x + attn(ln1(x))                      (attn ends with its own dropout)
//   y = h + drop(fc2(gelu(fc1(ln2(h)))))      fc1: dim -> mlp_ratio * dim
//
// Input and output are (T, dim) per sample; each sub-layer keeps its context in
// Context::children.
#pragma once

#include "layers/activation.h"
#include "layers/attention.h"
#include "layers/dropout.h"
#include "layers/layer.h"
#include "layers/layernorm.h"
#include "layers/linear.h"

namespace gpipe {
namespace layers {

struct TransformerBlockOptions {
  TransformerBlockOptions(int64_t dim, int64_t heads, int64_t seq_len) : dim(dim), heads(heads), seq_len(seq_len) {}
  int64_t dim, heads, seq_len;
  int64_t mlp_ratio = 4;
  double dropout = 0.0;  // after the attention projection and after fc2
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Split over a tensor group (Megatron's): the attention by heads, the MLP by its
  // hidden features (fc1 column-parallel, GELU on the member's block, fc2 row-parallel);
  // the layer norms and the residual stream whole on every member. Two sums forward
  // (after attention's projection and after fc2), two backward. Under sequence
  // parallelism (shard.sequence) the norms, the dropouts and the residual stream hold
  // the member's positions (S/T, dim), input and output too: attention's qkv and fc1
  // all-gather them, its projection and fc2 reduce-scatter back (seq_len is the whole's).
  TensorShard shard;
};

class TransformerBlock : public Layer {
 public:
  explicit TransformerBlock(const TransformerBlockOptions& opts);
  std::string type() const override { return "transformer_block"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  // "ln1.weight", "attn.qkv.weight", ..., "fc2.bias", in forward order.
  std::vector<Parameter*> parameters() override;
  bool splits_backward() const override { return true; }  // attention's and the MLP's weight gradients
  void set_collectives(TensorCollectives* group) override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  TransformerBlockOptions opts_;
  LayerNorm ln1_;             // (T, C)
  CausalSelfAttention attn_;  // (T, C)
  LayerNorm ln2_;             // (T, C)
  Linear fc1_;                // (T, C) -> (T, mlp_ratio C)
  Gelu gelu_;                 // (T, mlp_ratio C)
  Linear fc2_;                // (T, mlp_ratio C) -> (T, C)
  Dropout drop_;              // (T, C)
};

}  // namespace layers
}  // namespace gpipe
