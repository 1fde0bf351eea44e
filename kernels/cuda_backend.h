// The CUDA backend: cuBLAS for matrix products, the kernels of kernels/cuda_kernels.cu
// for everything else, all queued on one non-blocking stream per backend. Same
// semantics as the CPU reference (kernels/cpu_backend.cc) for float32 and float64;
// bfloat16 is rejected for now.
//
// Ops return as soon as their work is queued, with one exception: softmax_xent and
// softmax_xent_backward wait for their stream so that a bad label can be reported as a
// gpipe::UserError from the call that saw it (see the comment in cuda_backend.cc).
// Compiled only in CUDA builds (GPIPE_WITH_CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>

#include "kernels/backend.h"

namespace gpipe {

class CudaBackend : public Backend {
 public:
  // Creates the stream, the cuBLAS handle (bound to the stream) and two small buffers on
  // `device`. Throws UserError if the device does not exist.
  explicit CudaBackend(Device device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return device_; }
  Stream& stream() override { return *stream_; }

  void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
              double beta) override;
  void add_bias(Tensor& y, const Tensor& bias) override;
  void bias_grad(const Tensor& dy, Tensor& db, double beta) override;
  void relu(const Tensor& x, Tensor& y) override;
  void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override;
  void gelu(const Tensor& x, Tensor& y) override;
  void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void softmax_xent(const Tensor& logits, const Tensor& labels, double scale, int ignore_index, Tensor& probs,
                    Tensor& loss) override;
  void softmax_xent_backward(const Tensor& probs, const Tensor& labels, double scale, int ignore_index,
                             Tensor& dlogits) override;
  void fill(Tensor& x, double value) override;
  void scale(Tensor& x, double alpha) override;
  void axpy(double alpha, const Tensor& x, Tensor& y) override;
  void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, const SgdParams& p,
                bool first_step) override;
  void copy(const Tensor& src, Tensor& dst) override;
  double item(const Tensor& x) override;
  void synchronize() override;

 private:
  cudaStream_t cuda_stream() const;
  // Throws gpipe::Error unless `t` lives on this backend's device.
  void check_on_device(const Tensor& t, const char* op) const;
  // Waits for the stream and throws the CPU backend's UserError if a label kernel
  // flagged a row (bad_row_ != kNoBadRow).
  void check_labels(const Tensor& labels, int64_t classes, const char* op);
  void release() noexcept;

  Device device_;
  std::unique_ptr<Stream> stream_;    // a non-blocking CUDA stream on device_
  cublasHandle_t blas_ = nullptr;     // bound to stream_
  unsigned* bad_row_ = nullptr;       // device (1): first row with an invalid label
  void* host_staging_ = nullptr;      // pinned host (16 bytes): bad_row_ and item() land here
};

// A CUDA backend for `device` (the registry in backend_for() calls this).
std::unique_ptr<Backend> make_cuda_backend(Device device);

}  // namespace gpipe
