#include "layers/conv_layers.h"

#include <algorithm>
#include <cmath>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {

// A user's shape mistake names the layer, the shape and the fix.
void check_chw(const Shape& in, const std::string& who) {
  if (in.size() != 3 || in[0] < 1 || in[1] < 1 || in[2] < 1) {
    throw UserError(who + ": expects a (C, H, W) image per sample, got " + shape_str(in) +
                    "; set model.input to (channels, height, width) and keep image layers before flatten");
  }
}

// Positions of a kernel-wide window sliding with `stride` over `in` padded by `pad`.
int64_t out_extent(int64_t in, int64_t kernel, int64_t stride, int64_t pad) {
  return (in + 2 * pad - kernel) / stride + 1;
}

// Sum over the output positions of the input values each window covers (padding
// excluded), along one dimension.
int64_t covered(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad) {
  int64_t total = 0;
  for (int64_t p = 0; p < out; ++p) {
    const int64_t lo = std::max<int64_t>(0, p * stride - pad), hi = std::min<int64_t>(in, p * stride - pad + kernel);
    total += hi - lo;
  }
  return total;
}

double elem_size(DType dtype) { return static_cast<double>(dtype_size(dtype)); }

std::string window_str(int kernel, int stride, int pad) {
  std::string s = std::to_string(kernel) + "x" + std::to_string(kernel);
  if (stride != 1) s += ", stride " + std::to_string(stride);
  if (pad != 0) s += ", pad " + std::to_string(pad);
  return s;
}

// Host copies for BatchNorm2d::end_step's once-per-step round trip.
std::vector<double> host_doubles(Backend& be, const Tensor& t) {
  Tensor host = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  be.copy(t, host);
  be.synchronize();
  std::vector<double> out(host.numel());
  for (int64_t i = 0; i < host.numel(); ++i) {
    out[i] = host.dtype() == DType::kF32 ? host.data<float>()[i] : host.data<double>()[i];
  }
  return out;
}

void store_doubles(Backend& be, const std::vector<double>& v, Tensor& t) {
  Tensor host = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  for (int64_t i = 0; i < host.numel(); ++i) {
    if (host.dtype() == DType::kF32) {
      host.data<float>()[i] = static_cast<float>(v[i]);
    } else {
      host.data<double>()[i] = v[i];
    }
  }
  be.copy(host, t);
  be.synchronize();  // the host buffer dies on return
}

Tensor moved(const Tensor& t, Device device) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), device);
  copy_tensor(t, out);
  return out;
}

}  // namespace

// ---- Conv2d

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
  // dx (conv) and dw (conv, plus adding into the running dw), db (a sum per output).
  c.backward_flops = 2 * conv + w + (opts_.bias ? out : 0);
  c.input_grad_flops = conv;
  c.forward_bytes = es * (in + w + b + out);
  c.backward_bytes = es * (2 * out + 2 * in + 3 * w + 2 * b);  // dy twice, x and dx, w with dw read and written
  c.param_bytes = static_cast<int64_t>(es * (w + b));
  c.output_bytes = static_cast<int64_t>(es * out);
  c.saved_bytes = static_cast<int64_t>(es * in);  // x
  return c;
}

Tensor Conv2d::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  Tensor y = be.empty(batched(x.size(0), output_shape_), dtype_);  // (N, K, P, Q)
  be.conv2d(x, weight_.value, opts_.stride, opts_.pad, y);
  if (opts_.bias) be.add_channel_bias(y, bias_.value);
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
  be.conv2d_backward(dy, x, weight_.value, opts_.stride, opts_.pad, dx, no_dw);
  return dx;
}

// W: dw and the bias gradient.
void Conv2d::backward_weight_impl(Backend& be, Context& ctx) {
  GPIPE_CHECK(ctx.saved.size() == 2, describe() + ": weight gradient without its backward_input");
  const Tensor& x = ctx.saved[0];   // (N, C, H, W)
  const Tensor& dy = ctx.saved[1];  // (N, K, P, Q)
  Tensor no_dx;
  be.conv2d_backward(dy, x, weight_.value, opts_.stride, opts_.pad, no_dx, weight_.grad);
  if (opts_.bias) be.channel_bias_grad(dy, bias_.grad);
}

// ---- BatchNorm2d

