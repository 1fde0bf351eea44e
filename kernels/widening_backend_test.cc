// Mixed precision's ops (kernels/widening_backend.h): an op with bfloat16 operands gives,
// bit for bit, the float32 op on those operands widened, with what it writes rounded
// once: each operand read, written or added into is handled as its role says.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cpu_gemm.h"
#include "kernels/meta_backend.h"
#include "kernels/op_log.h"
#include "kernels/widening_backend.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_tensor;

namespace {

CpuBackend& reference() {
  static CpuBackend be(Device::cpu());  // unwrapped: float32 and float64 only
  return be;
}

Tensor as(const Tensor& t, DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype, Device::cpu());
  reference().cast(t, out);
  return out;
}

Tensor bf16(const Shape& shape, uint64_t seed) { return random_tensor(shape, DType::kBF16, seed); }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

}  // namespace

TEST_CASE("a product of bfloat16 operands is float32's product of their values, rounded once") {
  Backend& be = backend_for(Device::cpu());
  const Tensor a = bf16({5, 7}, 1), b = bf16({7, 3}, 2);
  SUBCASE("overwritten") {
    Tensor c = be.empty({5, 3}, DType::kBF16);
    be.matmul(a, false, b, false, c, 0.5, 0.0);
    Tensor want = reference().empty({5, 3}, DType::kF32);
    reference().matmul(as(a, DType::kF32), false, as(b, DType::kF32), false, want, 0.5, 0.0);
    CHECK(same_bits(c, as(want, DType::kBF16)));
  }
  SUBCASE("added into a bfloat16 output: its old values count") {
    const Tensor c0 = bf16({5, 3}, 3);
    Tensor c = as(as(c0, DType::kF32), DType::kBF16);
    be.matmul(a, false, b, false, c, 1.0, 1.0);
    Tensor want = as(c0, DType::kF32);
    reference().matmul(as(a, DType::kF32), false, as(b, DType::kF32), false, want, 1.0, 1.0);
    CHECK(same_bits(c, as(want, DType::kBF16)));
  }
  SUBCASE("accumulated into a float32 gradient, not rounded") {
    const Tensor g0 = random_tensor({7, 3}, DType::kF32, 4);
    Tensor g = as(g0, DType::kF32);
    const Tensor dy = bf16({5, 3}, 5);
    be.matmul(bf16({5, 7}, 6), true, dy, false, g, 1.0, 1.0);  // dW += x^T dy
    Tensor want = as(g0, DType::kF32);
    reference().matmul(as(bf16({5, 7}, 6), DType::kF32), true, as(dy, DType::kF32), false, want, 1.0, 1.0);
    CHECK(same_bits(g, want));
  }
}

TEST_CASE("a layer's weight in bfloat16 is never served from a packed copy of a temporary") {
  // matmul_weight may keep a packed copy of its weight keyed on where it lives; the
  // widened weight is a temporary, and the next one may live at the same address.
  const auto saved = cpu_blas::library();
  cpu_blas::set_library(cpu_blas::Library::kOnednn);
  cpu_blas::set_always_pack(true);
  Backend& be = backend_for(Device::cpu());
  const Tensor x = bf16({4, 8}, 7), w1 = bf16({6, 8}, 8), w2 = bf16({6, 8}, 9);
  Tensor y1 = be.empty({4, 6}, DType::kBF16), y2 = be.empty({4, 6}, DType::kBF16);
  {
    FrozenWeights frozen;
    be.matmul_weight(x, false, w1, true, y1, 1.0, 0.0);
    be.matmul_weight(x, false, w2, true, y2, 1.0, 0.0);
    CHECK(cpu_blas::packed_weights_held() == 0);
  }
  cpu_blas::set_always_pack(false);
  cpu_blas::set_library(saved);
  for (auto [w, y] : {std::pair<Tensor, Tensor>{w1, y1}, {w2, y2}}) {
    Tensor want = reference().empty({4, 6}, DType::kF32);
    reference().matmul(as(x, DType::kF32), false, as(w, DType::kF32), true, want, 1.0, 0.0);
    CHECK(same_bits(y, as(want, DType::kBF16)));
  }
}

