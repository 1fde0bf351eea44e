// The transformer ops and Adam of the reference backend: each op against naive loops,
// each backward against central finite differences in float64, dropout's mask against
// the Philox contract and across batch splits.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "kernels/backend.h"
#include "runtime/error.h"
#include "runtime/philox.h"
#include "runtime/philox_lanes_check.h"
#include "runtime/random.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

Tensor ids_tensor(const std::vector<int32_t>& v, int64_t B, int64_t T) {
  return Tensor::from_vector<int32_t>(v, {B, T});
}

double tol_for(DType dt) { return dt == DType::kF32 ? 1e-5 : 1e-12; }

// softmax_s(q_t . k_s / sqrt(D)) over s <= t and probs @ v, in double loops.
void naive_attention(const std::vector<double>& qkv, int64_t B, int64_t T, int64_t C, int64_t H,
                     std::vector<double>& probs, std::vector<double>& out) {
  const int64_t D = C / H;
  probs.assign(B * H * T * T, 0.0);
  out.assign(B * T * C, 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t c) { return qkv[(b * T + t) * 3 * C + c]; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> w(t + 1);
        double mx = -1e300;
        for (int64_t s = 0; s <= t; ++s) {
          double z = 0;
          for (int64_t i = 0; i < D; ++i) z += at(b, t, h * D + i) * at(b, s, C + h * D + i);
          w[s] = z / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, w[s]);
        }
        double sum = 0;
        for (int64_t s = 0; s <= t; ++s) sum += (w[s] = std::exp(w[s] - mx));
        for (int64_t s = 0; s <= t; ++s) {
          const double pr = w[s] / sum;
          probs[((b * H + h) * T + t) * T + s] = pr;
          for (int64_t i = 0; i < D; ++i) out[(b * T + t) * C + h * D + i] += pr * at(b, s, 2 * C + h * D + i);
        }
      }
}

}  // namespace

TEST_CASE("embedding gathers token rows and adds positions") {
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (bool with_pos : {true, false}) {
      const int64_t B = 2, T = 3, V = 5, C = 4, P = 6;  // P > T: only the first T positions are used
      Tensor table = random_tensor({V, C}, dt, 1);
      Tensor pos = with_pos ? random_tensor({P, C}, dt, 2) : Tensor();
      Tensor ids = ids_tensor({4, 0, 4, 1, 2, 3}, B, T);
      Tensor out = cpu().empty({B, T, C}, dt);
      cpu().embedding(ids, table, pos, out);
      const auto tb = to_doubles(table);
      const auto ps = with_pos ? to_doubles(pos) : std::vector<double>(P * C, 0.0);
      std::vector<double> want(B * T * C);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = 0; c < C; ++c)
            want[(b * T + t) * C + c] = tb[ids.data<int32_t>()[b * T + t] * C + c] + ps[t * C + c];
      GPIPE_EXPECT_CLOSE(out, want, tol_for(dt), tol_for(dt));
    }
  }
}

TEST_CASE("embedding backward accumulates and matches finite differences") {
  const int64_t B = 2, T = 3, V = 4, C = 3, P = 4;
  Tensor table = random_tensor({V, C}, DType::kF64, 1);
  Tensor pos = random_tensor({P, C}, DType::kF64, 2);
  Tensor ids = ids_tensor({1, 3, 1, 1, 0, 2}, B, T);  // id 1 three times: the adds must accumulate
  Tensor r = random_tensor({B, T, C}, DType::kF64, 3);
  auto f = [&] {
    Tensor out = cpu().empty({B, T, C}, DType::kF64);
    cpu().embedding(ids, table, pos, out);
    return gpipe::testing::dot(out, r);
  };
  // Start from non-zero gradients: backward adds.
  Tensor dtable = random_tensor({V, C}, DType::kF64, 4), dpos = random_tensor({P, C}, DType::kF64, 5);
  const auto dtable0 = to_doubles(dtable), dpos0 = to_doubles(dpos);
  cpu().embedding_backward(ids, r, dtable, dpos);
  auto nt = gpipe::testing::numeric_gradient(table, f), np = gpipe::testing::numeric_gradient(pos, f);
  for (size_t i = 0; i < nt.size(); ++i) nt[i] += dtable0[i];
  for (size_t i = 0; i < np.size(); ++i) np[i] += dpos0[i];
  GPIPE_EXPECT_CLOSE(dtable, nt, 1e-8, 1e-8);
  GPIPE_EXPECT_CLOSE(dpos, np, 1e-8, 1e-8);
  // Rows of the position table beyond T receive nothing.
  for (int64_t c = 0; c < C; ++c) CHECK(dpos.data<double>()[3 * C + c] == dpos0[3 * C + c]);

  // Without positions dpos is an undefined tensor and is left alone.
  Tensor none;
  cpu().embedding_backward(ids, r, dtable, none);
  CHECK(!none.defined());
}