namespace {
const Shape& checked_bn_input(const BatchNorm2dOptions& o) {
  check_chw(o.input, "batchnorm2d");
  if (!(o.eps > 0) || !(o.momentum >= 0 && o.momentum <= 1)) {
    throw UserError("batchnorm2d: eps must be positive and momentum in [0, 1], got eps " + std::to_string(o.eps) +
                    ", momentum " + std::to_string(o.momentum));
  }
  return o.input;
}
}  // namespace

BatchNorm2d::BatchNorm2d(const BatchNorm2dOptions& opts)
    : Layer(checked_bn_input(opts), opts.input, opts.dtype), opts_(opts) {
  const int64_t C = opts.input[0];
  Backend& host = backend_for(Device::cpu());
  gamma_ = constant_parameter("weight", {C}, 1.0);
  beta_ = constant_parameter("bias", {C}, 0.0);
  running_mean_ = host.zeros({C}, dtype_);
  running_var_ = host.empty({C}, dtype_);
  host.fill(running_var_, 1.0);
}

std::string BatchNorm2d::describe() const { return "batchnorm2d(" + std::to_string(input_shape_[0]) + ")"; }

// Per element, as the CPU kernels count: forward 1 (mean) + 3 (variance) + 3
// (normalise); backward 5 (the two sums) + 6 (dx). Per-channel scalars are ignored.
LayerCost BatchNorm2d::cost(int64_t batch) const {
  const double E = static_cast<double>(batch * shape_numel(input_shape_)), C = input_shape_[0];
  const double es = elem_size(dtype_);
  LayerCost c;
  c.forward_flops = 7 * E;
  c.backward_flops = 11 * E;
  c.input_grad_flops = 6 * E;               // computed for the first layer too: the op always writes dx
  c.forward_bytes = es * (4 * E + 4 * C);   // x read three times, y written; gamma, beta in, mean, var out
  c.backward_bytes = es * (5 * E + 7 * C);  // x and dy twice, dx once; gamma, mean, var, dgamma and dbeta
  c.param_bytes = static_cast<int64_t>(es * 2 * C);
  c.output_bytes = static_cast<int64_t>(es * E);
  c.saved_bytes = static_cast<int64_t>(es * (E + 2 * C));  // x, mean, var
  return c;
}

void BatchNorm2d::place_running_stats(Device device) {
  if (running_mean_.device() != device) running_mean_ = moved(running_mean_, device);
  if (running_var_.device() != device) running_var_ = moved(running_var_, device);
}

Tensor BatchNorm2d::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  const int64_t C = input_shape_[0];
  Tensor y = be.empty(x.shape(), dtype_);  // (N, C, H, W)
  if (!args.training) {
    place_running_stats(be.device());
    be.batchnorm_eval(x, gamma_.value, beta_.value, running_mean_, running_var_, opts_.eps, y);
    if (ctx != nullptr) ctx->saved.clear();  // backward refuses: see backward_impl
    return y;
  }
  Tensor mean = be.empty({C}, dtype_), var = be.empty({C}, dtype_);  // (C), biased var
  be.batchnorm_train(x, gamma_.value, beta_.value, opts_.eps, y, mean, var);
  // A recompute sees the same micro-batch again: counting it twice would skew the
  // running statistics.
  if (!args.recompute) {
    if (!kept_.empty() && kept_step_ != args.step) kept_.clear();  // left over from a step without end_step
    kept_step_ = args.step;
    // Copies, so that nothing that later reuses the context's buffers can change them.
    Kept k{be.empty({C}, dtype_), be.empty({C}, dtype_), x.size(0) * input_shape_[1] * input_shape_[2]};
    be.copy(mean, k.mean);
    be.copy(var, k.var);
    kept_.push_back(std::move(k));
  }
  if (ctx != nullptr) ctx->saved = {x, mean, var};
  return y;
}

Tensor BatchNorm2d::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  if (ctx.saved.size() != 3) {
    throw UserError(describe() +
                    ": backward after an evaluation forward (ForwardArgs::training false) is not supported; "
                    "run the forward in training mode to train");
  }
  const Tensor& x = ctx.saved[0];
  Tensor dx = be.empty(x.shape(), dtype_);  // the op always writes it: dgamma and dbeta come from the same sums
  be.batchnorm_backward(dy, x, gamma_.value, ctx.saved[1], ctx.saved[2], opts_.eps, dx, gamma_.grad, beta_.grad);
  return need_dx ? dx : Tensor();
}

