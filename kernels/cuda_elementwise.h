// Raw-pointer launchers of the generic elementwise and row ops (Backend::mul,
// scale_rows, scale_columns, row_dot, row_inverse_rms), kernels/cuda_elementwise.cu.
// Conventions as in kernels/cuda_kernels.h: device pointers on the current device,
// contiguous row-major (rows, cols) views, enqueued on `stream` without synchronising,
// the launch checked; n, rows and cols may be 0. Outputs may alias inputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/broadcast.h"
#include "kernels/unary.h"

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

}  // namespace cuda
}  // namespace gpipe
