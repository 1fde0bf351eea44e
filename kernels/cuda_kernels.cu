// Kernels of the CUDA backend and their launchers (declared in kernels/cuda_kernels.h):
// the MLP ops (elementwise, bias, softmax cross-entropy, SGD), then Adam, the squared
// norm and the transformer ops (embedding, layernorm, the softmax inside attention,
// dropout). Layout: device helpers, then the kernels, then the launchers, which do the
// grid math, launch on the caller's stream and check the launch. Every kernel matches
// the CPU reference (kernels/cpu_backend.cc, kernels/cpu_transformer_ops.cc) operation
// for operation (same formula, same element type for the arithmetic, double where the
// reference accumulates in double); only the order of additions in reductions differs
// (the embedding gradient of an id whose rows fit one 32-entry segment of the sorted
// ids adds in the CPU's order).
//
// Nothing here synchronises with the host. Everything is deterministic: reductions use
// fixed trees and fixed chunks (no floating-point atomics, and chunks that spread a
// reduction over the whole GPU); the only atomics are integer ones: the atomicMin of
// flag_error, which records the first bad label or token id in the op's error slot
// (kernels/cuda_kernels.h, "Deferred input errors") for the backend to report later,
// and argmax_correct's count.
#include "kernels/cuda_kernels.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda_elementwise.h"  // Master
#include "kernels/step_scalars.h"

#include "runtime/bf16.h"
#include "runtime/fp16.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"
#include "runtime/philox.h"

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
constexpr int64_t kSumSquaresMaxBlocks = 1024;  // sum_squares: partial sums (one per block)
constexpr int kLnRowLanes = 16;            // layernorm dgamma/dbeta: threads walking the rows of a column
constexpr int64_t kMinRowsPerChunk = 64;   // bias_grad, layernorm dgamma/dbeta: rows per partial sum, at least
constexpr int64_t kMaxChunks = 1024;       // ... and at most this many partial sums per column (<= kMaxGridY)
constexpr int64_t kEmbSegment = 32;        // embedding_backward: sorted (id, position) entries per block

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// Threads for one block per row: a multiple of 32 (block_allreduce needs full warps),
// no more than the row needs, at most kMaxRowThreads.
unsigned row_threads(int64_t cols) {
  const int64_t rounded = (std::max<int64_t>(cols, 1) + 31) / 32 * 32;
  return static_cast<unsigned>(std::min<int64_t>(rounded, kMaxRowThreads));
}

// Row chunks of a column reduction (bias_grad, layernorm's dgamma/dbeta): a function of
// `rows` alone, so the order of additions (and the result) does not change between runs.
int64_t row_chunks(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>((rows + kMinRowsPerChunk - 1) / kMinRowsPerChunk, kMaxChunks));
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
__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }  // IEEE (no fast-math)
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }

// Products and sums rounded each on its own: never contracted into an FMA, whose use the
// compiler decides kernel by kernel (an H200 found the single-tensor and the multi-tensor
// AdamW a bit apart where the decay's product met the update's difference; RMSNorm's
// weight-gradient term would fuse into the sum that adds it).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }


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

// Storage types (Backend::computes_narrow): a kernel templated on its storage type S
// loads each element into Wide<S> (float32 for bfloat16 and float16, else S itself),
// computes there and rounds once on store, with the host's conversions (runtime/bf16.h,
// fp16.h: to nearest, ties to even), as the widening reference does around the float32
// kernel. For float32 and float64, load and store are the identity.
template <typename S>
using Wide = Master<S>;  // kernels/cuda_elementwise.h

template <typename S>
__device__ __forceinline__ S load(S x) {
  return x;
}
__device__ __forceinline__ float load(BFloat16 x) { return bf16_to_float(x); }
__device__ __forceinline__ float load(Half x) { return half_to_float(x); }
template <typename S>
__device__ __forceinline__ S store_as(Wide<S> x) {
  return x;
}
template <>
__device__ __forceinline__ BFloat16 store_as<BFloat16>(float x) {
  return float_to_bf16(x);
}
template <>
__device__ __forceinline__ Half store_as<Half>(float x) {
  return float_to_half(x);
}

#define GRID_STRIDE_LOOP(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------------------------
// Kernels

// y: (rows, cols) += bias: (cols). Block (kTileCols, kAddBiasTileRows): threadIdx.x is
// the column within the block's tile (a warp touches 32 consecutive elements of a row),
// threadIdx.y walks rows with a stride of gridDim.y * kAddBiasTileRows.
template <typename S>
__global__ void add_bias_kernel(S* y, const S* bias, int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  if (col >= cols) return;
  const Wide<S> b = load(bias[col]);
  const int64_t stride = static_cast<int64_t>(gridDim.y) * kAddBiasTileRows;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * kAddBiasTileRows + threadIdx.y; r < rows; r += stride) {
    y[r * cols + col] = store_as<S>(load(y[r * cols + col]) + b);
  }
}

// Column sums of dy: (rows, cols) over one chunk of rows per blockIdx.y, in double:
// partial (chunks, cols). Block (kTileCols, kBiasGradRowLanes): thread (x, y) sums rows
// start + y, start + y + 16, ... of column x (coalesced across the warp), then a
// shared-memory tree over y adds the 16 partial sums. Chunks spread a tall matrix over
// the whole GPU (a few column tiles alone would occupy a handful of SMs). `Elem` gives the
// addend at (row, col): dy's element (ColumnOf), or RMSNorm's weight-gradient term
// (RmsNormWeightTerm), so that both sum in the same order.
template <typename Elem>
__global__ void column_sums_partial_kernel(Elem elem, double* partial, int64_t rows, int64_t cols,
                                           int64_t rows_per_chunk) {
  __shared__ double part[kBiasGradRowLanes][kTileCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + tx;
  const int64_t chunk = blockIdx.y;
  const int64_t start = chunk * rows_per_chunk;
  const int64_t end = start + rows_per_chunk < rows ? start + rows_per_chunk : rows;
  double acc = 0.0;
  if (col < cols) {
    for (int64_t r = start + ty; r < end; r += kBiasGradRowLanes) acc += elem(r, col);
  }
  part[ty][tx] = acc;
  __syncthreads();
  for (int s = kBiasGradRowLanes / 2; s > 0; s >>= 1) {
    if (ty < s) part[ty][tx] += part[ty + s][tx];
    __syncthreads();
  }
  if (ty == 0 && col < cols) partial[chunk * cols + col] = part[0][tx];
}

// dy[r, c], widened to double.
template <typename T>
struct ColumnOf {
  const T* dy;
  int64_t cols;
  __device__ double operator()(int64_t r, int64_t c) const { return static_cast<double>(dy[r * cols + c]); }
};

// RMSNorm's weight-gradient addend dy[r, c] (x[r, c] rstd[r]), computed in the master type
// M and rounded to it (as the (rows, cols) temporary of terms before held it), then widened
// to double.
template <typename S>
struct RmsNormWeightTerm {
  const S* dy;
  const S* x;
  const Wide<S>* rstd;
  int64_t cols;
  __device__ double operator()(int64_t r, int64_t c) const {
    const int64_t i = r * cols + c;
    // Each product rounded, as when the term was stored before being added: for float64
    // a plain product would fuse with the caller's sum into one FMA.
    using W = Wide<S>;
    const W term = mul_rn(static_cast<W>(load(dy[i])), mul_rn(static_cast<W>(load(x[i])), rstd[r]));
    return static_cast<double>(term);
  }
};

// db: (cols) = (accumulate ? beta * db : 0) + the chunks' partial sums, added in chunk
// order (deterministic) and rounded once.
template <typename T>
__global__ void bias_grad_final_kernel(const double* partial, T* db, int64_t chunks, int64_t cols, T beta,
                                       bool accumulate) {
  GRID_STRIDE_LOOP(c, cols) {
    double acc = 0.0;
    for (int64_t k = 0; k < chunks; ++k) acc += partial[k * cols + c];
    db[c] = (accumulate ? beta * db[c] : T(0)) + static_cast<T>(acc);
  }
}

template <typename S>
__global__ void relu_kernel(const S* x, S* y, int64_t n) {
  using T = Wide<S>;
  GRID_STRIDE_LOOP(i, n) {
    const T v = load(x[i]);
    y[i] = store_as<S>(v > T(0) ? v : T(0));
  }
}

template <typename S>
__global__ void relu_backward_kernel(const S* y, const S* dy, S* dx, int64_t n) {
  using T = Wide<S>;
  GRID_STRIDE_LOOP(i, n) { dx[i] = store_as<S>(load(y[i]) > T(0) ? load(dy[i]) : T(0)); }
}

template <typename S>
__global__ void gelu_kernel(const S* x, S* y, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { y[i] = store_as<S>(gelu_value(load(x[i]))); }
}

template <typename S>
__global__ void gelu_backward_kernel(const S* x, const S* dy, S* dx, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { dx[i] = store_as<S>(load(dy[i]) * gelu_slope(load(x[i]))); }
}

// One block per row r of logits: (rows, cols), blockDim.x a multiple of 32.
//   probs[r, :] = exp(x - max) / sum exp(x - max)
//   row_loss[r] = log(sum) + (max - x[label])   (0 when label == ignore_index or invalid)
// An invalid label is flagged as (r, label) and never read through.
template <typename T>
__global__ void softmax_xent_forward_kernel(const T* logits, const int32_t* labels, int64_t cols,
                                            int ignore_index, T* probs, T* row_loss, ErrorSlot* error) {
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
        flag_error(error, row, label);
      } else {
        loss = dev_log(sum) + (mx - in[label]);  // as the CPU: max - x[label] first, exact for near logits
      }
    }
    row_loss[row] = loss;
  }
}

// A loss's factor as a kernel reads it when it runs (LossScaleArg).
__device__ __forceinline__ double loss_scale(const LossScaleArg& s) { return s.at != nullptr ? *s.at : s.value; }

// One block: *loss = scale * sum of row_loss: (rows), accumulated in double (as the CPU
// reference does) in a fixed order: strided per-thread sums, then block_allreduce.
template <typename T>
__global__ void loss_sum_kernel(const T* row_loss, int64_t rows, LossScaleArg scale_arg, T* loss) {
  const double scale = loss_scale(scale_arg);
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) acc += static_cast<double>(row_loss[i]);
  acc = block_allreduce(acc, SumOp(), 0.0, shared);
  if (threadIdx.x == 0) *loss = static_cast<T>(acc * scale);
}