TEST_CASE("a token id outside the vocabulary is a user error naming it, its position and the vocabulary") {
  Tensor table = random_tensor({5, 2}, DType::kF32, 1);
  Tensor out = cpu().empty({2, 3, 2}, DType::kF32);
  Tensor bad = ids_tensor({0, 1, 2, 3, 4, 7}, 2, 3);
  CHECK_THROWS_WITH_AS(cpu().embedding(bad, table, Tensor(), out),
                       doctest::Contains("token id 7 at (b=1, t=2) is outside the vocabulary [0, 5)"), UserError);
  Tensor negative = ids_tensor({0, -1, 2, 3, 4, 1}, 2, 3);
  CHECK_THROWS_WITH_AS(cpu().embedding(negative, table, Tensor(), out), doctest::Contains("token id -1 at (b=0, t=1)"),
                       UserError);
  // Backward checks before it adds anything.
  Tensor dtable = cpu().zeros({5, 2}, DType::kF32), none;
  CHECK_THROWS_AS(cpu().embedding_backward(bad, out, dtable, none), UserError);
  CHECK(cpu().sum_squares(dtable) == 0.0);
  // A position table shorter than the sequence is a programming error.
  Tensor short_pos = random_tensor({2, 2}, DType::kF32, 2);
  CHECK_THROWS_WITH_AS(cpu().embedding(ids_tensor({0, 1, 2, 3, 4, 0}, 2, 3), table, short_pos, out),
                       doctest::Contains("P >= 3"), Error);
}

TEST_CASE("layernorm normalises rows with the biased variance") {
  for (DType dt : {DType::kF32, DType::kF64}) {
    const int64_t R = 5, C = 7;
    const double eps = 1e-5;
    Tensor x = random_tensor({R, C}, dt, 1, -2, 3);
    Tensor gamma = random_tensor({C}, dt, 2), beta = random_tensor({C}, dt, 3);
    Tensor y = cpu().empty({R, C}, dt), mean = cpu().empty({R}, dt), rstd = cpu().empty({R}, dt);
    cpu().layernorm(x, gamma, beta, eps, y, mean, rstd);
    const auto xs = to_doubles(x), g = to_doubles(gamma), b = to_doubles(beta);
    std::vector<double> want(R * C), wm(R), wr(R);
    for (int64_t r = 0; r < R; ++r) {
      double mu = 0, var = 0;
      for (int64_t c = 0; c < C; ++c) mu += xs[r * C + c] / C;
      for (int64_t c = 0; c < C; ++c) var += (xs[r * C + c] - mu) * (xs[r * C + c] - mu) / C;
      wm[r] = mu;
      wr[r] = 1 / std::sqrt(var + eps);
      for (int64_t c = 0; c < C; ++c) want[r * C + c] = (xs[r * C + c] - mu) * wr[r] * g[c] + b[c];
    }
    const double tol = dt == DType::kF32 ? 1e-5 : 1e-12;
    GPIPE_EXPECT_CLOSE(y, want, tol, tol);
    GPIPE_EXPECT_CLOSE(mean, wm, tol, tol);
    GPIPE_EXPECT_CLOSE(rstd, wr, tol, tol);
  }
}

