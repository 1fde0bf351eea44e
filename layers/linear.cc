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

// A sequence-parallel split's place as a TensorShard (its gathers and scatters).
TensorShard by_positions(const TensorSplit& s) { return {s.rank, s.size, true}; }

// The per-sample leading dimensions of the input (or the output): under sequence
// parallelism a column-parallel layer's input and a row-parallel layer's output are
// this member's positions, 1/T of the first.
Shape leading_here(const LinearOptions& o, bool input) {
  const TensorSplit& s = o.split;
  const bool column = s.kind == TensorSplitKind::kColumn;
  if (!s.sequence_split() || column != input) return o.leading;
  if (o.leading.empty()) {
    throw UserError("linear: sequence parallelism splits the positions, and this layer's input has none "
                    "(leading dimensions); set pipeline.sequence_parallel: false");
  }
  Shape l = o.leading;
  l[0] = by_positions(s).positions(l[0], "linear");
  return l;
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
    : Layer(with_last(leading_here(opts, true), features_here(opts, true)),
            with_last(leading_here(opts, false), features_here(opts, false)), opts.dtype),
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
  return TensorShard{opts_.split.rank, opts_.split.size}.checked(group_, describe());
}

std::string Linear::describe() const {
  const std::string split =
      opts_.split.split() ? ", " + opts_.split.str() + (opts_.split.sequence_split() ? ", by positions" : "") : "";
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
  // Under sequence parallelism a row-parallel layer's output is this member's positions.
  c.output_bytes = static_cast<int64_t>(es * static_cast<double>(batch * shape_numel(output_shape_)));
  c.saved_bytes = static_cast<int64_t>(es * b * in);  // x (a sequence-parallel column's: gathered)
  return c;
}

// The whole sequence's (B, S, features) from rows of (B S, features).
static Shape whole_positions(int64_t batch, const Shape& leading, int64_t features) {
  Shape s{batch};
  s.insert(s.end(), leading.begin(), leading.end());
  s.push_back(features);
  return s;
}

Tensor Linear::forward_impl(Backend& be, const Tensor& xin, Context* ctx, const ForwardArgs&) {
  const int64_t in = in_here(), B = xin.size(0);
  const TensorSplit& s = opts_.split;
  const bool column = s.kind == TensorSplitKind::kColumn, row = s.split() && s.kind == TensorSplitKind::kRow;
  // Sequence-parallel column: every member's positions, gathered.
  const Tensor xs = s.sequence_split() && column ? by_positions(s).gather_positions(be, group_, xin, describe()) : xin;
  const Tensor x = xs.reshape({xs.numel() / in, in});  // (R, in)
  Tensor y = be.empty({x.size(0), out_here()}, dtype_);  // (R, out)
  // The bias in the product's op (Backend::linear_bias), except where a row-parallel
  // member's partial sums are summed first.
  const bool bias_now = opts_.bias && !row;
  if (bias_now) {
    be.linear_bias(x, weight_.compute(), bias_.compute(), y);  // x (R, in) @ W^T (in, out) + b
  } else {
    be.matmul_weight(x, false, weight_.compute(), true, y);    // x (R, in) @ W^T (in, out)
  }
  if (ctx != nullptr) ctx->saved = {x};
  Shape out{B};
  out.insert(out.end(), output_shape_.begin(), output_shape_.end());
  if (row && s.sequence_split()) {
    // Row-parallel: each member's product is a partial sum over its input features; the
    // group's sum at this member's positions, then the bias there.
    Tensor whole = y.reshape(whole_positions(B, opts_.leading, out_here()));
    y = by_positions(s).sum_to_positions(be, group_, whole, describe());
    y = y.reshape({y.numel() / out_here(), out_here()});
  } else if (row) {
    group().all_reduce_sum(be, y);  // the partial sums, whole
  }
  if (opts_.bias && !bias_now) be.add_bias(y, bias_.compute());
  return y.reshape(out);
}