TEST_CASE("layer norm on bfloat16: statistics in float32, outputs rounded, float32 gradients accumulated") {
  Backend& be = backend_for(Device::cpu());
  const Tensor x = bf16({6, 16}, 10), gamma = bf16({16}, 11), beta = bf16({16}, 12), dy = bf16({6, 16}, 13);
  Tensor y = be.empty({6, 16}, DType::kBF16), mean = be.empty({6}, DType::kF32), rstd = be.empty({6}, DType::kF32);
  be.layernorm(x, gamma, beta, 1e-5, y, mean, rstd);
  Tensor wy = reference().empty({6, 16}, DType::kF32), wmean = reference().empty({6}, DType::kF32),
         wrstd = reference().empty({6}, DType::kF32);
  reference().layernorm(as(x, DType::kF32), as(gamma, DType::kF32), as(beta, DType::kF32), 1e-5, wy, wmean, wrstd);
  CHECK(same_bits(y, as(wy, DType::kBF16)));
  CHECK(same_bits(mean, wmean));
  CHECK(same_bits(rstd, wrstd));

  const Tensor g0 = random_tensor({16}, DType::kF32, 14), b0 = random_tensor({16}, DType::kF32, 15);
  Tensor dx = be.empty({6, 16}, DType::kBF16), dgamma = as(g0, DType::kF32), dbeta = as(b0, DType::kF32);
  be.layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
  Tensor wdx = reference().empty({6, 16}, DType::kF32), wdg = as(g0, DType::kF32), wdb = as(b0, DType::kF32);
  reference().layernorm_backward(as(dy, DType::kF32), as(x, DType::kF32), as(gamma, DType::kF32), wmean, wrstd, wdx,
                                 wdg, wdb);
  CHECK(same_bits(dx, as(wdx, DType::kBF16)));
  CHECK(same_bits(dgamma, wdg));
  CHECK(same_bits(dbeta, wdb));
}

TEST_CASE("softmax cross-entropy of bfloat16 logits: probabilities and loss in float32") {
  Backend& be = backend_for(Device::cpu());
  const Tensor logits = random_tensor({5, 9}, DType::kBF16, 16, -4, 4);
  const Tensor labels = gpipe::testing::random_labels(5, 9, 17);
  Tensor probs = be.empty({5, 9}, DType::kF32), loss = be.empty({1}, DType::kF32);
  be.softmax_xent(logits, labels, 0.2, -100, probs, loss);
  Tensor wp = reference().empty({5, 9}, DType::kF32), wl = reference().empty({1}, DType::kF32);
  reference().softmax_xent(as(logits, DType::kF32), labels, 0.2, -100, wp, wl);
  CHECK(same_bits(probs, wp));
  CHECK(same_bits(loss, wl));
  Tensor dlogits = be.empty({5, 9}, DType::kBF16), wd = reference().empty({5, 9}, DType::kF32);
  be.softmax_xent_backward(probs, labels, 0.2, -100, dlogits);
  reference().softmax_xent_backward(wp, labels, 0.2, -100, wd);
  CHECK(same_bits(dlogits, as(wd, DType::kBF16)));
}