TEST_CASE("layernorm backward matches finite differences") {
  // x is (2, 3, 5): the op normalises over the last dimension of any shape.
  const int64_t R = 6, C = 5;
  const double eps = 1e-5;
  Tensor x = random_tensor({2, 3, C}, DType::kF64, 1, -2, 2);
  Tensor gamma = random_tensor({C}, DType::kF64, 2, 0.5, 1.5), beta = random_tensor({C}, DType::kF64, 3);
  Tensor r = random_tensor({2, 3, C}, DType::kF64, 4);
  auto f = [&] {
    Tensor y = cpu().empty(x.shape(), DType::kF64);
    Tensor m = cpu().empty({R}, DType::kF64), s = cpu().empty({R}, DType::kF64);
    cpu().layernorm(x, gamma, beta, eps, y, m, s);
    return gpipe::testing::dot(y, r);
  };
  Tensor y = cpu().empty(x.shape(), DType::kF64), mean = cpu().empty({R}, DType::kF64),
         rstd = cpu().empty({R}, DType::kF64);
  cpu().layernorm(x, gamma, beta, eps, y, mean, rstd);
  Tensor dx = cpu().empty(x.shape(), DType::kF64);
  Tensor dgamma = Tensor::from_vector<double>(std::vector<double>(C, 0.5), {C});  // backward adds to these
  Tensor dbeta = Tensor::from_vector<double>(std::vector<double>(C, -0.25), {C});
  cpu().layernorm_backward(r, x, gamma, mean, rstd, dx, dgamma, dbeta);
  GPIPE_EXPECT_CLOSE(dx, gpipe::testing::numeric_gradient(x, f), 1e-6, 1e-8);
  auto ng = gpipe::testing::numeric_gradient(gamma, f), nb = gpipe::testing::numeric_gradient(beta, f);
  for (auto& v : ng) v += 0.5;
  for (auto& v : nb) v -= 0.25;
  GPIPE_EXPECT_CLOSE(dgamma, ng, 1e-6, 1e-8);
  GPIPE_EXPECT_CLOSE(dbeta, nb, 1e-6, 1e-8);
}

TEST_CASE("causal attention matches naive loops") {
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (int heads : {1, 2, 4}) {
      INFO(dtype_name(dt), " heads=", heads);
      const int64_t B = 2, T = 5, C = 8;
      Tensor qkv = random_tensor({B, T, 3 * C}, dt, 7, -2, 2);
      Tensor probs = cpu().empty({B, heads, T, T}, dt), out = cpu().empty({B, T, C}, dt);
      cpu().attention(qkv, heads, probs, out);
      std::vector<double> wp, wo;
      naive_attention(to_doubles(qkv), B, T, C, heads, wp, wo);
      GPIPE_EXPECT_CLOSE(probs, wp, tol_for(dt), tol_for(dt));
      GPIPE_EXPECT_CLOSE(out, wo, tol_for(dt), tol_for(dt));
      // The mask is exact zeros, not small numbers.
      const auto p = to_doubles(probs);
      for (int64_t i = 0; i < B * heads; ++i)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t s = t + 1; s < T; ++s) CHECK(p[(i * T + t) * T + s] == 0.0);
    }
  }
}

