// Kernels of the LLaMA ops and their launchers (declared in kernels/cuda_llama.h), the
// CUDA twins of kernels/cpu_llama_ops.cc: one thread per rotated pair or per packed
// element, the rotation's formula from kernels/llama_math.h (double angles and
// products), the group sums of pack_qkv_backward in double in head order as the CPU.
// Layout: helpers, kernels, launchers.
#include "kernels/cuda_llama.h"

#include <algorithm>

#include "kernels/llama_math.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {
namespace cuda {

namespace {

constexpr int kThreads = 256;          // threads per block
constexpr int64_t kMaxBlocks = 65536;  // grid cap; grid-stride loops cover the rest

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)); }

// ---------------------------------------------------------------------------------
// Kernels

// One thread per position's pair, for all heads: n = B T D/2, index p = (b T + t) D/2 + i.
// Its turn (a double pow, cos and sin) is computed once and turns pair i of each head.
template <typename T>
__global__ void rope_kernel(const T* x, T* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim, double base,
                            double sign) {
  const int64_t half = head_dim / 2;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half;
    const int64_t row = p / half;  // b T + t
    const ops::RopeTurn turn = ops::rope_turn(row % seq, i, head_dim, base, sign);
    ops::rope_heads<T>(x + row * heads * head_dim, y + row * heads * head_dim, heads, head_dim, i, turn,
                       [](T v) { return v; }, [](T v, T& out) { out = v; });
  }
}

// One thread per element of qkv (rows, 3C): column c of part (q, k, v) reads its source.
template <typename T>
__global__ void pack_qkv_kernel(const T* q, const T* k, const T* v, T* qkv, int64_t n, int64_t heads,
                                int64_t kv_heads, int64_t head_dim) {
  const int64_t C = heads * head_dim, KC = kv_heads * head_dim, group = heads / kv_heads;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / (3 * C), col = e % (3 * C), part = col / C, c = col % C;
    const int64_t src = r * KC + (c / head_dim / group) * head_dim + c % head_dim;
    qkv[e] = part == 0 ? q[r * C + c] : part == 1 ? k[src] : v[src];
  }
}

// One thread per element of dq (rows, C) and of dk, dv (rows, KV D): n = rows (C + 2 KC).
template <typename T>
__global__ void pack_qkv_backward_kernel(const T* dqkv, T* dq, T* dk, T* dv, int64_t rows, int64_t heads,
                                         int64_t kv_heads, int64_t head_dim) {
  const int64_t C = heads * head_dim, KC = kv_heads * head_dim, group = heads / kv_heads;
  const int64_t nq = rows * C, n = nq + 2 * rows * KC;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    if (e < nq) {
      dq[e] = dqkv[(e / C) * 3 * C + e % C];
      continue;
    }
    const int64_t f = (e - nq) % (rows * KC);
    const bool is_v = e - nq >= rows * KC;
    const int64_t r = f / KC, j = (f % KC) / head_dim, d = f % head_dim;
    const T* row = dqkv + r * 3 * C + (is_v ? 2 * C : C);
    double s = 0;
    for (int64_t g = 0; g < group; ++g) s += static_cast<double>(row[(j * group + g) * head_dim + d]);
    (is_v ? dv : dk)[f] = static_cast<T>(s);
  }
}

// ---------------------------------------------------------------------------------
// Launchers

template <typename T>
void rope_impl(const T* x, T* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
               double sign, cudaStream_t stream) {
  const int64_t n = batch * seq * (head_dim / 2);
  if (n == 0 || heads == 0) return;
  rope_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(x, y, n, seq, heads, head_dim, base, sign);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void pack_impl(const T* q, const T* k, const T* v, T* qkv, int64_t rows, int64_t heads, int64_t kv_heads,
               int64_t head_dim, cudaStream_t stream) {
  const int64_t n = rows * 3 * heads * head_dim;
  if (n == 0) return;
  pack_qkv_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(q, k, v, qkv, n, heads, kv_heads, head_dim);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void pack_backward_impl(const T* dqkv, T* dq, T* dk, T* dv, int64_t rows, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, cudaStream_t stream) {
  const int64_t n = rows * (heads + 2 * kv_heads) * head_dim;
  if (n == 0) return;
  pack_qkv_backward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(dqkv, dq, dk, dv, rows, heads, kv_heads,
                                                                       head_dim);
  GPIPE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope(const float* x, float* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
          double sign, cudaStream_t stream) {
  rope_impl(x, y, batch, seq, heads, head_dim, base, sign, stream);
}
void rope(const double* x, double* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
          double sign, cudaStream_t stream) {
  rope_impl(x, y, batch, seq, heads, head_dim, base, sign, stream);
}

void pack_qkv(const float* q, const float* k, const float* v, float* qkv, int64_t rows, int64_t heads,
              int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  pack_impl(q, k, v, qkv, rows, heads, kv_heads, head_dim, stream);
}
void pack_qkv(const double* q, const double* k, const double* v, double* qkv, int64_t rows, int64_t heads,
              int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  pack_impl(q, k, v, qkv, rows, heads, kv_heads, head_dim, stream);
}

void pack_qkv_backward(const float* dqkv, float* dq, float* dk, float* dv, int64_t rows, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  pack_backward_impl(dqkv, dq, dk, dv, rows, heads, kv_heads, head_dim, stream);
}
void pack_qkv_backward(const double* dqkv, double* dq, double* dk, double* dv, int64_t rows, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  pack_backward_impl(dqkv, dq, dk, dv, rows, heads, kv_heads, head_dim, stream);
}

}  // namespace cuda
}  // namespace gpipe
