// Raw-pointer launchers for the CUDA backend's convolution-op kernels
// (kernels/cuda_conv_kernels.cu): per-channel bias and its gradient, the conversions
// around cuDNN's batch normalisation, max pooling with argmax. Convolutions, average
// pooling and batch normalisation are cuDNN calls in kernels/cuda_conv_ops.cc. Plain
// C++: includable from files the host compiler builds.
//
// Conventions (those of kernels/cuda_kernels.h):
//   * every pointer is device memory on the current device (the caller sets it);
//     tensors are contiguous NCHW, viewed per channel as (N, C, E) with E positions per
//     (sample, channel) plane, so channel c of sample n is the run [(n C + c) E, + E);
//   * every launcher enqueues on `stream` and returns without synchronising; it checks
//     the launch and throws gpipe::Error if it failed;
//   * empty extents launch nothing;
//   * everything is deterministic: reductions add partial sums in a fixed order that
//     depends only on the shape (no floating-point atomics), and each kernel follows
//     the CPU reference (kernels/cpu_conv_ops.cc) operation for operation, with the
//     same element type for the arithmetic (double for the reductions); only the order
//     of additions in the reductions differs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_kernels.h"  // cuda::ErrorSlot

namespace gpipe {
namespace cuda_conv {

// y: (N, C, E) += bias[c].
void add_channel_bias(float* y, const float* bias, int64_t n, int64_t channels, int64_t positions,
                      cudaStream_t stream);
void add_channel_bias(double* y, const double* bias, int64_t n, int64_t channels, int64_t positions,
                      cudaStream_t stream);

// Doubles of workspace channel_bias_grad needs (a function of the shape).
int64_t channel_reduction_workspace(int64_t n, int64_t channels, int64_t positions);

// db: (C) += the sum of dy: (N, C, E) over n and e, accumulated in double and rounded
// once. workspace: channel_reduction_workspace() doubles.
void channel_bias_grad(const float* dy, float* db, int64_t n, int64_t channels, int64_t positions,
                       double* workspace, cudaStream_t stream);
void channel_bias_grad(const double* dy, double* db, int64_t n, int64_t channels, int64_t positions,
                       double* workspace, cudaStream_t stream);

// Batch normalisation runs on cuDNN, whose training forward saves, per channel, the
// batch mean and the inverse standard deviation invstd = 1 / sqrt(var + eps), and whose
// backward takes the same pair. The contract (kernels/backend.h) keeps the biased
// variance instead; these convert, per channel, in double, rounding once to T.
//
// v: (C) holds invstd on entry and var = max(1 / invstd^2 - eps, 0) on exit (a NaN stays
// NaN). The clamp only catches channels whose variance is within rounding of 0.
void batchnorm_invstd_to_var(float* v, double eps, int64_t channels, cudaStream_t stream);
void batchnorm_invstd_to_var(double* v, double eps, int64_t channels, cudaStream_t stream);

// invstd: (C) = T(1 / sqrt(double(var) + eps)) for var: (C) (the CPU reference's rstd,
// rounded to T).
void batchnorm_var_to_invstd(const float* var, double eps, float* invstd, int64_t channels, cudaStream_t stream);
void batchnorm_var_to_invstd(const double* var, double eps, double* invstd, int64_t channels,
                             cudaStream_t stream);

// Max pooling over `planes` (N C) planes of x: (H, W) into y, argmax: (P, Q) per plane.
// Each output scans its window clipped to the image in row-major order; the first
// maximum wins ties and a NaN wins over numbers (as in the CPU reference); argmax
// receives its flat index h W + w. Requires pad <= kernel / 2 (every window holds a
// real value) and H W <= 2^31 - 1.
void maxpool2d(const float* x, float* y, int32_t* argmax, int64_t planes, int64_t height, int64_t width,
               int64_t out_height, int64_t out_width, int kernel, int stride, int pad, cudaStream_t stream);
void maxpool2d(const double* x, double* y, int32_t* argmax, int64_t planes, int64_t height, int64_t width,
               int64_t out_height, int64_t out_width, int kernel, int stride, int pad, cudaStream_t stream);

// dx: (planes, in_size) = 0, then dx[plane, argmax[plane, o]] += dy[plane, o] for o in
// order: one warp per plane takes its outputs 32 at a time, and the additions into each
// element of dx happen in the CPU loop's order, so overlapping windows add up exactly
// as on the CPU. An argmax outside [0, in_size) is
// skipped and flagged in `error` (kNoError on entry; kernels/cuda_kernels.h, "Deferred
// input errors") as (plane * out_size + o, argmax), the CPU's flat index.
// planes * out_size must be at most cuda::kMaxErrorIndex.
void maxpool2d_backward(const float* dy, const int32_t* argmax, float* dx, int64_t planes, int64_t out_size,
                        int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream);
void maxpool2d_backward(const double* dy, const int32_t* argmax, double* dx, int64_t planes, int64_t out_size,
                        int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream);

}  // namespace cuda_conv
}  // namespace gpipe
