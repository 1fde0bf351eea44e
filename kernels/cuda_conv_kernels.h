// Raw-pointer launchers for the CUDA backend's convolution-op kernels
// (kernels/cuda_conv_kernels.cu): per-channel bias and its gradient, batch
// normalisation, max pooling with argmax. Convolutions and average pooling are cuDNN
// calls in kernels/cuda_conv_ops.cc. Plain C++: includable from files the host
// compiler builds.
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
//     same element type for the arithmetic (double for the reductions and statistics);
//     only the order of additions in the reductions differs.
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

// Doubles of workspace the per-channel reductions below need (a function of the shape).
int64_t channel_reduction_workspace(int64_t n, int64_t channels, int64_t positions);

// db: (C) += the sum of dy: (N, C, E) over n and e, accumulated in double and rounded
// once. workspace: channel_reduction_workspace() doubles.
void channel_bias_grad(const float* dy, float* db, int64_t n, int64_t channels, int64_t positions,
                       double* workspace, cudaStream_t stream);
void channel_bias_grad(const double* dy, double* db, int64_t n, int64_t channels, int64_t positions,
                       double* workspace, cudaStream_t stream);

// Batch normalisation with the batch's statistics, as the CPU reference computes them:
// per channel, in double, mu = sum x / m and v = sum (x - mu)^2 / m (m = N E, two
// passes); mean = T(mu), var = T(v); then
//   y = (x - T(mu)) * T(gamma / sqrt(double(T(v)) + eps)) + beta     (in T).
// y may alias x. workspace: channel_reduction_workspace() doubles. n * positions >= 1.
void batchnorm_train(const float* x, const float* gamma, const float* beta, double eps, float* y, float* mean,
                     float* var, int64_t n, int64_t channels, int64_t positions, double* workspace,
                     cudaStream_t stream);
void batchnorm_train(const double* x, const double* gamma, const double* beta, double eps, double* y,
                     double* mean, double* var, int64_t n, int64_t channels, int64_t positions, double* workspace,
                     cudaStream_t stream);

// y = (x - mean) * T(gamma / sqrt(double(var) + eps)) + beta (in T), per channel.
// y may alias x. workspace: channel_reduction_workspace() doubles.
void batchnorm_eval(const float* x, const float* gamma, const float* beta, const float* mean, const float* var,
                    double eps, float* y, int64_t n, int64_t channels, int64_t positions, double* workspace,
                    cudaStream_t stream);
void batchnorm_eval(const double* x, const double* gamma, const double* beta, const double* mean,
                    const double* var, double eps, double* y, int64_t n, int64_t channels, int64_t positions,
                    double* workspace, cudaStream_t stream);

// Backward of batchnorm_train, in double per channel with rstd = 1 / sqrt(var + eps),
// xhat = (x - mean) rstd, m = N E:
//   dbeta += T(sum dy);  dgamma += T(sum dy xhat);
//   dx = T(gamma rstd (dy - sum(dy) / m - xhat sum(dy xhat) / m)).
// The sums are complete before dx is written, so dx may alias dy or x.
// workspace: channel_reduction_workspace() doubles. n * positions >= 1.
void batchnorm_backward(const float* dy, const float* x, const float* gamma, const float* mean, const float* var,
                        double eps, float* dx, float* dgamma, float* dbeta, int64_t n, int64_t channels,
                        int64_t positions, double* workspace, cudaStream_t stream);
void batchnorm_backward(const double* dy, const double* x, const double* gamma, const double* mean,
                        const double* var, double eps, double* dx, double* dgamma, double* dbeta, int64_t n,
                        int64_t channels, int64_t positions, double* workspace, cudaStream_t stream);

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
// order: one thread per plane walks its outputs in the CPU loop's order, so
// overlapping windows add up exactly as on the CPU. An argmax outside [0, in_size) is
// skipped and flagged in `error` (kNoError on entry; kernels/cuda_kernels.h, "Deferred
// input errors") as (plane * out_size + o, argmax), the CPU's flat index.
// planes * out_size must be at most cuda::kMaxErrorIndex.
void maxpool2d_backward(const float* dy, const int32_t* argmax, float* dx, int64_t planes, int64_t out_size,
                        int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream);
void maxpool2d_backward(const double* dy, const int32_t* argmax, double* dx, int64_t planes, int64_t out_size,
                        int64_t in_size, cuda::ErrorSlot* error, cudaStream_t stream);

}  // namespace cuda_conv
}  // namespace gpipe
