// Kernels of the CUDA convolution ops and their launchers (declared in
// kernels/cuda_conv_kernels.h): per-channel bias and its gradient, the per-channel
// conversions between the batch-norm contract's biased variance and cuDNN's inverse
// standard deviation (batch norm itself is cuDNN, in kernels/cuda_conv_ops.cc), max
// pooling with argmax.
//
// Per-channel work on an (N, C, E) tensor runs over its N C planes of E contiguous
// positions: plane kernels take a 2-D grid (x over positions, y over planes, both
// grid-stride) so each block reads its channel's parameters once. Per-channel sums run
// in two steps with a shape-only geometry, so the result is the same on every run:
// grid (channel, chunk) blocks each reduce a fixed run of the channel's N E values
// into a partial sum in double (per-thread sums, then a fixed warp/block tree), then
// one thread per channel adds its chunks in order. No floating-point atomics.
//
// Additions are written as explicitly rounded operations (__fadd_rn and friends) so
// nvcc cannot fuse them into fmas. Max pooling and its backward (comparisons, and
// additions in the CPU loop's order) match kernels/cpu_conv_ops.cc bit for bit.
#include "kernels/cuda_conv_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {
namespace cuda_conv {

namespace {

// ---------------------------------------------------------------------------------
// Launch geometry

constexpr int kThreads = 256;                  // elementwise and reduction blocks
constexpr int64_t kMaxBlocks = 65536;          // grid cap for 1-D grid-stride kernels
constexpr int64_t kMaxGridY = 65535;           // hardware limit of gridDim.y
constexpr int64_t kMaxPlaneBlocksX = 1024;     // plane kernels: blocks along the positions
constexpr int64_t kMinPerChunk = 8 * kThreads;  // channel sums: values per partial sum, at least
constexpr int64_t kMaxChunks = 512;            // ... and at most this many partial sums per channel

#define GPIPE_CHECK_LAUNCH() GPIPE_CUDA_CHECK(cudaGetLastError())

#define GRID_STRIDE_LOOP(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)));
}

// Plane kernels: a multiple of 32 threads, no more than a plane needs, at most kThreads.
unsigned plane_threads(int64_t positions) {
  return static_cast<unsigned>(std::min<int64_t>((std::max<int64_t>(positions, 1) + 31) / 32 * 32, kThreads));
}
dim3 plane_grid(int64_t planes, int64_t positions, unsigned threads) {
  const int64_t bx = std::min<int64_t>((positions + threads - 1) / threads, kMaxPlaneBlocksX);
  return dim3(static_cast<unsigned>(std::max<int64_t>(bx, 1)),
              static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(planes, kMaxGridY))));
}

// Partial sums per channel: a function of the number of values m = N E alone.
int64_t reduction_chunks(int64_t m) {
  return std::max<int64_t>(1, std::min<int64_t>((m + kMinPerChunk - 1) / kMinPerChunk, kMaxChunks));
}

void check_channels(int64_t channels, const char* op) {
  if (channels >= static_cast<int64_t>(INT32_MAX)) {
    throw Error(std::string(op) + ": " + std::to_string(channels) + " channels exceed the CUDA grid limit");
  }
}

// ---------------------------------------------------------------------------------
// Device helpers: correctly rounded operations that nvcc does not contract.

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// Sum of v over a 1-D block whose size is a multiple of 32; thread 0 receives it.
// shared: 32 doubles. A fixed tree, so the same inputs give the same bits.
__device__ double block_sum(double v, double* shared) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shared[lane] : 0.0;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  __syncthreads();  // shared may be reused right away
  return v;
}

// ---------------------------------------------------------------------------------
// Per-channel sums (the bias gradient)

// Grid (C, chunks), 1-D blocks of kThreads. Block (c, k) sums, in double, values
// [k L, min((k + 1) L, m)) of channel c of v: (N, C, E), value j being element
// (n C + c) E + e with n = j / E, e = j % E; partial: (C, chunks).
template <typename T>
__global__ void channel_partial_kernel(const T* v, int64_t channels, int64_t positions, int64_t m,
                                       int64_t per_chunk, double* partial) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t chunks = gridDim.y;
  const int64_t start = chunk * per_chunk;
  const int64_t end = start + per_chunk < m ? start + per_chunk : m;
  double a = 0.0;
  int64_t j = start + threadIdx.x;
  if (j < end) {
    // Walk n and e incrementally: one division per thread, not per value.
    int64_t n = j / positions, e = j - n * positions;
    const int64_t step = blockDim.x;
    const int64_t step_n = step / positions, step_e = step - step_n * positions;
    for (; j < end; j += step) {
      a += static_cast<double>(v[(n * channels + c) * positions + e]);
      n += step_n;
      e += step_e;
      if (e >= positions) {
        e -= positions;
        ++n;
      }
    }
  }
  a = block_sum(a, shared);
  if (threadIdx.x == 0) partial[c * chunks + chunk] = a;
}

