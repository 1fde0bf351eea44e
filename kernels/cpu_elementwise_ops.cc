// The CPU reference of the generic elementwise and row ops (kernels/backend.h), the
// building blocks of layers of one's own such as an RMSNorm or a gated unit. The CUDA
// twins are in kernels/cuda_elementwise.cu. Row sums accumulate in double, so float32
// rows of any width keep their precision.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "kernels/cpu_backend.h"
#include "kernels/row_checks.h"
#include "kernels/unary_math.h"

namespace gpipe {

using ops::dispatch_float;

namespace {

// ops::sigmoid_of(x[i]) for n elements into s: first each exponential, a call each as
// sigmoid_of takes them (exp(-x) for x >= 0, else exp(x)), then the divisions in a loop
// the compiler vectorizes: the same IEEE operations on the same operands, so the same bits.
template <typename T>
void sigmoid_run(const T* x, int64_t n, T* s) {
  for (int64_t i = 0; i < n; ++i) s[i] = ops::exp_of(x[i] >= T(0) ? -x[i] : x[i]);
  for (int64_t i = 0; i < n; ++i) s[i] = (x[i] >= T(0) ? T(1) : s[i]) / (T(1) + s[i]);
}

constexpr int64_t kSigmoidRun = 512;  // elements per run: its sigmoids stay in the L1 cache

// f(i, sigmoid_of(x[i])) for each of the n elements, in order, their sigmoids a run of
// kSigmoidRun at a time (sigmoid_run).
template <typename T, typename F>
void for_each_sigmoid(const T* x, int64_t n, F f) {
  T sig[kSigmoidRun];
  for (int64_t at = 0; at < n; at += kSigmoidRun) {
    const int64_t m = std::min(kSigmoidRun, n - at);
    sigmoid_run(x + at, m, sig);
    for (int64_t i = 0; i < m; ++i) f(at + i, sig[i]);
  }
}

}  // namespace

void CpuBackend::unary_impl(Unary f, const Tensor& x, Tensor& y) {
  const std::string op = std::string("unary ") + unary_name(f);
  ops::check_float(x, op.c_str());
  ops::check_same(x, y, op.c_str());
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const int64_t n = x.numel();
    if (f == Unary::kSilu || f == Unary::kSigmoid) {  // unary_value's formulas, the sigmoids a run at a time
      const bool silu = f == Unary::kSilu;
      for_each_sigmoid(px, n, [&](int64_t i, T sig) { py[i] = silu ? ops::silu_from_sigmoid(px[i], sig) : sig; });
      return;
    }
    for (int64_t i = 0; i < n; ++i) py[i] = ops::unary_value(f, px[i]);
  });
}

void CpuBackend::unary_backward_impl(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const std::string op = std::string("unary_backward ") + unary_name(f);
  ops::check_float(x, op.c_str());
  ops::check_same(x, dy, op.c_str());
  ops::check_same(x, dx, op.c_str());
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    const int64_t n = x.numel();
    if (f == Unary::kSilu || f == Unary::kSigmoid) {  // unary_slope's formulas, the sigmoids a run at a time
      const bool silu = f == Unary::kSilu;
      for_each_sigmoid(px, n, [&](int64_t i, T sig) {
        pdx[i] = pdy[i] * (silu ? ops::silu_slope_from_sigmoid(px[i], sig) : ops::sigmoid_slope_from_sigmoid(sig));
      });
      return;
    }
    for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * ops::unary_slope(f, px[i]);
  });
}

void CpuBackend::mul(const Tensor& a, const Tensor& b, Tensor& y) {
  ops::check_float(a, "mul");
  ops::check_same(a, b, "mul");
  ops::check_same(a, y, "mul");
  dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* py = y.data<T>();
    const int64_t n = a.numel();
    for (int64_t i = 0; i < n; ++i) py[i] = pa[i] * pb[i];
  });
}

void CpuBackend::swiglu(const Tensor& a, const Tensor& b, Tensor& y) {
  ops::check_float(a, "swiglu");
  ops::check_same(a, b, "swiglu");
  ops::check_same(a, y, "swiglu");
  dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* py = y.data<T>();
    for_each_sigmoid(pa, a.numel(), [&](int64_t i, T sig) {
      const T s = ops::silu_from_sigmoid(pa[i], sig);  // rounded to T, as unary's output
      py[i] = s * pb[i];
    });
  });
}

void CpuBackend::swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) {
  ops::check_float(a, "swiglu_backward");
  for (const Tensor* t : {&dy, &b, static_cast<const Tensor*>(&da), static_cast<const Tensor*>(&db)}) {
    ops::check_same(a, *t, "swiglu_backward");
  }
  dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pdy = dy.data<T>();
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pda = da.data<T>();
    T* pdb = db.data<T>();
    for_each_sigmoid(pa, a.numel(), [&](int64_t i, T sig) {
      const T x = pa[i], d = pdy[i];
      const T silu = ops::silu_from_sigmoid(x, sig);  // each product rounded to T, as the composition's
      const T dyb = d * pb[i];
      pdb[i] = d * silu;
      pda[i] = dyb * ops::silu_slope_from_sigmoid(x, sig);
    });
  });
}

void CpuBackend::scale_rows(const Tensor& x, const Tensor& s, Tensor& y) {
  const ops::RowView d = ops::check_rows(x, "scale_rows");
  ops::check_same(x, y, "scale_rows");
  ops::check_factor(s, d.rows, x.dtype(), "scale_rows", "s");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    const T* ps = s.data<T>();
    T* py = y.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.cols; ++c) py[r * d.cols + c] = px[r * d.cols + c] * ps[r];
    }
  });
}

void CpuBackend::scale_columns(const Tensor& x, const Tensor& s, Tensor& y) {
  const ops::RowView d = ops::check_rows(x, "scale_columns");
  ops::check_same(x, y, "scale_columns");
  ops::check_factor(s, d.cols, x.dtype(), "scale_columns", "s");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    const T* ps = s.data<T>();
    T* py = y.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      for (int64_t c = 0; c < d.cols; ++c) py[r * d.cols + c] = px[r * d.cols + c] * ps[c];
    }
  });
}

void CpuBackend::row_dot(const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  const ops::RowView d = ops::check_rows(a, "row_dot");
  ops::check_same(a, b, "row_dot");
  ops::check_factor(out, d.rows, a.dtype(), "row_dot", "out");
  dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < d.cols; ++c) acc += static_cast<double>(pa[r * d.cols + c]) * pb[r * d.cols + c];
      po[r] = static_cast<T>(alpha * acc);
    }
  });
}

void CpuBackend::row_inverse_rms(const Tensor& x, double eps, Tensor& out) {
  const ops::RowView d = ops::check_rows(x, "row_inverse_rms");
  ops::check_factor(out, d.rows, x.dtype(), "row_inverse_rms", "out");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* po = out.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < d.cols; ++c) acc += static_cast<double>(px[r * d.cols + c]) * px[r * d.cols + c];
      po[r] = static_cast<T>(1.0 / std::sqrt(acc / static_cast<double>(d.cols) + eps));
    }
  });
}

}  // namespace gpipe
