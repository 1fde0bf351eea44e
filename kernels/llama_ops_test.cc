// The LLaMA ops of the CPU reference (kernels/cpu_llama_ops.cc): rope against a float64
// rotation written here from the definition (complex multiplication of the pairs by
// e^{i t theta}), its backward as the adjoint and the inverse and against finite
// differences, pack_qkv against a loop over heads and its backward as its adjoint, the
// widening backend's bfloat16 and float16 as the float32 op rounded once, and the errors a
// config can cause.
#include <doctest/doctest.h>

#include <cmath>
#include <complex>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/unary_math.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::dot;
using gpipe::testing::numeric_gradient;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

CpuBackend& reference() {
  static CpuBackend be(Device::cpu());  // unwrapped: float32 and float64 only
  return be;
}

Tensor as(const Tensor& t, DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype, Device::cpu());
  reference().cast(t, out);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// RoPE as HF LLaMA defines it, in long double: for pair (i, i + D/2) of each head at
// position t, (x_i + j x_{i+D/2}) e^{j t base^(-2i/D)}.
std::vector<double> rope_reference(const std::vector<double>& x, int64_t B, int64_t T, int64_t H, int64_t D,
                                   double base) {
  std::vector<double> y(x.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t o = ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < D / 2; ++i) {
          const long double theta = std::pow(static_cast<long double>(base), -2.0L * i / D);
          const std::complex<long double> z(x[o + i], x[o + i + D / 2]);
          const std::complex<long double> r = z * std::polar(1.0L, t * theta);
          y[o + i] = static_cast<double>(r.real());
          y[o + i + D / 2] = static_cast<double>(r.imag());
        }
      }
    }
  }
  return y;
}

}  // namespace

TEST_CASE("rope turns each head's pairs (i, i + D/2) by t base^(-2i/D), as HF LLaMA's rotate_half") {
  const int64_t B = 2, T = 5, H = 3, D = 8;
  for (double base : {10000.0, 500.0}) {
    CAPTURE(base);
    const Tensor x = random_tensor({B, T, H * D}, DType::kF64, 1);
    Tensor y = cpu().empty(x.shape(), DType::kF64);
    cpu().rope(x, static_cast<int>(H), base, y);
    const std::vector<double> want = rope_reference(to_doubles(x), B, T, H, D, base), got = to_doubles(y);
    for (size_t e = 0; e < got.size(); ++e) CHECK(got[e] == doctest::Approx(want[e]).epsilon(1e-14));
    // Position 0 is the identity; position 1 of pair 0 turns by exactly 1 radian.
    const std::vector<double> xv = to_doubles(x);
    for (int64_t c = 0; c < H * D; ++c) CHECK(got[c] == xv[c]);
    const int64_t o = H * D;  // (b 0, t 1, head 0)
    CHECK(got[o] == doctest::Approx(xv[o] * std::cos(1.0) - xv[o + D / 2] * std::sin(1.0)).epsilon(1e-15));
  }
  // float32: the double rotation rounded once.
  const Tensor x = random_tensor({B, T, H * D}, DType::kF32, 2);
  Tensor y = cpu().empty(x.shape(), DType::kF32);
  cpu().rope(x, static_cast<int>(H), 10000.0, y);
  const std::vector<double> want = rope_reference(to_doubles(x), B, T, H, D, 10000.0), got = to_doubles(y);
  for (size_t e = 0; e < got.size(); ++e) CHECK(got[e] == static_cast<double>(static_cast<float>(want[e])));
}

TEST_CASE("rope_backward is rope's adjoint and inverse, and equals finite differences") {
  const int64_t B = 2, T = 4, H = 2, D = 6;
  Tensor x = random_tensor({B, T, H * D}, DType::kF64, 3);
  const Tensor dy = random_tensor({B, T, H * D}, DType::kF64, 4);
  Tensor y = cpu().empty(x.shape(), DType::kF64), dx = cpu().empty(x.shape(), DType::kF64);
  cpu().rope(x, 2, 10000.0, y);
  cpu().rope_backward(dy, 2, 10000.0, dx);
  CHECK(dot(y, dy) == doctest::Approx(dot(x, dx)).epsilon(1e-13));  // <R x, dy> = <x, R^T dy>
  const std::vector<double> num = numeric_gradient(x, [&] {
    cpu().rope(x, 2, 10000.0, y);
    return dot(y, dy);
  });
  const std::vector<double> got = to_doubles(dx);
  for (size_t e = 0; e < got.size(); ++e) CHECK(got[e] == doctest::Approx(num[e]).epsilon(1e-8));
  // In place, and back: rope_backward(rope(x)) == x.
  Tensor z = cpu().empty(x.shape(), DType::kF64);
  reference().copy(x, z);
  cpu().rope(z, 2, 10000.0, z);
  cpu().rope_backward(z, 2, 10000.0, z);
  const std::vector<double> xv = to_doubles(x), zv = to_doubles(z);
  for (size_t e = 0; e < zv.size(); ++e) CHECK(zv[e] == doctest::Approx(xv[e]).epsilon(1e-14));
}

