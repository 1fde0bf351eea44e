#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <climits>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/cpu_blas.h"
#include "kernels/op_log.h"
#include "kernels/op_checks.h"
#include "kernels/transformer_checks.h"
#include "kernels/widening_backend.h"
#include "runtime/bf16.h"
#include "runtime/fp16.h"
#include "runtime/error.h"
#include "runtime/philox.h"

#ifdef GPIPE_WITH_CUDA
#include "kernels/cuda_backend.h"
#endif

namespace gpipe {

namespace {

using cpu_blas::gemm;
using ops::dispatch_float;

// Float GELU is evaluated with branch-free polynomial exp and erf that the compiler
// vectorises: libm's scalar erff and expf took a quarter of a transformer block's time.
// Errors: exp about 2e-7 relative, erf 1.5e-7 absolute (Abramowitz & Stegun 7.1.26),
// well inside float32 training tolerances. Double keeps libm, for finite-difference tests.
inline float fast_expf(float x) {
  x = x < -87.0f ? -87.0f : x;  // conditional selects (not std::min) so the loop vectorises
  x = x > 88.0f ? 88.0f : x;
  const float t = x * 1.44269504089f;                      // x log2(e)
  const float r = (t + 12582912.0f) - 12582912.0f;         // round to nearest (1.5 * 2^23 trick)
  const float f = (t - r) * 0.69314718056f;                // in [-ln2/2, ln2/2]
  // e^f by its Taylor series to degree 7: error < 1e-9 on this interval.
  float p = 1.98412698e-4f;
  p = p * f + 1.38888889e-3f;
  p = p * f + 8.33333333e-3f;
  p = p * f + 4.16666667e-2f;
  p = p * f + 1.66666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(r) + 127) << 23;  // 2^r
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float fast_erff(float x) {
  const float a = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float y = 1.0f - poly * fast_expf(-a * a);
  return x < 0.0f ? -y : y;
}

inline float gelu_value(float x) { return 0.5f * x * (1.0f + fast_erff(x * 0.70710678f)); }
inline double gelu_value(double x) { return 0.5 * x * (1.0 + std::erf(x * M_SQRT1_2)); }

inline float gelu_slope(float x) {
  const float cdf = 0.5f * (1.0f + fast_erff(x * 0.70710678f));
  const float pdf = fast_expf(-0.5f * x * x) * 0.3989422804f;  // 1/sqrt(2 pi)
  return cdf + x * pdf;
}
inline double gelu_slope(double x) {
  const double cdf = 0.5 * (1.0 + std::erf(x * M_SQRT1_2));
  const double pdf = std::exp(-0.5 * x * x) * 0.3989422804014327;
  return cdf + x * pdf;
}

void check_label(int32_t label, int64_t classes, int ignore_index, int64_t row) {
  if (label == ignore_index) return;
  if (label < 0 || label >= classes) {
    throw UserError("label " + std::to_string(label) + " in row " + std::to_string(row) +
                    " is outside [0, " + std::to_string(classes) +
                    "); the model's last layer must have as many outputs as there are classes");
  }
}

}  // namespace

Tensor Backend::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  fill(t, 0.0);
  return t;
}

void Backend::begin_capture() {
  throw CaptureError("the backend of " + device().str() + " cannot capture a step");
}

std::unique_ptr<CapturedOps> Backend::end_capture() {
  throw CaptureError("the backend of " + device().str() + " is not capturing");
}

void Backend::join_capture() {
  throw CaptureError("the backend of " + device().str() + " cannot capture a step");
}

double Backend::sum_squares_all(const std::vector<Tensor>& xs) {
  double total = 0;
  for (const Tensor& x : xs) total += sum_squares(x);
  return total;
}

namespace {
void check_lists(size_t n, std::initializer_list<size_t> others, const char* op) {
  for (size_t m : others) {
    if (m != n) {
      throw Error(std::string(op) + ": lists of " + std::to_string(n) + " and " + std::to_string(m) +
                  " tensors; each list needs one entry per tensor");
    }
  }
}
}  // namespace

void Backend::rmsnorm(const Tensor& x, const Tensor& g, double eps, Tensor& y, Tensor& rstd) {
  row_inverse_rms(x, eps, rstd);
  scale_rows(x, rstd, y);  // xhat = x * rstd
  scale_columns(y, g, y);  // y = xhat * g
}