// With n_i values, mean m_i and biased variance v_i per micro-batch, the mini-batch's
// n = sum n_i, mean m = sum n_i m_i / n and biased variance
// v = sum n_i (v_i + (m_i - m)^2) / n, exactly (Chan et al.'s parallel variance).
// Over replicas the micro-batches are spread across processes, and only sums can be
// reduced: with r the running mean (the same on every replica), d_i = m_i - r,
// S1 = sum n_i d_i and S2 = sum n_i (v_i + d_i^2), m = r + S1 / n and
// n v = S2 - S1^2 / n. Shifting by r keeps the difference well conditioned.
void BatchNorm2d::end_step_impl(Backend& be, const ReplicaSum& replicas) {
  if (kept_.empty() && !replicas) return;  // a replica that saw nothing still joins the sum
  const int64_t C = input_shape_[0];
  std::vector<std::vector<double>> means, vars;
  for (const Kept& k : kept_) {
    means.push_back(host_doubles(be, k.mean));
    vars.push_back(host_doubles(be, k.var));
  }
  place_running_stats(be.device());
  std::vector<double> rm = host_doubles(be, running_mean_), rv = host_doubles(be, running_var_);
  double n = 0;
  for (const Kept& k : kept_) n += static_cast<double>(k.count);
  std::vector<double> mean(C, 0.0), m2(C, 0.0);  // m2: sum of squared deviations from the mean
  if (replicas) {
    std::vector<double> sums(1 + 2 * C, 0.0);  // n, S1 (C), S2 (C)
    sums[0] = n;
    for (size_t i = 0; i < kept_.size(); ++i) {
      const double ni = static_cast<double>(kept_[i].count);
      for (int64_t c = 0; c < C; ++c) {
        const double d = means[i][c] - rm[c];
        sums[1 + c] += ni * d;
        sums[1 + C + c] += ni * (vars[i][c] + d * d);
      }
    }
    replicas(sums);
    n = sums[0];
    if (n == 0) return;
    for (int64_t c = 0; c < C; ++c) {
      mean[c] = rm[c] + sums[1 + c] / n;
      m2[c] = std::max(0.0, sums[1 + C + c] - sums[1 + c] * sums[1 + c] / n);
    }
  } else {
    for (int64_t c = 0; c < C; ++c) {
      for (size_t i = 0; i < kept_.size(); ++i) mean[c] += static_cast<double>(kept_[i].count) * means[i][c];
      mean[c] /= n;
      for (size_t i = 0; i < kept_.size(); ++i) {
        const double d = means[i][c] - mean[c];
        m2[c] += static_cast<double>(kept_[i].count) * (vars[i][c] + d * d);
      }
    }
  }
  const double mom = opts_.momentum;
  for (int64_t c = 0; c < C; ++c) {
    // PyTorch's running variance is unbiased (n - 1); with a single value there is no
    // unbiased estimate, and the biased one (0) is kept instead.
    const double unbiased = n > 1 ? m2[c] / (n - 1) : m2[c] / n;
    rm[c] = (1 - mom) * rm[c] + mom * mean[c];
    rv[c] = (1 - mom) * rv[c] + mom * unbiased;
  }
  store_doubles(be, rm, running_mean_);
  store_doubles(be, rv, running_var_);
  kept_.clear();
}

// ---- MaxPool2d

namespace {
MaxPool2dOptions resolved(MaxPool2dOptions o) {
  if (o.stride == 0) o.stride = o.kernel;
  return o;
}

std::string maxpool_name(const MaxPool2dOptions& o) {
  return "maxpool2d(" + window_str(o.kernel, o.stride, o.pad) + ")";
}

Shape maxpool_output(const MaxPool2dOptions& o) {
  const std::string who = maxpool_name(o);
  check_chw(o.input, who);
  if (o.kernel < 1 || o.stride < 1 || o.pad < 0 || o.pad > o.kernel / 2) {
    throw UserError(who + ": kernel and stride must be positive and pad between 0 and kernel / 2 (" +
                    std::to_string(std::max(0, o.kernel / 2)) + "), so that no window holds only padding");
  }
  if (o.input[1] + 2 * o.pad < o.kernel || o.input[2] + 2 * o.pad < o.kernel) {
    throw UserError(who + ": the window does not fit in the " + shape_str(o.input) + " input; use a smaller kernel");
  }
  return {o.input[0], out_extent(o.input[1], o.kernel, o.stride, o.pad),
          out_extent(o.input[2], o.kernel, o.stride, o.pad)};
}
}  // namespace