// Launches channel_partial_kernel over all channels into workspace rows (C, chunks).
template <typename T>
void launch_channel_partials(const T* v, int64_t n, int64_t channels, int64_t positions, double* partial,
                             cudaStream_t stream) {
  const int64_t m = n * positions;
  const int64_t chunks = reduction_chunks(m);
  const int64_t per_chunk = (m + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>(channels), static_cast<unsigned>(chunks));
  channel_partial_kernel<T><<<grid, kThreads, 0, stream>>>(v, channels, positions, m, per_chunk, partial);
  GPIPE_CHECK_LAUNCH();
}

// Sum of row c of partial: (C, chunks), in chunk order.
__device__ __forceinline__ double sum_chunks(const double* partial, int64_t c, int64_t chunks) {
  double s = 0.0;
  for (int64_t k = 0; k < chunks; ++k) s += partial[c * chunks + k];
  return s;
}

// ---------------------------------------------------------------------------------
// Kernels

// y[(n C + c) E + e] += bias[c].
template <typename T>
__global__ void add_channel_bias_kernel(T* y, const T* bias, int64_t planes, int64_t channels, int64_t positions) {
  for (int64_t plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    const T b = bias[plane % channels];
    T* row = y + plane * positions;
    GRID_STRIDE_LOOP(e, positions) row[e] = add_rn(row[e], b);
  }
}

template <typename T>
__global__ void channel_bias_grad_final_kernel(const double* partial, T* db, int64_t channels, int64_t chunks) {
  GRID_STRIDE_LOOP(c, channels) db[c] = add_rn(db[c], static_cast<T>(sum_chunks(partial, c, chunks)));
}

// Batch norm (kernels/cuda_conv_ops.cc): cuDNN's saved inverse standard deviation to
// the biased variance, in place and in double: var = 1 / invstd^2 - eps, clamped at 0
// (for a channel of (nearly) equal values the rounding of invstd can leave a tiny
// negative number). The comparison lets a NaN through.
template <typename T>
__global__ void batchnorm_invstd_to_var_kernel(T* v, double eps, int64_t channels) {
  GRID_STRIDE_LOOP(c, channels) {
    const double s = static_cast<double>(v[c]);
    const double var = __dsub_rn(__ddiv_rn(1.0, __dmul_rn(s, s)), eps);
    v[c] = static_cast<T>(var < 0.0 ? 0.0 : var);
  }
}

// The other way, for cuDNN's backward: invstd = T(1 / sqrt(double(var) + eps)), the CPU
// reference's rstd rounded once to T.
template <typename T>
__global__ void batchnorm_var_to_invstd_kernel(const T* var, double eps, T* invstd, int64_t channels) {
  GRID_STRIDE_LOOP(c, channels) {
    invstd[c] = static_cast<T>(__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(static_cast<double>(var[c]), eps))));
  }
}

// One thread per output (plane, p, q): the window clipped to the image, scanned in
// row-major order; the first maximum wins ties, a NaN wins over numbers.
template <typename T>
__global__ void maxpool2d_kernel(const T* x, T* y, int32_t* argmax, int64_t total, int64_t height, int64_t width,
                                 int64_t out_height, int64_t out_width, int kernel, int stride, int pad) {
  GRID_STRIDE_LOOP(o, total) {
    const int64_t q = o % out_width;
    const int64_t p = (o / out_width) % out_height;
    const int64_t plane = o / (out_width * out_height);
    const T* in = x + plane * height * width;
    const int64_t hs = p * stride - pad, ws = q * stride - pad;
    const int64_t h0 = hs > 0 ? hs : 0, h1 = hs + kernel < height ? hs + kernel : height;
    const int64_t w0 = ws > 0 ? ws : 0, w1 = ws + kernel < width ? ws + kernel : width;
    int64_t best = h0 * width + w0;
    T bv = in[best];
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t w = w0; w < w1; ++w) {
        const T v = in[h * width + w];
        if (v > bv || (isnan(v) && !isnan(bv))) {
          bv = v;
          best = h * width + w;
        }
      }
    }
    y[o] = bv;
    argmax[o] = static_cast<int32_t>(best);
  }
}

