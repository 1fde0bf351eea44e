// Kernels of the generic elementwise and row ops, and of the fused ops (RMSNorm, SwiGLU;
// rope and axpy on 16-bit storage; their section says how), with their launchers (declared in
// kernels/cuda_elementwise.h), the CUDA twins of kernels/cpu_elementwise_ops.cc: the
// same formula and element type per element, row sums in double as the CPU does; only
// the order of the additions in a row sum differs (strided per-thread sums, then a fixed
// tree, so results are deterministic). Layout: helpers, kernels, launchers.
#include "kernels/cuda_elementwise.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/broadcast.h"
#include "kernels/llama_math.h"
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

// block_sum's total (the same additions, in the same order) in every thread of the block.
// Contains __syncthreads(): call it from every thread.
__device__ double block_sum_all(double v, double* shared) {
  v = block_sum(v, shared);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  return shared[0];
}

// Loads into the master type and stores from it, rounding once (runtime/bf16.h, fp16.h).
__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ double load(double x) { return x; }
__device__ __forceinline__ float load(BFloat16 x) { return bf16_to_float(x); }
__device__ __forceinline__ float load(Half x) { return half_to_float(x); }
__device__ __forceinline__ void store(float v, float& out) { out = v; }
__device__ __forceinline__ void store(double v, double& out) { out = v; }
__device__ __forceinline__ void store(float v, BFloat16& out) { out = float_to_bf16(v); }
__device__ __forceinline__ void store(float v, Half& out) { out = float_to_half(v); }

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


// Element i of a broadcast result: the offsets it reads in a and b.
__device__ void broadcast_offsets(const ops::Broadcast& p, int64_t i, int64_t* a, int64_t* b) {
  int64_t oa = 0, ob = 0;
  for (int k = p.dims - 1; k >= 0; --k) {
    const int64_t c = i % p.size[k];
    i /= p.size[k];
    oa += c * p.a_stride[k];
    ob += c * p.b_stride[k];
  }
  *a = oa;
  *b = ob;
}

template <typename T>
__global__ void binary_kernel(Binary op, ops::Broadcast p, const T* a, const T* b, T* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < p.numel; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t oa, ob;
    broadcast_offsets(p, i, &oa, &ob);
    y[i] = binary_value(op, a[oa], b[ob]);
  }
}

// One thread per element j of y: the sum, in double, of the x elements that broadcast
// from it, in x's index order (the CPU's order, so the sums are the same). p as planned
// by check_sum_to: x's sizes, x's strides (a) and y's (b, 0 along summed dimensions).
template <typename T>
__global__ void sum_to_kernel(ops::Broadcast p, const T* x, T* y, int64_t y_numel) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < y_numel; j += int64_t(gridDim.x) * blockDim.x) {
    int64_t base = 0, rest = j, count = 1;
    for (int k = p.dims - 1; k >= 0; --k) {  // j's coordinates along the kept dimensions
      if (p.b_stride[k] == 0) {
        count *= p.size[k];
        continue;
      }
      base += (rest % p.size[k]) * p.a_stride[k];
      rest /= p.size[k];
    }
    double acc = 0.0;
    for (int64_t r = 0; r < count; ++r) {  // r's coordinates along the summed dimensions
      int64_t off = base, q = r;
      for (int k = p.dims - 1; k >= 0; --k) {
        if (p.b_stride[k] != 0) continue;
        off += (q % p.size[k]) * p.a_stride[k];
        q /= p.size[k];
      }
      acc += static_cast<double>(x[off]);
    }
    y[j] = static_cast<T>(acc);
  }
}

// The largest of v over a 1-D block (a NaN wins), valid in thread 0; shared: one T per
// thread.
template <typename T>
__device__ T block_max(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = 1; s < blockDim.x; s <<= 1) {  // pairs at distance s; any block size
    if (threadIdx.x % (2 * s) == 0 && threadIdx.x + s < blockDim.x) {
      const T o = shared[threadIdx.x + s];
      if (o > shared[threadIdx.x] || isnan(o)) shared[threadIdx.x] = o;
    }
    __syncthreads();
  }
  return shared[0];
}