// One block per row r: dlogits[r, :] = s * probs[r, :] - s * onehot(label), or 0 when
// label == ignore_index. An invalid label is flagged as (r, label); its row gets
// s * probs (no column matches it).
template <typename T>
__global__ void softmax_xent_backward_kernel(const T* probs, const int32_t* labels, int64_t cols,
                                             LossScaleArg scale, int ignore_index, T* dlogits, ErrorSlot* error) {
  const T s = static_cast<T>(loss_scale(scale));
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  const T* in = probs + row * cols;
  T* out = dlogits + row * cols;
  if (label == ignore_index) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[j] = T(0);
    return;
  }
  if (threadIdx.x == 0 && (label < 0 || label >= cols)) flag_error(error, row, label);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    T v = s * in[j];
    if (j == label) v -= s;
    out[j] = v;
  }
}

// The vocabulary-parallel softmax cross-entropy's share (Backend::softmax_xent_slice_*).
// One block per row r of logits (rows, cols), columns [first, first + cols) of `vocab`:
//   sums[r] = sum_j exp(x[j] - rowmax[r]);  sums[rows + r] = x[label - first] when the
//   label is one of these columns and not ignore_index, else 0. A label outside
//   [0, vocab) that is not ignore_index is flagged as (r, label).
template <typename T>
__global__ void softmax_xent_slice_sums_kernel(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                               int64_t first, int64_t vocab, int ignore_index, const T* rowmax,
                                               T* sums, ErrorSlot* error) {
  __shared__ T shared[32];
  const int64_t row = blockIdx.x;
  const T* in = logits + row * cols;
  const T mx = rowmax[row];
  T sum = T(0);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += dev_exp(in[j] - mx);
  sum = block_allreduce(sum, SumOp(), T(0), shared);
  if (threadIdx.x == 0) {
    sums[row] = sum;
    const int32_t label = labels[row];
    T target = T(0);
    if (label != ignore_index) {
      if (label < 0 || label >= vocab) {
        flag_error(error, row, label);
      } else {
        const int64_t col = static_cast<int64_t>(label) - first;
        if (col >= 0 && col < cols) target = in[col];
      }
    }
    sums[rows + row] = target;
  }
}

// lse[r] = rowmax[r] + log(sums[r]); row_loss[r] = log(sums[r]) + (rowmax[r] - sums[rows + r])
// (0 for ignore_index), which loss_sum_kernel then sums. Grid-stride over the rows.
template <typename T>
__global__ void softmax_xent_slice_rows_kernel(const T* sums, const T* rowmax, const int32_t* labels, int64_t rows,
                                               int ignore_index, T* lse, T* row_loss) {
  GRID_STRIDE_LOOP(r, rows) {
    const T log_sum = dev_log(sums[r]);
    lse[r] = rowmax[r] + log_sum;
    row_loss[r] = labels[r] == ignore_index ? T(0) : log_sum + (rowmax[r] - sums[rows + r]);
  }
}

// One block per row: dlogits = s * (exp(x - lse[r]) - onehot(label - first)), 0 for ignore_index.
template <typename T>
__global__ void softmax_xent_slice_backward_kernel(const T* logits, const int32_t* labels, int64_t cols,
                                                   int64_t first, int ignore_index, const T* lse, LossScaleArg scale,
                                                   T* dlogits) {
  const T s = static_cast<T>(loss_scale(scale));
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  const T* in = logits + row * cols;
  T* out = dlogits + row * cols;
  if (label == ignore_index) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[j] = T(0);
    return;
  }
  const int64_t col = static_cast<int64_t>(label) - first;
  const T e = lse[row];
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    T v = s * dev_exp(in[j] - e);
    if (j == col) v -= s;
    out[j] = v;
  }
}

struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};

// One block per row: index[r] = first + the first column whose logit equals value[r], or
// `none` (Backend::first_column_equal).
template <typename T>
__global__ void first_column_equal_kernel(const T* logits, const T* value, int64_t cols, int64_t first, int64_t none,
                                          T* index) {
  __shared__ long long shared[32];
  const int64_t row = blockIdx.x;
  const T* in = logits + row * cols;
  const T v = value[row];
  long long at = static_cast<long long>(cols);  // past every column: not found
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    if (in[j] == v) {
      at = static_cast<long long>(j);
      break;  // this thread's later columns are larger
    }
  }
  at = block_allreduce(at, MinOp(), static_cast<long long>(cols), shared);
  if (threadIdx.x == 0) index[row] = static_cast<T>(at < cols ? first + at : none);
}

// The better of two (value, column) candidates of one row, as the CPU's scan
// `if (v[j] > v[best]) best = j` would pick between them: the larger value, the smaller
// column on ties. column == -1 marks "no candidate" (a thread past the row's end).
template <typename T>
__device__ __forceinline__ void better_of(T& v, int64_t& col, T other_v, int64_t other_col) {
  if (other_col < 0) return;
  if (col < 0 || other_v > v || (!(v > other_v) && other_col < col)) {
    v = other_v;
    col = other_col;
  }
}

// One block per row r of logits: (rows, cols), blockDim.x a multiple of 32: the first
// largest column, by a per-thread scan over its strided columns, then warp shuffles,
// then one warp over the warps' results; *count += 1 when it is labels[r] (an integer
// atomic: the count does not depend on the order). Rows with ignore_index are skipped.
template <typename T>
__global__ void argmax_correct_kernel(const T* logits, const int32_t* labels, int64_t cols, int ignore_index,
                                      unsigned long long* count) {
  __shared__ T best_v[32];
  __shared__ int64_t best_c[32];
  const int64_t row = blockIdx.x;
  const int32_t label = labels[row];
  if (label == ignore_index) return;  // the whole block leaves together
  const T* in = logits + row * cols;
  T v = T(0);
  int64_t col = -1;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) better_of(v, col, in[j], j);
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T ov = __shfl_down_sync(0xffffffffu, v, offset);
    const long long oc = __shfl_down_sync(0xffffffffu, static_cast<long long>(col), offset);
    better_of(v, col, ov, static_cast<int64_t>(oc));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    best_v[warp] = v;
    best_c[warp] = col;
  }
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x >> 5;
  v = lane < warps ? best_v[lane] : T(0);
  col = lane < warps ? best_c[lane] : -1;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T ov = __shfl_down_sync(0xffffffffu, v, offset);
    const long long oc = __shfl_down_sync(0xffffffffu, static_cast<long long>(col), offset);
    better_of(v, col, ov, static_cast<int64_t>(oc));
  }
  if (lane == 0 && col >= 0 && col == static_cast<int64_t>(label)) atomicAdd(count, 1ULL);
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

// The scalars of one SGD step, converted to the element type once on the host.
template <typename T>
struct SgdScalars {
  T lr, momentum, weight_decay;
  bool nesterov, first_step;
};

// Element i of one SGD step (the single-tensor and the multi-tensor kernel's
// arithmetic). buf == nullptr: no momentum.
template <typename T>
__device__ __forceinline__ void sgd_update(T* w, const T* g, T* buf, int64_t i, const SgdScalars<T>& s) {
  T d = g[i] + s.weight_decay * w[i];
  if (buf != nullptr) {
    const T b = s.first_step ? d : s.momentum * buf[i] + d;
    buf[i] = b;
    d = s.nesterov ? d + s.momentum * b : b;
  }
  w[i] -= s.lr * d;
}

template <typename T>
__global__ void sgd_step_kernel(T* w, const T* g, T* buf, int64_t n, SgdScalars<T> s) {
  GRID_STRIDE_LOOP(i, n) { sgd_update(w, g, buf, i, s); }
}

// ---------------------------------------------------------------------------------
// Optimizer and norm kernels

// The scalars of one Adam step, converted to the element type once on the host.
template <typename T>
struct AdamScalars {
  T lr, beta1, beta2, eps, weight_decay;
  T decay;              // 1 - lr * weight_decay (decoupled, weight_decay != 0 only)
  T bias_correction1;   // 1 - beta1^step
  T bias_correction2;   // 1 - beta2^step
  bool decoupled;
  bool decay_weights;   // decoupled && weight_decay != 0
};

// Element i of one Adam step (the single-tensor and the multi-tensor kernel's arithmetic),
// every operation rounded on its own, so that both kernels give the same bits.
template <typename T>
__device__ __forceinline__ void adam_update(T* w, const T* grad, T* m, T* v, int64_t i, const AdamScalars<T>& s) {
  T param = w[i];
  T g = grad[i];
  if (s.decoupled) {
    if (s.decay_weights) param = mul_rn(param, s.decay);
  } else {
    g = add_rn(g, mul_rn(s.weight_decay, param));
  }
  const T mi = add_rn(mul_rn(s.beta1, m[i]), mul_rn(T(1) - s.beta1, g));
  const T vi = add_rn(mul_rn(s.beta2, v[i]), mul_rn(mul_rn(T(1) - s.beta2, g), g));
  m[i] = mi;
  v[i] = vi;
  const T step = div_rn(mul_rn(s.lr, div_rn(mi, s.bias_correction1)),
                        add_rn(dev_sqrt(div_rn(vi, s.bias_correction2)), s.eps));
  w[i] = add_rn(param, -step);
}

template <typename T>
__global__ void adam_step_kernel(T* w, const T* grad, T* m, T* v, int64_t n, AdamScalars<T> s) {
  GRID_STRIDE_LOOP(i, n) { adam_update(w, grad, m, v, i, s); }
}

// partial[blockIdx.x] = sum of x[i]^2 (in double) over this block's grid-stride share.
template <typename T>
__global__ void sum_squares_partial_kernel(const T* x, int64_t n, double* partial) {
  __shared__ double shared[32];
  double acc = 0.0;
  GRID_STRIDE_LOOP(i, n) {
    const double v = static_cast<double>(x[i]);
    acc += v * v;
  }
  acc = block_allreduce(acc, SumOp(), 0.0, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block: *result = sum of partial: (count), strided per-thread sums then a tree.
__global__ void sum_partials_kernel(const double* partial, int64_t count, double* result) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_allreduce(acc, SumOp(), 0.0, shared);
  if (threadIdx.x == 0) *result = acc;
}

// ---- Multi-tensor kernels: block b takes chunks b, b + gridDim.x, ... of the table
// (kMultiTensorChunk elements of one tensor each, the last of a tensor shorter) and
// applies the single-tensor kernel's element arithmetic to each element once.

// The tensor of chunk c and the element range [begin, end) it covers.
__device__ __forceinline__ void multi_chunk(const MultiTensorTable& tab, int64_t c, int64_t& tensor,
                                            int64_t& begin, int64_t& end) {
  int64_t lo = 0, hi = tab.tensors - 1;  // the last tensor whose first chunk is <= c
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (tab.chunk_start[mid] <= c) lo = mid;
    else hi = mid - 1;
  }
  tensor = lo;
  begin = (c - tab.chunk_start[lo]) * kMultiTensorChunk;
  const int64_t last = tab.numel[lo];
  end = begin + kMultiTensorChunk < last ? begin + kMultiTensorChunk : last;
}

