// The reference backend: OpenBLAS for matrix products, plain loops for the rest.
// Every other backend is tested against this one.
#pragma once

#include "kernels/backend.h"

namespace gpipe {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(Device device) : device_(device), stream_(device) {}
  Device device() const override { return device_; }
  Stream& stream() override { return stream_; }

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
  void synchronize() override {}

 private:
  Device device_;
  CpuStream stream_;
};

}  // namespace gpipe