TEST_CASE("attention, in-place scaling, an aliased product and a skipped output on bfloat16") {
  Backend& be = backend_for(Device::cpu());
  SUBCASE("attention and its backward") {
    const Tensor qkv = bf16({2, 4, 12}, 18), dout = bf16({2, 4, 4}, 19);
    Tensor probs = be.empty({2, 2, 4, 4}, DType::kBF16), out = be.empty({2, 4, 4}, DType::kBF16);
    be.attention(qkv, 2, probs, out);
    Tensor wp = reference().empty({2, 2, 4, 4}, DType::kF32), wo = reference().empty({2, 4, 4}, DType::kF32);
    reference().attention(as(qkv, DType::kF32), 2, wp, wo);
    CHECK(same_bits(probs, as(wp, DType::kBF16)));
    CHECK(same_bits(out, as(wo, DType::kBF16)));
    Tensor dqkv = be.empty(qkv.shape(), DType::kBF16), wd = reference().empty(qkv.shape(), DType::kF32);
    be.attention_backward(dout, qkv, probs, 2, dqkv);
    reference().attention_backward(as(dout, DType::kF32), as(qkv, DType::kF32), as(probs, DType::kF32), 2, wd);
    CHECK(same_bits(dqkv, as(wd, DType::kBF16)));
  }
  SUBCASE("scale reads what it overwrites") {
    const Tensor x0 = bf16({10}, 20);
    Tensor x = as(as(x0, DType::kF32), DType::kBF16);
    be.scale(x, 3.0);
    Tensor want = as(x0, DType::kF32);
    reference().scale(want, 3.0);
    CHECK(same_bits(x, as(want, DType::kBF16)));
  }
  SUBCASE("y = a * b with y the storage of a") {
    Tensor a = bf16({3, 5}, 21);
    const Tensor b = bf16({3, 5}, 22);
    Tensor want = reference().empty({3, 5}, DType::kF32);
    reference().mul(as(a, DType::kF32), as(b, DType::kF32), want);
    be.mul(a, b, a);
    CHECK(same_bits(a, as(want, DType::kBF16)));
  }
  SUBCASE("a convolution's weight gradient alone, added into float32") {
    const Tensor x = bf16({2, 3, 5, 5}, 23), w = bf16({4, 3, 3, 3}, 24), dy = bf16({2, 4, 5, 5}, 25);
    const Tensor g0 = random_tensor(w.shape(), DType::kF32, 26);
    Tensor dx, dw = as(g0, DType::kF32);
    be.conv2d_backward(dy, x, w, 1, 1, dx, dw);
    CHECK_FALSE(dx.defined());
    Tensor wdx, wdw = as(g0, DType::kF32);
    reference().conv2d_backward(as(dy, DType::kF32), as(x, DType::kF32), as(w, DType::kF32), 1, 1, wdx, wdw);
    CHECK(same_bits(dw, wdw));
  }
}

TEST_CASE("an op without bfloat16 operands is the wrapped backend's") {
  Backend& be = backend_for(Device::cpu());
  const Tensor a = random_tensor({4, 6}, DType::kF64, 27), b = random_tensor({6, 2}, DType::kF64, 28);
  Tensor c = be.empty({4, 2}, DType::kF64), want = reference().empty({4, 2}, DType::kF64);
  be.matmul(a, false, b, false, c, 1.0, 0.0);
  reference().matmul(a, false, b, false, want, 1.0, 0.0);
  CHECK(same_bits(c, want));
  Tensor y = bf16({3}, 30);
  CHECK_THROWS_AS(reference().relu(bf16({3}, 29), y), Error);  // the wrapped backend itself takes no bfloat16
}

namespace {

// A CPU backend that says it computes bfloat16 products and relu itself
// (Backend::computes_narrow, as the CUDA backend does) and records the operand types
// each call reaches it with; it computes them through a widening of its own, so its
// results are the reference's.
class ClaimsBf16 : public CpuBackend {
 public:
  ClaimsBf16() : CpuBackend(Device::cpu()) {}
  bool computes_narrow(NarrowOp op, DType t) const override {
    return t == DType::kBF16 && (op == NarrowOp::kMatmul || op == NarrowOp::kRelu);
  }
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha, double beta) override {
    seen.push_back({a.dtype(), b.dtype(), c.dtype()});
    computing().matmul(a, ta, b, tb, c, alpha, beta);
  }
  void matmul_weight(const Tensor& a, bool ta, const Tensor& w, bool tw, Tensor& c, double alpha,
                     double beta) override {
    seen.push_back({a.dtype(), w.dtype(), c.dtype()});
    computing().matmul(a, ta, w, tw, c, alpha, beta);
  }
  void relu(const Tensor& x, Tensor& y) override {
    seen.push_back({x.dtype(), y.dtype()});
    computing().relu(x, y);
  }
  std::vector<std::vector<DType>> seen;

 private:
  static Backend& computing() {
    static WideningBackend be(std::make_unique<CpuBackend>(Device::cpu()));
    return be;
  }
};

}  // namespace