// Calls f(tensor, begin, end) for each of this block's chunks: b, b + gridDim.x, ...
template <typename F>
__device__ __forceinline__ void for_each_chunk(const MultiTensorTable& tab, F&& f) {
  for (int64_t c = blockIdx.x; c < tab.chunks; c += gridDim.x) {
    int64_t t, begin, end;
    multi_chunk(tab, c, t, begin, end);
    f(t, begin, end);
  }
}

template <typename T>
__device__ __forceinline__ T* multi_ptr(const MultiTensorTable& tab, int list, int64_t tensor) {
  return static_cast<T*>(tab.ptrs[list * tab.tensors + tensor]);
}

// The multi-tensor optimizer kernels read the step's scalars (kernels/step_scalars.h)
// from the device when they run: the learning rate, the step's count (SGD's first step),
// and what the host computed of them for Adam (its decay and bias corrections, converted
// to T as adam_scalars converts them); a set kStepSkip leaves everything as it is.

// Lists: params, grads, momentum buffers (null pointers without momentum).
template <typename T>
__global__ void multi_sgd_kernel(MultiTensorTable tab, SgdScalars<T> s, const double* step) {
  if (step[kStepSkip] != 0.0) return;
  s.lr = static_cast<T>(step[kStepLr]);
  s.first_step = step[kStepNumber] == 1.0;
  for_each_chunk(tab, [&](int64_t t, int64_t begin, int64_t end) {
    T* w = multi_ptr<T>(tab, 0, t);
    const T* g = multi_ptr<T>(tab, 1, t);
    T* buf = multi_ptr<T>(tab, 2, t);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) sgd_update(w, g, buf, i, s);
  });
}

// Lists: params, grads, m, v.
template <typename T>
__global__ void multi_adam_kernel(MultiTensorTable tab, AdamScalars<T> s, const double* step) {
  if (step[kStepSkip] != 0.0) return;
  s.lr = static_cast<T>(step[kStepLr]);
  s.decay = static_cast<T>(step[kStepDecay]);
  s.bias_correction1 = static_cast<T>(step[kStepBiasCorrection1]);
  s.bias_correction2 = static_cast<T>(step[kStepBiasCorrection2]);
  for_each_chunk(tab, [&](int64_t t, int64_t begin, int64_t end) {
    T* w = multi_ptr<T>(tab, 0, t);
    const T* g = multi_ptr<T>(tab, 1, t);
    T* m = multi_ptr<T>(tab, 2, t);
    T* v = multi_ptr<T>(tab, 3, t);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) adam_update(w, g, m, v, i, s);
  });
}

// One list: x *= alpha (scale) or x = value (fill).
template <typename T>
__global__ void multi_scale_kernel(MultiTensorTable tab, T alpha, bool fill) {
  for_each_chunk(tab, [&](int64_t t, int64_t begin, int64_t end) {
    T* x = multi_ptr<T>(tab, 0, t);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) x[i] = fill ? alpha : x[i] * alpha;
  });
}

// One list: x *= the step's gradient scale (0 clears, as multi_scale's fill); nothing when
// the scale is 1 or the step is skipped.
template <typename T>
__global__ void multi_scale_by_kernel(MultiTensorTable tab, const double* step) {
  const double scale = step[kStepGradScale];
  if (step[kStepSkip] != 0.0 || scale == 1.0) return;
  const T alpha = static_cast<T>(scale);
  const bool clear = scale == 0.0;
  for_each_chunk(tab, [&](int64_t t, int64_t begin, int64_t end) {
    T* x = multi_ptr<T>(tab, 0, t);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) x[i] = clear ? T(0) : x[i] * alpha;
  });
}

// One block: the step's gradient scale and skip from its norm (Backend::step_grad_scale),
// with the host's double arithmetic written out (the same FMA as its std::fma, the same
// roundings); any flagged error slot of `slots` also skips the step.
__global__ void step_grad_scale_kernel(double* step, double max_norm, bool skip_nonfinite,
                                       const ErrorSlot* slots, int64_t slot_count) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < slot_count; i += blockDim.x) {
    if (slots[i] != kNoError) atomicOr(&bad, 1);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const double norm_squared = step[kStepNormSquared];
  const double norm = norm_squared < 0.0 ? -1.0 : __dsqrt_rn(norm_squared);  // NaN stays NaN
  if (bad != 0 || (skip_nonfinite && !isfinite(norm))) step[kStepSkip] = 1.0;
  const double inv_loss_scale = step[kStepUnscale];
  double scale = inv_loss_scale;
  if (max_norm > 0.0 && norm >= 0.0) {
    const double clip = __ddiv_rn(max_norm, __fma_rn(norm, inv_loss_scale, 1e-6));
    if (clip < 1.0) scale = __dmul_rn(scale, clip);
  }
  step[kStepGradScale] = scale;
}

// partial[blockIdx.x] = the sum of squares (in double) of this block's chunks; one list.
template <typename T>
__global__ void multi_sum_squares_kernel(MultiTensorTable tab, double* partial) {
  __shared__ double shared[32];
  double acc = 0.0;
  for_each_chunk(tab, [&](int64_t t, int64_t begin, int64_t end) {
    const T* x = multi_ptr<T>(tab, 0, t);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const double v = static_cast<double>(x[i]);
      acc += v * v;
    }
  });
  acc = block_allreduce(acc, SumOp(), 0.0, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// ---------------------------------------------------------------------------------
// Transformer kernels

// Flags (p, ids[p]) for every id outside [0, vocab). Only for embeddings without
// channels, where no gather or sort kernel sees the ids.
__global__ void validate_token_ids_kernel(const int32_t* ids, int64_t positions, int64_t vocab, ErrorSlot* error) {
  GRID_STRIDE_LOOP(p, positions) {
    const int32_t id = ids[p];
    if (id < 0 || id >= vocab) flag_error(error, p, id);
  }
}

// out: (P, C) = table[ids[p] - first] + pos[p % seq] (pos may be nullptr), P = positions;
// table: rows [first, first + vocab) of a vocabulary of `total` (the whole table: first
// 0, total vocab). Grid-stride over the P * C outputs. An id outside [0, total) yields
// zeros (never a read out of bounds) and is flagged once, by the thread of channel 0; a
// valid id outside the table's rows (embedding_slice) yields zeros.
template <typename T>
__global__ void embedding_kernel(const int32_t* ids, const T* table, const T* pos, T* out, int64_t positions,
                                 int64_t seq, int64_t vocab, int64_t channels, int64_t first, int64_t total,
                                 ErrorSlot* error) {
  // T: a storage type (Backend::computes_narrow): the sum in Wide<T>, rounded once.
  const int64_t n = positions * channels;
  GRID_STRIDE_LOOP(i, n) {
    const int64_t p = i / channels;
    const int64_t c = i - p * channels;
    const int32_t id = ids[p];
    if (id < 0 || id >= total) {
      if (c == 0) flag_error(error, p, id);
      out[i] = store_as<T>(Wide<T>(0));
      continue;
    }
    const int64_t row = static_cast<int64_t>(id) - first;
    if (row < 0 || row >= vocab) {
      out[i] = store_as<T>(Wide<T>(0));
      continue;
    }
    const Wide<T> value = load(table[row * channels + c]);
    out[i] = store_as<T>(pos != nullptr ? value + load(pos[(p % seq) * channels + c]) : value);
  }
}

// Sort input for embedding_backward: keys[p] = ids[p] - first when that is a row of the
// table (rows [first, first + vocab) of a vocabulary of `total`), else vocab (sorts after
// every row and is skipped); an id outside [0, total) is flagged; positions[p] = p.
__global__ void embedding_sort_input_kernel(const int32_t* ids, int64_t n, int64_t vocab, int64_t first,
                                            int64_t total, unsigned* keys, int32_t* positions, ErrorSlot* error) {
  GRID_STRIDE_LOOP(p, n) {
    const int32_t id = ids[p];
    const bool valid = id >= 0 && id < total;
    if (!valid) flag_error(error, p, id);
    const int64_t row = static_cast<int64_t>(id) - first;
    const bool mine = valid && row >= 0 && row < vocab;
    keys[p] = mine ? static_cast<unsigned>(row) : static_cast<unsigned>(vocab);
    positions[p] = static_cast<int32_t>(p);
  }
}

// The table gradient from the sorted (key, position) list, cut into segments of
// kEmbSegment entries so that a frequent id (a space in byte-level text: thousands of
// rows) is summed by many blocks, not walked serially by one. One block per segment,
// threads over the channels. Within a segment, each run of equal keys is a piece:
//   * a piece that is a whole run adds its rows into dtable[key] directly, starting
//     from the old value, in position order (the CPU's order; only this block touches
//     that row);
//   * the first piece continues a run from earlier segments: its sum goes to cont[seg];
//   * the last piece starts a run that continues: old value plus its rows go to
//     head[seg], and embedding_run_kernel finishes that row.
// head, cont: (segments, channels). Invalid ids sort last (key == vocab) and are skipped.
template <typename T>
__global__ void embedding_segment_kernel(const unsigned* keys, const int32_t* positions, const T* dout, T* dtable,
                                         T* head, T* cont, int64_t n, int64_t vocab, int64_t channels) {
  const int64_t seg = blockIdx.x;
  const int64_t first = seg * kEmbSegment;
  const int64_t last = (first + kEmbSegment < n ? first + kEmbSegment : n) - 1;
  const bool first_starts_run = first == 0 || keys[first - 1] != keys[first];
  const bool last_ends_run = last == n - 1 || keys[last + 1] != keys[last];
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) {
    for (int64_t j = first; j <= last;) {
      const unsigned key = keys[j];
      int64_t end = j;
      while (end < last && keys[end + 1] == key) ++end;  // the piece [j, end]
      if (static_cast<int64_t>(key) < vocab) {
        const bool continues = j == first && !first_starts_run;
        const bool goes_on = end == last && !last_ends_run;
        T* row = dtable + static_cast<int64_t>(key) * channels;
        T acc = continues ? T(0) : row[c];
        for (int64_t k = j; k <= end; ++k) acc += dout[static_cast<int64_t>(positions[k]) * channels + c];
        if (continues) {
          cont[seg * channels + c] = acc;
        } else if (goes_on) {
          head[seg * channels + c] = acc;
        } else {
          row[c] = acc;
        }
      }
      j = end + 1;
    }
  }
}

