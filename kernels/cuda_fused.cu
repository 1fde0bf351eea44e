// The CUDA backend's fused kernels (declared in kernels/cuda_fused.h). Each does in one
// launch what the CPU reference composes of generic ops (Backend::rmsnorm and the others
// in kernels/cpu_backend.cc), with the same formulas in the same order of operations;
// the composition stores every intermediate, which a fused kernel keeps in registers,
// so for float32 and float64 the results differ from the composition's only where nvcc
// fuses a multiply and an add, and in the order of a row sum's additions (a block's
// fixed tree, as cuda_elementwise.cu's row_dot). For 16-bit storage the intermediates
// are float32 and rounded once, at the store: closer to exact than the widening
// reference, which rounds each intermediate into the 16-bit type.
//
// Deterministic: fixed grids, fixed trees, no atomics.
#include "kernels/cuda_fused.h"

#include <algorithm>
#include <climits>
#include <string>

#include "kernels/llama_math.h"
#include "kernels/unary_math.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {
namespace cuda {

namespace {

constexpr int kThreads = 256;          // elementwise kernels: threads per block
constexpr int64_t kMaxBlocks = 65536;  // elementwise grid cap; grid-stride loops cover the rest
constexpr int kMaxRowThreads = 256;    // row kernels: at most this many threads per row

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

// Loads into the master type and stores from it, rounding once (runtime/bf16.h, fp16.h).
__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ double load(double x) { return x; }
__device__ __forceinline__ float load(BFloat16 x) { return bf16_to_float(x); }
__device__ __forceinline__ float load(Half x) { return half_to_float(x); }
__device__ __forceinline__ void store(float v, float& out) { out = v; }
__device__ __forceinline__ void store(double v, double& out) { out = v; }
__device__ __forceinline__ void store(float v, BFloat16& out) { out = float_to_bf16(v); }
__device__ __forceinline__ void store(float v, Half& out) { out = float_to_half(v); }

// The sum of v over a 1-D block whose size is a multiple of 32, in a fixed order; every
// thread receives it. shared: 32 doubles. Contains __syncthreads(): call from every thread.
__device__ double block_sum_all(double v, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shared[lane] : 0.0;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  v = shared[0];
  __syncthreads();  // the caller may reuse `shared` right away
  return v;
}

// ---------------------------------------------------------------------------------
// Kernels

// One block per row: the sum of squares, then rstd and y = (x rstd) g.
template <typename S>
__global__ void rmsnorm_kernel(const S* x, const S* g, double eps, S* y, Master<S>* rstd, int64_t cols) {
  using M = Master<S>;
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const S* px = x + row * cols;
  S* py = y + row * cols;
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const double v = static_cast<double>(load(px[c]));
    acc += v * v;
  }
  acc = block_sum_all(acc, shared);
  const M r = static_cast<M>(1.0 / sqrt(acc / static_cast<double>(cols) + eps));
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const M xhat = load(px[c]) * r;
    store(xhat * load(g[c]), py[c]);
  }
}

// One block per row: dot = mean_c(gdy xhat), then dx = rstd (gdy - xhat dot).
template <typename S>
__global__ void rmsnorm_backward_kernel(const S* dy, const S* x, const S* g, const Master<S>* rstd, S* dx,
                                        int64_t cols) {
  using M = Master<S>;
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const S* px = x + row * cols;
  const S* pdy = dy + row * cols;
  S* pdx = dx + row * cols;
  const M r = rstd[row];
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const M xhat = load(px[c]) * r;
    const M gdy = load(pdy[c]) * load(g[c]);
    acc += static_cast<double>(gdy) * static_cast<double>(xhat);
  }
  acc = block_sum_all(acc, shared);
  const M dot = static_cast<M>((1.0 / static_cast<double>(cols)) * acc);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const M xhat = load(px[c]) * r;
    const M gdy = load(pdy[c]) * load(g[c]);
    store((gdy - xhat * dot) * r, pdx[c]);
  }
}

template <typename S>
__global__ void rmsnorm_weight_terms_kernel(const S* dy, const S* x, const Master<S>* rstd, Master<S>* terms,
                                            int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    terms[i] = load(dy[i]) * (load(x[i]) * rstd[i / cols]);
  }
}