MaxPool2d::MaxPool2d(const MaxPool2dOptions& opts)
    : Layer(opts.input, maxpool_output(resolved(opts)), opts.dtype),
      kernel_(opts.kernel),
      stride_(resolved(opts).stride),
      pad_(opts.pad) {}

std::string MaxPool2d::describe() const { return "maxpool2d(" + window_str(kernel_, stride_, pad_) + ")"; }

LayerCost MaxPool2d::cost(int64_t batch) const {
  const double N = static_cast<double>(batch), C = input_shape_[0], H = input_shape_[1], W = input_shape_[2];
  const double P = output_shape_[1], Q = output_shape_[2];
  const double es = elem_size(dtype_);
  const double in = N * C * H * W, out = N * C * P * Q;
  // One comparison per real value of each window but its first (padding is skipped).
  const double values = N * C *
                        static_cast<double>(covered(input_shape_[1], output_shape_[1], kernel_, stride_, pad_)) *
                        static_cast<double>(covered(input_shape_[2], output_shape_[2], kernel_, stride_, pad_));
  LayerCost c;
  c.forward_flops = values - out;
  c.backward_flops = out;  // one add per output gradient into its argmax
  c.input_grad_flops = out;
  c.forward_bytes = es * (in + out) + 4 * out;   // x, y, int32 argmax
  c.backward_bytes = es * (out + in) + 4 * out;  // dy, dx, argmax
  c.output_bytes = static_cast<int64_t>(es * out);
  c.saved_bytes = static_cast<int64_t>(4 * out);  // argmax only: backward needs no values
  return c;
}

Tensor MaxPool2d::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) {
  const Shape out = batched(x.size(0), output_shape_);
  Tensor y = be.empty(out, dtype_);            // (N, C, P, Q)
  Tensor argmax = be.empty(out, DType::kI32);  // (N, C, P, Q), flat h W + w per plane
  be.maxpool2d(x, kernel_, stride_, pad_, y, argmax);
  if (ctx != nullptr) ctx->saved = {argmax};
  return y;
}

Tensor MaxPool2d::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(batched(dy.size(0), input_shape_), dtype_);  // (N, C, H, W)
  be.maxpool2d_backward(dy, ctx.saved.at(0), dx);
  return dx;
}

// ---- AvgPool2d

AvgPool2dOptions AvgPool2dOptions::global_pool(Shape input) {
  const int kernel = input.size() == 3 ? static_cast<int>(input[1]) : 0;
  AvgPool2dOptions o(std::move(input), kernel);
  o.global = true;
  return o;
}

namespace {
AvgPool2dOptions resolved(AvgPool2dOptions o) {
  if (o.stride == 0) o.stride = o.kernel;
  return o;
}

Shape avgpool_output(const AvgPool2dOptions& o) {
  if (o.global) {
    check_chw(o.input, "global_avgpool");
    if (o.input[1] != o.input[2]) {
      throw UserError("global_avgpool: the " + shape_str(o.input) +
                      " input's plane is not square, and the pooling window is; make height equal width");
    }
    return {o.input[0], 1, 1};
  }
  const std::string who = "avgpool2d(" + window_str(o.kernel, o.stride, 0) + ")";
  check_chw(o.input, who);
  if (o.kernel < 1 || o.stride < 1) throw UserError(who + ": kernel and stride must be positive");
  if (o.input[1] < o.kernel || o.input[2] < o.kernel) {
    throw UserError(who + ": the window does not fit in the " + shape_str(o.input) + " input; use a smaller kernel");
  }
  return {o.input[0], out_extent(o.input[1], o.kernel, o.stride, 0), out_extent(o.input[2], o.kernel, o.stride, 0)};
}
}  // namespace

