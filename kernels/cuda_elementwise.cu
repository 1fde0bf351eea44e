// Kernels of the generic elementwise and row ops and their launchers (declared in
// kernels/cuda_elementwise.h), the CUDA twins of kernels/cpu_elementwise_ops.cc: the
// same formula and element type per element, row sums in double as the CPU does; only
// the order of the additions in a row sum differs (strided per-thread sums, then a fixed
// tree, so results are deterministic). Layout: helpers, kernels, launchers.
#include "kernels/cuda_elementwise.h"

#include <algorithm>
#include <climits>
#include <string>

#include "kernels/unary_math.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {
namespace cuda {

namespace {

constexpr int kThreads = 256;          // elementwise kernels: threads per block
constexpr int64_t kMaxBlocks = 65536;  // elementwise grid cap; grid-stride loops cover the rest
constexpr int kMaxRowThreads = 256;    // row reductions: at most this many threads per row

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// One block per row: a multiple of 32 threads, no more than the row needs.
unsigned row_threads(int64_t cols) {
  const int64_t rounded = (std::max<int64_t>(cols, 1) + 31) / 32 * 32;
  return static_cast<unsigned>(std::min<int64_t>(rounded, kMaxRowThreads));
}

void check_rows(int64_t rows, const char* op) {
  if (rows >= static_cast<int64_t>(INT_MAX)) {
    throw Error(std::string(op) + ": " + std::to_string(rows) + " rows exceed the CUDA grid limit (2^31 - 2)");
  }
}

// The sum of v over a 1-D block whose size is a multiple of 32, in a fixed order; the
// result is valid in thread 0. shared: 32 doubles.
__device__ double block_sum(double v, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shared[lane] : 0.0;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// ---------------------------------------------------------------------------------
// Kernels

template <typename T>
__global__ void unary_kernel(Unary f, const T* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = ops::unary_value(f, x[i]);
  }
}

template <typename T>
__global__ void unary_backward_kernel(Unary f, const T* x, const T* dy, T* dx, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    dx[i] = dy[i] * ops::unary_slope(f, x[i]);
  }
}

template <typename T>
__global__ void mul_kernel(const T* a, const T* b, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = a[i] * b[i];
  }
}

// kPerRow: s indexed by row (scale_rows), else by column (scale_columns).
template <typename T, bool kPerRow>
__global__ void scale_kernel(const T* x, const T* s, T* y, int64_t n, int64_t cols) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = x[i] * s[kPerRow ? i / cols : i % cols];
  }
}

// One block per row r: acc = sum_c a[r, c] b[r, c] in double; then out[r] = alpha * acc
// (row_dot) or 1 / sqrt(acc / cols + eps) (row_inverse_rms, with a == b == x).
template <typename T, bool kInverseRms>
__global__ void row_reduce_kernel(const T* a, const T* b, double alpha_or_eps, T* out, int64_t cols) {
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const T* pa = a + row * cols;
  const T* pb = b + row * cols;
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc += static_cast<double>(pa[c]) * pb[c];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) {
    out[row] = static_cast<T>(kInverseRms ? 1.0 / sqrt(acc / static_cast<double>(cols) + alpha_or_eps)
                                          : alpha_or_eps * acc);
  }
}

// ---------------------------------------------------------------------------------
// Launchers

template <typename T>
void unary_impl(Unary f, const T* x, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  unary_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(f, x, y, n);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void unary_backward_impl(Unary f, const T* x, const T* dy, T* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  unary_backward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(f, x, dy, dx, n);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void mul_impl(const T* a, const T* b, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  mul_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(a, b, y, n);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T, bool kPerRow>
void scale_impl(const T* x, const T* s, T* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  scale_kernel<T, kPerRow><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, s, y, n, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T, bool kInverseRms>
void row_reduce_impl(const T* a, const T* b, double alpha_or_eps, T* out, int64_t rows, int64_t cols,
                     cudaStream_t stream, const char* op) {
  if (rows == 0) return;
  check_rows(rows, op);
  row_reduce_kernel<T, kInverseRms>
      <<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(a, b, alpha_or_eps, out, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void unary(Unary f, const float* x, float* y, int64_t n, cudaStream_t stream) { unary_impl(f, x, y, n, stream); }
void unary(Unary f, const double* x, double* y, int64_t n, cudaStream_t stream) { unary_impl(f, x, y, n, stream); }
void unary_backward(Unary f, const float* x, const float* dy, float* dx, int64_t n, cudaStream_t stream) {
  unary_backward_impl(f, x, dy, dx, n, stream);
}
void unary_backward(Unary f, const double* x, const double* dy, double* dx, int64_t n, cudaStream_t stream) {
  unary_backward_impl(f, x, dy, dx, n, stream);
}

void mul(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream) { mul_impl(a, b, y, n, stream); }
void mul(const double* a, const double* b, double* y, int64_t n, cudaStream_t stream) {
  mul_impl(a, b, y, n, stream);
}

void scale_rows(const float* x, const float* s, float* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  scale_impl<float, true>(x, s, y, rows, cols, stream);
}
void scale_rows(const double* x, const double* s, double* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  scale_impl<double, true>(x, s, y, rows, cols, stream);
}

void scale_columns(const float* x, const float* s, float* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  scale_impl<float, false>(x, s, y, rows, cols, stream);
}
void scale_columns(const double* x, const double* s, double* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  scale_impl<double, false>(x, s, y, rows, cols, stream);
}

void row_dot(const float* a, const float* b, double alpha, float* out, int64_t rows, int64_t cols,
             cudaStream_t stream) {
  row_reduce_impl<float, false>(a, b, alpha, out, rows, cols, stream, "row_dot");
}
void row_dot(const double* a, const double* b, double alpha, double* out, int64_t rows, int64_t cols,
             cudaStream_t stream) {
  row_reduce_impl<double, false>(a, b, alpha, out, rows, cols, stream, "row_dot");
}

void row_inverse_rms(const float* x, double eps, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  row_reduce_impl<float, true>(x, x, eps, out, rows, cols, stream, "row_inverse_rms");
}
void row_inverse_rms(const double* x, double eps, double* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  row_reduce_impl<double, true>(x, x, eps, out, rows, cols, stream, "row_inverse_rms");
}

}  // namespace cuda
}  // namespace gpipe