TEST_CASE("attention with large scores equals the float64 reference") {
  {
    // Random scores ~ 1e4 overflow exp without the row's maximum subtracted; their
    // differences are large, so each row is close to one-hot.
    const int64_t B = 1, T = 3, C = 2;
    Tensor qkv = random_tensor({B, T, 3 * C}, DType::kF32, 1, 100, 200);
    Tensor probs = cpu().empty({B, 1, T, T}, DType::kF32), out = cpu().empty({B, T, C}, DType::kF32);
    cpu().attention(qkv, 1, probs, out);
    std::vector<double> wp, wo;
    naive_attention(to_doubles(qkv), B, T, C, 1, wp, wo);
    GPIPE_EXPECT_CLOSE(probs, wp, 1e-4, 1e-4);
    GPIPE_EXPECT_CLOSE(out, wo, 1e-4, 1e-3);
  }
  {
    // Scores ~ 1e4 that differ by about 0.7 (q = (100, 0), k_s = (141 + 0.01 s, 0), D = 2):
    // every probability is far from 0 and 1, so a uniform or shifted softmax fails.
    const int64_t B = 1, T = 3, C = 2;
    const std::vector<float> v = {100, 0, 141.00f, 0, 1, 2,    //
                                  100, 0, 141.01f, 0, 3, -1,   //
                                  100, 0, 141.02f, 0, 0.5f, 4};
    Tensor qkv = Tensor::from_vector<float>(v, {B, T, 3 * C});
    Tensor probs = cpu().empty({B, 1, T, T}, DType::kF32), out = cpu().empty({B, T, C}, DType::kF32);
    cpu().attention(qkv, 1, probs, out);
    std::vector<double> wp, wo;
    naive_attention(to_doubles(qkv), B, T, C, 1, wp, wo);
    // float32 rounds a score of 1e4 to about 1e-3, so probabilities agree to about that.
    GPIPE_EXPECT_CLOSE(probs, wp, 5e-3, 5e-3);
    GPIPE_EXPECT_CLOSE(out, wo, 5e-3, 5e-3);
    CHECK(wp[2 * T + 0] > 0.1);  // row 2 is not one-hot ...
    CHECK(wp[2 * T + 2] < 0.8);
    CHECK(std::abs(wp[2 * T + 0] - 1.0 / 3) > 0.05);  // ... nor uniform
  }
}

TEST_CASE("attention backward matches finite differences") {
  for (int heads : {1, 2}) {
    INFO("heads=", heads);
    const int64_t B = 2, T = 4, C = 4;
    Tensor qkv = random_tensor({B, T, 3 * C}, DType::kF64, 3, -1.5, 1.5);
    Tensor r = random_tensor({B, T, C}, DType::kF64, 4);
    auto f = [&] {
      Tensor probs = cpu().empty({B, heads, T, T}, DType::kF64), out = cpu().empty({B, T, C}, DType::kF64);
      cpu().attention(qkv, heads, probs, out);
      return gpipe::testing::dot(out, r);
    };
    Tensor probs = cpu().empty({B, heads, T, T}, DType::kF64), out = cpu().empty({B, T, C}, DType::kF64);
    cpu().attention(qkv, heads, probs, out);
    Tensor dqkv = random_tensor({B, T, 3 * C}, DType::kF64, 9);  // garbage: backward overwrites
    cpu().attention_backward(r, qkv, probs, heads, dqkv);
    GPIPE_EXPECT_CLOSE(dqkv, gpipe::testing::numeric_gradient(qkv, f), 1e-6, 1e-8);
  }
}

TEST_CASE("attention rejects heads that do not divide the channels") {
  Tensor qkv = random_tensor({1, 2, 3 * 6}, DType::kF32, 1);
  Tensor probs = cpu().empty({1, 4, 2, 2}, DType::kF32), out = cpu().empty({1, 2, 6}, DType::kF32);
  CHECK_THROWS_WITH(cpu().attention(qkv, 4, probs, out), doctest::Contains("6 channels do not split into 4 heads"));
}

