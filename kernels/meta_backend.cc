#include "kernels/meta_backend.h"

#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace gpipe {

namespace {

thread_local std::optional<Device> answers_as;  // MetaAnswersAs's device, on this thread
thread_local int64_t ops_called = 0;            // every meta backend's ops on this thread (MetaOpCount)
thread_local MetaProducts* products = nullptr;  // the innermost MetaProducts alive on this thread

// A product of `op`: c = op(a) op(b), as Backend::matmul's arguments describe it.
void list_product(const char* op, const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c) {
  if (products == nullptr || a.dim() != 2 || b.dim() != 2) return;
  MetaProduct p;
  p.op = op;
  p.m = ta ? a.size(1) : a.size(0);
  p.k = ta ? a.size(0) : a.size(1);
  p.n = tb ? b.size(0) : b.size(1);
  p.trans_a = ta;
  p.trans_b = tb;
  p.dtype = a.dtype();
  p.c_dtype = c.dtype();
  products->add(std::move(p));
}

// Every op a no-op: outputs keep the shapes their callers allocated, and no data.
class MetaBackend final : public Backend {
 public:
  explicit MetaBackend(Device device) : device_(device), stream_(device) {}
  Device device() const override { return device_; }
  Stream& stream() override { return stream_; }
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double, double) override {
    ++ops_called;
    list_product("matmul", a, ta, b, tb, c);
  }
  void matmul_weight(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double, double) override {
    ++ops_called;
    list_product("matmul_weight", a, ta, b, tb, c);
  }
  // The fused ops around a product (GPIPE_PRODUCT_OP): one op, and the product listed.
  void linear_bias(const Tensor& x, const Tensor& w, const Tensor&, Tensor& y) override {
    ++ops_called;
    list_product("linear_bias", x, false, w, true, y);
  }
  void linear_weight_grad(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor&) override {
    ++ops_called;
    list_product("linear_weight_grad", dy, true, x, false, dw);
  }
  // As the device's backend would (what the layer keeps depends on it), asked without it;
  // as MetaAnswersAs's device's, where one is alive.
  bool has_fused_attention(DType t, const AttentionSizes& dims) override {
    if (answers_as && answers_as->is_cuda()) return gpu_fused_attention_expected(t, dims.head_dim);
    return fused_attention_available(answers_as.value_or(device_), t, dims.head_dim);
  }
  // The ops of kernels/backend_ops.inc, fused ones included: nothing computed, a host
  // value 0; each call counted (MetaOpCount).
#define GPIPE_OP(R, name, params, call) \
  R name params override {              \
    ++ops_called;                       \
    return R();                         \
  }
#define GPIPE_FUSED_OP(R, name, params) \
  R name params override {              \
    ++ops_called;                       \
    return R();                         \
  }
#define GPIPE_PRODUCT_OP(R, name, params)  // written above
#include "kernels/backend_ops.inc"

 private:
  Device device_;
  CpuStream stream_;  // never waited on: nothing is queued
};

}  // namespace

MetaAnswersAs::MetaAnswersAs(Device device) : outer_(answers_as) { answers_as = device; }
MetaAnswersAs::~MetaAnswersAs() { answers_as = outer_; }

MetaProducts::MetaProducts() : outer_(products) { products = this; }
MetaProducts::~MetaProducts() { products = outer_; }
std::vector<MetaProduct> MetaProducts::take() { return std::exchange(list_, {}); }

MetaOpCount::MetaOpCount() : start_(ops_called) {}
int64_t MetaOpCount::count() const { return ops_called - start_; }

Backend& meta_backend(Device device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<Backend>> table;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = table[{static_cast<int>(device.kind), device.index}];
  if (!slot) slot = std::make_unique<MetaBackend>(device);
  return *slot;
}

}  // namespace gpipe
