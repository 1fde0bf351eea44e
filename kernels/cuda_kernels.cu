// Kernels of the CUDA backend and their launchers (declared in kernels/cuda_kernels.h).
// Layout: device helpers, then the kernels, then the launchers, which do the grid math,
// launch on the caller's stream and check the launch. Every kernel matches the CPU
// reference in kernels/cpu_backend.cc operation for operation (same formula, same
// element type for the arithmetic); only the order of additions in reductions differs.
//
// Nothing here synchronises with the host. Everything is deterministic: reductions use
// fixed trees (no floating-point atomics); the only atomic is an integer atomicMin that
// records the first bad label row.
#include "kernels/cuda_kernels.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {
namespace cuda {

namespace {

// ---------------------------------------------------------------------------------
// Launch geometry

constexpr int kThreads = 256;              // elementwise kernels: threads per block
constexpr int64_t kMaxBlocks = 65536;      // elementwise grid cap; grid-stride loops cover the rest
constexpr int kTileCols = 32;              // add_bias / bias_grad: columns per block (one warp wide)
constexpr int kAddBiasTileRows = 8;        // add_bias: rows per block per iteration
constexpr int kBiasGradRowLanes = 16;      // bias_grad: threads walking the rows of each column
constexpr int64_t kMaxGridY = 65535;       // hardware limit of gridDim.y
constexpr int kMaxRowThreads = 512;        // softmax kernels: at most this many threads per row
constexpr int kLossSumThreads = 256;       // the one-block loss reduction

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// Threads for one block per row: a multiple of 32 (block_allreduce needs full warps),
// no more than the row needs, at most kMaxRowThreads.
unsigned row_threads(int64_t cols) {
  const int64_t rounded = (std::max<int64_t>(cols, 1) + 31) / 32 * 32;
  return static_cast<unsigned>(std::min<int64_t>(rounded, kMaxRowThreads));
}

void check_row_grid(int64_t rows, const char* op) {
  if (rows >= static_cast<int64_t>(INT_MAX)) {
    throw Error(std::string(op) + ": " + std::to_string(rows) + " rows exceed the CUDA grid limit (2^31 - 2)");
  }
}

// ---------------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }
__device__ __forceinline__ float dev_erf(float x) { return erff(x); }
__device__ __forceinline__ double dev_erf(double x) { return erf(x); }
__device__ __forceinline__ float dev_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double dev_max(double a, double b) { return fmax(a, b); }
template <typename T>
__device__ __forceinline__ T neg_infinity();
template <>
__device__ __forceinline__ float neg_infinity<float>() { return -INFINITY; }
template <>
__device__ __forceinline__ double neg_infinity<double>() { return -static_cast<double>(INFINITY); }

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return dev_max(a, b); }
};

// Reduces v over a 1-D block whose size is a multiple of 32 (at most 1024); every thread
// receives the result. The xor butterfly leaves the same bits in every lane (a + b and
// b + a round alike), so all threads continue with one value. shared: 32 elements.
// Contains __syncthreads(): call it from every thread of the block.
template <typename T, typename Op>
__device__ T block_allreduce(T v, Op op, T identity, T* shared) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : identity;
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // the caller may reuse `shared` right away
  return v;
}

template <typename T>
__device__ __forceinline__ T gelu_value(T x) {
  return T(0.5) * x * (T(1) + dev_erf(x * T(0.70710678118654752440)));  // 1/sqrt(2)
}
template <typename T>
__device__ __forceinline__ T gelu_slope(T x) {
  const T cdf = T(0.5) * (T(1) + dev_erf(x * T(0.70710678118654752440)));
  const T pdf = dev_exp(T(-0.5) * x * x) * T(0.3989422804014327);  // 1/sqrt(2 pi)
  return cdf + x * pdf;
}

#define GRID_STRIDE_LOOP(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------------------------
// Kernels

// y: (rows, cols) += bias: (cols). Block (kTileCols, kAddBiasTileRows): threadIdx.x is
// the column within the block's tile (a warp touches 32 consecutive elements of a row),
// threadIdx.y walks rows with a stride of gridDim.y * kAddBiasTileRows.
template <typename T>
__global__ void add_bias_kernel(T* y, const T* bias, int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  if (col >= cols) return;
  const T b = bias[col];
  const int64_t stride = static_cast<int64_t>(gridDim.y) * kAddBiasTileRows;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * kAddBiasTileRows + threadIdx.y; r < rows; r += stride) {
    y[r * cols + col] += b;
  }
}