TEST_CASE("SwiGLU on the CPU in one pass is the composition's formulas, bit for bit, and y may alias a or b") {
  // CpuBackend computes swiglu and its backward in one loop (one sigmoid per element in
  // the backward). Each element must be what the composition (unary silu, then mul)
  // computes, written here from unary_math.h's formulas: y = silu(a) b, db = dy silu(a),
  // da = (dy b) silu'(a), each product rounded to the type. Across the sigmoid's two
  // branches, large arguments, zeros and both float types; and with y in a's or b's
  // storage, where Backend's composition must agree too.
  for (DType dt : {DType::kF32, DType::kF64}) {
    CAPTURE(dtype_name(dt));
    const int64_t n = 4099;  // not a multiple of any vector width, nor of the CPU's runs of 512
    Tensor a = random_tensor({n}, dt, 11, -12.0, 12.0), b = random_tensor({n}, dt, 12, -3.0, 3.0);
    Tensor dy = random_tensor({n}, dt, 13, -2.0, 2.0);
    const double specials[] = {0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 700.0, -700.0};
    for (size_t i = 0; i < std::size(specials); ++i) {
      if (dt == DType::kF32) {
        a.data<float>()[i * 397] = static_cast<float>(specials[i]);
      } else {
        a.data<double>()[i * 397] = specials[i];
      }
    }
    // The formulas, element by element.
    Tensor y_want = Tensor::empty({n}, dt, Device::cpu()), da_want = Tensor::empty({n}, dt, Device::cpu());
    Tensor db_want = Tensor::empty({n}, dt, Device::cpu());
    auto fill = [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      for (int64_t i = 0; i < n; ++i) {
        const T x = a.data<T>()[i], g = dy.data<T>()[i], u = b.data<T>()[i];
        const T silu = ops::unary_value(Unary::kSilu, x);
        y_want.data<T>()[i] = silu * u;
        db_want.data<T>()[i] = g * silu;
        const T gu = g * u;
        da_want.data<T>()[i] = gu * ops::unary_slope(Unary::kSilu, x);
      }
    };
    if (dt == DType::kF32) {
      fill(static_cast<float*>(nullptr));
    } else {
      fill(static_cast<double*>(nullptr));
    }
    Tensor y = Tensor::empty({n}, dt, Device::cpu());
    reference().swiglu(a, b, y);
    CHECK(same_bits(y, y_want));
    Tensor da = Tensor::empty({n}, dt, Device::cpu()), db = Tensor::empty({n}, dt, Device::cpu());
    reference().swiglu_backward(dy, a, b, da, db);
    CHECK(same_bits(da, da_want));
    CHECK(same_bits(db, db_want));
    // The composition (Backend's default, a GPU's reference) gives the same.
    Tensor y_ref = Tensor::empty({n}, dt, Device::cpu()), da_ref = Tensor::empty({n}, dt, Device::cpu());
    Tensor db_ref = Tensor::empty({n}, dt, Device::cpu());
    reference().Backend::swiglu(a, b, y_ref);
    reference().Backend::swiglu_backward(dy, a, b, da_ref, db_ref);
    CHECK(same_bits(y_ref, y_want));
    CHECK(same_bits(da_ref, da_want));
    CHECK(same_bits(db_ref, db_want));
    // y in a's storage, then in b's: one pass and composition alike.
    for (bool into_a : {true, false}) {
      CAPTURE(into_a);
      for (bool composed : {false, true}) {
        CAPTURE(composed);
        Tensor a2 = as(a, dt), b2 = as(b, dt);
        Tensor& out = into_a ? a2 : b2;
        if (composed) {
          reference().Backend::swiglu(a2, b2, out);
        } else {
          reference().swiglu(a2, b2, out);
        }
        CHECK(same_bits(out, y_want));
      }
    }
    // And the widening backend hands float32 and float64 to the one pass.
    Tensor y_wide = cpu().empty({n}, dt);
    cpu().swiglu(a, b, y_wide);
    CHECK(same_bits(y_wide, y_want));
  }
  Tensor a = random_tensor({4}, DType::kF32, 1), b = random_tensor({5}, DType::kF32, 2);
  Tensor y = Tensor::empty({4}, DType::kF32, Device::cpu());
  CHECK_THROWS_AS(reference().swiglu(a, b, y), Error);
}

