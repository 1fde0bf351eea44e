// Token embedding plus an optional learned position embedding: the first layer of a
// language model, from int32 token ids (T) per sample to (T, dim) vectors in the
// model's dtype. Its input is not differentiable, so backward returns no dx.
#pragma once

#include "layers/layer.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

struct EmbeddingOptions {
  EmbeddingOptions(int64_t vocab, int64_t dim, int64_t seq_len)
      : vocab(vocab), dim(dim), seq_len(seq_len), max_positions(seq_len) {}
  int64_t vocab, dim, seq_len;
  int64_t max_positions;  // rows of the position table (>= seq_len); 0: no learned positions
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Vocabulary-parallel over a tensor group (Megatron's): member r keeps token rows
  // [r V/T, (r+1) V/T), looks up the ids among them (zeros for the others), and the
  // group sums the lookups; the position table whole on every member, added after the
  // sum. One sum forward, none backward. Under sequence parallelism (shard.sequence) the
  // sum is a reduce-scatter to the member's positions (S/T, dim), which take their rows
  // of the position table; backward all-gathers the output gradient for the token rows.
  TensorShard shard;
};

class Embedding : public Layer {
 public:
  explicit Embedding(const EmbeddingOptions& opts);
  std::string type() const override { return "embedding"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;
  void set_collectives(TensorCollectives* group) override { group_ = group; }
  Parameter& token() { return token_; }
  Parameter& position() { return position_; }  // undefined value when max_positions == 0

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  EmbeddingOptions opts_;
  TensorCollectives* group_ = nullptr;
  int64_t first_id() const;  // the first of this member's token rows
  // The rows of a position table (or its gradient) for the positions this member holds.
  Tensor position_rows(const Tensor& table) const;
  Parameter token_;     // (vocab, dim)
  Parameter position_;  // (max_positions, dim)
};

}  // namespace layers
}  // namespace gpipe