// db: (cols) = (accumulate ? beta * db : 0) + column sums of dy: (rows, cols).
// One block per tile of kTileCols columns, block (kTileCols, kBiasGradRowLanes): thread
// (x, y) sums rows y, y + 16, ... of column x (coalesced across the warp), then a
// shared-memory tree over y adds the 16 partial sums of each column.
template <typename T>
__global__ void bias_grad_kernel(const T* dy, T* db, int64_t rows, int64_t cols, T beta, bool accumulate) {
  __shared__ T partial[kBiasGradRowLanes][kTileCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + tx;
  T acc = T(0);
  if (col < cols) {
    for (int64_t r = ty; r < rows; r += kBiasGradRowLanes) acc += dy[r * cols + col];
  }
  partial[ty][tx] = acc;
  __syncthreads();
  for (int s = kBiasGradRowLanes / 2; s > 0; s >>= 1) {
    if (ty < s) partial[ty][tx] += partial[ty + s][tx];
    __syncthreads();
  }
  if (ty == 0 && col < cols) db[col] = (accumulate ? beta * db[col] : T(0)) + partial[0][tx];
}

template <typename T>
__global__ void relu_kernel(const T* x, T* y, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { y[i] = x[i] > T(0) ? x[i] : T(0); }
}

template <typename T>
__global__ void relu_backward_kernel(const T* y, const T* dy, T* dx, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { dx[i] = y[i] > T(0) ? dy[i] : T(0); }
}

template <typename T>
__global__ void gelu_kernel(const T* x, T* y, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { y[i] = gelu_value(x[i]); }
}

template <typename T>
__global__ void gelu_backward_kernel(const T* x, const T* dy, T* dx, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { dx[i] = dy[i] * gelu_slope(x[i]); }
}

// One block per row r of logits: (rows, cols), blockDim.x a multiple of 32.
//   probs[r, :] = exp(x - max) / sum exp(x - max)
//   row_loss[r] = log(sum) + max - x[label]   (0 when label == ignore_index or invalid)
// An invalid label lowers *bad_row to r.
template <typename T>
__global__ void softmax_xent_forward_kernel(const T* logits, const int32_t* labels, int64_t cols,
                                            int ignore_index, T* probs, T* row_loss, unsigned* bad_row) {
  __shared__ T shared[32];
  const int64_t row = blockIdx.x;
  const T* in = logits + row * cols;
  T* out = probs + row * cols;

  T mx = neg_infinity<T>();
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) mx = dev_max(mx, in[j]);
  mx = block_allreduce(mx, MaxOp(), neg_infinity<T>(), shared);

  T sum = T(0);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const T e = dev_exp(in[j] - mx);
    out[j] = e;
    sum += e;
  }
  sum = block_allreduce(sum, SumOp(), T(0), shared);

  const T inv = T(1) / sum;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[j] *= inv;  // each thread rescales its own

  if (threadIdx.x == 0) {
    const int32_t label = labels[row];
    T loss = T(0);
    if (label != ignore_index) {
      if (label < 0 || label >= cols) {
        atomicMin(bad_row, static_cast<unsigned>(row));
      } else {
        loss = dev_log(sum) + mx - in[label];
      }
    }
    row_loss[row] = loss;
  }
}

// One block: *loss = scale * sum of row_loss: (rows), accumulated in double (as the CPU
// reference does) in a fixed order: strided per-thread sums, then block_allreduce.
template <typename T>
__global__ void loss_sum_kernel(const T* row_loss, int64_t rows, double scale, T* loss) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) acc += static_cast<double>(row_loss[i]);
  acc = block_allreduce(acc, SumOp(), 0.0, shared);
  if (threadIdx.x == 0) *loss = static_cast<T>(acc * scale);
}

// One block per row r: dlogits[r, :] = s * probs[r, :] - s * onehot(label), or 0 when
// label == ignore_index. An invalid label lowers *bad_row to r.
template <typename T>
__global__ void softmax_xent_backward_kernel(const T* probs, const int32_t* labels, int64_t cols, T s,
                                             int ignore_index, T* dlogits, unsigned* bad_row) {
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  const T* in = probs + row * cols;
  T* out = dlogits + row * cols;
  if (label == ignore_index) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[j] = T(0);
    return;
  }
  if (threadIdx.x == 0 && (label < 0 || label >= cols)) atomicMin(bad_row, static_cast<unsigned>(row));
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    T v = s * in[j];
    if (j == label) v -= s;
    out[j] = v;
  }
}

template <typename T>
__global__ void fill_kernel(T* x, int64_t n, T value) {
  GRID_STRIDE_LOOP(i, n) { x[i] = value; }
}

