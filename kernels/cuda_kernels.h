// Raw-pointer launchers for the CUDA backend's elementwise, reduction, loss and
// optimizer kernels (kernels/cuda_kernels.cu). Plain C++: includable from files the
// host compiler builds.
//
// Conventions:
//   * every pointer is device memory on the current device (the caller sets it), and
//     matrices are contiguous and row-major;
//   * every launcher enqueues on `stream` and returns without synchronising; it checks
//     the launch (GPIPE_CUDA_CHECK(cudaGetLastError())) and throws gpipe::Error if the
//     launch failed;
//   * n, rows, cols may be 0 (then nothing is launched, except where noted);
//   * scalar arguments arrive as the element type where the CPU reference converts
//     them before use, so both backends round the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gpipe {
namespace cuda {

// y: (rows, cols) += bias: (cols), broadcast over rows.
void add_bias(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream);
void add_bias(double* y, const double* bias, int64_t rows, int64_t cols, cudaStream_t stream);

// db: (cols) = (beta == 0 ? 0 : beta * db) + sum over rows of dy: (rows, cols).
// beta == 0 ignores db's old contents (NaN included). Deterministic (no atomics).
void bias_grad(const float* dy, float* db, int64_t rows, int64_t cols, double beta, cudaStream_t stream);
void bias_grad(const double* dy, double* db, int64_t rows, int64_t cols, double beta, cudaStream_t stream);

// y = max(x, 0); x, y: (n). y may alias x.
void relu(const float* x, float* y, int64_t n, cudaStream_t stream);
void relu(const double* x, double* y, int64_t n, cudaStream_t stream);
// dx = y > 0 ? dy : 0; y, dy, dx: (n).
void relu_backward(const float* y, const float* dy, float* dx, int64_t n, cudaStream_t stream);
void relu_backward(const double* y, const double* dy, double* dx, int64_t n, cudaStream_t stream);

// y = 0.5 x (1 + erf(x / sqrt 2)); x, y: (n).
void gelu(const float* x, float* y, int64_t n, cudaStream_t stream);
void gelu(const double* x, double* y, int64_t n, cudaStream_t stream);
// dx = dy * (Phi(x) + x phi(x)); x, dy, dx: (n).
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, cudaStream_t stream);
void gelu_backward(const double* x, const double* dy, double* dx, int64_t n, cudaStream_t stream);

// Value of *bad_row after softmax_xent / softmax_xent_backward when every label was
// valid (or ignore_index).
constexpr unsigned kNoBadRow = 0xFFFFFFFFu;

// Softmax cross-entropy forward over the rows of logits: (rows, cols).
//   probs:    (rows, cols)  softmax of each row
//   row_loss: (rows)        workspace: -log probs[r, labels[r]], 0 for ignored rows
//   loss:     (1)           scale * sum of row_loss, summed in double in a fixed order
//   labels:   (rows) int32
//   bad_row:  (1) device    set to kNoBadRow first, then to the smallest row whose
//                           label is neither ignore_index nor in [0, cols)
// Always writes loss (0 when rows == 0). rows must be < 2^31 - 1.
void softmax_xent(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                  int ignore_index, float* probs, float* row_loss, float* loss, unsigned* bad_row,
                  cudaStream_t stream);
void softmax_xent(const double* logits, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                  int ignore_index, double* probs, double* row_loss, double* loss, unsigned* bad_row,
                  cudaStream_t stream);

// dlogits: (rows, cols) = scale * (probs - onehot(labels)); rows with ignore_index get 0.
// bad_row as for softmax_xent (such rows get scale * probs).
void softmax_xent_backward(const float* probs, const int32_t* labels, int64_t rows, int64_t cols, double scale,
                           int ignore_index, float* dlogits, unsigned* bad_row, cudaStream_t stream);
void softmax_xent_backward(const double* probs, const int32_t* labels, int64_t rows, int64_t cols,
                           double scale, int ignore_index, double* dlogits, unsigned* bad_row,
                           cudaStream_t stream);

// x: (n) = value.
void fill(float* x, int64_t n, float value, cudaStream_t stream);
void fill(double* x, int64_t n, double value, cudaStream_t stream);
void fill(int32_t* x, int64_t n, int32_t value, cudaStream_t stream);

// x: (n) *= alpha; alpha == 0 writes zeros (clears NaN and Inf too).
void scale(float* x, int64_t n, double alpha, cudaStream_t stream);
void scale(double* x, int64_t n, double alpha, cudaStream_t stream);

// y: (n) += alpha * x: (n).
void axpy(double alpha, const float* x, float* y, int64_t n, cudaStream_t stream);
void axpy(double alpha, const double* x, double* y, int64_t n, cudaStream_t stream);

// One SGD step, PyTorch semantics (dampening 0), the same formula as the CPU backend:
//   g = grad + weight_decay * param
//   buf = first_step ? g : momentum * buf + g          (only when buf != nullptr)
//   param -= lr * (buf == nullptr ? g : nesterov ? g + momentum * buf : buf)
// param, grad, buf: (n). Pass buf == nullptr exactly when momentum == 0.
void sgd_step(float* param, const float* grad, float* buf, int64_t n, double lr, double momentum,
              double weight_decay, bool nesterov, bool first_step, cudaStream_t stream);
void sgd_step(double* param, const double* grad, double* buf, int64_t n, double lr, double momentum,
              double weight_decay, bool nesterov, bool first_step, cudaStream_t stream);

}  // namespace cuda
}  // namespace gpipe