void Backend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd, Tensor& dx) {
  const int64_t rows = rstd.numel();
  Tensor xhat = empty(x.shape(), x.dtype());
  scale_rows(x, rstd, xhat);
  scale_columns(dy, g, dx);                  // gdy
  Tensor dot = empty({rows}, rstd.dtype());  // mean_c(gdy * xhat)
  row_dot(dx, xhat, 1.0 / static_cast<double>(x.shape().back()), dot);
  scale_rows(xhat, dot, xhat);
  axpy(-1.0, xhat, dx);
  scale_rows(dx, rstd, dx);
}

void Backend::rmsnorm_weight_grad(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dg) {
  Tensor t = empty(x.shape(), x.dtype());
  scale_rows(x, rstd, t);  // xhat
  mul(dy, t, t);
  bias_grad(t.reshape({rstd.numel(), dg.numel()}), dg, /*beta=*/1.0);
}

void Backend::linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  matmul_weight(x, false, w, true, y);  // x (R, K) @ w^T (K, N)
  add_bias(y, bias);
}

void Backend::linear_weight_grad(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor& db) {
  matmul(dy, true, x, false, dw, 1.0, 1.0);  // dw += dy^T (N, R) @ x (R, K)
  bias_grad(dy, db, 1.0);
}

void Backend::linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual, Tensor& y) {
  matmul_weight(x, false, w, true, y);  // x (R, K) @ w^T (K, N)
  axpy(1.0, residual, y);
}

void Backend::linear_input_grad_add(const Tensor& dy, const Tensor& w, Tensor& dx) {
  Tensor part = empty(dx.shape(), dx.dtype());
  matmul_weight(dy, false, w, false, part);  // dy (R, N) @ w (N, K)
  axpy(1.0, part, dx);
}

void Backend::rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                                   const Tensor& residual, Tensor& dx) {
  rmsnorm_backward(dy, x, g, rstd, dx);
  axpy(1.0, residual, dx);
}

void Backend::swiglu(const Tensor& a, const Tensor& b, Tensor& y) {
  if (y.raw_data() == b.raw_data() && y.raw_data() != a.raw_data()) {  // y may alias b: s in a temporary
    Tensor s = empty(a.shape(), a.dtype());
    unary(Unary::kSilu, a, s);
    mul(s, b, y);
    return;
  }
  unary(Unary::kSilu, a, y);  // s
  mul(y, b, y);               // s * b
}

void Backend::swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) {
  unary(Unary::kSilu, a, da);  // s, in da's storage until da is written
  mul(dy, da, db);             // db = dy * s
  mul(dy, b, da);              // dy * b
  unary_backward(Unary::kSilu, a, da, da);
}

void Backend::fused_attention(const Tensor& q, const Tensor&, const Tensor&, int, Tensor&, Tensor&) {
  throw Error("fused_attention: the backend of " + device().str() + " has no fused attention for " + q.str() +
              " (ask has_fused_attention first)");
}

void Backend::fused_attention_backward(const Tensor&, const Tensor& q, const Tensor&, const Tensor&, const Tensor&,
                                       const Tensor&, int, Tensor&, Tensor&, Tensor&) {
  throw Error("fused_attention_backward: the backend of " + device().str() + " has no fused attention for " +
              q.str() + " (ask has_fused_attention first)");
}

void check_step_scalars(const Tensor& scalars, Device device, const char* op) {
  if (!scalars.defined() || scalars.dtype() != DType::kF64 || scalars.numel() != kStepScalarCount ||
      !scalars.is_contiguous() || !(scalars.device() == device)) {
    throw Error(std::string(op) + ": the step's scalars must be " + std::to_string(kStepScalarCount) +
                " contiguous float64 values on " + device.str() + ", not " + scalars.str());
  }
}

double host_step_scalar(const Tensor& scalars, StepScalar slot, const char* op) {
  check_step_scalars(scalars, scalars.defined() && scalars.device().is_cpu() ? scalars.device() : Device::cpu(), op);
  return scalars.data<double>()[slot];
}

