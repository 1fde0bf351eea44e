#include "layers/linear.h"

#include <cmath>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {
Shape with_last(Shape leading, int64_t last) {
  leading.push_back(last);
  return leading;
}
}  // namespace

Linear::Linear(const LinearOptions& opts)
    : Layer(with_last(opts.leading, opts.in), with_last(opts.leading, opts.out), opts.dtype), opts_(opts) {
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
  // b: rows of the matrix product.
  const double b = static_cast<double>(batch * shape_numel(opts_.leading)), in = opts_.in, out = opts_.out;
  const double es = static_cast<double>(dtype_size(dtype_));
  LayerCost c;
  c.forward_flops = 2 * b * in * out + (opts_.bias ? b * out : 0);
  // B: dx = dy W (2 b in out). W: dW += dy^T x (2 b in out, plus the accumulation)
  // and db += the column sums of dy (b out).
  c.input_grad_flops = 2 * b * in * out;
  c.weight_grad_flops = 2 * b * in * out + in * out + (opts_.bias ? b * out : 0);
  c.backward_flops = c.input_grad_flops + c.weight_grad_flops;
  c.forward_bytes = es * (b * in + in * out + b * out);
  // B reads dy and W and writes dx; W reads dy and x and reads and writes dW.
  c.weight_grad_bytes = es * (b * out + b * in + 2 * in * out);
  c.backward_bytes = es * (b * out + in * out + b * in) + c.weight_grad_bytes;
  c.param_bytes = static_cast<int64_t>(es * (in * out + (opts_.bias ? out : 0)));
  c.output_bytes = static_cast<int64_t>(es * b * out);
  c.saved_bytes = static_cast<int64_t>(es * b * in);  // x
  return c;
}

Tensor Linear::forward_impl(Backend& be, const Tensor& xin, Context* ctx, const ForwardArgs&) {
  const Tensor x = xin.reshape({xin.numel() / opts_.in, opts_.in});  // (R, in)
  Tensor y = be.empty({x.size(0), opts_.out}, dtype_);               // (R, out)
  be.matmul_weight(x, false, weight_.compute(), true, y);                // x (R, in) @ W^T (in, out)
  if (opts_.bias) be.add_bias(y, bias_.compute());
  if (ctx != nullptr) ctx->saved = {x};
  Shape out{xin.size(0)};
  out.insert(out.end(), output_shape_.begin(), output_shape_.end());
  return y.reshape(out);
}

// B: dx = dy W; dy joins the context for W.
Tensor Linear::backward_input_impl(Backend& be, const Tensor& dyin, Context& ctx, bool need_dx) {
  const int64_t rows = ctx.saved.at(0).size(0);         // x: (R, in)
  const Tensor dy = dyin.reshape({rows, opts_.out});     // (R, out)
  ctx.saved.push_back(dy);
  if (!need_dx) return Tensor();
  Tensor dx = be.empty({dy.size(0), opts_.in}, dtype_);  // (R, in)
  be.matmul_weight(dy, false, weight_.compute(), false, dx); // dy (R, out) @ W (out, in)
  Shape in{dyin.size(0)};
  in.insert(in.end(), input_shape_.begin(), input_shape_.end());
  return dx.reshape(in);
}

// W: dW += dy^T x, db += sum over rows of dy.
void Linear::backward_weight_impl(Backend& be, Context& ctx) {
  GPIPE_CHECK(ctx.saved.size() == 2, describe() + ": weight gradient without its backward_input");
  const Tensor& x = ctx.saved[0];                          // (R, in)
  const Tensor& dy = ctx.saved[1];                         // (R, out)
  be.matmul(dy, true, x, false, weight_.grad, 1.0, 1.0);   // dW += dy^T (out, R) @ x (R, in)
  if (opts_.bias) be.bias_grad(dy, bias_.grad, 1.0);       // db += sum_R dy
}

void Linear::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  const Tensor x = concat_saved(be, ctxs, 0, describe());   // (sum R, in)
  const Tensor dy = concat_saved(be, ctxs, 1, describe());  // (sum R, out)
  be.matmul(dy, true, x, false, weight_.grad, 1.0, 1.0);
  if (opts_.bias) be.bias_grad(dy, bias_.grad, 1.0);
}

}  // namespace layers
}  // namespace gpipe