// B: dx = dy W; dy joins the context for W.
Tensor Linear::backward_input_impl(Backend& be, const Tensor& dyin, Context& ctx, bool need_dx) {
  const TensorSplit& s = opts_.split;
  const bool column = s.kind == TensorSplitKind::kColumn;
  const int64_t rows = ctx.saved.at(0).size(0);  // x: (R, in), the whole positions'
  // Sequence-parallel row: the output gradient at every member's positions, gathered
  // (W's dy, the bias's included, is then the whole sequence's on every member).
  const Tensor dys = s.sequence_split() && !column
                         ? by_positions(s).gather_positions(be, group_, dyin, describe())
                         : dyin;
  const Tensor dy = dys.reshape({rows, out_here()});  // (R, out)
  ctx.saved.push_back(dy);
  if (!need_dx) return Tensor();
  Tensor dx = be.empty({dy.size(0), in_here()}, dtype_);  // (R, in)
  be.matmul_weight(dy, false, weight_.compute(), false, dx); // dy (R, out) @ W (out, in)
  Shape in{dyin.size(0)};
  in.insert(in.end(), input_shape_.begin(), input_shape_.end());
  // Column-parallel: each member's input gradient is a partial sum over its outputs;
  // summed whole, or under sequence parallelism at this member's positions.
  if (s.split() && column && s.sum_input_grad) {
    if (s.sequence_split()) {
      Tensor whole = dx.reshape(whole_positions(dyin.size(0), opts_.leading, in_here()));
      return by_positions(s).sum_to_positions(be, group_, whole, describe()).reshape(in);
    }
    group().all_reduce_sum(be, dx);
  }
  return dx.reshape(in);
}

Tensor Linear::forward_add(Backend& be, const Tensor& xin, const Tensor& residual, Context* ctx,
                           const ForwardArgs& args) {
  if (opts_.bias || opts_.split.split()) {
    Tensor y = forward(be, xin, ctx, args);
    be.axpy(1.0, residual, y);
    return y;
  }
  check_batch(xin, input_shape_, input_dtype_, describe(), "input");
  check_batch(residual, output_shape_, dtype_, describe(), "residual");
  GPIPE_CHECK(residual.size(0) == xin.size(0), describe() + ": a residual of " + std::to_string(residual.size(0)) +
                                                    " samples for an input of " + std::to_string(xin.size(0)));
  const int64_t in = in_here(), out = out_here();
  const Tensor x = xin.reshape({xin.numel() / in, in});  // (R, in)
  Tensor y = be.empty({x.size(0), out}, dtype_);         // (R, out)
  be.linear_residual(x, weight_.compute(), residual.reshape({x.size(0), out}), y);  // x @ W^T + residual
  if (ctx != nullptr) ctx->saved = {x};
  return y.reshape(residual.shape());
}

void Linear::backward_input_add(Backend& be, const Tensor& dyin, Context& ctx, Tensor& dx) {
  const TensorSplit& s = opts_.split;
  if (s.split() && (s.kind == TensorSplitKind::kRow || s.sum_input_grad)) {
    const Tensor part = backward_input(be, dyin, ctx);
    be.axpy(1.0, part, dx);
    return;
  }
  check_batch(dyin, output_shape_, dtype_, describe(), "output gradient");
  GPIPE_CHECK(ctx.saved.size() == 1, describe() + ": backward without its forward");
  const int64_t rows = ctx.saved[0].size(0);  // x: (R, in)
  GPIPE_CHECK(dx.dtype() == dtype_ && dx.numel() == rows * in_here(),
              describe() + ": an input gradient " + dx.str() + " to add into, for " + ctx.saved[0].str());
  const Tensor dy = dyin.reshape({rows, out_here()});  // (R, out)
  ctx.saved.push_back(dy);
  Tensor sum = dx.reshape({rows, in_here()});  // (R, in), dx's elements
  be.linear_input_grad_add(dy, weight_.compute(), sum);  // dx += dy (R, out) @ W (out, in)
}

// W: dW += dy^T x, db += sum over rows of dy.
void Linear::backward_weight_impl(Backend& be, Context& ctx) {
  GPIPE_CHECK(ctx.saved.size() == 2, describe() + ": weight gradient without its backward_input");
  const Tensor& x = ctx.saved[0];                          // (R, in)
  const Tensor& dy = ctx.saved[1];                         // (R, out)
  weight_grad(be, dy, x);
}

// dW += dy^T (out, R) @ x (R, in); db += sum_R dy, in the same op (Backend::linear_weight_grad).
void Linear::weight_grad(Backend& be, const Tensor& dy, const Tensor& x) {
  if (opts_.bias) return be.linear_weight_grad(dy, x, weight_.grad, bias_.grad);
  be.matmul(dy, true, x, false, weight_.grad, 1.0, 1.0);
}

void Linear::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  const Tensor x = concat_saved(be, ctxs, 0, describe());   // (sum R, in)
  const Tensor dy = concat_saved(be, ctxs, 1, describe());  // (sum R, out)
  weight_grad(be, dy, x);
}

}  // namespace layers
}  // namespace gpipe