namespace {

// The step count of a step's scalars: a whole number from 1.
int64_t step_number(const StepScalarValues& s, const char* op) {
  const double n = s[kStepNumber];
  if (!(n >= 1 && n <= 9007199254740992.0 && n == static_cast<double>(static_cast<int64_t>(n)))) {
    throw Error(std::string(op) + ": step count " + std::to_string(n) + " in the step's scalars; it counts from 1");
  }
  return static_cast<int64_t>(n);
}
}  // namespace

uint64_t DropoutKey::host_key() const { return multiplier == 0 ? key : mixed_key(base, multiplier, step); }

StepScalarValues adam_step_scalars(const AdamParams& p, int64_t step) {
  StepScalarValues s = initial_step_scalars();
  const double n = static_cast<double>(step);
  s[kStepNumber] = n;
  s[kStepLr] = p.lr;
  s[kStepDecay] = 1.0 - p.lr * p.weight_decay;
  s[kStepBiasCorrection1] = 1.0 - std::pow(p.beta1, n);
  s[kStepBiasCorrection2] = 1.0 - std::pow(p.beta2, n);
  return s;
}

StepScalarValues sgd_step_scalars(const SgdParams& p, int64_t step) {
  StepScalarValues s = initial_step_scalars();
  s[kStepNumber] = static_cast<double>(step);
  s[kStepLr] = p.lr;
  return s;
}

Tensor Backend::step_scalars(const StepScalarValues& values) {
  Tensor t = empty({kStepScalarCount}, DType::kF64);
  write_step_scalars(values, t);
  return t;
}

namespace {

// The scalars' values on the host, and back: the ops' own reads and writes (a CPU
// reference's part of its op), not logged as the host's.
StepScalarValues scalar_values(Backend& be, const Tensor& scalars, const char* op) {
  check_step_scalars(scalars, be.device(), op);
  StepScalarValues v{};
  if (scalars.device().is_cpu()) {
    std::copy(scalars.data<double>(), scalars.data<double>() + kStepScalarCount, v.begin());
    return v;
  }
  Tensor host = Tensor::empty({kStepScalarCount}, DType::kF64, Device::cpu());
  be.copy(scalars, host);  // a copy to the host returns once the data is there
  std::copy(host.data<double>(), host.data<double>() + kStepScalarCount, v.begin());
  return v;
}

void set_scalar_values(Backend& be, const StepScalarValues& values, Tensor& scalars, const char* op) {
  check_step_scalars(scalars, be.device(), op);
  if (scalars.device().is_cpu()) {
    std::copy(values.begin(), values.end(), scalars.data<double>());
    return;
  }
  Tensor host = Tensor::empty({kStepScalarCount}, DType::kF64, Device::cpu());
  std::copy(values.begin(), values.end(), host.data<double>());
  be.copy(host, scalars);
}

}  // namespace

// The host's reads and writes, calls of their own in the OpLog (kernels/op_log.h), their
// copies inside them: a read waits for the device and hands the host its values.
StepScalarValues Backend::read_step_scalars(const Tensor& scalars) {
  const OpCall call("read_step_scalars", true);
  return scalar_values(*this, scalars, "read_step_scalars");
}

void Backend::write_step_scalars(const StepScalarValues& values, Tensor& scalars) {
  const OpCall call("write_step_scalars", false);
  set_scalar_values(*this, values, scalars, "write_step_scalars");
}

void Backend::sgd_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                           const std::vector<Tensor>& bufs, const SgdParams& p, const Tensor& scalars) {
  check_lists(params.size(), {grads.size(), bufs.size()}, "sgd_step_all");
  const StepScalarValues s = scalar_values(*this, scalars, "sgd_step_all");
  const bool first_step = step_number(s, "sgd_step_all") == 1;
  if (s[kStepSkip] != 0) return;
  SgdParams at = p;
  at.lr = s[kStepLr];
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor param = params[i], buf = bufs[i];  // handles: they write the same storage
    sgd_step(param, grads[i], buf, at, first_step);
  }
}

void Backend::adam_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                            const std::vector<Tensor>& m, const std::vector<Tensor>& v, const AdamParams& p,
                            const Tensor& scalars) {
  check_lists(params.size(), {grads.size(), m.size(), v.size()}, "adam_step_all");
  const StepScalarValues s = scalar_values(*this, scalars, "adam_step_all");
  const int64_t step = step_number(s, "adam_step_all");
  if (s[kStepSkip] != 0) return;  // every tensor as it was, and its moments
  AdamParams at = p;
  at.lr = s[kStepLr];
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor param = params[i], mi = m[i], vi = v[i];
    adam_step(param, grads[i], mi, vi, at, step);
  }
}