// One block per row: y[r] = op over the row (sums in double).
template <typename T>
__global__ void reduce_rows_kernel(Reduce op, const T* x, T* y, int64_t cols) {
  __shared__ double shared[32];
  __shared__ T shared_max[kMaxRowThreads];
  const T* row = x + blockIdx.x * cols;
  if (op == Reduce::kMax) {
    T m = -INFINITY;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      if (row[c] > m || isnan(row[c])) m = row[c];
    }
    m = block_max(m, shared_max);
    if (threadIdx.x == 0) y[blockIdx.x] = m;
    return;
  }
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    acc += op == Reduce::kNorm ? static_cast<double>(row[c]) * row[c] : static_cast<double>(row[c]);
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) {
    if (op == Reduce::kMean) acc /= static_cast<double>(cols);
    if (op == Reduce::kNorm) acc = sqrt(acc);
    y[blockIdx.x] = static_cast<T>(acc);
  }
}

// One thread per row, as the CPU's loop: max's gradient goes to the first largest entry.
template <typename T>
__global__ void reduce_rows_backward_kernel(Reduce op, const T* x, const T* y, const T* dy, T* dx, int64_t rows,
                                            int64_t cols) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    const T* row = x + r * cols;
    T* out = dx + r * cols;
    const T g = dy[r];
    const T m = y[r];
    bool found = false;
    for (int64_t c = 0; c < cols; ++c) {
      switch (op) {
        case Reduce::kSum: out[c] = g; break;
        case Reduce::kMean: out[c] = static_cast<T>(static_cast<double>(g) / static_cast<double>(cols)); break;
        case Reduce::kMax: {
          const bool at = !found && (row[c] == m || (isnan(m) && isnan(row[c])));
          out[c] = at ? g : T(0);
          found = found || at;
          break;
        }
        case Reduce::kNorm: out[c] = m == T(0) ? T(0) : g * row[c] / m; break;
      }
    }
  }
}

// One block per row: y = exp(x - max) / sum exp(x - max), the sum in double.
template <typename T>
__global__ void softmax_kernel(const T* x, T* y, int64_t cols) {
  __shared__ double shared[32];
  __shared__ T shared_max[kMaxRowThreads];
  __shared__ T inv;
  const T* row = x + blockIdx.x * cols;
  T* out = y + blockIdx.x * cols;
  T m = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = row[c] > m ? row[c] : m;
  m = block_max(m, shared_max);
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const T e = exp(row[c] - m);
    out[c] = e;
    acc += static_cast<double>(e);
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) inv = static_cast<T>(1.0 / acc);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] *= inv;
}

// One block per row: dx = y * (dy - sum_c dy y), the sum in double.
template <typename T>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, int64_t cols) {
  __shared__ double shared[32];
  __shared__ T dot;
  const T* yr = y + blockIdx.x * cols;
  const T* g = dy + blockIdx.x * cols;
  T* out = dx + blockIdx.x * cols;
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc += static_cast<double>(g[c]) * yr[c];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) dot = static_cast<T>(acc);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = yr[c] * (g[c] - dot);
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