TEST_CASE("an op the backend computes in 16 bits itself reaches it unwidened; any other is widened") {
  WideningBackend be(std::make_unique<ClaimsBf16>());
  auto& inner = static_cast<ClaimsBf16&>(be.inner());
  Backend& ref = backend_for(Device::cpu());
  constexpr DType B = DType::kBF16, F = DType::kF32, H = DType::kF16;
  struct Case {
    DType a, b, c;
    std::vector<DType> seen;  // what the backend's matmul receives
  };
  for (const Case& k : {Case{B, B, B, {B, B, B}}, Case{B, B, F, {B, B, F}}, Case{B, F, B, {F, F, F}},
                        Case{F, B, F, {F, F, F}}, Case{H, H, H, {F, F, F}}, Case{F, F, F, {F, F, F}}}) {
    CAPTURE(dtype_name(k.a));
    CAPTURE(dtype_name(k.b));
    CAPTURE(dtype_name(k.c));
    const Tensor a = random_tensor({6, 9}, k.a, 11), w = random_tensor({4, 9}, k.b, 12);
    const Tensor c0 = random_tensor({6, 4}, k.c, 13);
    for (bool weight : {false, true}) {
      inner.seen.clear();
      Tensor got = as(c0, k.c), want = as(c0, k.c);
      if (weight) {
        be.matmul_weight(a, false, w, true, got, 0.5, 1.0);
      } else {
        be.matmul(a, false, w, true, got, 0.5, 1.0);
      }
      ref.matmul(a, false, w, true, want, 0.5, 1.0);
      REQUIRE(inner.seen.size() == 1);
      CHECK(inner.seen[0] == k.seen);
      CHECK(same_bits(got, want));
    }
  }
  const Tensor x = random_tensor({5, 8}, B, 14);
  inner.seen.clear();
  Tensor y = be.empty(x.shape(), B), want = be.empty(x.shape(), B);
  be.relu(x, y);
  ref.relu(x, want);
  CHECK(inner.seen == std::vector<std::vector<DType>>{{B, B}});
  CHECK(same_bits(y, want));
  inner.seen.clear();
  be.relu(x, y = be.empty(x.shape(), F));  // mixed: widened
  CHECK(inner.seen == std::vector<std::vector<DType>>{{F, F}});
}

// A linear layer's product with its bias (Backend::linear_bias, linear_weight_grad): on
// the CPU, in every float type, the composition the layer used to call (matmul_weight
// and add_bias; matmul and bias_grad), bit for bit; one op in the log and in the
// planner's count on shapes, as a GPU's one cuBLASLt call.
TEST_CASE("linear_bias and linear_weight_grad are the CPU's products and bias ops, bit for bit, one op each") {
  Backend& be = backend_for(Device::cpu());
  uint64_t seed = 800;
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    CAPTURE(dtype_name(t));
    const DType master = master_dtype(t);
    const Tensor x = random_tensor({7, 5}, t, ++seed), w = random_tensor({3, 5}, t, ++seed);
    const Tensor bias = random_tensor({3}, t, ++seed), dy = random_tensor({7, 3}, t, ++seed);
    const Tensor dw0 = random_tensor({3, 5}, master, ++seed), db0 = random_tensor({3}, master, ++seed);
    Tensor want = be.empty({7, 3}, t), got = be.empty({7, 3}, t);
    be.matmul_weight(x, false, w, true, want);
    be.add_bias(want, bias);
    OpLog log;
    be.linear_bias(x, w, bias, got);
    const std::vector<OpLog::Call> forward = log.take();
    REQUIRE(forward.size() == 1);
    CHECK(forward[0].op == "linear_bias");
    CHECK(same_bits(got, want));
    Tensor dw_want = as(dw0, master), db_want = as(db0, master), dw = as(dw0, master), db = as(db0, master);
    be.matmul(dy, true, x, false, dw_want, 1.0, 1.0);
    be.bias_grad(dy, db_want, 1.0);
    log.take();
    be.linear_weight_grad(dy, x, dw, db);
    const std::vector<OpLog::Call> calls = log.take();
    REQUIRE(calls.size() == 1);
    CHECK(calls[0].op == "linear_weight_grad");
    CHECK(same_bits(dw, dw_want));
    CHECK(same_bits(db, db_want));
  }
  // On shapes: one op each.
  ShapesOnly shapes;
  Backend& meta = meta_backend(Device::cpu());
  const Tensor x = meta.empty({7, 5}, DType::kF32), w = meta.empty({3, 5}, DType::kF32);
  Tensor y = meta.empty({7, 3}, DType::kF32), dw = meta.empty({3, 5}, DType::kF32), db = meta.empty({3}, DType::kF32);
  const MetaOpCount count;
  meta.linear_bias(x, w, meta.empty({3}, DType::kF32), y);
  meta.linear_weight_grad(y, x, dw, db);
  CHECK(count.count() == 2);
}