// Finishes the runs that cross segments: the block of the segment where such a run
// starts adds the continuations' sums in segment order to its head and writes the row.
template <typename T>
__global__ void embedding_run_kernel(const unsigned* keys, T* dtable, const T* head, const T* cont, int64_t n,
                                     int64_t segments, int64_t vocab, int64_t channels) {
  const int64_t seg = blockIdx.x;
  const int64_t first = seg * kEmbSegment;
  const int64_t last = (first + kEmbSegment < n ? first + kEmbSegment : n) - 1;
  if (last == n - 1) return;
  const unsigned key = keys[last];
  if (static_cast<int64_t>(key) >= vocab || keys[last + 1] != key) return;  // its last piece ends here
  if (first > 0 && keys[first] == key && keys[first - 1] == key) return;    // ... or started earlier
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) {
    T acc = head[seg * channels + c];
    for (int64_t t = seg + 1; t < segments && keys[t * kEmbSegment] == key; ++t) acc += cont[t * channels + c];
    dtable[static_cast<int64_t>(key) * channels + c] = acc;
  }
}

// dpos: rows [0, seq) of (>= seq, C) += sum over b of dout: (batch, seq, C), b in order.
template <typename T>
__global__ void embedding_pos_grad_kernel(const T* dout, T* dpos, int64_t batch, int64_t seq, int64_t channels) {
  const int64_t n = seq * channels;
  GRID_STRIDE_LOOP(i, n) {
    T acc = dpos[i];
    for (int64_t b = 0; b < batch; ++b) acc += dout[b * n + i];
    dpos[i] = acc;
  }
}

// One block per row of x: (rows, cols), blockDim.x a multiple of 32. Statistics in
// double, two passes, as the CPU reference computes them:
//   mean = sum x / C;  rstd = 1 / sqrt(sum (x - mean)^2 / C + eps);
// then, with both rounded to T (they are stored, and backward uses the stored values),
//   y = (x - mean) * rstd * gamma + beta.
template <typename T>
__global__ void layernorm_kernel(const T* x, const T* gamma, const T* beta, double eps, T* y, T* mean, T* rstd,
                                 int64_t cols) {
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const T* in = x + row * cols;
  T* out = y + row * cols;

  double sum = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += static_cast<double>(in[j]);
  sum = block_allreduce(sum, SumOp(), 0.0, shared);
  const double mu = sum / static_cast<double>(cols);

  double var = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const double d = static_cast<double>(in[j]) - mu;
    var += d * d;
  }
  var = block_allreduce(var, SumOp(), 0.0, shared) / static_cast<double>(cols);
  const T m = static_cast<T>(mu);
  const T s = static_cast<T>(1.0 / sqrt(var + eps));

  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[j] = (in[j] - m) * s * gamma[j] + beta[j];
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// One block per row: with g = dy * gamma and xhat = (x - mean) * rstd (in T),
//   dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),
// the two means summed in double as on the CPU. Each thread reads and writes the same
// columns in both loops, so dx may alias dy or x.
template <typename T>
__global__ void layernorm_backward_dx_kernel(const T* dy, const T* x, const T* gamma, const T* mean, const T* rstd,
                                             T* dx, int64_t cols) {
  __shared__ double shared[32];
  const int64_t row = blockIdx.x;
  const T* d_in = dy + row * cols;
  const T* x_in = x + row * cols;
  T* out = dx + row * cols;
  const T m = mean[row], s = rstd[row];

  double sum_g = 0.0, sum_gx = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const T g = d_in[j] * gamma[j];
    const T xhat = (x_in[j] - m) * s;
    sum_g += static_cast<double>(g);
    sum_gx += static_cast<double>(g * xhat);
  }
  sum_g = block_allreduce(sum_g, SumOp(), 0.0, shared);
  sum_gx = block_allreduce(sum_gx, SumOp(), 0.0, shared);
  const T mean_g = static_cast<T>(sum_g / static_cast<double>(cols));
  const T mean_gx = static_cast<T>(sum_gx / static_cast<double>(cols));

  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const T xhat = (x_in[j] - m) * s;
    out[j] = s * (d_in[j] * gamma[j] - mean_g - xhat * mean_gx);
  }
}

// Partial column sums (in double) for dgamma and dbeta. Grid (column tiles, row
// chunks), block (kTileCols, kLnRowLanes): thread (x, y) sums rows start + y, + 16, ...
// of its chunk in its column, then a shared-memory tree over y; the block writes row
// `chunk` of partial_gamma and partial_beta: (chunks, cols).
template <typename T>
__global__ void layernorm_param_partial_kernel(const T* dy, const T* x, const T* mean, const T* rstd,
                                               double* partial_gamma, double* partial_beta, int64_t rows,
                                               int64_t cols, int64_t rows_per_chunk) {
  __shared__ double part_g[kLnRowLanes][kTileCols];
  __shared__ double part_b[kLnRowLanes][kTileCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTileCols + tx;
  const int64_t chunk = blockIdx.y;
  const int64_t start = chunk * rows_per_chunk;
  const int64_t end = start + rows_per_chunk < rows ? start + rows_per_chunk : rows;
  double acc_g = 0.0, acc_b = 0.0;
  if (col < cols) {
    for (int64_t r = start + ty; r < end; r += kLnRowLanes) {
      const T d = dy[r * cols + col];
      const T xhat = (x[r * cols + col] - mean[r]) * rstd[r];
      acc_g += static_cast<double>(d * xhat);
      acc_b += static_cast<double>(d);
    }
  }
  part_g[ty][tx] = acc_g;
  part_b[ty][tx] = acc_b;
  __syncthreads();
  for (int s = kLnRowLanes / 2; s > 0; s >>= 1) {
    if (ty < s) {
      part_g[ty][tx] += part_g[ty + s][tx];
      part_b[ty][tx] += part_b[ty + s][tx];
    }
    __syncthreads();
  }
  if (ty == 0 && col < cols) {
    partial_gamma[chunk * cols + col] = part_g[0][tx];
    partial_beta[chunk * cols + col] = part_b[0][tx];
  }
}

// dgamma, dbeta: (cols) += the chunks' partial sums, added in chunk order in double and
// rounded once, as the CPU reference does with its per-column double accumulators.
template <typename T>
__global__ void layernorm_param_final_kernel(const double* partial_gamma, const double* partial_beta, T* dgamma,
                                             T* dbeta, int64_t chunks, int64_t cols) {
  GRID_STRIDE_LOOP(c, cols) {
    double acc_g = 0.0, acc_b = 0.0;
    for (int64_t k = 0; k < chunks; ++k) {
      acc_g += partial_gamma[k * cols + c];
      acc_b += partial_beta[k * cols + c];
    }
    dgamma[c] += static_cast<T>(acc_g);
    dbeta[c] += static_cast<T>(acc_b);
  }
}

// One block per row r of scores: (rows, seq), query position t = r % seq; in place:
// softmax over s <= t, zeros for s > t (the scores arrive already scaled by 1/sqrt(D),
// the alpha of the q k^T product, as in the CPU reference). Each thread rescales the
// entries it wrote itself, so no barrier is needed between those passes.
template <typename T>
__global__ void causal_softmax_kernel(T* scores, int64_t seq) {
  __shared__ T shared[32];
  const int64_t row = blockIdx.x;
  const int64_t t = row % seq;
  T* p = scores + row * seq;

  T mx = neg_infinity<T>();
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) mx = dev_max(mx, p[s]);
  mx = block_allreduce(mx, MaxOp(), neg_infinity<T>(), shared);

  T sum = T(0);
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) {
    const T e = dev_exp(p[s] - mx);
    p[s] = e;
    sum += e;
  }
  sum = block_allreduce(sum, SumOp(), T(0), shared);

  const T inv = T(1) / sum;
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) p[s] *= inv;
  for (int64_t s = t + 1 + threadIdx.x; s < seq; s += blockDim.x) p[s] = T(0);
}

// One block per row (as causal_softmax_kernel); in place on d:
//   d[s] = probs[s] * (d[s] - sum_{s' <= t} d[s'] probs[s'])  for s <= t, else 0.
template <typename T>
__global__ void causal_softmax_backward_kernel(const T* probs, T* d, int64_t seq) {
  __shared__ T shared[32];
  const int64_t row = blockIdx.x;
  const int64_t t = row % seq;
  const T* p = probs + row * seq;
  T* g = d + row * seq;

  T dot = T(0);
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) dot += p[s] * g[s];
  dot = block_allreduce(dot, SumOp(), T(0), shared);

  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) g[s] = p[s] * (g[s] - dot);
  for (int64_t s = t + 1 + threadIdx.x; s < seq; s += blockDim.x) g[s] = T(0);
}

// Inverted dropout over x: (rows, per_row), row i's elements the sample's elements
// first .. first + per_row - 1. One thread per group of four consecutive sample
// elements 4k .. 4k + 3 (k from first / 4): they share one Philox block (counter
// (k, sample)), computed once; lane j of the block is the value
// philox_uniform(key, sample, 4k + j) returns, by the same expression
// (runtime/philox.h). The first and last groups of a row may lie partly outside it.
// The key: k.key, or with k.step mixed_key of k's base and the step's scalars' step index.
template <typename T>
__global__ void dropout_kernel(const T* x, T* y, int64_t rows, int64_t per_row, int64_t groups_per_row, double p,
                               T scale, DropoutKeyArgs k_args, uint64_t sample_offset, int64_t first) {
  const uint64_t key = k_args.step == nullptr
                           ? k_args.key
                           : mixed_key(k_args.base, k_args.multiplier, static_cast<uint64_t>(k_args.step[kStepIndex]));
  const int64_t n = rows * groups_per_row;
  const int64_t first_group = first / 4, last = first + per_row;
  GRID_STRIDE_LOOP(idx, n) {
    const int64_t i = idx / groups_per_row;
    const int64_t group = first_group + (idx - i * groups_per_row);  // of the sample's elements
    const uint64_t sample = sample_offset + static_cast<uint64_t>(i);
    const uint64_t k = static_cast<uint64_t>(group);  // == element >> 2
    const Philox4x32 counter{{static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32),
                              static_cast<uint32_t>(sample), static_cast<uint32_t>(sample >> 32)}};
    const Philox4x32 r = philox4x32_10(counter, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
    const int64_t base = i * per_row - first + group * 4;  // x's index of the sample's element 4k
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t e = group * 4 + j;
      if (e >= first && e < last) {
        const float u = static_cast<float>(r.v[j] >> 8) * (1.0f / 16777216.0f);
        y[base + j] = static_cast<double>(u) >= p ? x[base + j] * scale : T(0);
      }
    }
  }
}

