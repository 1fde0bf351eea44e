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
  void matmul_weight(const Tensor& a, bool trans_a, const Tensor& w, bool trans_w, Tensor& c, double alpha,
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
  int64_t argmax_correct(const Tensor& logits, const Tensor& labels, int ignore_index) override;
  void fill(Tensor& x, double value) override;
  void scale(Tensor& x, double alpha) override;
  void axpy(double alpha, const Tensor& x, Tensor& y) override;
  void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, const SgdParams& p,
                bool first_step) override;
  void adam_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p,
                 int64_t step) override;
  double sum_squares(const Tensor& x) override;
  // Transformer ops: kernels/cpu_transformer_ops.cc.
  void embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, Tensor& out) override;
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, Tensor& dpos) override;
  void layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y, Tensor& mean,
                 Tensor& rstd) override;
  void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                          const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override;
  void attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) override;
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                          Tensor& dqkv) override;
  void rope(const Tensor& x, int heads, double base, Tensor& y) override;
  void rope_backward(const Tensor& dy, int heads, double base, Tensor& dx) override;
  void pack_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& qkv) override;
  void pack_qkv_backward(const Tensor& dqkv, int heads, Tensor& dq, Tensor& dk, Tensor& dv) override;
  void dropout(const Tensor& x, double p, uint64_t key, int64_t sample_offset, Tensor& y) override;
  void dropout_backward(const Tensor& dy, double p, uint64_t key, int64_t sample_offset, Tensor& dx) override;
  // Convolution ops: kernels/cpu_conv_ops.cc.
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
  // Generic elementwise and row ops: kernels/cpu_elementwise_ops.cc.
  void unary_impl(Unary f, const Tensor& x, Tensor& y) override;
  void unary_backward_impl(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& y) override;
  void scale_rows(const Tensor& x, const Tensor& s, Tensor& y) override;
  void scale_columns(const Tensor& x, const Tensor& s, Tensor& y) override;
  void row_dot(const Tensor& a, const Tensor& b, double alpha, Tensor& out) override;
  void row_inverse_rms(const Tensor& x, double eps, Tensor& out) override;
  void binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) override;
  void sum_to(const Tensor& x, Tensor& y) override;
  void reduce_rows(Reduce op, const Tensor& x, Tensor& y) override;
  void reduce_rows_backward(Reduce op, const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx) override;
  void softmax(const Tensor& x, Tensor& y) override;
  void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override;
  void copy(const Tensor& src, Tensor& dst) override;
  void cast(const Tensor& src, Tensor& dst) override;
  double item(const Tensor& x) override;
  void synchronize() override {}

 private:
  Device device_;
  CpuStream stream_;
};

}  // namespace gpipe