TEST_CASE("pack_qkv repeats each key/value head for its group of query heads; its backward sums the group") {
  const int64_t B = 2, T = 3, H = 6, D = 2;
  for (int64_t KV : {1, 2, 3, 6}) {
    CAPTURE(KV);
    const Tensor q = random_tensor({B, T, H * D}, DType::kF64, 5), k = random_tensor({B, T, KV * D}, DType::kF64, 6),
                 v = random_tensor({B, T, KV * D}, DType::kF64, 7);
    Tensor qkv = cpu().empty({B, T, 3 * H * D}, DType::kF64);
    cpu().pack_qkv(q, k, v, static_cast<int>(H), qkv);
    const std::vector<double> qv = to_doubles(q), kv = to_doubles(k), vv = to_doubles(v), out = to_doubles(qkv);
    const int64_t C = H * D;
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t j = h * KV / H;  // the key/value head of query head h
        for (int64_t d = 0; d < D; ++d) {
          CHECK(out[r * 3 * C + h * D + d] == qv[r * C + h * D + d]);
          CHECK(out[r * 3 * C + C + h * D + d] == kv[r * KV * D + j * D + d]);
          CHECK(out[r * 3 * C + 2 * C + h * D + d] == vv[r * KV * D + j * D + d]);
        }
      }
    }
    // The backward is the adjoint: <pack(q, k, v), g> = <q, dq> + <k, dk> + <v, dv>.
    const Tensor g = random_tensor(qkv.shape(), DType::kF64, 8);
    Tensor dq = cpu().empty(q.shape(), DType::kF64), dk = cpu().empty(k.shape(), DType::kF64),
           dv = cpu().empty(v.shape(), DType::kF64);
    cpu().pack_qkv_backward(g, static_cast<int>(H), dq, dk, dv);
    CHECK(dot(qkv, g) == doctest::Approx(dot(q, dq) + dot(k, dk) + dot(v, dv)).epsilon(1e-13));
    // And each key gradient is its group's sum, element by element.
    const std::vector<double> gv = to_doubles(g), dkv = to_doubles(dk);
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t j = 0; j < KV; ++j) {
        for (int64_t d = 0; d < D; ++d) {
          double s = 0;
          for (int64_t h = j * (H / KV); h < (j + 1) * (H / KV); ++h) s += gv[r * 3 * C + C + h * D + d];
          CHECK(dkv[r * KV * D + j * D + d] == doctest::Approx(s).epsilon(1e-15));
        }
      }
    }
  }
}

TEST_CASE("the LLaMA ops in bfloat16 and float16 are the float32 op on the widened operands, rounded once") {
  Backend& be = cpu();  // the widening backend
  for (DType narrow : {DType::kBF16, DType::kF16}) {
    CAPTURE(dtype_name(narrow));
    const Tensor x = random_tensor({2, 4, 12}, narrow, 9);
    Tensor y = be.empty(x.shape(), narrow), want = reference().empty(x.shape(), DType::kF32);
    be.rope(x, 2, 10000.0, y);
    reference().rope(as(x, DType::kF32), 2, 10000.0, want);
    CHECK(same_bits(y, as(want, narrow)));
    be.rope_backward(x, 3, 10000.0, y);
    reference().rope_backward(as(x, DType::kF32), 3, 10000.0, want);
    CHECK(same_bits(y, as(want, narrow)));
    const Tensor k = random_tensor({2, 4, 4}, narrow, 10), v = random_tensor({2, 4, 4}, narrow, 11);
    Tensor qkv = be.empty({2, 4, 36}, narrow), wqkv = reference().empty({2, 4, 36}, DType::kF32);
    be.pack_qkv(x, k, v, 6, qkv);
    reference().pack_qkv(as(x, DType::kF32), as(k, DType::kF32), as(v, DType::kF32), 6, wqkv);
    CHECK(same_bits(qkv, as(wqkv, narrow)));
    const Tensor g = random_tensor({2, 4, 36}, narrow, 12);
    Tensor dq = be.empty(x.shape(), narrow), dk = be.empty(k.shape(), narrow), dv = be.empty(v.shape(), narrow);
    Tensor wq = reference().empty(x.shape(), DType::kF32), wk = reference().empty(k.shape(), DType::kF32),
           wv = reference().empty(v.shape(), DType::kF32);
    be.pack_qkv_backward(g, 6, dq, dk, dv);
    reference().pack_qkv_backward(as(g, DType::kF32), 6, wq, wk, wv);
    CHECK(same_bits(dq, as(wq, narrow)));
    CHECK(same_bits(dk, as(wk, narrow)));
    CHECK(same_bits(dv, as(wv, narrow)));
  }
}