// ---- cast (Backend::cast): the host's conversions of runtime/bf16.h and fp16.h, compiled for the GPU.

__device__ inline void convert(float x, BFloat16& y) { y = float_to_bf16(x); }
__device__ inline void convert(double x, BFloat16& y) { y = double_to_bf16(x); }
__device__ inline void convert(BFloat16 x, float& y) { y = bf16_to_float(x); }
__device__ inline void convert(BFloat16 x, double& y) { y = bf16_to_double(x); }
__device__ inline void convert(float x, double& y) { y = static_cast<double>(x); }
__device__ inline void convert(double x, float& y) { y = __double2float_rn(x); }
__device__ inline void convert(float x, Half& y) { y = float_to_half(x); }
__device__ inline void convert(double x, Half& y) { y = double_to_half(x); }
__device__ inline void convert(Half x, float& y) { y = half_to_float(x); }
__device__ inline void convert(Half x, double& y) { y = half_to_double(x); }

template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { convert(src[i], dst[i]); }
}

// Lists: sources, destinations (the cast of each element, as cast_kernel).
template <typename S, typename D>
__global__ void multi_cast_kernel(MultiTensorTable tab) {
  for_each_chunk(tab, [&](int64_t t, int64_t begin, int64_t end) {
    const S* src = multi_ptr<S>(tab, 0, t);
    D* dst = multi_ptr<D>(tab, 1, t);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) convert(src[i], dst[i]);
  });
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
void launch_bias_grad(const T* dy, T* db, int64_t rows, int64_t cols, double beta, double* workspace,
                      cudaStream_t stream) {
  if (cols == 0) return;  // rows == 0 still writes beta * db
  const int64_t chunks = row_chunks(rows);
  const int64_t rows_per_chunk = std::max<int64_t>((rows + chunks - 1) / chunks, 1);
  const dim3 block(kTileCols, kBiasGradRowLanes);
  const dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols), static_cast<unsigned>(chunks));
  column_sums_partial_kernel<<<grid, block, 0, stream>>>(ColumnOf<T>{dy, cols}, workspace, rows, cols,
                                                         rows_per_chunk);
  GPIPE_CHECK_LAUNCH();
  bias_grad_final_kernel<T><<<elementwise_blocks(cols), kThreads, 0, stream>>>(workspace, db, chunks, cols,
                                                                              static_cast<T>(beta), beta != 0.0);
  GPIPE_CHECK_LAUNCH();
}

// RMSNorm's weight gradient, dg += column sums of dy (x rstd): bias_grad of the terms, with
// each term made where it is added (no (rows, cols) temporary), in the same order.
template <typename S>
void launch_rmsnorm_weight_grad(const S* dy, const S* x, const Wide<S>* rstd, Wide<S>* dg, int64_t rows,
                                int64_t cols, double* workspace, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t chunks = row_chunks(rows);
  const int64_t rows_per_chunk = std::max<int64_t>((rows + chunks - 1) / chunks, 1);
  const dim3 block(kTileCols, kBiasGradRowLanes);
  const dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols), static_cast<unsigned>(chunks));
  column_sums_partial_kernel<<<grid, block, 0, stream>>>(RmsNormWeightTerm<S>{dy, x, rstd, cols}, workspace, rows,
                                                         cols, rows_per_chunk);
  GPIPE_CHECK_LAUNCH();
  bias_grad_final_kernel<Wide<S>><<<elementwise_blocks(cols), kThreads, 0, stream>>>(workspace, dg, chunks, cols,
                                                                                    Wide<S>(1), true);
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
void launch_softmax_xent(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                         int ignore_index, T* probs, T* row_loss, T* loss, ErrorSlot* error,
                         cudaStream_t stream) {
  check_row_grid(rows, "softmax_xent");
  if (rows > 0) {
    softmax_xent_forward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
        logits, labels, cols, ignore_index, probs, row_loss, error);
    GPIPE_CHECK_LAUNCH();
  }
  loss_sum_kernel<T><<<1, kLossSumThreads, 0, stream>>>(row_loss, rows, scale, loss);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_softmax_xent_backward(const T* probs, const int32_t* labels, int64_t rows, int64_t cols,
                                  LossScaleArg scale, int ignore_index, T* dlogits, ErrorSlot* error,
                                  cudaStream_t stream) {
  check_row_grid(rows, "softmax_xent_backward");
  if (rows == 0) return;
  softmax_xent_backward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      probs, labels, cols, scale, ignore_index, dlogits, error);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_softmax_xent_slice_sums(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, int64_t first,
                                    int64_t vocab, int ignore_index, const T* rowmax, T* sums, ErrorSlot* error,
                                    cudaStream_t stream) {
  check_row_grid(rows, "softmax_xent_slice_sums");
  if (rows == 0) return;
  softmax_xent_slice_sums_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      logits, labels, rows, cols, first, vocab, ignore_index, rowmax, sums, error);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_softmax_xent_slice_loss(const T* sums, const T* rowmax, const int32_t* labels, int64_t rows,
                                    int ignore_index, LossScaleArg scale, T* lse, T* row_loss, T* loss,
                                    cudaStream_t stream) {
  if (rows > 0) {
    softmax_xent_slice_rows_kernel<T><<<elementwise_blocks(rows), kThreads, 0, stream>>>(sums, rowmax, labels, rows,
                                                                                         ignore_index, lse, row_loss);
    GPIPE_CHECK_LAUNCH();
  }
  loss_sum_kernel<T><<<1, kLossSumThreads, 0, stream>>>(row_loss, rows, scale, loss);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_softmax_xent_slice_backward(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                        int64_t first, int ignore_index, const T* lse, LossScaleArg scale, T* dlogits,
                                        cudaStream_t stream) {
  check_row_grid(rows, "softmax_xent_slice_backward");
  if (rows == 0) return;
  softmax_xent_slice_backward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      logits, labels, cols, first, ignore_index, lse, scale, dlogits);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_first_column_equal(const T* logits, const T* value, int64_t rows, int64_t cols, int64_t first,
                               int64_t none, T* index, cudaStream_t stream) {
  check_row_grid(rows, "first_column_equal");
  if (rows == 0) return;
  first_column_equal_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(logits, value, cols,
                                                                                              first, none, index);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_argmax_correct(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, int ignore_index,
                           unsigned long long* count, cudaStream_t stream) {
  check_row_grid(rows, "argmax_correct");
  if (rows == 0 || cols == 0) return;
  argmax_correct_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(logits, labels, cols,
                                                                                         ignore_index, count);
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
SgdScalars<T> sgd_scalars(double lr, double momentum, double weight_decay, bool nesterov, bool first_step) {
  return SgdScalars<T>{static_cast<T>(lr), static_cast<T>(momentum), static_cast<T>(weight_decay), nesterov,
                       first_step};
}

template <typename T>
void launch_sgd_step(T* param, const T* grad, T* buf, int64_t n, double lr, double momentum, double weight_decay,
                     bool nesterov, bool first_step, cudaStream_t stream) {
  if (n == 0) return;
  sgd_step_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(
      param, grad, buf, n, sgd_scalars<T>(lr, momentum, weight_decay, nesterov, first_step));
  GPIPE_CHECK_LAUNCH();
}

// decay: 1 - lr * weight_decay, computed by the caller (adam_step_scalars, the host's one
// place for it: the multi-tensor kernels read the same value from the step's scalars).
template <typename T>
AdamScalars<T> adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                            double decay, double bias_correction1, double bias_correction2) {
  AdamScalars<T> s;
  s.lr = static_cast<T>(lr);
  s.beta1 = static_cast<T>(beta1);
  s.beta2 = static_cast<T>(beta2);
  s.eps = static_cast<T>(eps);
  s.weight_decay = static_cast<T>(weight_decay);
  s.decay = static_cast<T>(decay);
  s.bias_correction1 = static_cast<T>(bias_correction1);
  s.bias_correction2 = static_cast<T>(bias_correction2);
  s.decoupled = decoupled;
  s.decay_weights = decoupled && weight_decay != 0.0;
  return s;
}

template <typename T>
void launch_adam_step(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool decoupled, double decay, double bias_correction1,
                      double bias_correction2, cudaStream_t stream) {
  if (n == 0) return;
  const AdamScalars<T> s =
      adam_scalars<T>(lr, beta1, beta2, eps, weight_decay, decoupled, decay, bias_correction1, bias_correction2);
  adam_step_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(param, grad, m, v, n, s);
  GPIPE_CHECK_LAUNCH();
}

int64_t sum_squares_blocks(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, kSumSquaresMaxBlocks));
}

template <typename T>
void launch_sum_squares(const T* x, int64_t n, double* workspace, double* result, cudaStream_t stream) {
  const int64_t blocks = sum_squares_blocks(n);
  sum_squares_partial_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, workspace);
  GPIPE_CHECK_LAUNCH();
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(workspace, blocks, result);
  GPIPE_CHECK_LAUNCH();
}

// Positions are sort values (int32) and error indices (<= kMaxErrorIndex).
void check_positions(int64_t positions, const char* op) {
  if (positions >= static_cast<int64_t>(INT_MAX)) {
    throw Error(std::string(op) + ": " + std::to_string(positions) +
                " token positions exceed the kernels' 32-bit position index (2^31 - 2)");
  }
}

