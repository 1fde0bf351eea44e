// Launchers of the CUDA backend's fused kernels (kernels/cuda_fused.cu): RMSNorm forward
// and backward, SwiGLU's gate and its backward, and axpy on 16-bit storage. One kernel
// each where the CPU reference composes several generic ops (Backend::rmsnorm and the
// others, kernels/backend.h). Conventions as kernels/cuda_kernels.h: device pointers on
// the current device, contiguous row-major, enqueued on `stream`, launch checked.
//
// S, the storage type, is float, double, BFloat16 or Half. A kernel loads its operands
// into Master<S> (float for the 16-bit types, else S), computes there and rounds what it
// stores once; per-row statistics (rstd) and weight gradients are of type Master<S>.
// Row sums accumulate in double, as the CPU reference's do.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/bf16.h"
#include "runtime/fp16.h"

namespace gpipe {
namespace cuda {

template <typename S>
struct MasterOf {
  using type = S;
};
template <>
struct MasterOf<BFloat16> {
  using type = float;
};
template <>
struct MasterOf<Half> {
  using type = float;
};
template <typename S>
using Master = typename MasterOf<S>::type;

// x, y: (rows, cols); g: (cols). rstd[r] = 1 / sqrt(mean_c x^2 + eps), y = x rstd g.
template <typename S>
void rmsnorm(const S* x, const S* g, double eps, S* y, Master<S>* rstd, int64_t rows, int64_t cols,
             cudaStream_t stream);
// dx = rstd (gdy - xhat mean_c(gdy xhat)), xhat = x rstd, gdy = dy g. dx may not alias.
template <typename S>
void rmsnorm_backward(const S* dy, const S* x, const S* g, const Master<S>* rstd, S* dx, int64_t rows,
                      int64_t cols, cudaStream_t stream);
// terms[r, c] = dy[r, c] x[r, c] rstd[r], the addends of RMSNorm's weight gradient
// (whose column sums bias_grad adds into dg, in a fixed order).
template <typename S>
void rmsnorm_weight_terms(const S* dy, const S* x, const Master<S>* rstd, Master<S>* terms, int64_t rows,
                          int64_t cols, cudaStream_t stream);
// y = silu(a) b; (n) elements. y may alias a or b.
template <typename S>
void swiglu(const S* a, const S* b, S* y, int64_t n, cudaStream_t stream);
// da = dy b silu'(a), db = dy silu(a); (n) elements, da and db not aliasing the inputs.
template <typename S>
void swiglu_backward(const S* dy, const S* a, const S* b, S* da, S* db, int64_t n, cudaStream_t stream);
// Rotary position embeddings on 16-bit storage (S BFloat16 or Half), the rotation of
// kernels/llama_math.h in double, each result rounded to float32 and then to S: what the
// widening reference gives (the float32 kernel, then the cast). x, y: (B, T, H D); y may be x.
template <typename S>
void rope_narrow(const S* x, S* y, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, double base,
                 double sign, cudaStream_t stream);
// y += alpha x on 16-bit storage (S BFloat16 or Half), in float, rounded once.
template <typename S>
void axpy_narrow(double alpha, const S* x, S* y, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace gpipe
