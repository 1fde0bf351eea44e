// The CPU reference of the broadcasting binary ops, the last-axis reductions and softmax
// (kernels/backend.h; shapes and index plans in kernels/broadcast.h). The CUDA twins are
// in kernels/cuda_elementwise.cu. Sums accumulate in double, in index order.
#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/broadcast.h"
#include "kernels/cpu_backend.h"
#include "kernels/row_checks.h"

namespace gpipe {

using ops::dispatch_float;

namespace {

// Calls f(row, a_offset, b_offset) for each run of the plan's last dimension, in order:
// the offsets of the run's first element in a and b.
template <typename F>
void for_each_run(const ops::Broadcast& p, F&& f) {
  if (p.numel == 0) return;
  const int outer_dims = p.dims - 1;
  int64_t index[ops::kMaxBroadcastDims] = {};
  int64_t a = 0, b = 0;
  const int64_t runs = p.dims == 0 ? 1 : p.numel / p.size[p.dims - 1];
  for (int64_t r = 0; r < runs; ++r) {
    f(r, a, b);
    for (int k = outer_dims - 1; k >= 0; --k) {  // the next run: an odometer over the outer dimensions
      a += p.a_stride[k];
      b += p.b_stride[k];
      if (++index[k] < p.size[k]) break;
      a -= p.a_stride[k] * p.size[k];
      b -= p.b_stride[k] * p.size[k];
      index[k] = 0;
    }
  }
}

// One run of n results: out[i] = f(x[i sa], z[i sb]), the strides 0 or 1, in a loop
// the compiler can vectorise for each of the four stride cases.
template <typename T, typename F>
void binary_run(F f, T* out, const T* x, const T* z, int64_t n, bool sa, bool sb) {
  if (sa && sb) {
    for (int64_t i = 0; i < n; ++i) out[i] = f(x[i], z[i]);
  } else if (sa) {
    const T c = z[0];
    for (int64_t i = 0; i < n; ++i) out[i] = f(x[i], c);
  } else if (sb) {
    const T c = x[0];
    for (int64_t i = 0; i < n; ++i) out[i] = f(c, z[i]);
  } else {
    const T v = f(x[0], z[0]);
    for (int64_t i = 0; i < n; ++i) out[i] = v;
  }
}

template <typename T, typename F>
void binary_runs(F f, const ops::Broadcast& p, const T* pa, const T* pb, T* py) {
  const int64_t n = p.dims == 0 ? 1 : p.size[p.dims - 1];
  const bool sa = p.dims > 0 && p.a_stride[p.dims - 1] != 0;
  const bool sb = p.dims > 0 && p.b_stride[p.dims - 1] != 0;
  for_each_run(p, [&](int64_t r, int64_t a, int64_t b) { binary_run(f, py + r * n, pa + a, pb + b, n, sa, sb); });
}

}  // namespace

void CpuBackend::binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) {
  const std::string name = std::string("binary ") + binary_name(op);
  const ops::Broadcast p = ops::check_binary(a, b, y, name.c_str());
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // y may alias an operand only where that operand has y's shape, so each output
    // element is written after the one read at its own place: safe in index order.
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* py = y.data<T>();
    switch (op) {
      case Binary::kAdd: return binary_runs(std::plus<T>(), p, pa, pb, py);
      case Binary::kSub: return binary_runs(std::minus<T>(), p, pa, pb, py);
      case Binary::kMul: return binary_runs(std::multiplies<T>(), p, pa, pb, py);
      case Binary::kDiv: return binary_runs(std::divides<T>(), p, pa, pb, py);
    }
  });
}

void CpuBackend::sum_to(const Tensor& x, Tensor& y) {
  const ops::Broadcast p = ops::check_sum_to(x, y);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    std::vector<double> acc(static_cast<size_t>(y.numel()), 0.0);
    const T* px = x.data<T>();
    const int64_t n = p.dims == 0 ? 1 : p.size[p.dims - 1];
    const int64_t sy = p.dims == 0 ? 0 : p.b_stride[p.dims - 1];
    for_each_run(p, [&](int64_t, int64_t xo, int64_t yo) {
      for (int64_t i = 0; i < n; ++i) acc[static_cast<size_t>(yo + i * sy)] += static_cast<double>(px[xo + i]);
    });
    T* py = y.data<T>();
    for (int64_t i = 0; i < y.numel(); ++i) py[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
  });
}