// Without channels nothing else reads the ids, but they are still checked (as on the CPU).
void launch_validate_token_ids(const int32_t* ids, int64_t positions, int64_t vocab, ErrorSlot* error,
                               cudaStream_t stream) {
  if (positions == 0) return;
  validate_token_ids_kernel<<<elementwise_blocks(positions), kThreads, 0, stream>>>(ids, positions, vocab, error);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_embedding(const int32_t* ids, const T* table, const T* pos, T* out, int64_t batch, int64_t seq,
                      int64_t vocab, int64_t channels, int64_t first, int64_t total, ErrorSlot* error,
                      cudaStream_t stream) {
  const int64_t positions = batch * seq;
  check_positions(positions, "embedding");
  if (positions == 0) return;
  if (channels == 0) {
    launch_validate_token_ids(ids, positions, total, error, stream);
    return;
  }
  const int64_t n = positions * channels;
  embedding_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(ids, table, pos, out, positions, seq, vocab,
                                                                      channels, first, total, error);
  GPIPE_CHECK_LAUNCH();
}

// Workspace of embedding_backward: keys and positions before and after the sort, then
// CUB's temporary storage, each part aligned to kWorkspaceAlign bytes.
constexpr size_t kWorkspaceAlign = 256;
size_t align_up(size_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Bits that hold every key 0 .. vocab (vocab itself marks an invalid id).
int sort_bits(int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= vocab) ++bits;
  return bits;
}

size_t cub_sort_bytes(int64_t positions, int64_t vocab) {
  size_t bytes = 0;
  GPIPE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const unsigned*>(nullptr),
                                                   static_cast<unsigned*>(nullptr),
                                                   static_cast<const int32_t*>(nullptr),
                                                   static_cast<int32_t*>(nullptr), static_cast<int>(positions), 0,
                                                   sort_bits(vocab)));
  return bytes;
}

size_t embedding_workspace_bytes(int64_t positions, int64_t vocab, int64_t channels, size_t element_bytes) {
  check_positions(positions, "embedding_backward");
  if (positions == 0) return 0;
  const size_t array = align_up(static_cast<size_t>(positions) * sizeof(uint32_t));
  const int64_t segments = (positions + kEmbSegment - 1) / kEmbSegment;
  const size_t partials = align_up(static_cast<size_t>(segments * channels) * element_bytes);
  return 4 * array + align_up(cub_sort_bytes(positions, vocab)) + 2 * partials;
}

template <typename T>
void launch_embedding_backward(const int32_t* ids, const T* dout, T* dtable, T* dpos, int64_t batch, int64_t seq,
                               int64_t vocab, int64_t channels, int64_t first, int64_t total, void* workspace,
                               size_t workspace_bytes, ErrorSlot* error, cudaStream_t stream) {
  const int64_t positions = batch * seq;
  check_positions(positions, "embedding_backward");
  if (vocab >= static_cast<int64_t>(INT_MAX)) {
    throw Error("embedding_backward: a vocabulary of " + std::to_string(vocab) + " rows exceeds 2^31 - 2");
  }
  if (positions == 0) return;
  if (channels == 0) {
    launch_validate_token_ids(ids, positions, total, error, stream);
    return;
  }
  const size_t need = embedding_workspace_bytes(positions, vocab, channels, sizeof(T));
  if (workspace_bytes < need) {
    throw Error("embedding_backward: workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                std::to_string(need) + " needed");
  }
  const int64_t segments = (positions + kEmbSegment - 1) / kEmbSegment;
  const size_t array = align_up(static_cast<size_t>(positions) * sizeof(uint32_t));
  const size_t cub_bytes_needed = align_up(cub_sort_bytes(positions, vocab));
  const size_t partials = align_up(static_cast<size_t>(segments * channels) * sizeof(T));
  char* base = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<unsigned*>(base);
  auto* keys_out = reinterpret_cast<unsigned*>(base + array);
  auto* pos_in = reinterpret_cast<int32_t*>(base + 2 * array);
  auto* pos_out = reinterpret_cast<int32_t*>(base + 3 * array);
  void* cub_temp = base + 4 * array;
  size_t cub_bytes = cub_bytes_needed;
  T* head = reinterpret_cast<T*>(base + 4 * array + cub_bytes_needed);  // (segments, channels)
  T* cont = reinterpret_cast<T*>(base + 4 * array + cub_bytes_needed + partials);  // (segments, channels)

  embedding_sort_input_kernel<<<elementwise_blocks(positions), kThreads, 0, stream>>>(ids, positions, vocab, first,
                                                                                     total, keys_in, pos_in, error);
  GPIPE_CHECK_LAUNCH();
  // LSD radix sort is stable: equal keys keep their positions in increasing order.
  GPIPE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, keys_in, keys_out, pos_in, pos_out,
                                                   static_cast<int>(positions), 0, sort_bits(vocab), stream));
  embedding_segment_kernel<T><<<static_cast<unsigned>(segments), row_threads(channels), 0, stream>>>(
      keys_out, pos_out, dout, dtable, head, cont, positions, vocab, channels);
  GPIPE_CHECK_LAUNCH();
  embedding_run_kernel<T><<<static_cast<unsigned>(segments), row_threads(channels), 0, stream>>>(
      keys_out, dtable, head, cont, positions, segments, vocab, channels);
  GPIPE_CHECK_LAUNCH();
  if (dpos != nullptr) {
    embedding_pos_grad_kernel<T><<<elementwise_blocks(seq * channels), kThreads, 0, stream>>>(dout, dpos, batch, seq,
                                                                                            channels);
    GPIPE_CHECK_LAUNCH();
  }
}