AvgPool2d::AvgPool2d(const AvgPool2dOptions& opts)
    : Layer(opts.input, avgpool_output(resolved(opts)), opts.dtype),
      kernel_(opts.kernel),
      stride_(resolved(opts).stride),
      global_(opts.global) {}

std::string AvgPool2d::describe() const {
  if (global_) return "global_avgpool(" + std::to_string(kernel_) + "x" + std::to_string(kernel_) + ")";
  return "avgpool2d(" + window_str(kernel_, stride_, 0) + ")";
}

LayerCost AvgPool2d::cost(int64_t batch) const {
  const double in = static_cast<double>(batch * shape_numel(input_shape_));
  const double out = static_cast<double>(batch * shape_numel(output_shape_));
  const double window = static_cast<double>(kernel_) * kernel_, es = elem_size(dtype_);
  LayerCost c;
  c.forward_flops = window * out;         // window - 1 adds and one scaling per output
  c.backward_flops = (window + 1) * out;  // one scaling per output, one add per window value
  c.input_grad_flops = c.backward_flops;
  c.forward_bytes = es * (in + out);
  c.backward_bytes = es * (out + in);
  c.output_bytes = static_cast<int64_t>(es * out);
  c.saved_bytes = 0;  // backward needs only the shapes
  return c;
}

Tensor AvgPool2d::forward_impl(Backend& be, const Tensor& x, Context*, const ForwardArgs&) {
  Tensor y = be.empty(batched(x.size(0), output_shape_), dtype_);  // (N, C, P, Q)
  be.avgpool2d(x, kernel_, stride_, y);
  return y;
}

Tensor AvgPool2d::backward_impl(Backend& be, const Tensor& dy, const Context&, bool need_dx) {
  if (!need_dx) return Tensor();
  Tensor dx = be.empty(batched(dy.size(0), input_shape_), dtype_);  // (N, C, H, W)
  be.avgpool2d_backward(dy, kernel_, stride_, dx);
  return dx;
}

// ---- Flatten

namespace {
const Shape& checked_flatten_input(const Shape& in) {
  if (in.empty()) throw UserError("flatten: the input is already one value per sample; remove the flatten layer");
  return in;
}
}  // namespace

Flatten::Flatten(const Shape& input, DType dtype) : Layer(checked_flatten_input(input), {shape_numel(input)}, dtype) {}

std::string Flatten::describe() const {
  return "flatten(" + shape_str(input_shape_) + " -> " + std::to_string(output_shape_[0]) + ")";
}

// A view: no flops and no traffic. The output is counted, as it is what a stage
// boundary placed here would send.
LayerCost Flatten::cost(int64_t batch) const {
  LayerCost c;
  c.output_bytes = static_cast<int64_t>(elem_size(dtype_) * static_cast<double>(batch * output_shape_[0]));
  return c;
}

Tensor Flatten::forward_impl(Backend&, const Tensor& x, Context*, const ForwardArgs&) {
  return x.reshape({x.size(0), output_shape_[0]});  // (N, C H W)
}

Tensor Flatten::backward_impl(Backend&, const Tensor& dy, const Context&, bool need_dx) {
  if (!need_dx) return Tensor();
  return dy.reshape(batched(dy.size(0), input_shape_));  // (N, C, H, W)
}

// ---- BasicBlock

namespace {
// Children of a BasicBlock's Context, in forward order.
enum Child { kConv1, kBn1, kRelu1, kConv2, kBn2, kProjConv, kProjBn, kReluOut, kNumChildren };

std::string block_name(const BasicBlockOptions& o) {
  std::string s = "basic_block(" + (o.input.empty() ? std::string("?") : std::to_string(o.input[0])) + " -> " +
                  std::to_string(o.out);
  if (o.stride != 1) s += ", stride " + std::to_string(o.stride);
  if (!o.batchnorm) s += ", no batchnorm";
  return s + ")";
}

Shape block_output(const BasicBlockOptions& o) {
  const std::string who = block_name(o);
  check_chw(o.input, who);
  if (o.out < 1 || o.stride < 1) throw UserError(who + ": out and stride must be positive");
  // 3x3 with padding 1, and the 1x1 projection without padding, give the same size.
  return {o.out, out_extent(o.input[1], 3, o.stride, 1), out_extent(o.input[2], 3, o.stride, 1)};
}

std::unique_ptr<Conv2d> make_conv(const Shape& in, int64_t out, int kernel, int stride, const BasicBlockOptions& o,
                                  uint64_t stream) {
  Conv2dOptions c(in, out, kernel);
  c.stride = stride;
  c.pad = kernel / 2;
  c.bias = !o.batchnorm;  // a batch norm's beta makes a bias redundant
  c.dtype = o.dtype;
  c.seed = mix_seed(o.seed, stream);
  return std::make_unique<Conv2d>(c);
}

std::unique_ptr<BatchNorm2d> make_bn(const Shape& in, const BasicBlockOptions& o) {
  if (!o.batchnorm) return nullptr;
  BatchNorm2dOptions b(in);
  b.dtype = o.dtype;
  return std::make_unique<BatchNorm2d>(b);
}

void prefix_names(Layer* l, const std::string& prefix) {
  if (l == nullptr) return;
  for (Parameter* p : l->parameters()) p->name = prefix + p->name;
}
}  // namespace

