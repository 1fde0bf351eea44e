// The CUDA backend: cuBLAS for matrix products, the kernels of kernels/cuda_kernels.cu
// for everything else, all queued on one non-blocking stream per backend. Same
// semantics as the CPU reference (kernels/cpu_backend.cc) for float32 and float64;
// bfloat16 is rejected for now.
//
// Ops return as soon as their work is queued, with these exceptions: softmax_xent,
// softmax_xent_backward, embedding and embedding_backward wait for their stream so
// that a bad label or token id can be reported as a gpipe::UserError from the call that
// saw it (see the comment in cuda_backend.cc), and sum_squares returns a host value.
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
  void adam_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p,
                 int64_t step) override;
  double sum_squares(const Tensor& x) override;
  void embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, Tensor& out) override;
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, Tensor& dpos) override;
  void layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y, Tensor& mean,
                 Tensor& rstd) override;
  void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                          const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override;
  void attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) override;
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                          Tensor& dqkv) override;
  void dropout(const Tensor& x, double p, uint64_t key, int64_t sample_offset, Tensor& y) override;
  void dropout_backward(const Tensor& dy, double p, uint64_t key, int64_t sample_offset, Tensor& dx) override;
  // Convolution ops: kernels/cuda_conv_ops.cc (cuDNN for convolutions and average
  // pooling, kernels/cuda_conv_kernels.cu for the rest). maxpool2d_backward waits for
  // its stream: it validates argmax on the device before writing dx, as the CPU does.
  void conv2d(const Tensor& x, const Tensor& w, int stride, int pad, Tensor& y) override;
  void conv2d_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int stride, int pad, Tensor& dx,
                       Tensor& dw) override;
  void add_channel_bias(Tensor& y, const Tensor& bias) override;
  void channel_bias_grad(const Tensor& dy, Tensor& db) override;
  void batchnorm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y, Tensor& mean,
                       Tensor& var) override;
  void batchnorm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean, const Tensor& var,
                      double eps, Tensor& y) override;
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                          const Tensor& var, double eps, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override;
  void maxpool2d(const Tensor& x, int kernel, int stride, int pad, Tensor& y, Tensor& argmax) override;
  void maxpool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) override;
  void avgpool2d(const Tensor& x, int kernel, int stride, Tensor& y) override;
  void avgpool2d_backward(const Tensor& dy, int kernel, int stride, Tensor& dx) override;
  void copy(const Tensor& src, Tensor& dst) override;
  double item(const Tensor& x) override;
  void synchronize() override;

 private:
  cudaStream_t cuda_stream() const;
  // Throws gpipe::Error unless `t` lives on this backend's device.
  void check_on_device(const Tensor& t, const char* op) const;
  // Waits for the stream and returns bad_row_ (cuda::kNoBadRow when nothing was flagged).
  unsigned wait_for_bad_row();
  // Waits for the stream and throws the CPU backend's UserError if a label kernel
  // flagged a row (bad_row_ != kNoBadRow).
  void check_labels(const Tensor& labels, int64_t classes, const char* op);
  // Validates token ids (B, T) against [0, vocab) on the device, waits, and throws the
  // CPU backend's UserError for the first bad one; called before an embedding op
  // queues any other work.
  void check_token_ids(const Tensor& ids, int64_t vocab, const char* op);
  // dropout and dropout_backward: the same map (dropout is linear and diagonal).
  void dropout_impl(const Tensor& in, double p, uint64_t key, int64_t sample_offset, Tensor& out, const char* op);
  void release() noexcept;
  // The cuDNN state (handle bound to stream_, descriptors, chosen algorithms), created
  // on first use by a convolution op; kernels/cuda_conv_ops.cc.
  struct CudnnState& cudnn();
  void release_cudnn() noexcept;  // called by release(); the device is already current

  Device device_;
  std::unique_ptr<Stream> stream_;    // a non-blocking CUDA stream on device_
  cublasHandle_t blas_ = nullptr;     // bound to stream_
  unsigned* bad_row_ = nullptr;       // device (1): first row with an invalid label or token id
  void* host_staging_ = nullptr;      // pinned host (16 bytes): bad_row_, item() and sum_squares land here
  void* cudnn_ = nullptr;             // CudnnState*, see cudnn()
};

// A CUDA backend for `device` (the registry in backend_for() calls this).
std::unique_ptr<Backend> make_cuda_backend(Device device);

}  // namespace gpipe