TEST_CASE("rope and pack_qkv name a head width or head count that cannot work, with the fix") {
  const Tensor x = random_tensor({2, 3, 12}, DType::kF32, 13);
  Tensor y = cpu().empty(x.shape(), DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().rope(x, 4, 10000.0, y), doctest::Contains("head width 3 (12 / 4 heads) is odd"), UserError);
  CHECK_THROWS_WITH_AS(cpu().rope(x, 5, 10000.0, y), doctest::Contains("do not split into 5 heads"), UserError);
  CHECK_THROWS_WITH_AS(cpu().rope(x, 2, 1.0, y), doctest::Contains("base must be greater than 1"), UserError);
  const Tensor k = random_tensor({2, 3, 8}, DType::kF32, 14);  // 2 heads of 4 for 3 query heads
  Tensor qkv = cpu().empty({2, 3, 36}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().pack_qkv(x, k, k, 3, qkv), doctest::Contains("choose kv_heads that divide heads"),
                       UserError);
  Tensor wrong = cpu().empty({2, 3, 30}, DType::kF32);
  CHECK_THROWS_AS(cpu().pack_qkv(x, k, k, 6, wrong), Error);
}

// The CPU's fused attention (float32, float64) keeps what a flash kernel keeps and
// computes with the exact path's own per-head code: its output and its gradients are
// pack_qkv then attention's bit for bit (the backward recomputes the probabilities), and
// its statistics are each row's log-sum-exp, here summed naively in long double.
TEST_CASE("fused attention on the CPU: the exact path's output and gradients bit for bit, and the log-sum-exp") {
  Backend& be = backend_for(Device::cpu());
  const int64_t B = 2, T = 7, D = 8;
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 2}, {4, 4}, {2, 1}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(H);
      CAPTURE(KV);
      const int64_t C = H * D, KC = KV * D;
      REQUIRE(be.has_fused_attention(dt, {B, T, H, KV, D}));
      const Tensor q = random_tensor({B, T, C}, dt, 60, -2, 2), k = random_tensor({B, T, KC}, dt, 61, -2, 2);
      const Tensor v = random_tensor({B, T, KC}, dt, 62), dout = random_tensor({B, T, C}, dt, 63);
      Tensor out = be.empty({B, T, C}, dt), stats = be.empty({B, H, T}, DType::kF32);
      be.fused_attention(q, k, v, static_cast<int>(H), out, stats);
      Tensor qkv = be.empty({B, T, 3 * C}, dt), probs = be.empty({B, H, T, T}, dt), want = be.empty({B, T, C}, dt);
      be.pack_qkv(q, k, v, static_cast<int>(H), qkv);
      be.attention(qkv, static_cast<int>(H), probs, want);
      CHECK(same_bits(out, want));
      const std::vector<double> qd = to_doubles(q), kd = to_doubles(k), lse = to_doubles(stats);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t j = h / (H / KV);  // its key/value head
          for (int64_t t = 0; t < T; ++t) {
            long double sum = 0;
            for (int64_t s = 0; s <= t; ++s) {
              long double score = 0;
              for (int64_t e = 0; e < D; ++e) score += qd[(b * T + t) * C + h * D + e] * kd[(b * T + s) * KC + j * D + e];
              sum += std::exp(score / std::sqrt(static_cast<long double>(D)));
            }
            CHECK(lse[(b * H + h) * T + t] == doctest::Approx(static_cast<double>(std::log(sum))).epsilon(2e-6));
          }
        }
      }
      Tensor dq = be.empty(q.shape(), dt), dk = be.empty(k.shape(), dt), dv = be.empty(v.shape(), dt);
      be.fused_attention_backward(dout, q, k, v, out, stats, static_cast<int>(H), dq, dk, dv);
      Tensor dqkv = be.empty(qkv.shape(), dt), wq = be.empty(q.shape(), dt), wk = be.empty(k.shape(), dt),
             wv = be.empty(v.shape(), dt);
      be.attention_backward(dout, qkv, probs, static_cast<int>(H), dqkv);
      be.pack_qkv_backward(dqkv, static_cast<int>(H), wq, wk, wv);
      CHECK(same_bits(dq, wq));
      CHECK(same_bits(dk, wk));
      CHECK(same_bits(dv, wv));
    }
  }
  CHECK_FALSE(be.has_fused_attention(DType::kBF16, {B, T, 4, 2, D}));  // widened: the exact path
  setenv("GPIPE_FUSED_ATTENTION", "0", 1);
  CHECK_FALSE(be.has_fused_attention(DType::kF32, {B, T, 4, 2, D}));
  CHECK_FALSE(fused_attention_available(Device::cpu(), DType::kF32, D));
  unsetenv("GPIPE_FUSED_ATTENTION");
  CHECK(fused_attention_available(Device::cpu(), DType::kF64, D));
}