TEST_CASE("a dropout key mixed from the step: mix_seed's, from the host or from the step's scalars") {
  // mixed_key finishes mix_seed with the step in any of its three slots.
  for (uint64_t step : {0ull, 1ull, 7ull, 123456789ull, (1ull << 52) + 3}) {
    CAPTURE(step);
    const uint64_t seed = 0xC0FFEE1234ull;
    CHECK(mixed_key(mix_seed_base(seed), kMixA, step) == mix_seed(seed, step));
    CHECK(mixed_key(mix_seed_base(seed, 5, 0, 9), kMixB, step) == mix_seed(seed, 5, step, 9));
    CHECK(mixed_key(mix_seed_base(seed, 0x64726f70u, 4), kMixC, step) == mix_seed(seed, 0x64726f70u, 4, step));
  }
  // The op's mask is the same with the step on the host and read from the step's scalars
  // (kStepIndex), and another step draws another.
  const Tensor x = random_tensor({6, 37}, DType::kF64, 3, 0.5, 1.5);
  StepScalarValues v = initial_step_scalars();
  v[kStepIndex] = 41;
  const Tensor scalars = cpu().step_scalars(v);
  Tensor host = cpu().empty(x.shape(), DType::kF64), device = cpu().empty(x.shape(), DType::kF64),
         other = cpu().empty(x.shape(), DType::kF64);
  cpu().dropout(x, 0.4, DropoutKey::of_step(99, kMixA, 41), 2, 0, host);
  cpu().dropout(x, 0.4, DropoutKey::of_step(99, kMixA, 0, scalars), 2, 0, device);
  cpu().dropout(x, 0.4, DropoutKey::of_step(99, kMixA, 42), 2, 0, other);
  CHECK(to_doubles(host) == to_doubles(device));
  CHECK(to_doubles(host) != to_doubles(other));
  CHECK(to_doubles(host) != to_doubles(x));
  // The plain key is the mixed one.
  cpu().dropout(x, 0.4, mix_seed(99, 41), 2, 0, other);
  CHECK(to_doubles(host) == to_doubles(other));
  CHECK_THROWS_WITH_AS(cpu().dropout(x, 0.4, DropoutKey::of_step(99, kMixA, 0, cpu().zeros({2}, DType::kF64)), 2, 0, other),
                       doctest::Contains("the step's scalars"), Error);
}

TEST_CASE("dropout keeps 1 - p of the elements, scaled, with the Philox mask") {
  const int64_t N = 16, E = 1001;  // not a multiple of 4: a partial Philox block ends each row
  const double p = 0.3;
  const uint64_t key = 0x1234567890ABCDEFull;
  const int64_t offset = 5;
  Tensor x = random_tensor({N, E}, DType::kF32, 1, 0.5, 1.5);  // no zeros: a zero output means dropped
  Tensor y = cpu().empty({N, E}, DType::kF32);
  cpu().dropout(x, p, key, offset, 0, y);
  int64_t kept = 0;
  bool mask_ok = true, scale_ok = true;
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t e = 0; e < E; ++e) {
      const float xv = x.data<float>()[i * E + e], yv = y.data<float>()[i * E + e];
      const bool keep = philox_uniform(key, offset + i, e) >= p;
      mask_ok &= keep == (yv != 0.0f);
      if (keep) {
        ++kept;
        scale_ok &= yv == xv * static_cast<float>(1.0 / (1.0 - p));
      }
    }
  }
  CHECK(mask_ok);
  CHECK(scale_ok);
  const double rate = static_cast<double>(kept) / (N * E);
  CHECK(rate == doctest::Approx(1 - p).epsilon(0.02));  // 16000 draws: sd of the rate ~0.004
}

TEST_CASE("dropout's mask does not depend on the batch split, and backward reuses it") {
  for (DType dt : {DType::kF32, DType::kF64}) {
    const int64_t N = 8, T = 3, C = 5;  // (N, T, C): E = 15 elements per sample
    const double p = 0.5;
    const uint64_t key = 42;
    Tensor x = random_tensor({N, T, C}, dt, 2, 0.5, 1.5);
    Tensor whole = cpu().empty({N, T, C}, dt);
    cpu().dropout(x, p, key, 0, 0, whole);
    // Rows 0..3 and 4..7 as two micro-batches, the second starting at sample 4.
    Tensor a = cpu().empty({4, T, C}, dt), b = cpu().empty({4, T, C}, dt);
    cpu().dropout(x.narrow_rows(0, 4), p, key, 0, 0, a);
    cpu().dropout(x.narrow_rows(4, 4), p, key, 4, 0, b);
    std::vector<double> split = to_doubles(a);
    const auto second = to_doubles(b);
    split.insert(split.end(), second.begin(), second.end());
    CHECK(to_doubles(whole) == split);  // bitwise

    // A different key draws a different mask.
    Tensor other = cpu().empty({N, T, C}, dt);
    cpu().dropout(x, p, key + 1, 0, 0, other);
    CHECK(to_doubles(other) != to_doubles(whole));

    // Backward: dx = dy * mask / (1 - p) with the forward's mask, here split as 3 + 5.
    Tensor dy = random_tensor({N, T, C}, dt, 3, 0.5, 1.5);
    Tensor head = cpu().empty({3, T, C}, dt), tail = cpu().empty({5, T, C}, dt);
    cpu().dropout_backward(dy.narrow_rows(0, 3), p, key, 0, 0, head);
    cpu().dropout_backward(dy.narrow_rows(3, 5), p, key, 3, 0, tail);
    std::vector<double> dx = to_doubles(head);
    const auto dx_tail = to_doubles(tail);
    dx.insert(dx.end(), dx_tail.begin(), dx_tail.end());
    const auto w = to_doubles(whole), g = to_doubles(dy);
    bool same_mask = true, same_scale = true;
    for (int64_t i = 0; i < N * T * C; ++i) {
      same_mask &= (w[i] != 0.0) == (dx[i] != 0.0);
      if (w[i] != 0.0) same_scale &= dx[i] == g[i] * 2.0;  // 1 / (1 - 0.5), exact in either dtype
    }
    CHECK(same_mask);
    CHECK(same_scale);
  }
}