template <typename T>
void binary(Binary op, const ops::Broadcast& p, const T* a, const T* b, T* y, cudaStream_t stream) {
  if (p.numel == 0) return;
  binary_kernel<T><<<elementwise_blocks(p.numel), kThreads, 0, stream>>>(op, p, a, b, y);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void sum_to(const ops::Broadcast& p, const T* x, T* y, int64_t y_numel, cudaStream_t stream) {
  if (y_numel == 0) return;
  sum_to_kernel<T><<<elementwise_blocks(y_numel), kThreads, 0, stream>>>(p, x, y, y_numel);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void reduce_rows(Reduce op, const T* x, T* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0) return;
  check_rows(rows, "reduce_rows");
  reduce_rows_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(op, x, y, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void reduce_rows_backward(Reduce op, const T* x, const T* y, const T* dy, T* dx, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  reduce_rows_backward_kernel<T><<<elementwise_blocks(rows), kThreads, 0, stream>>>(op, x, y, dy, dx, rows, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void softmax(const T* x, T* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  check_rows(rows, "softmax");
  softmax_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(x, y, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void softmax_backward(const T* y, const T* dy, T* dx, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  check_rows(rows, "softmax_backward");
  softmax_backward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(y, dy, dx, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

#define GPIPE_TENSOR_OPS(T)                                                                                     \
  template void binary<T>(Binary, const ops::Broadcast&, const T*, const T*, T*, cudaStream_t);                 \
  template void sum_to<T>(const ops::Broadcast&, const T*, T*, int64_t, cudaStream_t);                          \
  template void reduce_rows<T>(Reduce, const T*, T*, int64_t, int64_t, cudaStream_t);                           \
  template void reduce_rows_backward<T>(Reduce, const T*, const T*, const T*, T*, int64_t, int64_t, cudaStream_t); \
  template void softmax<T>(const T*, T*, int64_t, int64_t, cudaStream_t);                                       \
  template void softmax_backward<T>(const T*, const T*, T*, int64_t, int64_t, cudaStream_t);
GPIPE_TENSOR_OPS(float)
GPIPE_TENSOR_OPS(double)
#undef GPIPE_TENSOR_OPS

// ---------------------------------------------------------------------------------
// Fused ops (Backend::rmsnorm, swiglu and their backward ops) and 16-bit rope and axpy:
// one launch each where the CPU reference composes several generic ops
// (kernels/cpu_backend.cc), with the same formulas in the same order; the composition
// stores every intermediate, which these keep in registers, so for float32 and float64
// they differ from it only where nvcc fuses a multiply and an add. For 16-bit storage the
// intermediates are float32 and rounded once, at the store: closer to exact than the
// widening reference, which rounds each intermediate into the 16-bit type.

namespace {


// float32 and float64 (16-bit rows: rmsnorm_chunks_kernel, below, the same formulas eight
// elements a load). One block per row: the sum of squares, then rstd and y = (x rstd) g. The loops are
// unrolled by 4: in the sums, a thread's next loads are in flight while it adds (the H200 ran
// these at half a device copy's rate one load at a time), the additions in their order.
template <typename S>
__global__ void rmsnorm_kernel(const S* x, const S* g, double eps, S* y, Master<S>* rstd, int64_t cols) {
  using M = Master<S>;
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const S* px = x + row * cols;
  S* py = y + row * cols;
  double acc = 0.0;
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const double v = static_cast<double>(load(px[c]));
    acc += v * v;
  }
  acc = block_sum_all(acc, shared);
  const M r = static_cast<M>(1.0 / sqrt(acc / static_cast<double>(cols) + eps));
  if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const M xhat = load(px[c]) * r;
    store(xhat * load(g[c]), py[c]);
  }
}

// float32 and float64 (16-bit: rmsnorm_backward_chunks_kernel, below). One block per row:
// dot = mean_c(gdy xhat), then dx = rstd (gdy - xhat dot), plus the
// residual's gradient where there is one (rmsnorm_backward_add), added before the one rounding.
template <typename S>
__global__ void rmsnorm_backward_kernel(const S* dy, const S* x, const S* g, const Master<S>* rstd,
                                        const S* residual, S* dx, int64_t cols) {
  using M = Master<S>;
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const S* px = x + row * cols;
  const S* pdy = dy + row * cols;
  S* pdx = dx + row * cols;
  const S* pres = residual != nullptr ? residual + row * cols : nullptr;
  const M r = rstd[row];
  double acc = 0.0;
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const M xhat = load(px[c]) * r;
    const M gdy = load(pdy[c]) * load(g[c]);
    acc += static_cast<double>(gdy) * static_cast<double>(xhat);
  }
  acc = block_sum_all(acc, shared);
  const M dot = static_cast<M>((1.0 / static_cast<double>(cols)) * acc);
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const M xhat = load(px[c]) * r;
    const M gdy = load(pdy[c]) * load(g[c]);
    const M v = (gdy - xhat * dot) * r;
    store(pres != nullptr ? v + static_cast<M>(load(pres[c])) : v, pdx[c]);
  }
}

// 16-bit operands eight at a time: one 16-byte load or store for eight elements, where every
// pointer of the call is 16-byte aligned (the allocator's blocks are; a view into one need not
// be: vec8_aligned), and one element at a time otherwise and for the last n % 8. Each
// element's formula is the same either way.
constexpr int kVec = 8;
union Bits8 {
  uint4 raw;
  uint16_t bits[kVec];
};
template <typename S>
__device__ __forceinline__ Bits8 load8(const S* p, int64_t j) {
  Bits8 v;
  v.raw = reinterpret_cast<const uint4*>(p)[j];
  return v;
}
template <typename S>
__device__ __forceinline__ void store8(S* p, int64_t j, const Bits8& v) {
  reinterpret_cast<uint4*>(p)[j] = v.raw;
}
template <typename S>
__device__ __forceinline__ float lane(const Bits8& v, int e) {
  S s;
  s.bits = v.bits[e];
  return load(s);
}
template <typename S>
__device__ __forceinline__ void set_lane(float f, Bits8& v, int e) {
  S s;
  store(f, s);
  v.bits[e] = s.bits;
}
bool vec8_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % sizeof(uint4) != 0) return false;
  }
  return true;
}
// Blocks for n elements, n / 8 of them eight at a time when `vec`.
unsigned vec8_blocks(int64_t n, bool vec) { return elementwise_blocks(vec ? (n + kVec - 1) / kVec : n); }

// SwiGLU's gate of one element, and its two gradients (da, db).
template <typename M>
__device__ __forceinline__ M swiglu_value(M a, M b) {
  const M s = ops::unary_value(Unary::kSilu, a);
  return s * b;
}
template <typename M>
__device__ __forceinline__ void swiglu_grads(M d, M a, M b, M* da, M* db) {
  const M sig = ops::sigmoid_of(a);  // once, for SiLU's value and its slope
  *db = d * ops::silu_from_sigmoid(a, sig);
  *da = (d * b) * ops::silu_slope_from_sigmoid(a, sig);
}

// `vec` (16-bit S only): every pointer 16-byte aligned, eight elements a load.
template <typename S>
__global__ void swiglu_kernel(const S* a, const S* b, S* y, int64_t n, bool vec) {
  using M = Master<S>;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if constexpr (sizeof(S) == 2) {
    if (vec) {
      for (int64_t j = first; j < n / kVec; j += stride) {
        const Bits8 av = load8(a, j), bv = load8(b, j);
        Bits8 yv;
#pragma unroll
        for (int e = 0; e < kVec; ++e) set_lane<S>(swiglu_value(lane<S>(av, e), lane<S>(bv, e)), yv, e);
        store8(y, j, yv);
      }
      done = n / kVec * kVec;
    }
  }
  for (int64_t i = done + first; i < n; i += stride) store(swiglu_value<M>(load(a[i]), load(b[i])), y[i]);
}

template <typename S>
__global__ void swiglu_backward_kernel(const S* dy, const S* a, const S* b, S* da, S* db, int64_t n, bool vec) {
  using M = Master<S>;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if constexpr (sizeof(S) == 2) {
    if (vec) {
      for (int64_t j = first; j < n / kVec; j += stride) {
        const Bits8 dv = load8(dy, j), av = load8(a, j), bv = load8(b, j);
        Bits8 dav, dbv;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          float ga, gb;
          swiglu_grads(lane<S>(dv, e), lane<S>(av, e), lane<S>(bv, e), &ga, &gb);
          set_lane<S>(gb, dbv, e);
          set_lane<S>(ga, dav, e);
        }
        store8(db, j, dbv);
        store8(da, j, dav);
      }
      done = n / kVec * kVec;
    }
  }
  for (int64_t i = done + first; i < n; i += stride) {
    M ga, gb;
    swiglu_grads<M>(load(dy[i]), load(a[i]), load(b[i]), &ga, &gb);
    store(gb, db[i]);
    store(ga, da[i]);
  }
}

// One thread per position's pair, for all heads: n = B T D/2, index p = (b T + t) D/2 + i.
// Its turn (a double pow, cos and sin) is computed once and turns pair i of each head.
template <typename S>
__global__ void rope_narrow_kernel(const S* x, S* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim,
                                   double base, double sign) {
  const int64_t half = head_dim / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half;
    const int64_t row = p / half;  // b T + t
    const ops::RopeTurn turn = ops::rope_turn(row % seq, i, head_dim, base, sign);
    // Each pair as the float32 reference holds it, turned by its formula, then rounded to S.
    ops::rope_heads<float>(x + row * heads * head_dim, y + row * heads * head_dim, heads, head_dim, i, turn,
                           [](S v) { return load(v); }, [](float v, S& out) { store(v, out); });
  }
}

template <typename S>
__global__ void axpy_narrow_kernel(float alpha, const S* x, S* y, int64_t n, bool vec) {
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if (vec) {
    for (int64_t j = first; j < n / kVec; j += stride) {
      const Bits8 xv = load8(x, j);
      Bits8 yv = load8(y, j);
#pragma unroll
      for (int e = 0; e < kVec; ++e) set_lane<S>(lane<S>(yv, e) + alpha * lane<S>(xv, e), yv, e);
      store8(y, j, yv);
    }
    done = n / kVec * kVec;
  }
  for (int64_t i = done + first; i < n; i += stride) store(load(y[i]) + alpha * load(x[i]), y[i]);
}

// RMSNorm on 16-bit rows in chunks of eight elements: thread t of a row's block takes chunks
// t, t + blockDim.x, ..., each as one 16-byte load or store where `vec` (cols a multiple of 8
// and every pointer 16-byte aligned, so every row is), and as eight single ones otherwise (the
// row's last chunk up to cols). The order of every sum is the same either way, so the results
// are the same bits; each element's formula is rmsnorm_kernel's and rmsnorm_backward_kernel's.
// Positions past cols load as 0 and add nothing to the sums.
template <typename S>
__device__ __forceinline__ void load_chunk(const S* p, int64_t c, int64_t cols, bool vec, float (&v)[kVec]) {
  if (vec) {
    const Bits8 b = load8(p, c);
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = lane<S>(b, e);
    return;
  }
  const int64_t first = c * kVec;
#pragma unroll
  for (int e = 0; e < kVec; ++e) v[e] = first + e < cols ? load(p[first + e]) : 0.0f;
}
template <typename S>
__device__ __forceinline__ void store_chunk(S* p, int64_t c, int64_t cols, bool vec, const float (&v)[kVec]) {
  if (vec) {
    Bits8 b;
#pragma unroll
    for (int e = 0; e < kVec; ++e) set_lane<S>(v[e], b, e);
    store8(p, c, b);
    return;
  }
  const int64_t first = c * kVec;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    if (first + e < cols) store(v[e], p[first + e]);
  }
}

