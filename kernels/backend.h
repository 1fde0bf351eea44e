// The backend interface: every numerical op the layers need, with one CPU
// implementation (the reference, on OpenBLAS) and one CUDA implementation (cuBLAS and
// small kernels) that have the same semantics. Layers call only this; they never call
// BLAS, CUDA or NCCL themselves.
//
// Conventions: tensors are contiguous and row-major; matrices are 2-D (rows, cols);
// floating-point ops accept float32 and float64 (float64 exists for finite-difference
// and exact-equality tests), and all operands of one call share a dtype and device.
// Outputs are written, never resized: the caller allocates them with empty()/zeros().
#pragma once

#include <memory>

#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace gpipe {

struct SgdParams {
  double lr = 0.01;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual Stream& stream() = 0;

  Tensor empty(const Shape& shape, DType dtype) { return Tensor::empty(shape, dtype, device()); }
  Tensor zeros(const Shape& shape, DType dtype);

  // c = alpha * op(a) @ op(b) + beta * c, op(x) = x or x^T.
  //   a: (M, K) or (K, M) if trans_a;  b: (K, N) or (N, K) if trans_b;  c: (M, N)
  virtual void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                      double alpha = 1.0, double beta = 0.0) = 0;
  // y: (R, C) += bias: (C) broadcast over rows.
  virtual void add_bias(Tensor& y, const Tensor& bias) = 0;
  // db: (C) = beta * db + sum over rows of dy: (R, C).
  virtual void bias_grad(const Tensor& dy, Tensor& db, double beta) = 0;

  // y = max(x, 0); dx = dy * (y > 0). x, y, dy, dx: same shape.
  virtual void relu(const Tensor& x, Tensor& y) = 0;
  virtual void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  // Exact GELU: y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); dx = dy * (Phi(x) + x phi(x)).
  virtual void gelu(const Tensor& x, Tensor& y) = 0;
  virtual void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;

  // Softmax cross-entropy over the rows of logits (B, C) against int32 labels (B).
  // probs (B, C) receives softmax(logits); loss (1) receives
  //   scale * sum_i -log probs[i, labels[i]]   over rows whose label != ignore_index.
  // A label outside [0, C) that is not ignore_index is an error.
  virtual void softmax_xent(const Tensor& logits, const Tensor& labels, double scale, int ignore_index,
                            Tensor& probs, Tensor& loss) = 0;
  // dlogits = scale * (probs - onehot(labels)); rows with ignore_index get 0.
  virtual void softmax_xent_backward(const Tensor& probs, const Tensor& labels, double scale,
                                     int ignore_index, Tensor& dlogits) = 0;

  virtual void fill(Tensor& x, double value) = 0;
  virtual void scale(Tensor& x, double alpha) = 0;                   // x *= alpha
  virtual void axpy(double alpha, const Tensor& x, Tensor& y) = 0;  // y += alpha * x

  // One SGD step with PyTorch's semantics (dampening 0):
  //   g = grad + weight_decay * param
  //   buf = g on the first step, else momentum * buf + g      (skipped when momentum == 0)
  //   param -= lr * (nesterov ? g + momentum * buf : buf)
  virtual void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, const SgdParams& p,
                        bool first_step) = 0;

  // dst = src; either may live on the host or on this backend's device.
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  // The value of a one-element tensor, on the host (waits for queued work).
  virtual double item(const Tensor& x) = 0;
  // Waits for all work queued on this backend's stream.
  virtual void synchronize() = 0;
};

// The backend of a device, created on first use and alive for the process. CPU
// backends are stateless and thread-safe; a CUDA backend owns its stream and cuBLAS
// handle and is used by one stage thread at a time.
Backend& backend_for(Device device);

// Limits the BLAS library to `threads` threads per call (1 = the calling thread only,
// so one pipeline stage uses one core).
void set_cpu_blas_threads(int threads);

}  // namespace gpipe