// A residual block's sums in the op before them (Backend::linear_residual,
// linear_input_grad_add, rmsnorm_backward_add): on the CPU, in every float type, the op
// then axpy as the layers used to call them, bit for bit, one op in the log; and against
// sums written out here in double, so that the composition itself is the right one (a
// transposed operand would still be the same bits as itself).
TEST_CASE("the residual sums are the CPU's op then axpy, bit for bit, one op each, and the sums written out") {
  Backend& be = backend_for(Device::cpu());
  uint64_t seed = 900;
  const int64_t R = 6, K = 5, N = 4;
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16}) {
    CAPTURE(dtype_name(t));
    const double tol = t == DType::kF64 ? 1e-12 : t == DType::kF32 ? 1e-5 : t == DType::kBF16 ? 3e-2 : 4e-3;
    const Tensor x = random_tensor({R, K}, t, ++seed), w = random_tensor({N, K}, t, ++seed);
    const Tensor res = random_tensor({R, N}, t, ++seed), dy = random_tensor({R, N}, t, ++seed);
    const Tensor dx0 = random_tensor({R, K}, t, ++seed);
    const std::vector<double> xv = testing::to_doubles(x), wv = testing::to_doubles(w), rv = testing::to_doubles(res),
                              dyv = testing::to_doubles(dy), dx0v = testing::to_doubles(dx0);
    // Each element of `got` (rows x cols) within tol of expected(r, c), written out in double.
    auto near_each = [&](const Tensor& got, int64_t rows, int64_t cols, auto expected) {
      const std::vector<double> v = testing::to_doubles(got);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const double e = expected(r, c);
          CHECK(std::fabs(v[r * cols + c] - e) <= tol * (1 + std::fabs(e)));
        }
      }
    };
    OpLog log;
    auto one_op = [&](const char* op) {  // the calls since the last take: this op alone
      const std::vector<OpLog::Call> calls = log.take();
      REQUIRE(calls.size() == 1);
      CHECK(calls[0].op == op);
    };
    // y = x w^T + residual.
    Tensor want = be.empty({R, N}, t), got = be.empty({R, N}, t);
    be.matmul_weight(x, false, w, true, want);
    be.axpy(1.0, res, want);
    log.take();
    be.linear_residual(x, w, res, got);
    one_op("linear_residual");
    CHECK(same_bits(got, want));
    near_each(got, R, N, [&](int64_t r, int64_t n) {
      double e = rv[r * N + n];
      for (int64_t k = 0; k < K; ++k) e += xv[r * K + k] * wv[n * K + k];
      return e;
    });
    // dx += dy w.
    Tensor dx_want = as(dx0, t), dx = as(dx0, t), part = be.empty({R, K}, t);
    be.matmul_weight(dy, false, w, false, part);
    be.axpy(1.0, part, dx_want);
    log.take();
    be.linear_input_grad_add(dy, w, dx);
    one_op("linear_input_grad_add");
    CHECK(same_bits(dx, dx_want));
    near_each(dx, R, K, [&](int64_t r, int64_t k) {
      double e = dx0v[r * K + k];
      for (int64_t n = 0; n < N; ++n) e += dyv[r * N + n] * wv[n * K + k];
      return e;
    });
    // dx = rmsnorm_backward's dx + residual, x (R, K) normalised over K.
    const Tensor g = random_tensor({K}, t, ++seed), ny = random_tensor({R, K}, t, ++seed);
    const Tensor nres = random_tensor({R, K}, t, ++seed);
    Tensor y_norm = be.empty({R, K}, t), rstd = be.empty({R}, master_dtype(t));
    be.rmsnorm(x, g, 1e-5, y_norm, rstd);
    Tensor n_want = be.empty({R, K}, t), n_got = be.empty({R, K}, t);
    be.rmsnorm_backward(ny, x, g, rstd, n_want);
    const std::vector<double> plain = testing::to_doubles(n_want), nresv = testing::to_doubles(nres);
    be.axpy(1.0, nres, n_want);
    log.take();
    be.rmsnorm_backward_add(ny, x, g, rstd, nres, n_got);
    one_op("rmsnorm_backward_add");
    CHECK(same_bits(n_got, n_want));
    near_each(n_got, R, K, [&](int64_t r, int64_t k) { return plain[r * K + k] + nresv[r * K + k]; });
  }
  // On shapes: one op each, the two products listed as such.
  ShapesOnly shapes;
  Backend& meta = meta_backend(Device::cpu());
  const Tensor x = meta.empty({R, K}, DType::kF32), w = meta.empty({N, K}, DType::kF32);
  Tensor y = meta.empty({R, N}, DType::kF32), dx = meta.empty({R, K}, DType::kF32);
  Tensor rstd = meta.empty({R}, DType::kF32), g = meta.empty({K}, DType::kF32);
  const MetaOpCount count;
  MetaProducts products;
  const Tensor res = meta.empty({R, N}, DType::kF32);
  meta.linear_residual(x, w, res, y);
  meta.linear_input_grad_add(y, w, dx);
  meta.rmsnorm_backward_add(dx, x, g, rstd, x, dx);
  CHECK(count.count() == 3);
  const std::vector<MetaProduct> listed = products.take();
  REQUIRE(listed.size() == 2);
  CHECK(listed[0].op == "linear_residual");  // (R, K) @ (N, K)^T: m R, n N, k K
  CHECK((listed[0].m == R && listed[0].n == N && listed[0].k == K));
  CHECK(listed[1].op == "linear_input_grad_add");  // (R, N) @ (N, K): m R, n K, k N
  CHECK((listed[1].m == R && listed[1].n == K && listed[1].k == N));
}