template <typename S>
__global__ void rmsnorm_chunks_kernel(const S* x, const S* g, double eps, S* y, float* rstd, int64_t cols, bool vec) {
  __shared__ double shared[32];
  const int64_t row = blockIdx.x, chunks = (cols + kVec - 1) / kVec;
  const S* px = x + row * cols;
  S* py = y + row * cols;
  double acc = 0.0;
  float v[kVec], gv[kVec], out[kVec];
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    load_chunk(px, c, cols, vec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc += static_cast<double>(v[e]) * static_cast<double>(v[e]);
  }
  acc = block_sum_all(acc, shared);
  const float r = static_cast<float>(1.0 / sqrt(acc / static_cast<double>(cols) + eps));
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    load_chunk(px, c, cols, vec, v);
    load_chunk(g, c, cols, vec, gv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float xhat = v[e] * r;
      out[e] = xhat * gv[e];
    }
    store_chunk(py, c, cols, vec, out);
  }
}

template <typename S>
__global__ void rmsnorm_backward_chunks_kernel(const S* dy, const S* x, const S* g, const float* rstd,
                                               const S* residual, S* dx, int64_t cols, bool vec) {
  __shared__ double shared[32];
  const int64_t row = blockIdx.x, chunks = (cols + kVec - 1) / kVec;
  const S* px = x + row * cols;
  const S* pdy = dy + row * cols;
  const S* pres = residual != nullptr ? residual + row * cols : nullptr;
  S* pdx = dx + row * cols;
  const float r = rstd[row];
  double acc = 0.0;
  float xv[kVec], dyv[kVec], gv[kVec], rv[kVec], out[kVec];
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    load_chunk(px, c, cols, vec, xv);
    load_chunk(pdy, c, cols, vec, dyv);
    load_chunk(g, c, cols, vec, gv);
    const int valid = vec ? kVec : static_cast<int>(cols - c * kVec < kVec ? cols - c * kVec : kVec);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (e >= valid) continue;  // past cols: nothing (0 * an infinite rstd would be NaN)
      const float xhat = xv[e] * r;
      const float gdy = dyv[e] * gv[e];
      acc += static_cast<double>(gdy) * static_cast<double>(xhat);
    }
  }
  acc = block_sum_all(acc, shared);
  const float dot = static_cast<float>((1.0 / static_cast<double>(cols)) * acc);
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    load_chunk(px, c, cols, vec, xv);
    load_chunk(pdy, c, cols, vec, dyv);
    load_chunk(g, c, cols, vec, gv);
    if (pres != nullptr) load_chunk(pres, c, cols, vec, rv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float xhat = xv[e] * r;
      const float gdy = dyv[e] * gv[e];
      const float d = (gdy - xhat * dot) * r;
      out[e] = pres != nullptr ? d + rv[e] : d;
    }
    store_chunk(pdx, c, cols, vec, out);
  }
}

}  // namespace


