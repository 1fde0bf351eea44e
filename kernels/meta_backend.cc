#include "kernels/meta_backend.h"

#include <initializer_list>
#include <map>
#include <memory>
#include <string>
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

// An op of several products (MetaProduct's second form): its tensors' shapes, its ints.
void list_op(const char* op, std::vector<const Tensor*> tensors, std::vector<int64_t> ints, const Tensor& output,
             double flops) {
  if (products == nullptr) return;
  MetaProduct p;
  p.op = op;
  for (const Tensor* t : tensors) {
    p.tensors.push_back(t->shape());
    p.types.push_back(t->dtype());
  }
  p.ints = std::move(ints);
  p.dtype = tensors.front()->dtype();
  p.c_dtype = output.dtype();
  p.op_flops = flops;
  products->add(std::move(p));
}

double product(std::initializer_list<int64_t> xs) {
  double out = 1;
  for (int64_t x : xs) out *= static_cast<double>(x);
  return out;
}

// Every op a no-op: outputs keep the shapes their callers allocated, and no data.
class MetaOps : public Backend {
 public:
  explicit MetaOps(Device device) : device_(device), stream_(device) {}
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
  void linear_residual(const Tensor& x, const Tensor& w, const Tensor&, Tensor& y) override {
    ++ops_called;
    list_product("linear_residual", x, false, w, true, y);
  }
  void linear_input_grad_add(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    ++ops_called;
    list_product("linear_input_grad_add", dy, false, w, false, dx);
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

// The ops made of several products, listed as well (MetaProducts), and counted as MetaOps
// counts every op.
class MetaBackend final : public MetaOps {
 public:
  using MetaOps::MetaOps;
  void attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) override {
    MetaOps::attention(qkv, heads, probs, out);
    const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
    list_op("attention", {&qkv, &probs, &out}, {heads}, out, 4 * product({B, T, T, C}));
  }
  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                          Tensor& dqkv) override {
    MetaOps::attention_backward(dout, qkv, probs, heads, dqkv);
    const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
    list_op("attention_backward", {&dout, &qkv, &probs, &dqkv}, {heads}, dqkv, 8 * product({B, T, T, C}));
  }
  void fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                       Tensor& stats) override {
    MetaOps::fused_attention(q, k, v, heads, out, stats);
    const int64_t B = q.size(0), T = q.size(1), C = q.size(2);
    list_op("fused_attention", {&q, &k, &v, &out, &stats}, {heads}, out, 4 * product({B, T, T, C}));
  }
  void fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& stats, int heads, Tensor& dq, Tensor& dk,
                                Tensor& dv) override {
    MetaOps::fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv);
    const int64_t B = q.size(0), T = q.size(1), C = q.size(2);
    list_op("fused_attention_backward", {&dout, &q, &k, &v, &out, &stats, &dq, &dk, &dv}, {heads}, dq,
            8 * product({B, T, T, C}));
  }
  void conv2d(const Tensor& x, const Tensor& w, int stride, int pad, Tensor& y) override {
    MetaOps::conv2d(x, w, stride, pad, y);
    list_op("conv2d", {&x, &w, &y}, {stride, pad}, y, conv_flops(w, y));
  }
  void conv2d_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int stride, int pad, Tensor& dx,
                       Tensor& dw) override {
    MetaOps::conv2d_backward(dy, x, w, stride, pad, dx, dw);
    const int computed = (dx.shape().empty() ? 0 : 1) + (dw.shape().empty() ? 0 : 1);
    list_op("conv2d_backward", {&dy, &x, &w, &dx, &dw}, {stride, pad}, dx.shape().empty() ? dw : dx,
            computed * conv_flops(w, dy));
  }

 private:
  // y (N, K, P, Q) from w (K, C, R, S): 2 N K P Q C R S.
  static double conv_flops(const Tensor& w, const Tensor& y) {
    return 2 * product({y.size(0), y.size(1), y.size(2), y.size(3), w.size(1), w.size(2), w.size(3)});
  }
};

}  // namespace

MetaAnswersAs::MetaAnswersAs(Device device) : outer_(answers_as) { answers_as = device; }
MetaAnswersAs::~MetaAnswersAs() { answers_as = outer_; }

std::string MetaProduct::describe() const {
  if (is_gemm()) return "";
  auto dims = [](const Shape& s) {
    std::string out;
    for (int64_t d : s) out += (out.empty() ? "" : "x") + std::to_string(d);
    return out;
  };
  // The arguments' names in each op's signature (kernels/backend_ops.inc); a `->` before its outputs.
  static const std::map<std::string, std::pair<std::vector<std::string>, size_t>> names = {
      {"attention", {{"qkv", "probs", "out"}, 1}},
      {"attention_backward", {{"dout", "qkv", "probs", "dqkv"}, 3}},
      {"fused_attention", {{"q", "k", "v", "out", "stats"}, 3}},
      {"fused_attention_backward", {{"dout", "q", "k", "v", "out", "stats", "dq", "dk", "dv"}, 6}},
      {"conv2d", {{"x", "w", "y"}, 2}},
      {"conv2d_backward", {{"dy", "x", "w", "dx", "dw"}, 3}}};
  const auto it = names.find(op);
  std::string out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = it != names.end() && i < it->second.first.size() ? it->second.first[i] : "t" + std::to_string(i);
    if (it != names.end() && i == it->second.second) {
      for (size_t j = 0; j < ints.size(); ++j) {
        out += std::string(", ") + (op.rfind("conv2d", 0) == 0 ? (j == 0 ? "stride " : "pad ") : "heads ") +
               std::to_string(ints[j]);
      }
      out += " ->";
    }
    if (tensors[i].empty()) continue;  // a gradient this call skips
    out += (out.empty() || out.back() == '>' ? " " : ", ") + name + " " + dims(tensors[i]);
  }
  return !out.empty() && out.front() == ' ' ? out.substr(1) : out;
}

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
