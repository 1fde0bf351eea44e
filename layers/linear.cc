#include "layers/linear.h"

#include <cmath>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

Linear::Linear(const LinearOptions& opts) : Layer({opts.in}, {opts.out}, opts.dtype), opts_(opts) {
  if (opts.in <= 0 || opts.out <= 0) {
    throw UserError("linear: in and out must be positive, got in=" + std::to_string(opts.in) +
                    ", out=" + std::to_string(opts.out));
  }
  const double fan_in = static_cast<double>(opts.in);
  weight_ = make_parameter("weight", {opts.out, opts.in}, std::sqrt(6.0 / fan_in), mix_seed(opts.seed, 1));
  if (opts.bias) bias_ = make_parameter("bias", {opts.out}, 1.0 / std::sqrt(fan_in), mix_seed(opts.seed, 2));
}

std::string Linear::describe() const {
  return "linear(" + std::to_string(opts_.in) + " -> " + std::to_string(opts_.out) + ")";
}

std::vector<Parameter*> Linear::parameters() {
  if (opts_.bias) return {&weight_, &bias_};
  return {&weight_};
}

LayerCost Linear::cost(int64_t batch) const {
  const double b = static_cast<double>(batch), in = opts_.in, out = opts_.out;
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  c.forward_flops = 2 * b * in * out + (opts_.bias ? b * out : 0);
  // dx = dy W (2 b in out) and dW += dy^T x (2 b in out, plus the accumulation), db.
  c.backward_flops = 4 * b * in * out + in * out + (opts_.bias ? b * out : 0);
  c.input_grad_flops = 2 * b * in * out;
  c.forward_bytes = es * (b * in + in * out + b * out);
  c.backward_bytes = es * (2 * b * out + 2 * b * in + 3 * in * out);
  c.param_bytes = static_cast<int64_t>(es * (in * out + (opts_.bias ? out : 0)));
  c.output_bytes = static_cast<int64_t>(es * b * out);
  c.saved_bytes = static_cast<int64_t>(es * b * in);  // x
  return c;
}

Tensor Linear::forward_impl(Backend& be, const Tensor& x, Context* ctx) {
  Tensor y = be.empty({x.size(0), opts_.out}, dtype_);  // (B, out)
  be.matmul(x, false, weight_.value, true, y);           // x (B, in) @ W^T (in, out)
  if (opts_.bias) be.add_bias(y, bias_.value);
  if (ctx != nullptr) ctx->saved = {x};
  return y;
}

Tensor Linear::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  const Tensor& x = ctx.saved.at(0);                          // (B, in)
  be.matmul(dy, true, x, false, weight_.grad, 1.0, 1.0);      // dW += dy^T (out, B) @ x (B, in)
  if (opts_.bias) be.bias_grad(dy, bias_.grad, 1.0);         // db += sum_B dy
  if (!need_dx) return Tensor();
  Tensor dx = be.empty({dy.size(0), opts_.in}, dtype_);       // (B, in)
  be.matmul(dy, false, weight_.value, false, dx);             // dy (B, out) @ W (out, in)
  return dx;
}

}  // namespace layers
}  // namespace gpipe