TEST_CASE("dropout of a part of each sample, at its element offset, is that part of the whole samples' dropout") {
  // A sequence-parallel member holds positions [r T/n, (r+1) T/n) of each sample: the
  // elements from r (T/n) C on. Parts starting and ending inside a Philox block of four
  // (C = 3) and on one (C = 4), forward and backward, both float types: bit for bit.
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (int64_t C : {3, 4}) {
      const int64_t N = 5, T = 8, parts = 4, rows = T / parts;
      const double p = 0.4;
      const uint64_t key = 0xFEEDull;
      Tensor x = random_tensor({N, T, C}, dt, 7, 0.5, 1.5);
      Tensor whole = cpu().empty({N, T, C}, dt), back = cpu().empty({N, T, C}, dt);
      cpu().dropout(x, p, key, 3, 0, whole);
      cpu().dropout_backward(x, p, key, 3, 0, back);
      const auto w = to_doubles(whole), wb = to_doubles(back);
      for (int64_t r = 0; r < parts; ++r) {
        CAPTURE(dtype_name(dt));
        CAPTURE(C);
        CAPTURE(r);
        Tensor part = cpu().empty({N, rows, C}, dt);
        for (int64_t n = 0; n < N; ++n) {  // the part's rows of each sample
          for (int64_t e = 0; e < rows * C; ++e) {
            const int64_t at = n * T * C + r * rows * C + e;
            if (dt == DType::kF32) {
              part.data<float>()[n * rows * C + e] = x.data<float>()[at];
            } else {
              part.data<double>()[n * rows * C + e] = x.data<double>()[at];
            }
          }
        }
        Tensor y = cpu().empty({N, rows, C}, dt), dx = cpu().empty({N, rows, C}, dt);
        cpu().dropout(part, p, key, 3, r * rows * C, y);
        cpu().dropout_backward(part, p, key, 3, r * rows * C, dx);
        const auto yv = to_doubles(y), dv = to_doubles(dx);
        bool same = true;
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t e = 0; e < rows * C; ++e) {
            const int64_t at = n * T * C + r * rows * C + e;
            same &= yv[n * rows * C + e] == w[at] && dv[n * rows * C + e] == wb[at];
          }
        }
        CHECK(same);
      }
    }
  }
  Tensor x = random_tensor({2, 3}, DType::kF32, 1), y = cpu().empty({2, 3}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().dropout(x, 0.5, 1, 0, -1, y), doctest::Contains("negative element offset"), Error);
}

TEST_CASE("Philox's side-by-side lanes are philox4x32_10 of each lane's counter") {
  CHECK(philox_lanes_match_blocks());  // the build's AVX2 lanes
}