BasicBlock::BasicBlock(const BasicBlockOptions& opts) : Layer(opts.input, block_output(opts), opts.dtype), opts_(opts) {
  conv1_ = make_conv(opts.input, opts.out, 3, opts.stride, opts, 1);
  bn1_ = make_bn(conv1_->output_shape(), opts);
  relu1_ = std::make_unique<Relu>(conv1_->output_shape(), opts.dtype);
  conv2_ = make_conv(conv1_->output_shape(), opts.out, 3, 1, opts, 2);
  bn2_ = make_bn(conv2_->output_shape(), opts);
  if (opts.stride != 1 || opts.input[0] != opts.out) {
    proj_conv_ = make_conv(opts.input, opts.out, 1, opts.stride, opts, 3);
    proj_bn_ = make_bn(proj_conv_->output_shape(), opts);
  }
  relu_out_ = std::make_unique<Relu>(output_shape_, opts.dtype);
  prefix_names(conv1_.get(), "conv1.");
  prefix_names(bn1_.get(), "bn1.");
  prefix_names(conv2_.get(), "conv2.");
  prefix_names(bn2_.get(), "bn2.");
  prefix_names(proj_conv_.get(), "downsample.0.");
  prefix_names(proj_bn_.get(), "downsample.1.");
}

std::string BasicBlock::describe() const { return block_name(opts_); }