// The multi-tensor ops (Backend::*_all) through the backend every device gets: float32
// lists go to the wrapped backend whole, lists with a narrow tensor are widened tensor
// by tensor; either way each tensor ends as the single-tensor op leaves it.
TEST_CASE("multi-tensor ops equal the single-tensor op on each tensor, narrow tensors included") {
  Backend& be = backend_for(Device::cpu());
  auto list = [](DType dt, uint64_t seed) {
    std::vector<Tensor> out;
    for (const Shape& s : {Shape{0}, Shape{1}, Shape{7, 5}, Shape{300}}) out.push_back(random_tensor(s, dt, seed++));
    return out;
  };
  auto copies = [](const std::vector<Tensor>& xs) {
    std::vector<Tensor> out;
    for (const Tensor& x : xs) {
      out.push_back(Tensor::empty(x.shape(), x.dtype(), Device::cpu()));
      copy_tensor(x, out.back());
    }
    return out;
  };
  auto same = [](const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(same_bits(a[i], b[i]));
  };
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16}) {
    CAPTURE(dtype_name(dt));
    AdamParams ap;
    ap.weight_decay = 0.1;
    ap.decoupled = true;
    std::vector<Tensor> w = list(dt, 10), m = list(dt, 20), v = list(dt, 30);
    for (Tensor& t : v) be.scale(t, 0.0);  // second moments start at 0
    std::vector<Tensor> w1 = copies(w), m1 = copies(m), v1 = copies(v);
    const std::vector<Tensor> g = list(dt, 40);
    be.adam_step_all(w, g, m, v, ap, be.step_scalars(adam_step_scalars(ap, 2)));
    for (size_t i = 0; i < w.size(); ++i) be.adam_step(w1[i], g[i], m1[i], v1[i], ap, 2);
    same(w, w1);
    same(m, m1);
    same(v, v1);

    SgdParams sp;
    sp.momentum = 0.9;
    std::vector<Tensor> b = list(dt, 50), b1 = copies(b), u = copies(w1), u1 = copies(w1);
    be.sgd_step_all(w, g, b, sp, be.step_scalars(sgd_step_scalars(sp, 2)));
    for (size_t i = 0; i < w1.size(); ++i) be.sgd_step(w1[i], g[i], b1[i], sp, false);
    same(w, w1);
    same(b, b1);
    sp.momentum = 0.0;  // no momentum: undefined buffers
    be.sgd_step_all(u, g, std::vector<Tensor>(u.size()), sp, be.step_scalars(sgd_step_scalars(sp, 1)));
    for (size_t i = 0; i < u1.size(); ++i) {
      Tensor none;
      be.sgd_step(u1[i], g[i], none, sp, true);
    }
    same(u, u1);

    be.scale_all(u, 0.25);
    for (Tensor& t : u1) be.scale(t, 0.25);
    same(u, u1);
    be.fill_all(u, 1.5);
    for (const Tensor& t : u) CHECK(testing::to_doubles(t) == std::vector<double>(static_cast<size_t>(t.numel()), 1.5));
  }
  // Masters into working copies.
  const std::vector<Tensor> masters = list(DType::kF32, 60);
  std::vector<Tensor> work, work1;
  for (const Tensor& t : masters) {
    work.push_back(Tensor::empty(t.shape(), DType::kBF16, Device::cpu()));
    work1.push_back(Tensor::empty(t.shape(), DType::kBF16, Device::cpu()));
  }
  be.cast_all(masters, work);
  for (size_t i = 0; i < masters.size(); ++i) be.cast(masters[i], work1[i]);
  same(work, work1);
  // One entry per tensor in every list.
  std::vector<Tensor> w = list(DType::kF32, 70);
  CHECK_THROWS_WITH_AS(be.adam_step_all(w, w, w, {}, AdamParams{}, be.step_scalars(adam_step_scalars(AdamParams{}, 1))),
                       doctest::Contains("each list needs one entry per tensor"), Error);
  CHECK_THROWS_AS(be.cast_all(masters, {}), Error);
}