TEST_CASE("dropout at any element offset and length is philox_uniform's mask, and p equal to a uniform keeps it") {
  // The CPU draws eight Philox blocks (32 elements) at a time and compares the uniform's
  // 24 bits with ceil(p 2^24): parts that start and end inside a span and on one, and p
  // placed exactly on one element's uniform (kept) and just above it (dropped).
  const uint64_t key = 0xC0FFEEull;
  const int64_t rows = 3, sample_offset = 11;
  const float probe_u = philox_uniform(key, sample_offset + 1, 45);  // row 1, element 45
  const double just_above = std::nextafter(static_cast<double>(probe_u), 1.0);
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (int64_t offset : {0, 1, 3, 4, 31, 32, 33, 37}) {
      for (int64_t length : {1, 5, 31, 32, 33, 100}) {
        for (double p : {0.3, 0.5, 0.25, 1e-9, 0.999999, static_cast<double>(probe_u), just_above}) {
          CAPTURE(dtype_name(dt));
          CAPTURE(offset);
          CAPTURE(length);
          CAPTURE(p);
          Tensor x = random_tensor({rows, length}, dt, 5, 0.5, 1.5);  // no zeros
          Tensor y = cpu().empty({rows, length}, dt);
          cpu().dropout(x, p, key, sample_offset, offset, y);
          const auto xv = to_doubles(x), yv = to_doubles(y);
          const double scale = dt == DType::kF32 ? static_cast<double>(static_cast<float>(1.0 / (1.0 - p)))
                                                 : 1.0 / (1.0 - p);
          bool same = true;
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t e = 0; e < length; ++e) {
              const bool keep = philox_uniform(key, sample_offset + i, offset + e) >= p;
              const double x_e = xv[i * length + e];
              const double want = !keep ? 0.0
                                        : dt == DType::kF32 ? static_cast<double>(static_cast<float>(x_e) *
                                                                                  static_cast<float>(scale))
                                                            : x_e * scale;
              same &= yv[i * length + e] == want;
            }
          }
          CHECK(same);
          // In place (y in x's storage): a row's span must not write past the row into the next one's input.
          Tensor inplace = random_tensor({rows, length}, dt, 5, 0.5, 1.5);
          cpu().dropout(inplace, p, key, sample_offset, offset, inplace);
          CHECK(to_doubles(inplace) == yv);
          if (offset <= 45 && 45 < offset + length) {  // the probed element: kept at p = u, dropped just above
            const bool kept = yv[1 * length + (45 - offset)] != 0.0;
            if (p == static_cast<double>(probe_u)) CHECK(kept);
            if (p == just_above) CHECK_FALSE(kept);
          }
        }
      }
    }
  }
}

TEST_CASE("dropout backward matches finite differences") {
  const int64_t N = 3, E = 6;
  const double p = 0.4;
  Tensor x = random_tensor({N, E}, DType::kF64, 1);
  Tensor r = random_tensor({N, E}, DType::kF64, 2);
  auto f = [&] {
    Tensor y = cpu().empty({N, E}, DType::kF64);
    cpu().dropout(x, p, 7, 11, 0, y);
    return gpipe::testing::dot(y, r);
  };
  Tensor dx = cpu().empty({N, E}, DType::kF64);
  cpu().dropout_backward(r, p, 7, 11, 0, dx);
  GPIPE_EXPECT_CLOSE(dx, gpipe::testing::numeric_gradient(x, f), 1e-8, 1e-8);
}

TEST_CASE("dropout with p = 0 copies, and p outside [0, 1) is a user error") {
  Tensor x = random_tensor({4, 5}, DType::kF32, 1);
  Tensor y = cpu().empty({4, 5}, DType::kF32);
  cpu().dropout(x, 0.0, 3, 0, 0, y);
  CHECK(y.to_vector<float>() == x.to_vector<float>());
  cpu().dropout_backward(x, 0.0, 3, 0, 0, y);
  CHECK(y.to_vector<float>() == x.to_vector<float>());
  CHECK_THROWS_WITH_AS(cpu().dropout(x, 1.0, 3, 0, 0, y), doctest::Contains("must be in [0, 1)"), UserError);
  CHECK_THROWS_AS(cpu().dropout(x, -0.1, 3, 0, 0, y), UserError);
  CHECK_THROWS_AS(cpu().dropout_backward(x, NAN, 3, 0, 0, y), UserError);
}