void Backend::scale_all(const std::vector<Tensor>& xs, double alpha) {
  for (Tensor x : xs) scale(x, alpha);
}

void Backend::sum_squares_all_to(const std::vector<Tensor>& xs, Tensor& scalars) {
  StepScalarValues s = scalar_values(*this, scalars, "sum_squares_all_to");
  s[kStepNormSquared] = sum_squares_all(xs);
  set_scalar_values(*this, s, scalars, "sum_squares_all_to");
}

void Backend::step_grad_scale(Tensor& scalars, double max_norm, bool skip_nonfinite) {
  StepScalarValues s = scalar_values(*this, scalars, "step_grad_scale");
  const double inv_loss_scale = s[kStepUnscale];
  const double norm_squared = s[kStepNormSquared];
  const double norm = norm_squared < 0 ? -1.0 : std::sqrt(norm_squared);  // NaN stays NaN
  if (skip_nonfinite && !std::isfinite(norm)) s[kStepSkip] = 1.0;
  double scale = inv_loss_scale;
  if (max_norm > 0 && norm >= 0) {
    // One rounding for norm * inv_loss_scale + 1e-6 (an FMA), written out so that the
    // GPU's kernel (__fma_rn) gives the same bits whatever the compilers contract.
    const double clip = max_norm / std::fma(norm, inv_loss_scale, 1e-6);
    if (clip < 1.0) scale *= clip;
  }
  s[kStepGradScale] = scale;
  set_scalar_values(*this, s, scalars, "step_grad_scale");
}

void Backend::scale_all_by(const std::vector<Tensor>& xs, const Tensor& scalars) {
  const StepScalarValues s = scalar_values(*this, scalars, "scale_all_by");
  if (s[kStepSkip] != 0 || s[kStepGradScale] == 1.0) return;
  scale_all(xs, s[kStepGradScale]);
}

void Backend::fill_all(const std::vector<Tensor>& xs, double value) {
  for (Tensor x : xs) fill(x, value);
}

void Backend::cast_all(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts) {
  check_lists(srcs.size(), {dsts.size()}, "cast_all");
  for (size_t i = 0; i < srcs.size(); ++i) {
    Tensor dst = dsts[i];
    cast(srcs[i], dst);
  }
}

void CpuBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha, double beta) {
  const auto d = ops::check_matmul(a, ta, b, tb, c);
  if (d.m == 0 || d.n == 0) return;
  dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (d.k == 0) {  // BLAS leaves c untouched when k == 0; the definition says beta * c.
      scale(c, beta);
      return;
    }
    gemm(ta, tb, static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(d.k), alpha, a.data<T>(),
         static_cast<int>(a.size(1)), b.data<T>(), static_cast<int>(b.size(1)), beta, c.data<T>(),
         static_cast<int>(c.size(1)));
  });
}

void CpuBackend::matmul_weight(const Tensor& a, bool ta, const Tensor& w, bool tw, Tensor& c, double alpha,
                               double beta) {
  const auto d = ops::check_matmul(a, ta, w, tw, c);
  if (a.dtype() == DType::kF32 && d.m > 0 && d.n > 0 && d.k > 0 &&
      cpu_blas::gemm_weight(ta, static_cast<int>(d.m), static_cast<int>(d.n), static_cast<int>(d.k),
                            static_cast<float>(alpha), a.data<float>(), static_cast<int>(a.size(1)), w, tw,
                            static_cast<float>(beta), c.data<float>(), static_cast<int>(c.size(1)))) {
    return;
  }
  matmul(a, ta, w, tw, c, alpha, beta);
}

void CpuBackend::add_bias(Tensor& y, const Tensor& bias) {
  ops::check_matrix(y, "add_bias");
  ops::check_float(bias, "add_bias");
  GPIPE_CHECK(bias.dtype() == y.dtype() && bias.numel() == y.size(1),
              "add_bias: bias " + bias.str() + " for " + y.str());
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = y.size(0), cols = y.size(1);
    T* py = y.data<T>();
    const T* pb = bias.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      T* row = py + r * cols;
      for (int64_t j = 0; j < cols; ++j) row[j] += pb[j];
    }
  });
}