// One warp per plane (the planes strided over the grid's warps); dx is zero already.
// The warp takes the plane's outputs 32 at a time, in order. Within a batch, the lowest
// lane of the lanes that share a target adds their dy values into dx one by one in lane
// order, so every element of dx receives its additions in the CPU loop's order (bit for
// bit, overlapping windows included) with no atomics, and a plane's outputs are spread
// over 32 lanes instead of walked by one thread. An index outside the plane is skipped
// and flagged; atomicMin keeps the lowest flat index.
template <typename T>
__global__ void maxpool2d_backward_kernel(const T* __restrict__ dy, const int32_t* __restrict__ argmax, T* dx,
                                          int64_t planes, int64_t out_size, int64_t in_size, cuda::ErrorSlot* error) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t plane = warp; plane < planes; plane += warps) {  // uniform across the warp
    const T* g = dy + plane * out_size;
    const int32_t* a = argmax + plane * out_size;
    T* out = dx + plane * in_size;
    for (int64_t base = 0; base < out_size; base += 32) {
      const int64_t o = base + lane;
      int32_t target = -1;  // no output here, or a bad index: adds nothing
      T v = T(0);
      if (o < out_size) {
        const int32_t i = a[o];
        if (i < 0 || i >= in_size) {
          cuda::flag_error(error, plane * out_size + o, i);
        } else {
          target = i;
          v = g[o];
        }
      }
      bool leader = target >= 0;
      for (int src = 0; src < 32; ++src) {
        const int32_t t = __shfl_sync(kAll, target, src);
        if (src < lane && t == target) leader = false;
      }
      T acc = leader ? out[target] : T(0);
      for (int src = 0; src < 32; ++src) {
        const int32_t t = __shfl_sync(kAll, target, src);
        const T w = __shfl_sync(kAll, v, src);
        if (leader && src >= lane && t == target) acc = add_rn(acc, w);
      }
      if (leader) out[target] = acc;
      __syncwarp();  // the next batch's leaders read what these wrote
    }
  }
}

// ---------------------------------------------------------------------------------
// Launchers

