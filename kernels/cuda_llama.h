// Raw-pointer launchers of the LLaMA ops (Backend::rope, rope_backward, pack_qkv,
// pack_qkv_backward), kernels/cuda_llama.cu. Conventions as in kernels/cuda_kernels.h:
// device pointers on the current device, contiguous row-major, enqueued on `stream`
// without synchronising, the launch checked; sizes may be 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gpipe {
namespace cuda {

// y = x with each head's pairs (i, i + D/2) of row (b, t) turned by sign * t theta_i
// (kernels/llama_math.h). x, y: (B, T, H D); y may be x.
void rope(const float* x, float* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
          double sign, cudaStream_t stream);
void rope(const double* x, double* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
          double sign, cudaStream_t stream);
// qkv (rows, 3 H D) from q (rows, H D), k and v (rows, KV D), each key/value head
// repeated H/KV times; and back, dk and dv summing the copies in double, in head order.
void pack_qkv(const float* q, const float* k, const float* v, float* qkv, int64_t rows, int64_t heads,
              int64_t kv_heads, int64_t head_dim, cudaStream_t stream);
void pack_qkv(const double* q, const double* k, const double* v, double* qkv, int64_t rows, int64_t heads,
              int64_t kv_heads, int64_t head_dim, cudaStream_t stream);
void pack_qkv_backward(const float* dqkv, float* dq, float* dk, float* dv, int64_t rows, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, cudaStream_t stream);
void pack_qkv_backward(const double* dqkv, double* dq, double* dk, double* dv, int64_t rows, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

}  // namespace cuda
}  // namespace gpipe