template <typename T>
__global__ void scale_kernel(T* x, int64_t n, T alpha) {
  GRID_STRIDE_LOOP(i, n) { x[i] *= alpha; }
}

template <typename T>
__global__ void axpy_kernel(T alpha, const T* x, T* y, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { y[i] += alpha * x[i]; }
}

// buf == nullptr: no momentum.
template <typename T>
__global__ void sgd_step_kernel(T* w, const T* g, T* buf, int64_t n, T lr, T mom, T wd, bool nesterov,
                                bool first_step) {
  GRID_STRIDE_LOOP(i, n) {
    T d = g[i] + wd * w[i];
    if (buf != nullptr) {
      const T b = first_step ? d : mom * buf[i] + d;
      buf[i] = b;
      d = nesterov ? d + mom * b : b;
    }
    w[i] -= lr * d;
  }
}

#undef GRID_STRIDE_LOOP

// ---------------------------------------------------------------------------------
// Launchers (templates; the exported overloads below instantiate them)

#define GPIPE_CHECK_LAUNCH() GPIPE_CUDA_CHECK(cudaGetLastError())

template <typename T>
void launch_add_bias(T* y, const T* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 block(kTileCols, kAddBiasTileRows);
  const dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>(std::min<int64_t>((rows + kAddBiasTileRows - 1) / kAddBiasTileRows, kMaxGridY)));
  add_bias_kernel<T><<<grid, block, 0, stream>>>(y, bias, rows, cols);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_bias_grad(const T* dy, T* db, int64_t rows, int64_t cols, double beta, cudaStream_t stream) {
  if (cols == 0) return;  // rows == 0 still writes beta * db
  const dim3 block(kTileCols, kBiasGradRowLanes);
  const dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols));
  bias_grad_kernel<T><<<grid, block, 0, stream>>>(dy, db, rows, cols, static_cast<T>(beta), beta != 0.0);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_relu(const T* x, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  relu_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, y, n);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_relu_backward(const T* y, const T* dy, T* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  relu_backward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(y, dy, dx, n);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_gelu(const T* x, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, y, n);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_gelu_backward(const T* x, const T* dy, T* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_backward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, dy, dx, n);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_softmax_xent(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                         int ignore_index, T* probs, T* row_loss, T* loss, unsigned* bad_row,
                         cudaStream_t stream) {
  check_row_grid(rows, "softmax_xent");
  GPIPE_CUDA_CHECK(cudaMemsetAsync(bad_row, 0xFF, sizeof(unsigned), stream));  // kNoBadRow
  if (rows > 0) {
    softmax_xent_forward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
        logits, labels, cols, ignore_index, probs, row_loss, bad_row);
    GPIPE_CHECK_LAUNCH();
  }
  loss_sum_kernel<T><<<1, kLossSumThreads, 0, stream>>>(row_loss, rows, scale, loss);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_softmax_xent_backward(const T* probs, const int32_t* labels, int64_t rows, int64_t cols,
                                  double scale, int ignore_index, T* dlogits, unsigned* bad_row,
                                  cudaStream_t stream) {
  check_row_grid(rows, "softmax_xent_backward");
  GPIPE_CUDA_CHECK(cudaMemsetAsync(bad_row, 0xFF, sizeof(unsigned), stream));  // kNoBadRow
  if (rows == 0) return;
  softmax_xent_backward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      probs, labels, cols, static_cast<T>(scale), ignore_index, dlogits, bad_row);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_fill(T* x, int64_t n, T value, cudaStream_t stream) {
  if (n == 0) return;
  // All-zero bits (+0.0, integer 0): a memset is cheaper than a kernel. -0.0 takes the kernel.
  if (value == T(0) && !std::signbit(static_cast<double>(value))) {
    GPIPE_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n) * sizeof(T), stream));
    return;
  }
  fill_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, n, value);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_scale(T* x, int64_t n, double alpha, cudaStream_t stream) {
  if (n == 0) return;
  if (alpha == 0.0) {  // "clear": 0 * NaN would stay NaN
    launch_fill<T>(x, n, T(0), stream);
    return;
  }
  scale_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, n, static_cast<T>(alpha));
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_axpy(double alpha, const T* x, T* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  axpy_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(static_cast<T>(alpha), x, y, n);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_sgd_step(T* param, const T* grad, T* buf, int64_t n, double lr, double momentum, double weight_decay,
                     bool nesterov, bool first_step, cudaStream_t stream) {
  if (n == 0) return;
  sgd_step_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(
      param, grad, buf, n, static_cast<T>(lr), static_cast<T>(momentum), static_cast<T>(weight_decay), nesterov,
      first_step);
  GPIPE_CHECK_LAUNCH();
}

#undef GPIPE_CHECK_LAUNCH

}  // namespace

