#include "layers/embedding.h"

#include <cmath>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

Embedding::Embedding(const EmbeddingOptions& opts)
    : Layer({opts.seq_len}, {opts.seq_len, opts.dim}, opts.dtype), opts_(opts) {
  if (opts.vocab <= 0 || opts.dim <= 0 || opts.seq_len <= 0) {
    throw UserError("embedding: vocab, dim and the sequence length must be positive, got vocab=" +
                    std::to_string(opts.vocab) + ", dim=" + std::to_string(opts.dim) +
                    ", seq_len=" + std::to_string(opts.seq_len));
  }
  if (opts.max_positions != 0 && opts.max_positions < opts.seq_len) {
    throw UserError("embedding: positions=" + std::to_string(opts.max_positions) + " is shorter than the sequence (" +
                    std::to_string(opts.seq_len) + " tokens); use at least " + std::to_string(opts.seq_len) +
                    ", or 0 for no learned positions");
  }
  input_dtype_ = DType::kI32;
  // GPT-2 draws both tables from N(0, 0.02); uniform with the same standard
  // deviation (bound 0.02 sqrt 3) keeps make_parameter's portable generator.
  const double bound = 0.02 * std::sqrt(3.0);
  token_ = make_parameter("token", {opts.vocab, opts.dim}, bound, mix_seed(opts.seed, 1));
  if (opts.max_positions > 0) {
    position_ = make_parameter("position", {opts.max_positions, opts.dim}, bound, mix_seed(opts.seed, 2));
  }
}

std::string Embedding::describe() const {
  return "embedding(" + std::to_string(opts_.vocab) + " -> " + std::to_string(opts_.dim) +
         (opts_.max_positions > 0 ? ", " + std::to_string(opts_.max_positions) + " positions" : std::string()) + ")";
}

std::vector<Parameter*> Embedding::parameters() {
  if (opts_.max_positions > 0) return {&token_, &position_};
  return {&token_};
}

LayerCost Embedding::cost(int64_t batch) const {
  const bool pos = opts_.max_positions > 0;
  const double n = static_cast<double>(batch * opts_.seq_len * opts_.dim);  // output elements
  const double ids = 4.0 * static_cast<double>(batch * opts_.seq_len);     // int32 ids
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  // Forward is a gather, plus one add per element for the position.
  c.forward_flops = pos ? n : 0;
  // dtable[id] += dout (and dpos[t] += dout): one add per element and table.
  c.backward_flops = pos ? 2 * n : n;
  c.input_grad_flops = 0;  // token ids have no gradient
  c.forward_bytes = ids + es * (n /* token rows */ + (pos ? n : 0) /* position rows */ + n /* out */);
  c.backward_bytes = ids + es * (n /* dout */ + 2 * n /* dtable rows, read and written */ + (pos ? 2 * n : 0));
  c.param_bytes = static_cast<int64_t>(es * (opts_.vocab + opts_.max_positions) * opts_.dim);
  c.output_bytes = static_cast<int64_t>(es * n);
  c.saved_bytes = static_cast<int64_t>(ids);  // the ids
  return c;
}

Tensor Embedding::forward_impl(Backend& be, const Tensor& ids, Context* ctx, const ForwardArgs&) {
  Tensor out = be.empty({ids.size(0), opts_.seq_len, opts_.dim}, dtype_);  // (B, T, C)
  be.embedding(ids, token_.compute(), position_.compute(), out);                   // ids (B, T) int32
  if (ctx != nullptr) ctx->saved = {ids};
  return out;
}

Tensor Embedding::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool) {
  // position_.grad is undefined without learned positions, which the op skips.
  be.embedding_backward(ctx.saved.at(0), dy, token_.grad, position_.grad);
  return Tensor();  // ids are not differentiable
}

}  // namespace layers
}  // namespace gpipe