template <typename S>
__global__ void swiglu_kernel(const S* a, const S* b, S* y, int64_t n) {
  using M = Master<S>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const M s = ops::unary_value(Unary::kSilu, load(a[i]));
    store(s * load(b[i]), y[i]);
  }
}

template <typename S>
__global__ void swiglu_backward_kernel(const S* dy, const S* a, const S* b, S* da, S* db, int64_t n) {
  using M = Master<S>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const M av = load(a[i]), d = load(dy[i]);
    store(d * ops::unary_value(Unary::kSilu, av), db[i]);
    store((d * load(b[i])) * ops::unary_slope(Unary::kSilu, av), da[i]);
  }
}

// One thread per pair: n = B T H D/2 pairs, pair p = ((b T + t) H + h) D/2 + i.
template <typename S>
__global__ void rope_narrow_kernel(const S* x, S* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim,
                                   double base, double sign) {
  const int64_t half = head_dim / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half;
    const int64_t head = p / half;  // (b T + t) H + h
    const int64_t t = (head / heads) % seq;
    const S* px = x + head * head_dim;
    S* py = y + head * head_dim;
    // The pair as the float32 reference holds it, turned by its formula (rope_pair on a
    // two-element row: element 0 pairs with element 1), then rounded to S.
    const float in[2] = {load(px[i]), load(px[i + half])};
    float out[2];
    ops::rope_pair(in, out, 0, 1, ops::rope_angle(t, i, head_dim, base), sign);
    store(out[0], py[i]);
    store(out[1], py[i + half]);
  }
}

template <typename S>
__global__ void axpy_narrow_kernel(float alpha, const S* x, S* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    store(load(y[i]) + alpha * load(x[i]), y[i]);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------
// Launchers

template <typename S>
void rmsnorm(const S* x, const S* g, double eps, S* y, Master<S>* rstd, int64_t rows, int64_t cols,
             cudaStream_t stream) {
  if (rows == 0) return;
  check_rows(rows, "rmsnorm");
  rmsnorm_kernel<S><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(x, g, eps, y, rstd, cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void rmsnorm_backward(const S* dy, const S* x, const S* g, const Master<S>* rstd, S* dx, int64_t rows,
                      int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  check_rows(rows, "rmsnorm_backward");
  rmsnorm_backward_kernel<S><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(dy, x, g, rstd, dx,
                                                                                             cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void rmsnorm_weight_terms(const S* dy, const S* x, const Master<S>* rstd, Master<S>* terms, int64_t rows,
                          int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  rmsnorm_weight_terms_kernel<S><<<elementwise_blocks(rows * cols), kThreads, 0, stream>>>(dy, x, rstd, terms, rows,
                                                                                           cols);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void swiglu(const S* a, const S* b, S* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_kernel<S><<<elementwise_blocks(n), kThreads, 0, stream>>>(a, b, y, n);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void swiglu_backward(const S* dy, const S* a, const S* b, S* da, S* db, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_backward_kernel<S><<<elementwise_blocks(n), kThreads, 0, stream>>>(dy, a, b, da, db, n);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename S>
void axpy_narrow(double alpha, const S* x, S* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  axpy_narrow_kernel<S><<<elementwise_blocks(n), kThreads, 0, stream>>>(static_cast<float>(alpha), x, y, n);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

#define GPIPE_FUSED_INSTANTIATE(S)                                                                              \
  template void rmsnorm<S>(const S*, const S*, double, S*, Master<S>*, int64_t, int64_t, cudaStream_t);         \
  template void rmsnorm_backward<S>(const S*, const S*, const S*, const Master<S>*, S*, int64_t, int64_t,       \
                                    cudaStream_t);                                                              \
  template void rmsnorm_weight_terms<S>(const S*, const S*, const Master<S>*, Master<S>*, int64_t, int64_t,     \
                                        cudaStream_t);                                                          \
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
  const int64_t n = batch * seq * heads * (head_dim / 2);
  if (n == 0) return;
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
