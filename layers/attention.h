// Causal multi-head self-attention, GPT-2 style: one fused projection to q, k and v,
// the attention core (Backend::attention), an output projection, then dropout. Input
// and output are (T, dim) per sample. A composite layer: each sub-layer's context is
// one of Context::children.
#pragma once

#include "layers/dropout.h"
#include "layers/layer.h"
#include "layers/linear.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

struct AttentionOptions {
  AttentionOptions(int64_t dim, int64_t heads, int64_t seq_len) : dim(dim), heads(heads), seq_len(seq_len) {}
  int64_t dim, heads, seq_len;
  double dropout = 0.0;  // on the output projection (GPT-2's resid_pdrop)
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Split by heads over a tensor group (Megatron's): member r keeps heads [r H/T,
  // (r+1) H/T), its blocks of q, k and v (the qkv projection column-parallel) and of the
  // output projection's inputs (row-parallel: the partial outputs summed, then the bias
  // and the dropout, whose mask is every member's alike). Input and output are whole;
  // under sequence parallelism (shard.sequence) they are the member's positions
  // (S/T, dim): qkv all-gathers them, proj reduce-scatters to them, and the dropout
  // draws the unsplit mask's share there.
  TensorShard shard;
};

// The counts of Backend::attention and attention_backward on a (B, T, 3C) fused
// operand with `heads` heads: their FLOPs and bytes, backward's two kernels, and the
// qkv and probs a context keeps. Shared by the attention layers.
LayerCost attention_core_cost(int64_t batch, int64_t seq_len, int64_t dim, int64_t heads, DType dtype);
// The same core as Backend::fused_attention runs it, with kv_heads key/value heads: the
// exact path's FLOPs (the backward's recompute of the scores and softmax is not counted,
// as no recompute is), and a context that keeps q, k, v, the output and one log-sum-exp
// per row and head, not qkv and the probabilities.
LayerCost fused_attention_core_cost(int64_t batch, int64_t seq_len, int64_t dim, int64_t heads, int64_t kv_heads,
                                   DType dtype);

class CausalSelfAttention : public Layer {
 public:
  explicit CausalSelfAttention(const AttentionOptions& opts);
  std::string type() const override { return "attention"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  // "qkv.weight", "qkv.bias", "proj.weight", "proj.bias".
  std::vector<Parameter*> parameters() override;
  bool splits_backward() const override { return true; }  // the projections' weight gradients
  void set_collectives(TensorCollectives* group) override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  AttentionOptions opts_;
  Linear qkv_;    // (T, C) -> (T, 3C)
  Linear proj_;   // (T, C) -> (T, C)
  Dropout drop_;  // (T, C)
};

}  // namespace layers
}  // namespace gpipe
