// A LLaMA decoder block as ONE layer, so the partitioner can cut a model between
// blocks: pre-RMSNorm residual grouped-query attention with rotary embeddings, then a
// pre-RMSNorm residual SwiGLU feed-forward,
//
//   h = x + drop(attn(norm1(x)))    attn: GqaAttention (q, k, v, o without biases, RoPE)
//   y = h + drop(ffn(norm2(h)))     ffn: SwiGLU, dim -> hidden -> dim
//
// Input and output are (T, dim) per sample; each sub-layer keeps its context in
// Context::children. Backward splits: W is the norms' scales and every projection's
// weight gradient, so zero bubble defers them all.
#pragma once

#include "layers/dropout.h"
#include "layers/gqa_attention.h"
#include "layers/layer.h"
#include "layers/rmsnorm.h"
#include "layers/swiglu.h"

namespace gpipe {
namespace layers {

struct LlamaBlockOptions {
  LlamaBlockOptions(int64_t dim, int64_t heads, int64_t hidden, int64_t seq_len)
      : dim(dim), heads(heads), kv_heads(heads), hidden(hidden), seq_len(seq_len) {}
  int64_t dim, heads, kv_heads, hidden, seq_len;
  double rope_base = 10000.0;
  double eps = 1e-6;  // the norms'
  double dropout = 0.0;  // on each branch's output, before its residual add
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Split over a tensor group (Megatron's): the attention by heads, the SwiGLU by its
  // hidden features; the norms, the dropouts and the residual stream whole on every
  // member. Two sums forward, two backward. Under sequence parallelism (shard.sequence)
  // the norms, the dropouts and the residual stream hold the member's positions
  // (S/T, dim), input and output too; the attention and the SwiGLU all-gather them and
  // reduce-scatter back (seq_len is the whole's).
  TensorShard shard;
};

class LlamaBlock : public Layer {
 public:
  explicit LlamaBlock(const LlamaBlockOptions& opts);
  std::string type() const override { return "llama_block"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  // "norm1.weight", "attn.q.weight", ..., "ffn.down.weight", in forward order.
  std::vector<Parameter*> parameters() override;
  bool splits_backward() const override { return true; }
  void set_collectives(TensorCollectives* group) override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  LlamaBlockOptions opts_;
  RmsNorm norm1_;      // (T, C)
  GqaAttention attn_;  // (T, C)
  RmsNorm norm2_;      // (T, C)
  SwiGLU ffn_;         // (T, C) -> (T, hidden) -> (T, C)
  Dropout drop_attn_;  // (T, C), the attention branch's
  Dropout drop_ffn_;   // (T, C), the feed-forward branch's
};

}  // namespace layers
}  // namespace gpipe