template <typename T>
void launch_layernorm(const T* x, const T* gamma, const T* beta, double eps, T* y, T* mean, T* rstd, int64_t rows,
                      int64_t cols, cudaStream_t stream) {
  check_row_grid(rows, "layernorm");
  if (rows == 0) return;
  layernorm_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(x, gamma, beta, eps, y, mean,
                                                                                    rstd, cols);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_layernorm_backward(const T* dy, const T* x, const T* gamma, const T* mean, const T* rstd, T* dx,
                               T* dgamma, T* dbeta, int64_t rows, int64_t cols, double* workspace,
                               cudaStream_t stream) {
  check_row_grid(rows, "layernorm_backward");
  if (rows == 0 || cols == 0) return;
  const int64_t chunks = row_chunks(rows);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  double* partial_gamma = workspace;                // (chunks, cols)
  double* partial_beta = workspace + chunks * cols;  // (chunks, cols)
  // Parameter gradients first: dx may alias dy or x.
  const dim3 block(kTileCols, kLnRowLanes);
  const dim3 grid(static_cast<unsigned>((cols + kTileCols - 1) / kTileCols), static_cast<unsigned>(chunks));
  layernorm_param_partial_kernel<T><<<grid, block, 0, stream>>>(dy, x, mean, rstd, partial_gamma, partial_beta, rows,
                                                                cols, rows_per_chunk);
  GPIPE_CHECK_LAUNCH();
  layernorm_param_final_kernel<T><<<elementwise_blocks(cols), kThreads, 0, stream>>>(partial_gamma, partial_beta,
                                                                                     dgamma, dbeta, chunks, cols);
  GPIPE_CHECK_LAUNCH();
  layernorm_backward_dx_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, stream>>>(
      dy, x, gamma, mean, rstd, dx, cols);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_causal_softmax(T* scores, int64_t rows, int64_t seq, cudaStream_t stream) {
  check_row_grid(rows, "attention");
  if (rows == 0 || seq == 0) return;
  causal_softmax_kernel<T><<<static_cast<unsigned>(rows), row_threads(seq), 0, stream>>>(scores, seq);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_causal_softmax_backward(const T* probs, T* dprobs, int64_t rows, int64_t seq, cudaStream_t stream) {
  check_row_grid(rows, "attention_backward");
  if (rows == 0 || seq == 0) return;
  causal_softmax_backward_kernel<T><<<static_cast<unsigned>(rows), row_threads(seq), 0, stream>>>(probs, dprobs, seq);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_dropout(const T* x, T* y, int64_t rows, int64_t per_row, double p, const DropoutKeyArgs& key,
                    int64_t sample_offset, int64_t element_offset, cudaStream_t stream) {
  if (rows == 0 || per_row == 0) return;
  if (p == 0.0) {  // no mask to draw: a plain copy, bit for bit (as the CPU reference)
    if (y != x) {
      GPIPE_CUDA_CHECK(cudaMemcpyAsync(y, x, static_cast<size_t>(rows * per_row) * sizeof(T),
                                       cudaMemcpyDeviceToDevice, stream));
    }
    return;
  }
  // The groups of four sample elements that [element_offset, element_offset + per_row) touches.
  const int64_t groups_per_row = (element_offset + per_row + 3) / 4 - element_offset / 4;
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  dropout_kernel<T><<<elementwise_blocks(rows * groups_per_row), kThreads, 0, stream>>>(
      x, y, rows, per_row, groups_per_row, p, scale, key, static_cast<uint64_t>(sample_offset), element_offset);
  GPIPE_CHECK_LAUNCH();
}

template <typename S, typename D>
void launch_cast(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  cast_kernel<S, D><<<elementwise_blocks(n), kThreads, 0, stream>>>(static_cast<const S*>(src), static_cast<D*>(dst), n);
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

int64_t bias_grad_workspace(int64_t rows, int64_t cols) { return row_chunks(rows) * cols; }
template <typename S>
void rmsnorm_weight_grad(const S* dy, const S* x, const Master<S>* rstd, Master<S>* dg, int64_t rows, int64_t cols,
                         double* workspace, cudaStream_t stream) {
  launch_rmsnorm_weight_grad(dy, x, rstd, dg, rows, cols, workspace, stream);
}
template void rmsnorm_weight_grad<float>(const float*, const float*, const float*, float*, int64_t, int64_t, double*,
                                         cudaStream_t);
template void rmsnorm_weight_grad<double>(const double*, const double*, const double*, double*, int64_t, int64_t,
                                          double*, cudaStream_t);
template void rmsnorm_weight_grad<BFloat16>(const BFloat16*, const BFloat16*, const float*, float*, int64_t, int64_t,
                                            double*, cudaStream_t);
template void rmsnorm_weight_grad<Half>(const Half*, const Half*, const float*, float*, int64_t, int64_t, double*,
                                        cudaStream_t);
void bias_grad(const float* dy, float* db, int64_t rows, int64_t cols, double beta, double* workspace,
               cudaStream_t stream) {
  launch_bias_grad(dy, db, rows, cols, beta, workspace, stream);
}
void bias_grad(const double* dy, double* db, int64_t rows, int64_t cols, double beta, double* workspace,
               cudaStream_t stream) {
  launch_bias_grad(dy, db, rows, cols, beta, workspace, stream);
}

void add_bias(BFloat16* y, const BFloat16* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_add_bias(y, bias, rows, cols, stream);
}
void add_bias(Half* y, const Half* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_add_bias(y, bias, rows, cols, stream);
}

void relu(const float* x, float* y, int64_t n, cudaStream_t stream) { launch_relu(x, y, n, stream); }
void relu(const double* x, double* y, int64_t n, cudaStream_t stream) { launch_relu(x, y, n, stream); }
void relu(const BFloat16* x, BFloat16* y, int64_t n, cudaStream_t stream) { launch_relu(x, y, n, stream); }
void relu(const Half* x, Half* y, int64_t n, cudaStream_t stream) { launch_relu(x, y, n, stream); }

void relu_backward(const float* y, const float* dy, float* dx, int64_t n, cudaStream_t stream) {
  launch_relu_backward(y, dy, dx, n, stream);
}
void relu_backward(const double* y, const double* dy, double* dx, int64_t n, cudaStream_t stream) {
  launch_relu_backward(y, dy, dx, n, stream);
}
void relu_backward(const BFloat16* y, const BFloat16* dy, BFloat16* dx, int64_t n, cudaStream_t stream) {
  launch_relu_backward(y, dy, dx, n, stream);
}
void relu_backward(const Half* y, const Half* dy, Half* dx, int64_t n, cudaStream_t stream) {
  launch_relu_backward(y, dy, dx, n, stream);
}

void gelu(const float* x, float* y, int64_t n, cudaStream_t stream) { launch_gelu(x, y, n, stream); }
void gelu(const double* x, double* y, int64_t n, cudaStream_t stream) { launch_gelu(x, y, n, stream); }
void gelu(const BFloat16* x, BFloat16* y, int64_t n, cudaStream_t stream) { launch_gelu(x, y, n, stream); }
void gelu(const Half* x, Half* y, int64_t n, cudaStream_t stream) { launch_gelu(x, y, n, stream); }

void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, cudaStream_t stream) {
  launch_gelu_backward(x, dy, dx, n, stream);
}
void gelu_backward(const double* x, const double* dy, double* dx, int64_t n, cudaStream_t stream) {
  launch_gelu_backward(x, dy, dx, n, stream);
}
void gelu_backward(const BFloat16* x, const BFloat16* dy, BFloat16* dx, int64_t n, cudaStream_t stream) {
  launch_gelu_backward(x, dy, dx, n, stream);
}
void gelu_backward(const Half* x, const Half* dy, Half* dx, int64_t n, cudaStream_t stream) {
  launch_gelu_backward(x, dy, dx, n, stream);
}

#define GPIPE_XENT_SLICE(T)                                                                                     \
  void softmax_xent_slice_sums(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, int64_t first, \
                               int64_t vocab, int ignore_index, const T* rowmax, T* sums, ErrorSlot* error,       \
                               cudaStream_t stream) {                                                             \
    launch_softmax_xent_slice_sums(logits, labels, rows, cols, first, vocab, ignore_index, rowmax, sums, error,    \
                                   stream);                                                                       \
  }                                                                                                               \
  void softmax_xent_slice_loss(const T* sums, const T* rowmax, const int32_t* labels, int64_t rows,               \
                               int ignore_index, LossScaleArg scale, T* lse, T* row_loss, T* loss, cudaStream_t stream) { \
    launch_softmax_xent_slice_loss(sums, rowmax, labels, rows, ignore_index, scale, lse, row_loss, loss, stream); \
  }                                                                                                               \
  void softmax_xent_slice_backward(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,            \
                                   int64_t first, int ignore_index, const T* lse, LossScaleArg scale, T* dlogits,       \
                                   cudaStream_t stream) {                                                         \
    launch_softmax_xent_slice_backward(logits, labels, rows, cols, first, ignore_index, lse, scale, dlogits,      \
                                       stream);                                                                   \
  }                                                                                                               \
  void first_column_equal(const T* logits, const T* value, int64_t rows, int64_t cols, int64_t first, int64_t none, \
                          T* index, cudaStream_t stream) {                                                        \
    launch_first_column_equal(logits, value, rows, cols, first, none, index, stream);                             \
  }
GPIPE_XENT_SLICE(float)
GPIPE_XENT_SLICE(double)
#undef GPIPE_XENT_SLICE

void softmax_xent(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                  int ignore_index, float* probs, float* row_loss, float* loss, ErrorSlot* error,
                  cudaStream_t stream) {
  launch_softmax_xent(logits, labels, rows, cols, scale, ignore_index, probs, row_loss, loss, error, stream);
}
void softmax_xent(const double* logits, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                  int ignore_index, double* probs, double* row_loss, double* loss, ErrorSlot* error,
                  cudaStream_t stream) {
  launch_softmax_xent(logits, labels, rows, cols, scale, ignore_index, probs, row_loss, loss, error, stream);
}

void softmax_xent_backward(const float* probs, const int32_t* labels, int64_t rows, int64_t cols, LossScaleArg scale,
                           int ignore_index, float* dlogits, ErrorSlot* error, cudaStream_t stream) {
  launch_softmax_xent_backward(probs, labels, rows, cols, scale, ignore_index, dlogits, error, stream);
}
void softmax_xent_backward(const double* probs, const int32_t* labels, int64_t rows, int64_t cols,
                           LossScaleArg scale, int ignore_index, double* dlogits, ErrorSlot* error,
                           cudaStream_t stream) {
  launch_softmax_xent_backward(probs, labels, rows, cols, scale, ignore_index, dlogits, error, stream);
}

void argmax_correct(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, int ignore_index,
                    unsigned long long* count, cudaStream_t stream) {
  launch_argmax_correct(logits, labels, rows, cols, ignore_index, count, stream);
}
void argmax_correct(const double* logits, const int32_t* labels, int64_t rows, int64_t cols, int ignore_index,
                    unsigned long long* count, cudaStream_t stream) {
  launch_argmax_correct(logits, labels, rows, cols, ignore_index, count, stream);
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

void adam_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, double decay, double bias_correction1,
               double bias_correction2, cudaStream_t stream) {
  launch_adam_step(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, decoupled, decay, bias_correction1,
                   bias_correction2, stream);
}
void adam_step(double* param, const double* grad, double* m, double* v, int64_t n, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, double decay, double bias_correction1,
               double bias_correction2, cudaStream_t stream) {
  launch_adam_step(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, decoupled, decay, bias_correction1,
                   bias_correction2, stream);
}

int64_t sum_squares_workspace(int64_t n) { return sum_squares_blocks(n); }
void sum_squares(const float* x, int64_t n, double* workspace, double* result, cudaStream_t stream) {
  launch_sum_squares(x, n, workspace, result, stream);
}
void sum_squares(const double* x, int64_t n, double* workspace, double* result, cudaStream_t stream) {
  launch_sum_squares(x, n, workspace, result, stream);
}

void embedding(const int32_t* ids, const float* table, const float* pos, float* out, int64_t batch,
               int64_t seq, int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream) {
  launch_embedding(ids, table, pos, out, batch, seq, vocab, channels, 0, vocab, error, stream);
}
void embedding(const int32_t* ids, const double* table, const double* pos, double* out, int64_t batch,
               int64_t seq, int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream) {
  launch_embedding(ids, table, pos, out, batch, seq, vocab, channels, 0, vocab, error, stream);
}
void embedding(const int32_t* ids, const BFloat16* table, const BFloat16* pos, BFloat16* out, int64_t batch,
               int64_t seq, int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream) {
  launch_embedding(ids, table, pos, out, batch, seq, vocab, channels, 0, vocab, error, stream);
}
void embedding(const int32_t* ids, const Half* table, const Half* pos, Half* out, int64_t batch, int64_t seq,
               int64_t vocab, int64_t channels, ErrorSlot* error, cudaStream_t stream) {
  launch_embedding(ids, table, pos, out, batch, seq, vocab, channels, 0, vocab, error, stream);
}

size_t embedding_backward_workspace_bytes(int64_t positions, int64_t vocab, int64_t channels, size_t element_bytes) {
  return embedding_workspace_bytes(positions, vocab, channels, element_bytes);
}
void embedding_backward(const int32_t* ids, const float* dout, float* dtable, float* dpos, int64_t batch,
                        int64_t seq, int64_t vocab, int64_t channels, void* workspace, size_t workspace_bytes,
                        ErrorSlot* error, cudaStream_t stream) {
  launch_embedding_backward(ids, dout, dtable, dpos, batch, seq, vocab, channels, 0, vocab, workspace,
                            workspace_bytes, error, stream);
}
void embedding_backward(const int32_t* ids, const double* dout, double* dtable, double* dpos, int64_t batch,
                        int64_t seq, int64_t vocab, int64_t channels, void* workspace, size_t workspace_bytes,
                        ErrorSlot* error, cudaStream_t stream) {
  launch_embedding_backward(ids, dout, dtable, dpos, batch, seq, vocab, channels, 0, vocab, workspace,
                            workspace_bytes, error, stream);
}

#define GPIPE_EMBEDDING_SLICE(T)                                                                              \
  void embedding_slice(const int32_t* ids, const T* table, T* out, int64_t batch, int64_t seq, int64_t rows,     \
                       int64_t channels, int64_t first, int64_t vocab, ErrorSlot* error, cudaStream_t stream) {  \
    launch_embedding(ids, table, static_cast<const T*>(nullptr), out, batch, seq, rows, channels, first, vocab, \
                     error, stream);                                                                             \
  }
GPIPE_EMBEDDING_SLICE(float)
GPIPE_EMBEDDING_SLICE(double)
GPIPE_EMBEDDING_SLICE(BFloat16)
GPIPE_EMBEDDING_SLICE(Half)
#undef GPIPE_EMBEDDING_SLICE
#define GPIPE_EMBEDDING_SLICE_BACKWARD(T)                                                                        \
  void embedding_slice_backward(const int32_t* ids, const T* dout, T* dtable, int64_t batch, int64_t seq,        \
                                int64_t rows, int64_t channels, int64_t first, int64_t vocab, void* workspace,   \
                                size_t workspace_bytes, ErrorSlot* error, cudaStream_t stream) {                 \
    launch_embedding_backward(ids, dout, dtable, static_cast<T*>(nullptr), batch, seq, rows, channels, first,   \
                              vocab, workspace, workspace_bytes, error, stream);                                 \
  }
GPIPE_EMBEDDING_SLICE_BACKWARD(float)
GPIPE_EMBEDDING_SLICE_BACKWARD(double)
#undef GPIPE_EMBEDDING_SLICE_BACKWARD

void layernorm(const float* x, const float* gamma, const float* beta, double eps, float* y, float* mean,
               float* rstd, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_layernorm(x, gamma, beta, eps, y, mean, rstd, rows, cols, stream);
}
void layernorm(const double* x, const double* gamma, const double* beta, double eps, double* y, double* mean,
               double* rstd, int64_t rows, int64_t cols, cudaStream_t stream) {
  launch_layernorm(x, gamma, beta, eps, y, mean, rstd, rows, cols, stream);
}

int64_t layernorm_backward_workspace(int64_t rows, int64_t cols) { return 2 * row_chunks(rows) * cols; }
void layernorm_backward(const float* dy, const float* x, const float* gamma, const float* mean, const float* rstd,
                        float* dx, float* dgamma, float* dbeta, int64_t rows, int64_t cols, double* workspace,
                        cudaStream_t stream) {
  launch_layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, rows, cols, workspace, stream);
}
void layernorm_backward(const double* dy, const double* x, const double* gamma, const double* mean,
                        const double* rstd, double* dx, double* dgamma, double* dbeta, int64_t rows, int64_t cols,
                        double* workspace, cudaStream_t stream) {
  launch_layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, rows, cols, workspace, stream);
}

void causal_softmax(float* scores, int64_t rows, int64_t seq, cudaStream_t stream) {
  launch_causal_softmax(scores, rows, seq, stream);
}
void causal_softmax(double* scores, int64_t rows, int64_t seq, cudaStream_t stream) {
  launch_causal_softmax(scores, rows, seq, stream);
}
void causal_softmax_backward(const float* probs, float* dprobs, int64_t rows, int64_t seq, cudaStream_t stream) {
  launch_causal_softmax_backward(probs, dprobs, rows, seq, stream);
}
void causal_softmax_backward(const double* probs, double* dprobs, int64_t rows, int64_t seq,
                             cudaStream_t stream) {
  launch_causal_softmax_backward(probs, dprobs, rows, seq, stream);
}

void dropout(const float* x, float* y, int64_t rows, int64_t per_row, double p, const DropoutKeyArgs& key,
             int64_t sample_offset, int64_t element_offset, cudaStream_t stream) {
  launch_dropout(x, y, rows, per_row, p, key, sample_offset, element_offset, stream);
}
void dropout(const double* x, double* y, int64_t rows, int64_t per_row, double p, const DropoutKeyArgs& key,
             int64_t sample_offset, int64_t element_offset, cudaStream_t stream) {
  launch_dropout(x, y, rows, per_row, p, key, sample_offset, element_offset, stream);
}

void cast(const void* src, DType from, void* dst, DType to, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (from == DType::kF32 && to == DType::kBF16) return launch_cast<float, BFloat16>(src, dst, n, stream);
  if (from == DType::kF64 && to == DType::kBF16) return launch_cast<double, BFloat16>(src, dst, n, stream);
  if (from == DType::kBF16 && to == DType::kF32) return launch_cast<BFloat16, float>(src, dst, n, stream);
  if (from == DType::kBF16 && to == DType::kF64) return launch_cast<BFloat16, double>(src, dst, n, stream);
  if (from == DType::kF32 && to == DType::kF16) return launch_cast<float, Half>(src, dst, n, stream);
  if (from == DType::kF64 && to == DType::kF16) return launch_cast<double, Half>(src, dst, n, stream);
  if (from == DType::kF16 && to == DType::kF32) return launch_cast<Half, float>(src, dst, n, stream);
  if (from == DType::kF16 && to == DType::kF64) return launch_cast<Half, double>(src, dst, n, stream);
  if (from == DType::kF32 && to == DType::kF64) return launch_cast<float, double>(src, dst, n, stream);
  if (from == DType::kF64 && to == DType::kF32) return launch_cast<double, float>(src, dst, n, stream);
  throw Error(std::string("cast from ") + dtype_name(from) + " to " + dtype_name(to) + " on a GPU");
}

// ---- Multi-tensor launches

std::vector<int64_t> multi_tensor_image(const std::vector<std::vector<const void*>>& lists,
                                        const std::vector<int64_t>& numel) {
  const int64_t n = static_cast<int64_t>(numel.size());
  std::vector<int64_t> image;
  image.reserve(static_cast<size_t>(2 * n + 1 + static_cast<int64_t>(lists.size()) * n));
  int64_t chunks = 0;
  for (int64_t t = 0; t < n; ++t) {
    GPIPE_CHECK(numel[t] > 0, "multi_tensor_image: tensor " + std::to_string(t) + " is empty");
    image.push_back(chunks);
    chunks += (numel[t] + kMultiTensorChunk - 1) / kMultiTensorChunk;
  }
  image.push_back(chunks);
  image.insert(image.end(), numel.begin(), numel.end());
  for (const std::vector<const void*>& list : lists) {
    GPIPE_CHECK(static_cast<int64_t>(list.size()) == n, "multi_tensor_image: a list of another length");
    for (const void* p : list) image.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
  }
  return image;
}

MultiTensorTable multi_tensor_view(const int64_t* image, const std::vector<int64_t>& host_image, int lists) {
  MultiTensorTable tab;
  tab.tensors = (static_cast<int64_t>(host_image.size()) - 1) / (2 + lists);
  tab.lists = lists;
  tab.chunks = host_image[static_cast<size_t>(tab.tensors)];
  tab.chunk_start = image;
  tab.numel = image + tab.tensors + 1;
  tab.ptrs = reinterpret_cast<void* const*>(image + 2 * tab.tensors + 1);
  return tab;
}

namespace {
unsigned multi_blocks(const MultiTensorTable& tab, int64_t cap) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(tab.chunks, cap)));
}
}  // namespace

