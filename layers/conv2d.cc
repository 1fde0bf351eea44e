#include "layers/conv2d.h"

#include <cmath>

#include "layers/image_shape.h"
#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {
std::string conv_name(const Conv2dOptions& o) {
  return "conv2d(" + (o.input.empty() ? std::string("?") : std::to_string(o.input[0])) + " -> " +
         std::to_string(o.out) + ", " + window_str(o.kernel, o.stride, o.pad) + ")";
}

// Validates the options and returns the per-sample output (K, P, Q).
Shape conv_output(const Conv2dOptions& o) {
  const std::string who = conv_name(o);
  check_chw(o.input, who);
  if (o.out < 1 || o.kernel < 1 || o.stride < 1 || o.pad < 0) {
    throw UserError(who + ": out, kernel and stride must be positive and pad not negative");
  }
  if (o.input[1] + 2 * o.pad < o.kernel || o.input[2] + 2 * o.pad < o.kernel) {
    throw UserError(who + ": the " + std::to_string(o.kernel) + "x" + std::to_string(o.kernel) +
                    " kernel does not fit in the " + shape_str(o.input) + " input with padding " +
                    std::to_string(o.pad) + "; use a smaller kernel or more padding");
  }
  return {o.out, out_extent(o.input[1], o.kernel, o.stride, o.pad), out_extent(o.input[2], o.kernel, o.stride, o.pad)};
}
}  // namespace

Conv2d::Conv2d(const Conv2dOptions& opts) : Layer(opts.input, conv_output(opts), opts.dtype), opts_(opts) {
  const int64_t C = opts.input[0];
  const double fan_in = static_cast<double>(C * opts.kernel * opts.kernel);
  weight_ = make_parameter("weight", {opts.out, C, opts.kernel, opts.kernel}, std::sqrt(6.0 / fan_in),
                           mix_seed(opts.seed, 1));
  if (opts.bias) bias_ = make_parameter("bias", {opts.out}, 1.0 / std::sqrt(fan_in), mix_seed(opts.seed, 2));
}

std::string Conv2d::describe() const { return conv_name(opts_); }

std::vector<Parameter*> Conv2d::parameters() {
  if (opts_.bias) return {&weight_, &bias_};
  return {&weight_};
}

LayerCost Conv2d::cost(int64_t batch) const {
  const double N = static_cast<double>(batch), C = input_shape_[0], H = input_shape_[1], W = input_shape_[2];
  const double K = opts_.out, R = opts_.kernel, S = opts_.kernel, P = output_shape_[1], Q = output_shape_[2];
  const double es = elem_size(dtype_);
  const double conv =
      2 * N * K * P * Q * C * R * S;  // one multiply-add per (n, k, p, q, c, r, s), padding taps included
  const double in = N * C * H * W, out = N * K * P * Q, w = K * C * R * S, b = opts_.bias ? K : 0;
  LayerCost c;
  c.forward_flops = conv + (opts_.bias ? out : 0);
  // B: dx (conv). W: dw (conv, plus adding into the running dw) and db (a sum per output).
  c.input_grad_flops = conv;
  c.weight_grad_flops = conv + w + (opts_.bias ? out : 0);
  c.backward_flops = c.input_grad_flops + c.weight_grad_flops;
  c.forward_bytes = es * (in + w + b + out);
  // B reads dy and w and writes dx; W reads dy and x, and reads and writes dw and db.
  c.weight_grad_bytes = es * (out + in + 2 * w + 2 * b);
  c.backward_bytes = es * (out + w + in) + c.weight_grad_bytes;
  c.param_bytes = static_cast<int64_t>(es * (w + b));
  c.output_bytes = static_cast<int64_t>(es * out);
  c.saved_bytes = static_cast<int64_t>(es * in);  // x
  return c;
}

Tensor Conv2d::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  Tensor y = be.empty(batched(x.size(0), output_shape_), dtype_);  // (N, K, P, Q)
  be.conv2d(x, weight_.compute(), opts_.stride, opts_.pad, y);
  if (opts_.bias) be.add_channel_bias(y, bias_.compute());
  if (ctx != nullptr) ctx->saved = {x};  // (N, C, H, W)
  return y;
}

// B: dx only; dy joins the context for W.
Tensor Conv2d::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  const Tensor x = ctx.saved.at(0);  // (N, C, H, W); a handle, as push_back may move the vector
  ctx.saved.push_back(dy);           // (N, K, P, Q)
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(x.shape(), dtype_);
  Tensor no_dw;  // undefined: the op skips the weight gradient
  be.conv2d_backward(dy, x, weight_.compute(), opts_.stride, opts_.pad, dx, no_dw);
  return dx;
}

// W: dw and the bias gradient.
void Conv2d::backward_weight_impl(Backend& be, Context& ctx) {
  GPIPE_CHECK(ctx.saved.size() == 2, describe() + ": weight gradient without its backward_input");
  const Tensor& x = ctx.saved[0];   // (N, C, H, W)
  const Tensor& dy = ctx.saved[1];  // (N, K, P, Q)
  Tensor no_dx;
  be.conv2d_backward(dy, x, weight_.compute(), opts_.stride, opts_.pad, no_dx, weight_.grad);
  if (opts_.bias) be.channel_bias_grad(dy, bias_.grad);
}

void Conv2d::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  const Tensor x = concat_saved(be, ctxs, 0, describe());   // (sum N, C, H, W)
  const Tensor dy = concat_saved(be, ctxs, 1, describe());  // (sum N, K, P, Q)
  Tensor no_dx;
  be.conv2d_backward(dy, x, weight_.compute(), opts_.stride, opts_.pad, no_dx, weight_.grad);
  if (opts_.bias) be.channel_bias_grad(dy, bias_.grad);
}

}  // namespace layers
}  // namespace gpipe