void CpuBackend::bias_grad(const Tensor& dy, Tensor& db, double beta) {
  ops::check_matrix(dy, "bias_grad");
  ops::check_float(db, "bias_grad");
  GPIPE_CHECK(db.dtype() == dy.dtype() && db.numel() == dy.size(1), "bias_grad: " + db.str() + " for " + dy.str());
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = dy.size(0), cols = dy.size(1);
    const T* p = dy.data<T>();
    T* out = db.data<T>();
    std::vector<T> acc(cols, T(0));
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = p + r * cols;
      for (int64_t j = 0; j < cols; ++j) acc[j] += row[j];
    }
    for (int64_t j = 0; j < cols; ++j) out[j] = (beta == 0.0 ? T(0) : T(beta) * out[j]) + acc[j];
  });
}

void CpuBackend::relu(const Tensor& x, Tensor& y) {
  ops::check_float(x, "relu");
  ops::check_same(x, y, "relu");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) py[i] = px[i] > T(0) ? px[i] : T(0);
  });
}

void CpuBackend::relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  ops::check_float(y, "relu_backward");
  ops::check_same(y, dy, "relu_backward");
  ops::check_same(y, dx, "relu_backward");
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* py = y.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    const int64_t n = y.numel();
    for (int64_t i = 0; i < n; ++i) pdx[i] = py[i] > T(0) ? pdy[i] : T(0);
  });
}

void CpuBackend::gelu(const Tensor& x, Tensor& y) {
  ops::check_float(x, "gelu");
  ops::check_same(x, y, "gelu");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) py[i] = gelu_value(px[i]);
  });
}

void CpuBackend::gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  ops::check_float(x, "gelu_backward");
  ops::check_same(x, dy, "gelu_backward");
  ops::check_same(x, dx, "gelu_backward");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * gelu_slope(px[i]);
  });
}

namespace {
// A loss's factor as the CPU reads it: with the step's scalars, their kStepLossScale.
double loss_scale_value(const LossScale& scale, const char* op) {
  return scale.from_device() ? host_step_scalar(scale.scalars, kStepLossScale, op) : scale.value;
}
}  // namespace

void CpuBackend::softmax_xent(const Tensor& logits, const Tensor& labels, const LossScale& loss_scale,
                              int ignore_index, Tensor& probs, Tensor& loss) {
  const double scale = loss_scale_value(loss_scale, "softmax_xent");
  ops::check_xent(logits, labels, probs);
  GPIPE_CHECK(loss.numel() == 1 && loss.dtype() == logits.dtype(), "softmax_xent: loss " + loss.str());
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = logits.size(0), cols = logits.size(1);
    const T* pl = logits.data<T>();
    const int32_t* py = labels.data<int32_t>();
    T* pp = probs.data<T>();
    double total = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = pl + r * cols;
      T* out = pp + r * cols;
      T mx = in[0];
      for (int64_t j = 1; j < cols; ++j) mx = std::max(mx, in[j]);
      T sum = 0;
      for (int64_t j = 0; j < cols; ++j) {
        out[j] = std::exp(in[j] - mx);
        sum += out[j];
      }
      const T inv = T(1) / sum;
      for (int64_t j = 0; j < cols; ++j) out[j] *= inv;
      check_label(py[r], cols, ignore_index, r);
      // max - x[label] first: exact for near logits, where log(sum) + max would round at
      // max's magnitude (5e-4 at logits of 1e4 in float32).
      if (py[r] != ignore_index) total += static_cast<double>(std::log(sum) + (mx - in[py[r]]));
    }
    *loss.data<T>() = static_cast<T>(total * scale);
  });
}

void CpuBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels, const LossScale& loss_scale,
                                       int ignore_index, Tensor& dlogits) {
  const double scale = loss_scale_value(loss_scale, "softmax_xent_backward");
  ops::check_xent(probs, labels, dlogits);
  dispatch_float(probs, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = probs.size(0), cols = probs.size(1);
    const T* pp = probs.data<T>();
    const int32_t* py = labels.data<int32_t>();
    T* pd = dlogits.data<T>();
    const T s = static_cast<T>(scale);
    for (int64_t r = 0; r < rows; ++r) {
      T* out = pd + r * cols;
      if (py[r] == ignore_index) {
        std::fill(out, out + cols, T(0));
        continue;
      }
      check_label(py[r], cols, ignore_index, r);
      const T* in = pp + r * cols;
      for (int64_t j = 0; j < cols; ++j) out[j] = s * in[j];
      out[py[r]] -= s;
    }
  });
}