template <typename T>
void launch_add_channel_bias(T* y, const T* bias, int64_t n, int64_t channels, int64_t positions,
                             cudaStream_t stream) {
  const int64_t planes = n * channels;
  if (planes == 0 || positions == 0) return;
  const unsigned threads = plane_threads(positions);
  add_channel_bias_kernel<T><<<plane_grid(planes, positions, threads), threads, 0, stream>>>(y, bias, planes, channels,
                                                                                          positions);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_channel_bias_grad(const T* dy, T* db, int64_t n, int64_t channels, int64_t positions, double* workspace,
                              cudaStream_t stream) {
  check_channels(channels, "channel_bias_grad");
  if (channels == 0 || n * positions == 0) return;  // db += 0
  const int64_t chunks = reduction_chunks(n * positions);
  launch_channel_partials(dy, n, channels, positions, workspace, stream);
  channel_bias_grad_final_kernel<T><<<elementwise_blocks(channels), kThreads, 0, stream>>>(workspace, db, channels,
                                                                                          chunks);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_batchnorm_invstd_to_var(T* v, double eps, int64_t channels, cudaStream_t stream) {
  if (channels == 0) return;
  batchnorm_invstd_to_var_kernel<T><<<elementwise_blocks(channels), kThreads, 0, stream>>>(v, eps, channels);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_batchnorm_var_to_invstd(const T* var, double eps, T* invstd, int64_t channels, cudaStream_t stream) {
  if (channels == 0) return;
  batchnorm_var_to_invstd_kernel<T><<<elementwise_blocks(channels), kThreads, 0, stream>>>(var, eps, invstd,
                                                                                          channels);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_maxpool2d(const T* x, T* y, int32_t* argmax, int64_t planes, int64_t height, int64_t width,
                      int64_t out_height, int64_t out_width, int kernel, int stride, int pad, cudaStream_t stream) {
  const int64_t total = planes * out_height * out_width;
  if (total == 0) return;
  maxpool2d_kernel<T><<<elementwise_blocks(total), kThreads, 0, stream>>>(x, y, argmax, total, height, width,
                                                                         out_height, out_width, kernel, stride, pad);
  GPIPE_CHECK_LAUNCH();
}

template <typename T>
void launch_maxpool2d_backward(const T* dy, const int32_t* argmax, T* dx, int64_t planes, int64_t out_size,
                               int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream) {
  if (planes * out_size > cuda::kMaxErrorIndex) {
    throw Error("maxpool2d_backward: " + std::to_string(planes * out_size) +
                " argmax values exceed the CUDA argmax check's 32-bit index (2^32 - 2)");
  }
  if (planes == 0) return;
  if (in_size > 0) {
    GPIPE_CUDA_CHECK(cudaMemsetAsync(dx, 0, static_cast<size_t>(planes * in_size) * sizeof(T), stream));
  }
  // With in_size == 0 the kernel still runs: every argmax is then out of range, as the
  // CPU reference reports.
  if (out_size == 0) return;
  // One warp per plane, 8 warps per block.
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((planes * 32 + kThreads - 1) / kThreads, kMaxBlocks));
  maxpool2d_backward_kernel<T><<<blocks, kThreads, 0, stream>>>(dy, argmax, dx, planes, out_size, in_size, error);
  GPIPE_CHECK_LAUNCH();
}

}  // namespace

int64_t channel_reduction_workspace(int64_t n, int64_t channels, int64_t positions) {
  return channels * reduction_chunks(n * positions);
}

void add_channel_bias(float* y, const float* bias, int64_t n, int64_t channels, int64_t positions,
                      cudaStream_t stream) {
  launch_add_channel_bias(y, bias, n, channels, positions, stream);
}
void add_channel_bias(double* y, const double* bias, int64_t n, int64_t channels, int64_t positions,
                      cudaStream_t stream) {
  launch_add_channel_bias(y, bias, n, channels, positions, stream);
}

void channel_bias_grad(const float* dy, float* db, int64_t n, int64_t channels, int64_t positions,
                       double* workspace, cudaStream_t stream) {
  launch_channel_bias_grad(dy, db, n, channels, positions, workspace, stream);
}
void channel_bias_grad(const double* dy, double* db, int64_t n, int64_t channels, int64_t positions,
                       double* workspace, cudaStream_t stream) {
  launch_channel_bias_grad(dy, db, n, channels, positions, workspace, stream);
}

void batchnorm_invstd_to_var(float* v, double eps, int64_t channels, cudaStream_t stream) {
  launch_batchnorm_invstd_to_var(v, eps, channels, stream);
}
void batchnorm_invstd_to_var(double* v, double eps, int64_t channels, cudaStream_t stream) {
  launch_batchnorm_invstd_to_var(v, eps, channels, stream);
}

void batchnorm_var_to_invstd(const float* var, double eps, float* invstd, int64_t channels, cudaStream_t stream) {
  launch_batchnorm_var_to_invstd(var, eps, invstd, channels, stream);
}
void batchnorm_var_to_invstd(const double* var, double eps, double* invstd, int64_t channels,
                             cudaStream_t stream) {
  launch_batchnorm_var_to_invstd(var, eps, invstd, channels, stream);
}

void maxpool2d(const float* x, float* y, int32_t* argmax, int64_t planes, int64_t height, int64_t width,
               int64_t out_height, int64_t out_width, int kernel, int stride, int pad, cudaStream_t stream) {
  launch_maxpool2d(x, y, argmax, planes, height, width, out_height, out_width, kernel, stride, pad, stream);
}
void maxpool2d(const double* x, double* y, int32_t* argmax, int64_t planes, int64_t height, int64_t width,
               int64_t out_height, int64_t out_width, int kernel, int stride, int pad, cudaStream_t stream) {
  launch_maxpool2d(x, y, argmax, planes, height, width, out_height, out_width, kernel, stride, pad, stream);
}

void maxpool2d_backward(const float* dy, const int32_t* argmax, float* dx, int64_t planes, int64_t out_size,
                        int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream) {
  launch_maxpool2d_backward(dy, argmax, dx, planes, out_size, in_size, error, stream);
}
void maxpool2d_backward(const double* dy, const int32_t* argmax, double* dx, int64_t planes, int64_t out_size,
                        int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream) {
  launch_maxpool2d_backward(dy, argmax, dx, planes, out_size, in_size, error, stream);
}

}  // namespace cuda_conv
}  // namespace gpipe