// WideningBackend's ops are generated from the marks of kernels/backend_ops.inc's calls
// (In, Out, InOut). What a wrong mark would change, op by op: an operand added into
// (InOut) keeps its old values, a written one (Out) does not, an int32 output passes
// through, and a host value is the float32 op's.
TEST_CASE("the generated wrappers: added-into operands keep their values, int32 outputs pass through") {
  Backend& be = backend_for(Device::cpu());
  constexpr DType B = DType::kBF16, F = DType::kF32;
  SUBCASE("add_bias and axpy add into a bfloat16 y") {
    const Tensor y0 = bf16({4, 6}, 40), bias = bf16({6}, 41), x = bf16({4, 6}, 42);
    Tensor y = as(as(y0, F), B);
    be.add_bias(y, bias);
    be.axpy(-0.75, x, y);
    Tensor want = as(y0, F);
    reference().add_bias(want, as(bias, F));
    want = as(as(want, B), F);  // each op rounds what it stores
    reference().axpy(-0.75, as(x, F), want);
    CHECK(same_bits(y, as(want, B)));
  }
  SUBCASE("embedding_backward adds into a bfloat16 table and positions") {
    const Tensor ids = Tensor::from_vector<int32_t>({3, 0, 3, 1, 2, 3}, {2, 3});
    const Tensor dout = bf16({2, 3, 4}, 43), t0 = bf16({5, 4}, 44), p0 = bf16({3, 4}, 45);
    Tensor dtable = as(as(t0, F), B), dpos = as(as(p0, F), B);
    be.embedding_backward(ids, dout, dtable, dpos);
    Tensor wt = as(t0, F), wp = as(p0, F);
    reference().embedding_backward(ids, as(dout, F), wt, wp);
    CHECK(same_bits(dtable, as(wt, B)));
    CHECK(same_bits(dpos, as(wp, B)));
  }
  SUBCASE("max pooling's int32 argmax passes through, its backward overwrites dx") {
    const Tensor x = bf16({1, 2, 4, 4}, 46);
    Tensor y = be.empty({1, 2, 2, 2}, B), argmax = be.empty({1, 2, 2, 2}, DType::kI32);
    be.maxpool2d(x, 2, 2, 0, y, argmax);
    Tensor wy = reference().empty({1, 2, 2, 2}, F), wa = reference().empty({1, 2, 2, 2}, DType::kI32);
    reference().maxpool2d(as(x, F), 2, 2, 0, wy, wa);
    CHECK(same_bits(y, as(wy, B)));
    CHECK(same_bits(argmax, wa));
    const Tensor dy = bf16({1, 2, 2, 2}, 47);
    Tensor dx = bf16({1, 2, 4, 4}, 48), wdx = reference().empty({1, 2, 4, 4}, F);
    be.maxpool2d_backward(dy, argmax, dx);
    reference().maxpool2d_backward(as(dy, F), wa, wdx);
    CHECK(same_bits(dx, as(wdx, B)));
  }
  SUBCASE("host values: sum_squares, item and argmax_correct of bfloat16 operands") {
    const Tensor x = bf16({3, 7}, 49);
    CHECK(be.sum_squares(x) == reference().sum_squares(as(x, F)));
    const Tensor one = as(Tensor::from_vector<float>({2.5f}, {1}), B);
    CHECK(be.item(one) == 2.5);
    const Tensor labels = gpipe::testing::random_labels(3, 7, 50);
    CHECK(be.argmax_correct(x, labels, -100) == reference().argmax_correct(as(x, F), labels, -100));
  }
}