void CpuBackend::reduce_rows(Reduce op, const Tensor& x, Tensor& y) {
  const std::string name = std::string("reduce_rows ") + reduce_name(op);
  const ops::RowView d = ops::check_rows(x, name.c_str());
  ops::check_factor(y, d.rows, x.dtype(), name.c_str(), "y");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      const T* row = px + r * d.cols;
      if (op == Reduce::kMax) {
        T m = d.cols > 0 ? row[0] : -std::numeric_limits<T>::infinity();
        for (int64_t c = 1; c < d.cols; ++c) {
          if (row[c] > m || std::isnan(row[c])) m = row[c];
          if (std::isnan(m)) break;
        }
        py[r] = m;
        continue;
      }
      double acc = 0;
      for (int64_t c = 0; c < d.cols; ++c) {
        acc += op == Reduce::kNorm ? static_cast<double>(row[c]) * row[c] : static_cast<double>(row[c]);
      }
      if (op == Reduce::kMean) acc /= static_cast<double>(d.cols);
      if (op == Reduce::kNorm) acc = std::sqrt(acc);
      py[r] = static_cast<T>(acc);
    }
  });
}

void CpuBackend::reduce_rows_backward(Reduce op, const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx) {
  const std::string name = std::string("reduce_rows_backward ") + reduce_name(op);
  const ops::RowView d = ops::check_rows(x, name.c_str());
  ops::check_factor(y, d.rows, x.dtype(), name.c_str(), "y");
  ops::check_factor(dy, d.rows, x.dtype(), name.c_str(), "dy");
  ops::check_same(x, dx, name.c_str());
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    const T* py = y.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      const T* row = px + r * d.cols;
      T* out = pdx + r * d.cols;
      const T g = pdy[r];
      switch (op) {
        case Reduce::kSum:
          for (int64_t c = 0; c < d.cols; ++c) out[c] = g;
          break;
        case Reduce::kMean: {
          const T v = static_cast<T>(static_cast<double>(g) / static_cast<double>(d.cols));
          for (int64_t c = 0; c < d.cols; ++c) out[c] = v;
          break;
        }
        case Reduce::kMax: {
          bool found = false;  // the first entry equal to the maximum (or, for a NaN maximum, the first NaN)
          for (int64_t c = 0; c < d.cols; ++c) {
            const bool at = !found && (row[c] == py[r] || (std::isnan(py[r]) && std::isnan(row[c])));
            out[c] = at ? g : T(0);
            found = found || at;
          }
          break;
        }
        case Reduce::kNorm: {
          const T m = py[r];
          for (int64_t c = 0; c < d.cols; ++c) out[c] = m == T(0) ? T(0) : g * row[c] / m;
          break;
        }
      }
    }
  });
}

void CpuBackend::softmax(const Tensor& x, Tensor& y) {
  const ops::RowView d = ops::check_rows(x, "softmax");
  ops::check_same(x, y, "softmax");
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      const T* row = px + r * d.cols;
      T* out = py + r * d.cols;
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t c = 0; c < d.cols; ++c) m = row[c] > m ? row[c] : m;
      double sum = 0;
      for (int64_t c = 0; c < d.cols; ++c) {
        out[c] = std::exp(row[c] - m);
        sum += static_cast<double>(out[c]);
      }
      const T inv = static_cast<T>(1.0 / sum);
      for (int64_t c = 0; c < d.cols; ++c) out[c] *= inv;
    }
  });
}

void CpuBackend::softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const ops::RowView d = ops::check_rows(y, "softmax_backward");
  ops::check_same(y, dy, "softmax_backward");
  ops::check_same(y, dx, "softmax_backward");
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* py = y.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    for (int64_t r = 0; r < d.rows; ++r) {
      const T* yr = py + r * d.cols;
      const T* g = pdy + r * d.cols;
      T* out = pdx + r * d.cols;
      double dot = 0;
      for (int64_t c = 0; c < d.cols; ++c) dot += static_cast<double>(g[c]) * yr[c];
      const T s = static_cast<T>(dot);
      for (int64_t c = 0; c < d.cols; ++c) out[c] = yr[c] * (g[c] - s);
    }
  });
}

}  // namespace gpipe
