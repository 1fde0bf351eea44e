#include "layers/embedding.h"

#include <cmath>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

Embedding::Embedding(const EmbeddingOptions& opts)
    : Layer({opts.seq_len}, {opts.shard.positions(opts.seq_len, "embedding"), opts.dim}, opts.dtype), opts_(opts) {
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
  const TensorShard& s = opts.shard;
  if (s.rank < 0 || s.rank >= s.size || opts.vocab % s.size != 0) {
    throw UserError("embedding: a vocabulary of " + std::to_string(opts.vocab) +
                    " tokens does not split over a tensor group of " + std::to_string(s.size) +
                    "; pad vocab to a multiple of the group's size (ids above the data's are never looked up) or "
                    "split over fewer devices");
  }
  token_ = s.split() ? make_parameter_block("token", {opts.vocab, opts.dim}, 0, s.rank, s.size, 1, bound,
                                            mix_seed(opts.seed, 1))
                     : make_parameter("token", {opts.vocab, opts.dim}, bound, mix_seed(opts.seed, 1));
  if (opts.max_positions > 0) {
    position_ = make_parameter("position", {opts.max_positions, opts.dim}, bound, mix_seed(opts.seed, 2));
    // Under sequence parallelism a member adds (and its gradient takes) its positions' rows only.
    position_.sequence_partial = s.sequence_split();
  }
}

std::string Embedding::describe() const {
  return "embedding(" + std::to_string(opts_.vocab) + " -> " + std::to_string(opts_.dim) +
         (opts_.max_positions > 0 ? ", " + std::to_string(opts_.max_positions) + " positions" : std::string()) +
         (opts_.shard.split() ? ", member " + std::to_string(opts_.shard.rank) + "/" + std::to_string(opts_.shard.size)
                              : std::string()) +
         ")";
}

int64_t Embedding::first_id() const { return opts_.shard.rank * (opts_.vocab / opts_.shard.size); }

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
  c.param_bytes = static_cast<int64_t>(es * (opts_.vocab / opts_.shard.size + opts_.max_positions) * opts_.dim);
  c.output_bytes = static_cast<int64_t>(es * static_cast<double>(batch * shape_numel(output_shape_)));
  c.saved_bytes = static_cast<int64_t>(ids);  // the ids
  return c;
}

Tensor Embedding::forward_impl(Backend& be, const Tensor& ids, Context* ctx, const ForwardArgs&) {
  Tensor out = be.empty({ids.size(0), opts_.seq_len, opts_.dim}, dtype_);  // (B, T, C)
  if (ctx != nullptr) ctx->saved = {ids};
  if (!opts_.shard.split()) {
    be.embedding(ids, token_.compute(), position_.compute(), out);  // ids (B, T) int32
    return out;
  }
  // This member's rows, zeros for the others' ids; summed, each position has its one row
  // (exactly: the rest are zeros), and then its position's, as the whole table's lookup.
  // Under sequence parallelism, the sum at this member's positions (a reduce-scatter),
  // and their rows of the position table.
  be.embedding_slice(ids, token_.compute(), first_id(), opts_.vocab, out);
  Tensor y = opts_.shard.sum_to_positions(be, group_, out, describe());  // (B, T or T / members, C)
  if (opts_.max_positions > 0) be.binary(Binary::kAdd, y, position_rows(position_.compute()), y);
  return y;
}

Tensor Embedding::position_rows(const Tensor& table) const {
  return table.narrow_rows(opts_.shard.first_position(opts_.seq_len, "embedding"), output_shape_[0]);
}

Tensor Embedding::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool) {
  if (!opts_.shard.split()) {
    // position_.grad is undefined without learned positions, which the op skips.
    be.embedding_backward(ctx.saved.at(0), dy, token_.grad, position_.grad);
    return Tensor();  // ids are not differentiable
  }
  // The token rows' gradient takes every position's (all-gathered under sequence parallelism).
  be.embedding_slice_backward(ctx.saved.at(0), opts_.shard.gather_positions(be, group_, dy, describe()), first_id(),
                              opts_.vocab, token_.grad);
  if (opts_.max_positions > 0) {  // dpos[t] += sum over b of dy[b, t], in the gradient's (master) type
    const DType master = position_.grad.dtype();
    Tensor g = dy;
    if (dy.dtype() != master) {
      g = be.empty(dy.shape(), master);
      be.cast(dy, g);
    }
    Tensor sum = be.empty({output_shape_[0], opts_.dim}, master);
    be.sum_to(g, sum);
    Tensor rows = position_rows(position_.grad);  // this member's positions' (partial: summed over the group later)
    be.axpy(1.0, sum, rows);
  }
  return Tensor();
}

}  // namespace layers
}  // namespace gpipe