// ---------------------------------------------------------------------------------
// Exported overloads

void add_bias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_add_bias(y, bias, rows, cols, stream);
}
void add_bias(double* y, const double* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_add_bias(y, bias, rows, cols, stream);
}

void bias_grad(const float* dy, float* db, int64_t rows, int64_t cols, double beta, cudaStream_t stream) {
  launch_bias_grad(dy, db, rows, cols, beta, stream);
}
void bias_grad(const double* dy, double* db, int64_t rows, int64_t cols, double beta, cudaStream_t stream) {
  launch_bias_grad(dy, db, rows, cols, beta, stream);
}

void relu(const float* x, float* y, int64_t n, cudaStream_t stream) { launch_relu(x, y, n, stream); }
void relu(const double* x, double* y, int64_t n, cudaStream_t stream) { launch_relu(x, y, n, stream); }

void relu_backward(const float* y, const float* dy, float* dx, int64_t n, cudaStream_t stream) {
  launch_relu_backward(y, dy, dx, n, stream);
}
void relu_backward(const double* y, const double* dy, double* dx, int64_t n, cudaStream_t stream) {
  launch_relu_backward(y, dy, dx, n, stream);
}

void gelu(const float* x, float* y, int64_t n, cudaStream_t stream) { launch_gelu(x, y, n, stream); }
void gelu(const double* x, double* y, int64_t n, cudaStream_t stream) { launch_gelu(x, y, n, stream); }

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, cudaStream_t stream) {
  launch_gelu_backward(x, dy, dx, n, stream);
}
void gelu_backward(const double* x, const double* dy, double* dx, int64_t n, cudaStream_t stream) {
  launch_gelu_backward(x, dy, dx, n, stream);
}

void softmax_xent(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                  int ignore_index, float* probs, float* row_loss, float* loss, unsigned* bad_row,
                  cudaStream_t stream) {
  launch_softmax_xent(logits, labels, rows, cols, scale, ignore_index, probs, row_loss, loss, bad_row, stream);
}
void softmax_xent(const double* logits, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                  int ignore_index, double* probs, double* row_loss, double* loss, unsigned* bad_row,
                  cudaStream_t stream) {
  launch_softmax_xent(logits, labels, rows, cols, scale, ignore_index, probs, row_loss, loss, bad_row, stream);
}

void softmax_xent_backward(const float* probs, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                           int ignore_index, float* dlogits, unsigned* bad_row, cudaStream_t stream) {
  launch_softmax_xent_backward(probs, labels, rows, cols, scale, ignore_index, dlogits, bad_row, stream);
}
void softmax_xent_backward(const double* probs, const int32_t* labels, int64_t rows, int64_t cols,
                           double scale, int ignore_index, double* dlogits, unsigned* bad_row,
                           cudaStream_t stream) {
  launch_softmax_xent_backward(probs, labels, rows, cols, scale, ignore_index, dlogits, bad_row, stream);
}

void fill(float* x, int64_t n, float value, cudaStream_t stream) { launch_fill(x, n, value, stream); }
void fill(double* x, int64_t n, double value, cudaStream_t stream) { launch_fill(x, n, value, stream); }
void fill(int32_t* x, int64_t n, int32_t value, cudaStream_t stream) { launch_fill(x, n, value, stream); }

void scale(float* x, int64_t n, double alpha, cudaStream_t stream) { launch_scale(x, n, alpha, stream); }
void scale(double* x, int64_t n, double alpha, cudaStream_t stream) { launch_scale(x, n, alpha, stream); }

void axpy(double alpha, const float* x, float* y, int64_t n, cudaStream_t stream) {
  launch_axpy(alpha, x, y, n, stream);
}
void axpy(double alpha, const double* x, double* y, int64_t n, cudaStream_t stream) {
  launch_axpy(alpha, x, y, n, stream);
}

void sgd_step(float* param, const float* grad, float* buf, int64_t n, double lr, double momentum,
              double weight_decay, bool nesterov, bool first_step, cudaStream_t stream) {
  launch_sgd_step(param, grad, buf, n, lr, momentum, weight_decay, nesterov, first_step, stream);
}
void sgd_step(double* param, const double* grad, double* buf, int64_t n, double lr, double momentum,
              double weight_decay, bool nesterov, bool first_step, cudaStream_t stream) {
  launch_sgd_step(param, grad, buf, n, lr, momentum, weight_decay, nesterov, first_step, stream);
}

}  // namespace cuda
}  // namespace gpipe