void CpuBackend::softmax_xent_slice_sums(const Tensor& logits, const Tensor& labels, int64_t first, int64_t vocab,
                                         int ignore_index, const Tensor& rowmax, Tensor& sums) {
  ops::check_xent_slice(logits, labels, first, vocab, rowmax, "softmax_xent_slice_sums");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  ops::check_shape(sums, {2 * rows}, logits.dtype(), "softmax_xent_slice_sums", "sums");
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pl = logits.data<T>();
    const int32_t* py = labels.data<int32_t>();
    const T* pm = rowmax.data<T>();
    T* ps = sums.data<T>();
    for (int64_t r = 0; r < rows; ++r) check_label(py[r], vocab, ignore_index, r);  // before anything is written
    for (int64_t r = 0; r < rows; ++r) {
      const T* in = pl + r * cols;
      T sum = 0;
      for (int64_t j = 0; j < cols; ++j) sum += std::exp(in[j] - pm[r]);
      ps[r] = sum;
      const int64_t col = static_cast<int64_t>(py[r]) - first;
      ps[rows + r] = py[r] != ignore_index && col >= 0 && col < cols ? in[col] : T(0);
    }
  });
}

void CpuBackend::softmax_xent_slice_loss(const Tensor& sums, const Tensor& rowmax, const Tensor& labels,
                                         int ignore_index, const LossScale& loss_scale, Tensor& lse, Tensor& loss) {
  const double scale = loss_scale_value(loss_scale, "softmax_xent_slice_loss");
  ops::check_xent_slice_loss(sums, rowmax, labels, lse, loss);
  const int64_t rows = rowmax.numel();
  dispatch_float(rowmax, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* ps = sums.data<T>();
    const T* pm = rowmax.data<T>();
    const int32_t* py = labels.data<int32_t>();
    T* pl = lse.data<T>();
    double total = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const T log_sum = std::log(ps[r]);
      pl[r] = pm[r] + log_sum;
      // max - x[label] first, as softmax_xent: exact for near logits.
      if (py[r] != ignore_index) total += static_cast<double>(log_sum + (pm[r] - ps[rows + r]));
    }
    *loss.data<T>() = static_cast<T>(total * scale);
  });
}

void CpuBackend::softmax_xent_slice_backward(const Tensor& logits, const Tensor& labels, int64_t first,
                                             int ignore_index, const Tensor& lse, const LossScale& loss_scale,
                                             Tensor& dlogits) {
  const double scale = loss_scale_value(loss_scale, "softmax_xent_slice_backward");
  ops::check_xent_slice(logits, labels, first, INT32_MAX, lse, "softmax_xent_slice_backward");
  ops::check_same(logits, dlogits, "softmax_xent_slice_backward");
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = logits.size(0), cols = logits.size(1);
    const T* pl = logits.data<T>();
    const int32_t* py = labels.data<int32_t>();
    const T* pe = lse.data<T>();
    T* pd = dlogits.data<T>();
    const T s = static_cast<T>(scale);
    for (int64_t r = 0; r < rows; ++r) {
      T* out = pd + r * cols;
      if (py[r] == ignore_index) {
        std::fill(out, out + cols, T(0));
        continue;
      }
      const T* in = pl + r * cols;
      for (int64_t j = 0; j < cols; ++j) out[j] = s * std::exp(in[j] - pe[r]);
      const int64_t col = static_cast<int64_t>(py[r]) - first;
      if (col >= 0 && col < cols) out[col] -= s;
    }
  });
}

void CpuBackend::first_column_equal(const Tensor& logits, const Tensor& value, int64_t first, int64_t none,
                                    Tensor& index) {
  ops::check_first_column_equal(logits, value, index);
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = logits.size(0), cols = logits.size(1);
    const T* pl = logits.data<T>();
    const T* pv = value.data<T>();
    T* pi = index.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      int64_t at = none;
      for (int64_t j = 0; j < cols; ++j) {
        if (pl[r * cols + j] == pv[r]) {
          at = first + j;
          break;
        }
      }
      pi[r] = static_cast<T>(at);
    }
  });
}

