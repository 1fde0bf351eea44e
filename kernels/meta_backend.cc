#include "kernels/meta_backend.h"

#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace gpipe {

namespace {

// Every op a no-op: outputs keep the shapes their callers allocated, and no data.
class MetaBackend final : public Backend {
 public:
  explicit MetaBackend(Device device) : device_(device), stream_(device) {}
  Device device() const override { return device_; }
  Stream& stream() override { return stream_; }
  void matmul(const Tensor&, bool, const Tensor&, bool, Tensor&, double, double) override {}
  void matmul_weight(const Tensor&, bool, const Tensor&, bool, Tensor&, double, double) override {}
  void add_bias(Tensor&, const Tensor&) override {}
  void bias_grad(const Tensor&, Tensor&, double) override {}
  void unary_impl(Unary, const Tensor&, Tensor&) override {}
  void unary_backward_impl(Unary, const Tensor&, const Tensor&, Tensor&) override {}
  void relu(const Tensor&, Tensor&) override {}
  void relu_backward(const Tensor&, const Tensor&, Tensor&) override {}
  void gelu(const Tensor&, Tensor&) override {}
  void gelu_backward(const Tensor&, const Tensor&, Tensor&) override {}
  void softmax_xent(const Tensor&, const Tensor&, double, int, Tensor&, Tensor&) override {}
  void softmax_xent_backward(const Tensor&, const Tensor&, double, int, Tensor&) override {}
  int64_t argmax_correct(const Tensor&, const Tensor&, int) override { return 0; }
  void fill(Tensor&, double) override {}
  void scale(Tensor&, double) override {}
  void axpy(double, const Tensor&, Tensor&) override {}
  void sgd_step(Tensor&, const Tensor&, Tensor&, const SgdParams&, bool) override {}
  void adam_step(Tensor&, const Tensor&, Tensor&, Tensor&, const AdamParams&, int64_t) override {}
  double sum_squares(const Tensor&) override { return 0.0; }
  void embedding(const Tensor&, const Tensor&, const Tensor&, Tensor&) override {}
  void embedding_backward(const Tensor&, const Tensor&, Tensor&, Tensor&) override {}
  void layernorm(const Tensor&, const Tensor&, const Tensor&, double, Tensor&, Tensor&, Tensor&) override {}
  void layernorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                          Tensor&) override {}
  void attention(const Tensor&, int, Tensor&, Tensor&) override {}
  // As the device's backend would (what the layer keeps depends on it), asked without it.
  bool has_fused_attention(DType t, const AttentionSizes& dims) override {
    return fused_attention_available(device_, t, dims.head_dim);
  }
  void fused_attention(const Tensor&, const Tensor&, const Tensor&, int, Tensor&, Tensor&) override {}
  void fused_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, int, Tensor&, Tensor&, Tensor&) override {}
  void attention_backward(const Tensor&, const Tensor&, const Tensor&, int, Tensor&) override {}
  void dropout(const Tensor&, double, uint64_t, int64_t, Tensor&) override {}
  void dropout_backward(const Tensor&, double, uint64_t, int64_t, Tensor&) override {}
  void rope(const Tensor&, int, double, Tensor&) override {}
  void rope_backward(const Tensor&, int, double, Tensor&) override {}
  void pack_qkv(const Tensor&, const Tensor&, const Tensor&, int, Tensor&) override {}
  void pack_qkv_backward(const Tensor&, int, Tensor&, Tensor&, Tensor&) override {}
  void conv2d(const Tensor&, const Tensor&, int, int, Tensor&) override {}
  void conv2d_backward(const Tensor&, const Tensor&, const Tensor&, int, int, Tensor&, Tensor&) override {}
  void add_channel_bias(Tensor&, const Tensor&) override {}
  void channel_bias_grad(const Tensor&, Tensor&) override {}
  void batchnorm_train(const Tensor&, const Tensor&, const Tensor&, double, Tensor&, Tensor&, Tensor&) override {}
  void batchnorm_eval(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                      Tensor&) override {}
  void batchnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, Tensor&,
                          Tensor&, Tensor&) override {}
  void maxpool2d(const Tensor&, int, int, int, Tensor&, Tensor&) override {}
  void maxpool2d_backward(const Tensor&, const Tensor&, Tensor&) override {}
  void avgpool2d(const Tensor&, int, int, Tensor&) override {}
  void avgpool2d_backward(const Tensor&, int, int, Tensor&) override {}
  void mul(const Tensor&, const Tensor&, Tensor&) override {}
  void scale_rows(const Tensor&, const Tensor&, Tensor&) override {}
  void scale_columns(const Tensor&, const Tensor&, Tensor&) override {}
  void row_dot(const Tensor&, const Tensor&, double, Tensor&) override {}
  void row_inverse_rms(const Tensor&, double, Tensor&) override {}
  void binary(Binary, const Tensor&, const Tensor&, Tensor&) override {}
  void sum_to(const Tensor&, Tensor&) override {}
  void reduce_rows(Reduce, const Tensor&, Tensor&) override {}
  void reduce_rows_backward(Reduce, const Tensor&, const Tensor&, const Tensor&, Tensor&) override {}
  void softmax(const Tensor&, Tensor&) override {}
  void softmax_backward(const Tensor&, const Tensor&, Tensor&) override {}
  void copy(const Tensor&, Tensor&) override {}
  void cast(const Tensor&, Tensor&) override {}
  double item(const Tensor&) override { return 0.0; }
  void synchronize() override {}

 private:
  Device device_;
  CpuStream stream_;  // never waited on: nothing is queued
};

}  // namespace

Backend& meta_backend(Device device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<Backend>> table;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = table[{static_cast<int>(device.kind), device.index}];
  if (!slot) slot = std::make_unique<MetaBackend>(device);
  return *slot;
}

}  // namespace gpipe
