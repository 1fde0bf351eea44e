#include "layers/dropout.h"

#include <sstream>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// The context keeps the mask's step and sample offset, not the mask: four int32 words
// (step lo, step hi, offset lo, offset hi) in a host tensor.
constexpr int64_t kStateWords = 4;

Tensor pack_state(uint64_t step, int64_t offset) {
  const uint64_t off = static_cast<uint64_t>(offset);
  return Tensor::from_vector<int32_t>({static_cast<int32_t>(static_cast<uint32_t>(step)),
                                       static_cast<int32_t>(static_cast<uint32_t>(step >> 32)),
                                       static_cast<int32_t>(static_cast<uint32_t>(off)),
                                       static_cast<int32_t>(static_cast<uint32_t>(off >> 32))},
                                      {kStateWords});
}

void unpack_state(const Tensor& state, uint64_t* step, int64_t* offset) {
  const int32_t* w = state.data<int32_t>();
  auto word = [&](int i) { return static_cast<uint64_t>(static_cast<uint32_t>(w[i])); };
  *step = word(0) | (word(1) << 32);
  *offset = static_cast<int64_t>(word(2) | (word(3) << 32));
}

}  // namespace

Dropout::Dropout(const DropoutOptions& opts) : Layer(opts.shape, opts.shape, opts.dtype), opts_(opts) {
  if (!(opts.p >= 0.0 && opts.p < 1.0)) {
    std::ostringstream os;
    os << "dropout: p=" << opts.p << " must be in [0, 1); use 0 to disable dropout";
    throw UserError(os.str());
  }
}

std::string Dropout::describe() const {
  std::ostringstream os;  // "dropout(p=0.1)(8, 64)": shortest form of p
  os << "dropout(p=" << opts_.p << ")" << shape_str(input_shape_);
  return os.str();
}

// mix_seed(seed, step): the step in mix_seed's first slot.
DropoutKey Dropout::key(uint64_t step, const Tensor& step_scalars) const {
  return DropoutKey::of_step(mix_seed_base(opts_.seed), kMixA, step, step_scalars);
}

LayerCost Dropout::cost(int64_t batch) const {
  LayerCost c;
  const double n = static_cast<double>(batch * shape_numel(input_shape_));
  const double es = static_cast<double>(dtype_size(dtype_));
  c.output_bytes = static_cast<int64_t>(es * n);
  if (opts_.p == 0.0) return c;  // the identity: no work, nothing saved
  // One multiply per element each way (x * mask / (1 - p)); the Philox rounds that
  // draw the mask are integer work and not counted as flops.
  c.forward_flops = n;
  c.backward_flops = n;
  c.input_grad_flops = n;
  c.forward_bytes = 2 * es * n;
  c.backward_bytes = 2 * es * n;
  c.saved_bytes = kStateWords * 4;  // key and offset, on the host
  return c;
}

Tensor Dropout::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  if (ctx != nullptr) ctx->saved.clear();
  if (identity(args)) return x;
  step_scalars_ = args.step_scalars;
  step_scalars_step_ = args.step;
  Tensor y = be.empty(x.shape(), dtype_);
  be.dropout(x, opts_.p, key(args.step, args.step_scalars), args.sample_offset, opts_.element_offset, y);
  if (ctx != nullptr) ctx->saved = {pack_state(args.step, args.sample_offset)};
  return y;
}

Tensor Dropout::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  if (!need_dx) return Tensor();
  if (ctx.saved.empty()) return dy;  // the forward was the identity
  uint64_t step = 0;
  int64_t offset = 0;
  unpack_state(ctx.saved.at(0), &step, &offset);
  Tensor dx = be.empty(dy.shape(), dtype_);
  be.dropout_backward(dy, opts_.p, key(step, step == step_scalars_step_ ? step_scalars_ : Tensor()), offset,
                      opts_.element_offset, dx);
  return dx;
}

}  // namespace layers
}  // namespace gpipe
