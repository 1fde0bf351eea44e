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

// The features a member of a split layer takes in or gives out (checked: positive and,
// where split, a multiple of the group's size).
int64_t features_here(const LinearOptions& o, bool input) {
  if (o.in <= 0 || o.out <= 0) {
    throw UserError("linear: in and out must be positive, got in=" + std::to_string(o.in) +
                    ", out=" + std::to_string(o.out));
  }
  if (!o.split.split()) return input ? o.in : o.out;
  if (o.split.rank < 0 || o.split.rank >= o.split.size) {
    throw UserError("linear: member " + std::to_string(o.split.rank) + " of a tensor group of " +
                    std::to_string(o.split.size));
  }
  const bool column = o.split.kind == TensorSplitKind::kColumn;
  const std::string what = "linear(" + std::to_string(o.in) + " -> " + std::to_string(o.out) + ") split by " +
                           (column ? "output features (column-parallel)" : "input features (row-parallel)");
  const int g = o.split.groups;
  const int64_t split = column ? o.out : o.in;
  if (g < 1 || split % g != 0) {
    throw UserError(what + ": " + std::to_string(split) + " features are not " + std::to_string(g) + " equal parts");
  }
  const int64_t here = g * block_length(split / g, o.split.size, what);
  if (column) return input ? o.in : here;
  return input ? here : o.out;
}

}  // namespace

Linear::Linear(const LinearOptions& opts)
    : Layer(with_last(opts.leading, features_here(opts, true)), with_last(opts.leading, features_here(opts, false)),
            opts.dtype),
      opts_(opts) {
  // The unsplit layer's bounds and seeds: a member's block holds the whole layer's values.
  const double fan_in = static_cast<double>(opts.in);
  const double w_bound = std::sqrt(6.0 / fan_in), b_bound = 1.0 / std::sqrt(fan_in);
  const TensorSplit& s = opts.split;
  if (!s.split()) {
    weight_ = make_parameter("weight", {opts.out, opts.in}, w_bound, mix_seed(opts.seed, 1));
    if (opts.bias) bias_ = make_parameter("bias", {opts.out}, b_bound, mix_seed(opts.seed, 2));
  } else if (s.kind == TensorSplitKind::kColumn) {  // W's rows and the bias split
    weight_ = make_parameter_block("weight", {opts.out, opts.in}, 0, s.rank, s.size, s.groups, w_bound,
                                   mix_seed(opts.seed, 1));
    if (opts.bias) {
      bias_ = make_parameter_block("bias", {opts.out}, 0, s.rank, s.size, s.groups, b_bound, mix_seed(opts.seed, 2));
    }
  } else {  // W's columns split; the bias whole, added once after the sum
    weight_ = make_parameter_block("weight", {opts.out, opts.in}, 1, s.rank, s.size, s.groups, w_bound,
                                   mix_seed(opts.seed, 1));
    if (opts.bias) bias_ = make_parameter("bias", {opts.out}, b_bound, mix_seed(opts.seed, 2));
  }
}

int64_t Linear::in_here() const { return input_shape_.back(); }
int64_t Linear::out_here() const { return output_shape_.back(); }

TensorCollectives& Linear::group() const {
  if (group_ == nullptr || group_->size() != opts_.split.size || group_->rank() != opts_.split.rank) {
    throw Error(describe() + " is split over a tensor group of " + std::to_string(opts_.split.size) +
                " but was given " +
                (group_ == nullptr
                     ? std::string("none")
                     : "member " + std::to_string(group_->rank()) + " of " + std::to_string(group_->size())) +
                " (Linear::set_collectives)");
  }
  return *group_;
}

std::string Linear::describe() const {
  const std::string split = opts_.split.split() ? ", " + opts_.split.str() : "";
  return "linear(" + std::to_string(opts_.in) + " -> " + std::to_string(opts_.out) + split + ")";
}

std::vector<Parameter*> Linear::parameters() {
  if (opts_.bias) return {&weight_, &bias_};
  return {&weight_};
}

LayerCost Linear::cost(int64_t batch) const {
  // b: rows of the matrix product.
  // This member's share: its input and output features (all of them unsplit).
  const double b = static_cast<double>(batch * shape_numel(opts_.leading)), in = static_cast<double>(in_here()),
               out = static_cast<double>(out_here());
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
  const int64_t in = in_here();
  const Tensor x = xin.reshape({xin.numel() / in, in});  // (R, in)
  Tensor y = be.empty({x.size(0), out_here()}, dtype_);  // (R, out)
  be.matmul_weight(x, false, weight_.compute(), true, y);    // x (R, in) @ W^T (in, out)
  // Row-parallel: each member's product is a partial sum over its input features.
  if (opts_.split.split() && opts_.split.kind == TensorSplitKind::kRow) group().all_reduce_sum(be, y);
  if (opts_.bias) be.add_bias(y, bias_.compute());
  if (ctx != nullptr) ctx->saved = {x};
  Shape out{xin.size(0)};
  out.insert(out.end(), output_shape_.begin(), output_shape_.end());
  return y.reshape(out);
}

// B: dx = dy W; dy joins the context for W.
Tensor Linear::backward_input_impl(Backend& be, const Tensor& dyin, Context& ctx, bool need_dx) {
  const int64_t rows = ctx.saved.at(0).size(0);         // x: (R, in)
  const Tensor dy = dyin.reshape({rows, out_here()});    // (R, out)
  ctx.saved.push_back(dy);
  if (!need_dx) return Tensor();
  Tensor dx = be.empty({dy.size(0), in_here()}, dtype_);  // (R, in)
  be.matmul_weight(dy, false, weight_.compute(), false, dx); // dy (R, out) @ W (out, in)
  // Column-parallel: each member's input gradient is a partial sum over its outputs.
  if (opts_.split.split() && opts_.split.kind == TensorSplitKind::kColumn && opts_.split.sum_input_grad) {
    group().all_reduce_sum(be, dx);
  }
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