std::vector<Parameter*> BasicBlock::parameters() {
  std::vector<Parameter*> out;
  for (Layer* l : std::initializer_list<Layer*>{conv1_.get(), bn1_.get(), conv2_.get(), bn2_.get(), proj_conv_.get(),
                                                proj_bn_.get()}) {
    if (l == nullptr) continue;
    for (Parameter* p : l->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<Buffer> BasicBlock::buffers() {
  std::vector<Buffer> out;
  for (const auto& [bn, prefix] : {std::make_pair(bn1_.get(), "bn1."), std::make_pair(bn2_.get(), "bn2."),
                                   std::make_pair(proj_bn_.get(), "downsample.1.")}) {
    if (bn == nullptr) continue;
    for (const Buffer& b : bn->buffers()) out.push_back({prefix + b.name, b.value});
  }
  return out;
}

std::vector<BatchNorm2d*> BasicBlock::batchnorms() {
  std::vector<BatchNorm2d*> out;
  for (BatchNorm2d* b : {bn1_.get(), bn2_.get(), proj_bn_.get()}) {
    if (b != nullptr) out.push_back(b);
  }
  return out;
}

void BasicBlock::end_step_impl(Backend& be, const ReplicaSum& replicas) {
  for (BatchNorm2d* b : batchnorms()) b->end_step(be, replicas);
}

LayerCost BasicBlock::cost(int64_t batch) const {
  const double es = elem_size(dtype_);
  const double in = static_cast<double>(batch * shape_numel(input_shape_));
  const double out = static_cast<double>(batch * shape_numel(output_shape_));
  LayerCost c;
  std::vector<const Layer*> parts = {conv1_.get(), bn1_.get(),       relu1_.get(),   conv2_.get(),
                                     bn2_.get(),   proj_conv_.get(), proj_bn_.get(), relu_out_.get()};
  for (const Layer* l : parts) {
    if (l == nullptr) continue;
    const LayerCost p = l->cost(batch);
    c.forward_flops += p.forward_flops;
    c.backward_flops += p.backward_flops;
    c.forward_bytes += p.forward_bytes;
    c.backward_bytes += p.backward_bytes;
    c.param_bytes += p.param_bytes;
  }
  // The residual add: forward, and the shortcut's gradient added into dx in backward.
  c.forward_flops += out;
  c.forward_bytes += 3 * es * out;
  c.backward_flops += in;
  c.backward_bytes += 3 * es * in;
  // Only conv1's and the projection's input gradients (and their sum) serve dx alone;
  // every other dx inside the block feeds a parameter gradient.
  c.input_grad_flops = conv1_->cost(batch).input_grad_flops + in;
  if (proj_conv_) c.input_grad_flops += proj_conv_->cost(batch).input_grad_flops;
  c.output_bytes = static_cast<int64_t>(es * out);
  // Distinct buffers: conv2 saves relu1's output and the projection saves the block
  // input, both already counted (by relu1 and conv1).
  for (const Layer* l : {static_cast<const Layer*>(conv1_.get()), static_cast<const Layer*>(relu1_.get()),
                         static_cast<const Layer*>(relu_out_.get()), static_cast<const Layer*>(bn1_.get()),
                         static_cast<const Layer*>(bn2_.get()), static_cast<const Layer*>(proj_bn_.get())}) {
    if (l != nullptr) c.saved_bytes += l->cost(batch).saved_bytes;
  }
  return c;
}

Tensor BasicBlock::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  if (ctx != nullptr) ctx->children.assign(kNumChildren, {});
  auto child = [&](Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; };
  Tensor h = conv1_->forward(be, x, child(kConv1), args);  // (N, K, P, Q)
  if (bn1_) h = bn1_->forward(be, h, child(kBn1), args);
  h = relu1_->forward(be, h, child(kRelu1), args);
  h = conv2_->forward(be, h, child(kConv2), args);
  if (bn2_) h = bn2_->forward(be, h, child(kBn2), args);
  Tensor shortcut = x;
  if (proj_conv_) {
    shortcut = proj_conv_->forward(be, x, child(kProjConv), args);
    if (proj_bn_) shortcut = proj_bn_->forward(be, shortcut, child(kProjBn), args);
  }
  // In place: h is the last conv's or BN's output, which neither keeps for backward.
  be.axpy(1.0, shortcut, h);
  Tensor y = relu_out_->forward(be, h, child(kReluOut), args);
  if (ctx != nullptr) {
    // The children hold what backward reads. The same buffers (shared, not copied)
    // are listed here too, so memory accounting that reads only a layer's own saved
    // tensors (the executor's meter) sees them.
    ctx->saved.clear();
    for (const Context& c : ctx->children) {
      for (const Tensor& t : c.saved) {
        const bool seen = std::any_of(ctx->saved.begin(), ctx->saved.end(),
                                      [&](const Tensor& s) { return s.raw_data() == t.raw_data(); });
        if (!seen) ctx->saved.push_back(t);
      }
    }
  }
  return y;
}

Tensor BasicBlock::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  const auto& ch = ctx.children;
  GPIPE_CHECK(ch.size() == kNumChildren, describe() + ": backward without its forward's context");
  const Tensor g = relu_out_->backward(be, dy, ch[kReluOut], true);  // (N, K, P, Q), into both branches
  Tensor gm = g;
  if (bn2_) gm = bn2_->backward(be, gm, ch[kBn2], true);
  gm = conv2_->backward(be, gm, ch[kConv2], true);
  gm = relu1_->backward(be, gm, ch[kRelu1], true);
  if (bn1_) gm = bn1_->backward(be, gm, ch[kBn1], true);
  Tensor dx = conv1_->backward(be, gm, ch[kConv1], need_dx);  // (N, C, H, W)
  if (proj_conv_) {
    Tensor gs = g;
    if (proj_bn_) gs = proj_bn_->backward(be, gs, ch[kProjBn], true);
    gs = proj_conv_->backward(be, gs, ch[kProjConv], need_dx);
    if (need_dx) be.axpy(1.0, gs, dx);
  } else if (need_dx) {
    be.axpy(1.0, g, dx);  // identity shortcut
  }
  return dx;
}

}  // namespace layers
}  // namespace gpipe