void multi_sgd_step(const MultiTensorTable& tab, DType t, double momentum, double weight_decay, bool nesterov,
                    const double* step, cudaStream_t stream) {
  if (tab.chunks == 0) return;
  if (t == DType::kF32) {
    multi_sgd_kernel<float><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(
        tab, sgd_scalars<float>(0.0, momentum, weight_decay, nesterov, false), step);
  } else if (t == DType::kF64) {
    multi_sgd_kernel<double><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(
        tab, sgd_scalars<double>(0.0, momentum, weight_decay, nesterov, false), step);
  } else {
    throw Error(std::string("multi_sgd_step: ") + dtype_name(t) + " tensors; float32 or float64 only");
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

void multi_adam_step(const MultiTensorTable& tab, DType t, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, const double* step, cudaStream_t stream) {
  if (tab.chunks == 0) return;
  // lr, decay and the bias corrections: the kernel's, from `step`.
  if (t == DType::kF32) {
    multi_adam_kernel<float><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(
        tab, adam_scalars<float>(0.0, beta1, beta2, eps, weight_decay, decoupled, 1.0, 1.0, 1.0), step);
  } else if (t == DType::kF64) {
    multi_adam_kernel<double><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(
        tab, adam_scalars<double>(0.0, beta1, beta2, eps, weight_decay, decoupled, 1.0, 1.0, 1.0), step);
  } else {
    throw Error(std::string("multi_adam_step: ") + dtype_name(t) + " tensors; float32 or float64 only");
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

void multi_scale(const MultiTensorTable& tab, DType t, double alpha, bool fill, cudaStream_t stream) {
  if (tab.chunks == 0) return;
  if (t == DType::kF32) {
    multi_scale_kernel<float><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(tab, static_cast<float>(alpha),
                                                                                    fill);
  } else if (t == DType::kF64) {
    multi_scale_kernel<double><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(tab, alpha, fill);
  } else {
    throw Error(std::string("multi_scale: ") + dtype_name(t) + " tensors; float32 or float64 only");
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

void multi_scale_by(const MultiTensorTable& tab, DType t, const double* step, cudaStream_t stream) {
  if (tab.chunks == 0) return;
  if (t == DType::kF32) {
    multi_scale_by_kernel<float><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(tab, step);
  } else if (t == DType::kF64) {
    multi_scale_by_kernel<double><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(tab, step);
  } else {
    throw Error(std::string("multi_scale_by: ") + dtype_name(t) + " tensors; float32 or float64 only");
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

void step_grad_scale(double* step, double max_norm, bool skip_nonfinite,
                     const ErrorSlot* slots, int64_t slot_count, cudaStream_t stream) {
  step_grad_scale_kernel<<<1, kThreads, 0, stream>>>(step, max_norm, skip_nonfinite, slots,
                                                     slot_count);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

int64_t multi_sum_squares_workspace(const MultiTensorTable& tab) {
  return multi_blocks(tab, kSumSquaresMaxBlocks);
}

void multi_sum_squares(const MultiTensorTable& tab, DType t, double* workspace, double* result,
                       cudaStream_t stream) {
  const unsigned blocks = multi_blocks(tab, kSumSquaresMaxBlocks);
  if (t == DType::kF32) {
    multi_sum_squares_kernel<float><<<blocks, kThreads, 0, stream>>>(tab, workspace);
  } else if (t == DType::kF64) {
    multi_sum_squares_kernel<double><<<blocks, kThreads, 0, stream>>>(tab, workspace);
  } else {
    throw Error(std::string("multi_sum_squares: ") + dtype_name(t) + " tensors; float32 or float64 only");
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(workspace, blocks, result);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

bool multi_cast_supported(DType from, DType to) {
  return from == DType::kF32 && (to == DType::kBF16 || to == DType::kF16);
}

void multi_cast(const MultiTensorTable& tab, DType from, DType to, cudaStream_t stream) {
  if (tab.chunks == 0) return;
  GPIPE_CHECK(multi_cast_supported(from, to),
              std::string("multi_cast from ") + dtype_name(from) + " to " + dtype_name(to));
  if (to == DType::kBF16) {
    multi_cast_kernel<float, BFloat16><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(tab);
  } else {
    multi_cast_kernel<float, Half><<<multi_blocks(tab, kMaxBlocks), kThreads, 0, stream>>>(tab);
  }
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda
}  // namespace gpipe