template <typename S>
void rmsnorm(const S* x, const S* g, double eps, S* y, Master<S>* rstd, int64_t rows, int64_t cols,
             cudaStream_t stream) {
  if (rows == 0) return;
  check_rows(rows, "rmsnorm");
  if constexpr (sizeof(S) == 2) {  // eight elements a thread's step (cols 0: rstd as rmsnorm_kernel's, NaN)
    const bool vec = cols % kVec == 0 && vec8_aligned({x, g, y});
    rmsnorm_chunks_kernel<S><<<static_cast<unsigned>(rows), row_threads((cols + kVec - 1) / kVec), 0, stream>>>(
        x, g, eps, y, rstd, cols, vec);
  } else {
    rmsnorm_kernel<S><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(x, g, eps, y, rstd, cols);
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void rmsnorm_backward(const S* dy, const S* x, const S* g, const Master<S>* rstd, const S* residual, S* dx,
                      int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  check_rows(rows, residual != nullptr ? "rmsnorm_backward_add" : "rmsnorm_backward");
  if constexpr (sizeof(S) == 2) {
    const bool vec = cols % kVec == 0 && vec8_aligned({dy, x, g, dx}) && (residual == nullptr || vec8_aligned({residual}));
    rmsnorm_backward_chunks_kernel<S><<<static_cast<unsigned>(rows), row_threads((cols + kVec - 1) / kVec), 0,
                                        stream>>>(dy, x, g, rstd, residual, dx, cols, vec);
  } else {
    rmsnorm_backward_kernel<S><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(dy, x, g, rstd,
                                                                                               residual, dx, cols);
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}


template <typename S>
void swiglu(const S* a, const S* b, S* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = sizeof(S) == 2 && vec8_aligned({a, b, y});
  swiglu_kernel<S><<<vec8_blocks(n, vec), kThreads, 0, stream>>>(a, b, y, n, vec);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void swiglu_backward(const S* dy, const S* a, const S* b, S* da, S* db, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = sizeof(S) == 2 && vec8_aligned({dy, a, b, da, db});
  swiglu_backward_kernel<S><<<vec8_blocks(n, vec), kThreads, 0, stream>>>(dy, a, b, da, db, n, vec);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void axpy_narrow(double alpha, const S* x, S* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = vec8_aligned({x, y});
  axpy_narrow_kernel<S><<<vec8_blocks(n, vec), kThreads, 0, stream>>>(static_cast<float>(alpha), x, y, n, vec);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

#define GPIPE_FUSED_INSTANTIATE(S)                                                                              \
  template void rmsnorm<S>(const S*, const S*, double, S*, Master<S>*, int64_t, int64_t, cudaStream_t);         \
  template void rmsnorm_backward<S>(const S*, const S*, const S*, const Master<S>*, const S*, S*, int64_t,     \
                                    int64_t, cudaStream_t);                                                     \
  template void swiglu<S>(const S*, const S*, S*, int64_t, cudaStream_t);                                       \
  template void swiglu_backward<S>(const S*, const S*, const S*, S*, S*, int64_t, cudaStream_t);
GPIPE_FUSED_INSTANTIATE(float)
GPIPE_FUSED_INSTANTIATE(double)
GPIPE_FUSED_INSTANTIATE(BFloat16)
GPIPE_FUSED_INSTANTIATE(Half)
#undef GPIPE_FUSED_INSTANTIATE
template <typename S>
void rope_narrow(const S* x, S* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
                 double sign, cudaStream_t stream) {
  const int64_t n = batch * seq * (head_dim / 2);
  if (n == 0 || heads == 0) return;
  rope_narrow_kernel<S><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, y, n, seq, heads, head_dim, base, sign);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}
template void rope_narrow<BFloat16>(const BFloat16*, BFloat16*, int64_t, int64_t, int64_t, int64_t, double, double,
                                    cudaStream_t);
template void rope_narrow<Half>(const Half*, Half*, int64_t, int64_t, int64_t, int64_t, double, double, cudaStream_t);
template void axpy_narrow<BFloat16>(double, const BFloat16*, BFloat16*, int64_t, cudaStream_t);
template void axpy_narrow<Half>(double, const Half*, Half*, int64_t, cudaStream_t);

}  // namespace cuda
}  // namespace gpipe
