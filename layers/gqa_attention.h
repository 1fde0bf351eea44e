// Causal grouped-query self-attention as in LLaMA 2 and 3.0 (Ainslie et al., "GQA"; no
// rope scaling, which LLaMA 3.1 adds): q, k, v
// and output projections without biases, rotary position embeddings on q and k
// (Backend::rope), and kv_heads key/value heads, each shared by heads / kv_heads query
// heads (kv_heads == heads: multi-head attention; 1: multi-query). The core is the fused
// Backend::attention on q and the key/value heads repeated (Backend::pack_qkv), whose
// backward sums each group's gradient. Input and output are (T, dim) per sample;
// parameters "q.weight" (dim, dim), "k.weight", "v.weight" (kv_heads dim/heads, dim),
// "o.weight" (dim, dim). Backward splits into B and W (the four weight gradients). The
// grouping saves projection weights and products, not activation memory: the repeated
// heads and the scores are kept per query head.
#pragma once

#include <functional>

#include "layers/layer.h"
#include "layers/linear.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

struct GqaAttentionOptions {
  GqaAttentionOptions(int64_t dim, int64_t heads, int64_t seq_len)
      : dim(dim), heads(heads), kv_heads(heads), seq_len(seq_len) {}
  int64_t dim, heads, kv_heads, seq_len;
  bool rope = true;            // rotary embeddings on q and k; false: none (no positions at all)
  double rope_base = 10000.0;  // theta_i = rope_base^(-2i/D)
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Split by heads over a tensor group (Megatron's): member r keeps query heads
  // [r H/T, (r+1) H/T) and key/value heads [r KV/T, (r+1) KV/T), which serve exactly
  // those query heads (KV a multiple of T); q, k and v column-parallel, o row-parallel.
  // One sum forward (o's), one backward (the input gradients of q, k and v, added first).
  // A group larger than KV (T a multiple of KV) replicates each key/value head over the
  // T / KV members whose query heads it serves: member r keeps head r / (T / KV), and
  // the layer sums those heads' weight gradients over the members after each W
  // (Parameter::shard_replicas). Under sequence parallelism (shard.sequence) input and
  // output are the member's positions (S/T, dim): gathered once before q, k and v,
  // and o reduce-scatters to them.
  TensorShard shard;
};

class GqaAttention : public Layer {
 public:
  explicit GqaAttention(const GqaAttentionOptions& opts);
  std::string type() const override { return "gqa_attention"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;  // q.weight, k.weight, v.weight, o.weight
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
  GqaAttentionOptions opts_;
  TensorCollectives* group_ = nullptr;
  int64_t heads_here() const { return opts_.heads / opts_.shard.size; }
  // Members holding each key/value head: 1, or T / KV where the group is larger.
  int64_t kv_replicas() const { return opts_.shard.size > opts_.kv_heads ? opts_.shard.size / opts_.kv_heads : 1; }
  int64_t kv_heads_here() const { return opts_.kv_heads * kv_replicas() / opts_.shard.size; }
  // The sum of replicated key/value heads' weight gradients over their members, of what
  // weight_gradient(k or v, its child) adds (one micro-batch's W, or a batch of them).
  void sum_replicated_kv(Backend& be, const std::function<void(Linear&, int)>& weight_gradient);
  Linear q_;  // (T, C) -> (T, C)
  Linear k_;  // (T, C) -> (T, KV D)
  Linear v_;  // (T, C) -> (T, KV D)
  Linear o_;  // (T, C) -> (T, C)
};

}  // namespace layers
}  // namespace gpipe