TEST_CASE("capture on the CPU: the calls are kept, not run; a replay runs them on the buffers as they are then") {
  Backend& be = backend_for(Device::cpu());
  Tensor x = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  Tensor w = Tensor::from_vector<float>({1, 0, 0, 2}, {2, 2});
  Tensor y = Tensor::from_vector<float>({0, 0, 0, 0}, {2, 2});
  Tensor yb = be.empty({2, 2}, DType::kBF16);
  int host_steps = 0;
  be.begin_capture();
  CHECK(be.capturing());
  be.matmul(x, false, w, false, y, 1.0, 0.0);  // y = x w
  be.host_step([&] { ++host_steps; });
  be.cast(y, yb);                              // a narrow output: widened at each replay
  CHECK_THROWS_AS(be.item(y), CaptureError);   // a value for the host cannot be captured
  std::unique_ptr<CapturedOps> ops = be.end_capture();
  CHECK_FALSE(be.capturing());
  CHECK(ops->nodes() == 2);
  CHECK(y.to_vector<float>() == std::vector<float>{0, 0, 0, 0});  // nothing ran
  CHECK(host_steps == 0);
  ops->replay();
  CHECK(y.to_vector<float>() == std::vector<float>{1, 4, 3, 8});
  CHECK(host_steps == 1);
  std::memcpy(x.data<float>(), std::vector<float>{2, 0, 0, 2}.data(), 4 * sizeof(float));  // new data, same buffer
  ops->replay();
  CHECK(y.to_vector<float>() == std::vector<float>{2, 0, 0, 4});
  Tensor back = be.empty({2, 2}, DType::kF32);
  be.cast(yb, back);
  CHECK(back.to_vector<float>() == std::vector<float>{2, 0, 0, 4});
  CHECK(host_steps == 2);
  // An aborted capture runs nothing and leaves the backend as before.
  be.begin_capture();
  be.fill(y, 7.0);
  be.abort_capture();
  CHECK_FALSE(be.capturing());
  CHECK(y.to_vector<float>() == std::vector<float>{2, 0, 0, 4});
  be.fill(y, 7.0);
  CHECK(y.to_vector<float>() == std::vector<float>{7, 7, 7, 7});
}