int64_t CpuBackend::argmax_correct(const Tensor& logits, const Tensor& labels, int ignore_index) {
  ops::check_argmax_correct(logits, labels);
  int64_t correct = 0;
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = logits.size(0), cols = logits.size(1);
    const T* pl = logits.data<T>();
    const int32_t* py = labels.data<int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      if (py[r] == ignore_index || cols == 0) continue;
      const T* in = pl + r * cols;
      int64_t best = 0;
      for (int64_t j = 1; j < cols; ++j) {
        if (in[j] > in[best]) best = j;
      }
      correct += best == py[r];
    }
  });
  return correct;
}

void CpuBackend::fill(Tensor& x, double value) {
  if (x.dtype() == DType::kI32) {
    std::fill(x.data<int32_t>(), x.data<int32_t>() + x.numel(), static_cast<int32_t>(value));
    return;
  }
  ops::check_float(x, "fill");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    std::fill(x.data<T>(), x.data<T>() + x.numel(), static_cast<T>(value));
  });
}

void CpuBackend::scale(Tensor& x, double alpha) {
  ops::check_float(x, "scale");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* p = x.data<T>();
    const int64_t n = x.numel();
    if (alpha == 0.0) {
      std::fill(p, p + n, T(0));  // 0 * NaN would stay NaN; scale(0) means "clear"
      return;
    }
    const T a = static_cast<T>(alpha);
    for (int64_t i = 0; i < n; ++i) p[i] *= a;
  });
}

void CpuBackend::axpy(double alpha, const Tensor& x, Tensor& y) {
  ops::check_float(x, "axpy");
  ops::check_same(x, y, "axpy");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const T a = static_cast<T>(alpha);
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) py[i] += a * px[i];
  });
}

void CpuBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p, bool first_step) {
  ops::check_float(param, "sgd_step");
  ops::check_same(param, grad, "sgd_step");
  if (p.momentum != 0.0) ops::check_same(param, buf, "sgd_step");
  dispatch_float(param, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* w = param.data<T>();
    const T* g = grad.data<T>();
    T* b = p.momentum != 0.0 ? buf.data<T>() : nullptr;
    const T lr = static_cast<T>(p.lr), mom = static_cast<T>(p.momentum), wd = static_cast<T>(p.weight_decay);
    const int64_t n = param.numel();
    for (int64_t i = 0; i < n; ++i) {
      T d = g[i] + wd * w[i];
      if (b != nullptr) {
        b[i] = first_step ? d : mom * b[i] + d;
        d = p.nesterov ? d + mom * b[i] : b[i];
      }
      w[i] -= lr * d;
    }
  });
}

void CpuBackend::copy(const Tensor& src, Tensor& dst) { copy_tensor(src, dst); }

void CpuBackend::transpose_blocks(const Tensor& src, int64_t rows, int64_t cols, Tensor& dst) {
  const int64_t block = ops::check_transpose_blocks(src, rows, cols, dst);
  GPIPE_CHECK(src.device().is_cpu() && dst.device().is_cpu(),
              "transpose_blocks of " + src.str() + " into " + dst.str() + " off the host");
  const char* from = static_cast<const char*>(src.raw_data());
  char* to = static_cast<char*>(dst.raw_data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      std::memcpy(to + (c * rows + r) * block, from + (r * cols + c) * block, static_cast<size_t>(block));
    }
  }
}

