#include "layers/batchnorm2d.h"

#include <algorithm>
#include <cmath>

#include "kernels/meta_backend.h"
#include "layers/image_shape.h"
#include "runtime/error.h"

namespace gpipe {
namespace layers {

namespace {

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
  Backend& host = ShapesOnly::active() ? meta_backend(Device::cpu()) : backend_for(Device::cpu());
  gamma_ = constant_parameter("weight", {C}, 1.0);
  beta_ = constant_parameter("bias", {C}, 0.0);
  running_mean_ = host.zeros({C}, master_dtype(dtype_));  // float32 in a bf16 or fp16 model
  running_var_ = host.empty({C}, master_dtype(dtype_));
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
    be.batchnorm_eval(x, gamma_.compute(), beta_.compute(), running_mean_, running_var_, opts_.eps, y);
    if (ctx != nullptr) ctx->saved.clear();  // backward refuses: see backward_impl
    return y;
  }
  const DType stats = master_dtype(dtype_);  // float32 in a bf16 or fp16 model
  Tensor mean = be.empty({C}, stats), var = be.empty({C}, stats);  // (C), biased var
  be.batchnorm_train(x, gamma_.compute(), beta_.compute(), opts_.eps, y, mean, var);
  // A recompute sees the same micro-batch again: counting it twice would skew the
  // running statistics.
  if (!args.recompute) {
    // Copies, so that nothing that later reuses the context's buffers can change them.
    Kept k{be.empty({C}, stats), be.empty({C}, stats), x.size(0) * input_shape_[1] * input_shape_[2]};
    be.copy(mean, k.mean);
    be.copy(var, k.var);
    // On shapes (the planner counting a training forward's ops) the copies are made and
    // nothing is kept: statistics without data must never reach end_step.
    if (!ShapesOnly::active()) {
      if (!kept_.empty() && kept_step_ != args.step) kept_.clear();  // left over from a step without end_step
      kept_step_ = args.step;
      kept_.push_back(std::move(k));
    }
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
  be.batchnorm_backward(dy, x, gamma_.compute(), ctx.saved[1], ctx.saved[2], opts_.eps, dx, gamma_.grad, beta_.grad);
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

}  // namespace layers
}  // namespace gpipe