TEST_CASE("Adam and AdamW follow PyTorch's update over two steps") {
  for (bool decoupled : {false, true}) {
    INFO("decoupled=", decoupled);
    AdamParams ap;
    ap.lr = 0.1;
    ap.beta1 = 0.8;
    ap.beta2 = 0.9;
    ap.eps = 1e-3;
    ap.weight_decay = 0.05;
    ap.decoupled = decoupled;
    Tensor w = Tensor::from_vector<double>({1.0, -2.0, 0.5}, {3});
    Tensor m = cpu().zeros({3}, DType::kF64), v = cpu().zeros({3}, DType::kF64);
    const std::vector<double> g1{0.5, -0.25, 0.0}, g2{-1.0, 0.75, 2.0};
    // The same update written out by hand in double.
    std::vector<double> ew{1.0, -2.0, 0.5}, em(3, 0.0), ev(3, 0.0);
    for (int step = 1; step <= 2; ++step) {
      const auto& gs = step == 1 ? g1 : g2;
      Tensor g = Tensor::from_vector<double>(gs, {3});
      cpu().adam_step(w, g, m, v, ap, step);
      for (int i = 0; i < 3; ++i) {
        double gi = gs[i];
        if (decoupled) {
          ew[i] *= 1 - 0.1 * 0.05;
        } else {
          gi += 0.05 * ew[i];
        }
        em[i] = 0.8 * em[i] + 0.2 * gi;
        ev[i] = 0.9 * ev[i] + 0.1 * gi * gi;
        const double mhat = em[i] / (1 - std::pow(0.8, step)), vhat = ev[i] / (1 - std::pow(0.9, step));
        ew[i] -= 0.1 * mhat / (std::sqrt(vhat) + 1e-3);
      }
      GPIPE_EXPECT_CLOSE(w, ew, 1e-14, 1e-14);
      GPIPE_EXPECT_CLOSE(m, em, 1e-14, 1e-14);
      GPIPE_EXPECT_CLOSE(v, ev, 1e-14, 1e-14);
    }
  }
  // The first step moves every parameter with a non-zero gradient by about lr.
  AdamParams plain;
  plain.lr = 0.01;
  Tensor w = Tensor::from_vector<float>({0.f, 0.f}, {2});
  Tensor g = Tensor::from_vector<float>({3.f, -1e-3f}, {2});
  Tensor m = cpu().zeros({2}, DType::kF32), v = cpu().zeros({2}, DType::kF32);
  cpu().adam_step(w, g, m, v, plain, 1);
  CHECK(w.data<float>()[0] == doctest::Approx(-0.01).epsilon(1e-4));
  CHECK(w.data<float>()[1] == doctest::Approx(0.01).epsilon(1e-4));
  CHECK_THROWS_WITH(cpu().adam_step(w, g, m, v, plain, 0), doctest::Contains("step counts from 1"));
}

TEST_CASE("sum of squares in double") {
  Tensor x = Tensor::from_vector<float>({1.f, -2.f, 3.f}, {3});
  CHECK(cpu().sum_squares(x) == 14.0);
  Tensor y = random_tensor({10, 7}, DType::kF64, 3);
  double s = 0;
  for (double v : to_doubles(y)) s += v * v;
  CHECK(cpu().sum_squares(y) == doctest::Approx(s).epsilon(1e-14));
  // Over several tensors (a stage's gradients): each one's sum, added in order; nothing is 0.
  Tensor z = random_tensor({5}, DType::kF64, 4);
  CHECK(cpu().sum_squares_all({y, z}) == cpu().sum_squares(y) + cpu().sum_squares(z));
  CHECK(cpu().sum_squares_all({}) == 0.0);
  // A bfloat16 tensor among them is widened on its own (backend_for's WideningBackend).
  Tensor h = Tensor::empty({3}, DType::kBF16, Device::cpu());
  cpu().cast(x, h);  // 1, -2, 3: exact in bfloat16
  CHECK(cpu().sum_squares_all({x, h}) == 28.0);
}
