// Mixed precision for every backend: a Backend that runs ops whose operands include
// narrow tensors (bfloat16, float16: is_narrow) on a backend that computes in float32
// and float64.
//
// An op with no narrow operand goes straight to the wrapped backend, and so does one the
// wrapped backend computes itself in the narrow type (Backend::computes_narrow: the CUDA
// backend's products and elementwise ops, which do the same float32 arithmetic and the
// same single rounding without the temporaries). Otherwise each
// narrow operand is widened into a float32 temporary (exact), the wrapped backend's
// float32 op runs on the temporaries and the float32 operands, and each narrow operand
// the op writes is rounded back (to nearest, ties to even: Backend::cast). An operand
// the op accumulates into (matmul with beta != 0, add_bias, dW +=) is widened before and
// rounded after. So, as the backend's documentation of each op says for float32, sums
// and products accumulate in float32 and statistics (a layer norm's, a softmax's) are
// computed in float32; what is rounded is only what the op stores.
//
// A bf16 or fp16 model keeps its gradients, master weights and optimizer state in
// float32 and its activations, messages and kept tensors narrow: its ops mix the two
// types, and every mix is widened the same way. backend_for() returns every backend
// wrapped in one of these. The widening costs a pass over each narrow operand per op;
// measured in bench/RESULTS.md ("Mixed precision").
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace gpipe {

class WideningBackend : public Backend {
 public:
  explicit WideningBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  Backend& inner() { return *inner_; }
  Device device() const override { return inner_->device(); }
  Stream& stream() override { return inner_->stream(); }

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
  double sum_squares_all(const std::vector<Tensor>& xs) override;
  // Fused attention: the wrapped backend's, which takes 16-bit operands as they are.
  bool has_fused_attention(DType t, const AttentionSizes& dims) override {
    return inner_->has_fused_attention(t, dims);
  }
  void fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                       Tensor& stats) override {
    inner_->fused_attention(q, k, v, heads, out, stats);
  }
  void fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& stats, int heads, Tensor& dq, Tensor& dk,
                                Tensor& dv) override {
    inner_->fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv);
  }
  // The fused ops go to the wrapped backend when no operand is narrow or when it computes
  // them in the narrow type (kRmsNorm, kSwiglu); else they are composed here of widened
  // generic ops (Backend's defaults), which is the reference.
  void rmsnorm(const Tensor& x, const Tensor& g, double eps, Tensor& y, Tensor& rstd) override;
  void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                        Tensor& dx) override;
  void rmsnorm_weight_grad(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dg) override;
  void swiglu(const Tensor& a, const Tensor& b, Tensor& y) override;
  void swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) override;
  // The multi-tensor ops go to the wrapped backend whole when no operand is narrow (a
  // narrow model's optimizer works on float32 masters), else each tensor is widened.
  void sgd_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                    const std::vector<Tensor>& momentum_bufs, const SgdParams& p, bool first_step) override;
  void adam_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                     const std::vector<Tensor>& m, const std::vector<Tensor>& v, const AdamParams& p,
                     int64_t step) override;
  void scale_all(const std::vector<Tensor>& xs, double alpha) override;
  void fill_all(const std::vector<Tensor>& xs, double value) override;
  void cast_all(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts) override {
    inner_->cast_all(srcs, dsts);
  }
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
  void copy(const Tensor& src, Tensor& dst) override { inner_->copy(src, dst); }
  void cast(const Tensor& src, Tensor& dst) override { inner_->cast(src, dst); }
  double item(const Tensor& x) override;
  void synchronize() override { inner_->synchronize(); }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace gpipe
