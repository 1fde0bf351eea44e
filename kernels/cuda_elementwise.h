// Raw-pointer launchers of the generic elementwise and row ops (Backend::mul,
// scale_rows, scale_columns, row_dot, row_inverse_rms) and of the fused ops (RMSNorm,
// SwiGLU; rope and axpy on 16-bit storage), kernels/cuda_elementwise.cu.
// Conventions as in kernels/cuda_kernels.h: device pointers on the current device,
// contiguous row-major (rows, cols) views, enqueued on `stream` without synchronising,
// the launch checked; n, rows and cols may be 0. Outputs may alias inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/broadcast.h"
#include "kernels/unary.h"
#include "runtime/bf16.h"
#include "runtime/fp16.h"

namespace gpipe {
namespace cuda {

// y = f(x) and dx = dy * f'(x) (Backend::unary, kernels/unary_math.h's formulas, which
// the CPU reference compiles too); f neither kRelu nor kGelu. x, y, dy, dx: (n).
void unary(Unary f, const float* x, float* y, int64_t n, cudaStream_t stream);
void unary(Unary f, const double* x, double* y, int64_t n, cudaStream_t stream);
void unary_backward(Unary f, const float* x, const float* dy, float* dx, int64_t n, cudaStream_t stream);
void unary_backward(Unary f, const double* x, const double* dy, double* dx, int64_t n, cudaStream_t stream);
// y = a * b; a, b, y: (n).
void mul(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream);
void mul(const double* a, const double* b, double* y, int64_t n, cudaStream_t stream);
// y[r, c] = x[r, c] * s[r]; x, y: (rows, cols); s: (rows).
void scale_rows(const float* x, const float* s, float* y, int64_t rows, int64_t cols, cudaStream_t stream);
void scale_rows(const double* x, const double* s, double* y, int64_t rows, int64_t cols, cudaStream_t stream);
// y[r, c] = x[r, c] * s[c]; s: (cols).
void scale_columns(const float* x, const float* s, float* y, int64_t rows, int64_t cols, cudaStream_t stream);
void scale_columns(const double* x, const double* s, double* y, int64_t rows, int64_t cols, cudaStream_t stream);
// out[r] = alpha * sum_c a[r, c] b[r, c], summed in double; out: (rows).
void row_dot(const float* a, const float* b, double alpha, float* out, int64_t rows, int64_t cols,
             cudaStream_t stream);
void row_dot(const double* a, const double* b, double alpha, double* out, int64_t rows, int64_t cols,
             cudaStream_t stream);
// out[r] = 1 / sqrt(sum_c x[r, c]^2 / cols + eps), summed in double; out: (rows).
void row_inverse_rms(const float* x, double eps, float* out, int64_t rows, int64_t cols, cudaStream_t stream);
void row_inverse_rms(const double* x, double eps, double* out, int64_t rows, int64_t cols, cudaStream_t stream);


// The broadcasting binary ops, last-axis reductions and softmax (Backend::binary, sum_to,
// reduce_rows, reduce_rows_backward, softmax, softmax_backward), T float or double.
// binary: y (p.numel) = a op b as planned by ops::check_binary. sum_to: y (y_numel) = x
// summed as planned by ops::check_sum_to. The row ops: x, dx (rows, cols); y, dy (rows)
// for the reductions, (rows, cols) for softmax.
template <typename T>
void binary(Binary op, const ops::Broadcast& p, const T* a, const T* b, T* y, cudaStream_t stream);
template <typename T>
void sum_to(const ops::Broadcast& p, const T* x, T* y, int64_t y_numel, cudaStream_t stream);
template <typename T>
void reduce_rows(Reduce op, const T* x, T* y, int64_t rows, int64_t cols, cudaStream_t stream);
template <typename T>
void reduce_rows_backward(Reduce op, const T* x, const T* y, const T* dy, T* dx, int64_t rows, int64_t cols,
                          cudaStream_t stream);
template <typename T>
void softmax(const T* x, T* y, int64_t rows, int64_t cols, cudaStream_t stream);
template <typename T>
void softmax_backward(const T* y, const T* dy, T* dx, int64_t rows, int64_t cols, cudaStream_t stream);

// ---- Fused ops and 16-bit rope and axpy (the CUDA backend's rmsnorm, swiglu and their
// backward ops; NarrowOp::kRope, kAxpy). S, the storage type, is float, double, BFloat16
// or Half: a kernel loads its operands into Master<S> (float for the 16-bit types, else
// S), computes there and rounds what it stores once; per-row statistics (rstd) and weight
// gradients are of type Master<S>. Row sums accumulate in double, in block_sum's order.

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
// dx = rstd (gdy - xhat mean_c(gdy xhat)) (+ residual, when not null: added in the master
// type before the one rounding), xhat = x rstd, gdy = dy g. dx may not alias.
template <typename S>
void rmsnorm_backward(const S* dy, const S* x, const S* g, const Master<S>* rstd, const S* residual, S* dx,
                      int64_t rows, int64_t cols, cudaStream_t stream);
// RMSNorm's weight gradient: dg (cols) += the column sums of dy (x rstd) over (rows, cols),
// each term dy (x rstd) made and rounded in the master type, summed as bias_grad
// (kernels/cuda_kernels.h) sums (the same workspace, chunks and order), without a temporary
// of the terms. Defined in cuda_kernels.cu, beside bias_grad.
template <typename S>
void rmsnorm_weight_grad(const S* dy, const S* x, const Master<S>* rstd, Master<S>* dg, int64_t rows, int64_t cols,
                         double* workspace, cudaStream_t stream);

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