void CpuBackend::cast(const Tensor& src, Tensor& dst) {
  ops::check_cast(src, dst);
  GPIPE_CHECK(src.device().is_cpu() && dst.device().is_cpu(), "cast " + src.str() + " -> " + dst.str() + " off the host");
  if (src.dtype() == dst.dtype()) return copy_tensor(src, dst);
  const int64_t n = src.numel();
  auto from = [&](auto* s_tag, auto* d_tag, auto convert) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    using D = std::remove_pointer_t<decltype(d_tag)>;
    const S* s = src.data<S>();
    D* d = dst.data<D>();
    for (int64_t i = 0; i < n; ++i) d[i] = convert(s[i]);
  };
  const DType a = src.dtype(), b = dst.dtype();
  if (a == DType::kF32 && b == DType::kBF16) {
    from((float*)nullptr, (BFloat16*)nullptr, [](float x) { return float_to_bf16(x); });
  } else if (a == DType::kF64 && b == DType::kBF16) {
    from((double*)nullptr, (BFloat16*)nullptr, [](double x) { return double_to_bf16(x); });
  } else if (a == DType::kBF16 && b == DType::kF32) {
    from((BFloat16*)nullptr, (float*)nullptr, [](BFloat16 x) { return bf16_to_float(x); });
  } else if (a == DType::kBF16 && b == DType::kF64) {
    from((BFloat16*)nullptr, (double*)nullptr, [](BFloat16 x) { return bf16_to_double(x); });
  } else if (a == DType::kF32 && b == DType::kF16) {
    from((float*)nullptr, (Half*)nullptr, [](float x) { return float_to_half(x); });
  } else if (a == DType::kF64 && b == DType::kF16) {
    from((double*)nullptr, (Half*)nullptr, [](double x) { return double_to_half(x); });
  } else if (a == DType::kF16 && b == DType::kF32) {
    from((Half*)nullptr, (float*)nullptr, [](Half x) { return half_to_float(x); });
  } else if (a == DType::kF16 && b == DType::kF64) {
    from((Half*)nullptr, (double*)nullptr, [](Half x) { return half_to_double(x); });
  } else if ((a == DType::kBF16 && b == DType::kF16) || (a == DType::kF16 && b == DType::kBF16)) {
    throw Error("cast " + src.str() + " -> " + dst.str() + ": between the two narrow types, go through float32");
  } else if (a == DType::kF32 && b == DType::kF64) {
    from((float*)nullptr, (double*)nullptr, [](float x) { return static_cast<double>(x); });
  } else {
    from((double*)nullptr, (float*)nullptr, [](double x) { return static_cast<float>(x); });
  }
}

double CpuBackend::item(const Tensor& x) {
  GPIPE_CHECK(x.numel() == 1, "item() of " + x.str());
  switch (x.dtype()) {
    case DType::kF32: return *x.data<float>();
    case DType::kF64: return *x.data<double>();
    case DType::kI32: return *x.data<int32_t>();
    default: throw Error("item() of " + x.str());
  }
}

void CpuBackend::synchronize() {}  // every op returns done

Backend& backend_for(Device device) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Backend>> cpu, cuda;
  std::lock_guard<std::mutex> lock(mu);
  auto& table = device.is_cpu() ? cpu : cuda;
  if (static_cast<size_t>(device.index) >= table.size()) table.resize(device.index + 1);
  auto& slot = table[device.index];
  if (!slot) {
    if (device.is_cpu()) {
      slot = std::make_unique<WideningBackend>(std::make_unique<CpuBackend>(device));
    } else {
#ifdef GPIPE_WITH_CUDA
      slot = std::make_unique<WideningBackend>(make_cuda_backend(device));
#else
      throw UserError("device " + device.str() +
                      " requested, but this build has no CUDA support; use cpu devices or build where nvcc exists");
#endif
    }
  }
  return *slot;
}

namespace {
// GPIPE_FUSED_ATTENTION=0: the exact attention everywhere (the probabilities kept).
bool fused_attention_turned_off() {
  const char* env = std::getenv("GPIPE_FUSED_ATTENTION");
  return env != nullptr && std::string(env) == "0";
}
}  // namespace

bool cpu_fused_attention_available(DType t) {
  return !fused_attention_turned_off() && (t == DType::kF32 || t == DType::kF64);
}

bool gpu_fused_attention_expected(DType t, int64_t head_dim) {
  return !fused_attention_turned_off() && is_narrow(t) && head_dim > 0 && head_dim % 8 == 0 && head_dim <= 128;
}

bool fused_attention_available(Device device, DType t, int64_t head_dim) {
  if (device.is_cpu()) return cpu_fused_attention_available(t);
#ifdef GPIPE_WITH_CUDA
  return device.is_cuda() && cuda_fused_attention_available(t, head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

void set_cpu_blas_threads(int threads) {
  cpu_blas::library();
  cpu_blas::set_threads(threads);
}

}  // namespace gpipe
