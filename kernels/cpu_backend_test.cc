// The reference backend against naive double-precision loops.
#include <doctest/doctest.h>

#include <cmath>

#include "kernels/backend.h"
#include "runtime/bf16.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {
Backend& cpu() { return backend_for(Device::cpu()); }

std::vector<double> naive_matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, const std::vector<double>& c0,
                                 double alpha, double beta) {
  const auto A = to_doubles(a), B = to_doubles(b);
  const int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const int64_t n = tb ? b.size(0) : b.size(1);
  std::vector<double> c(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? A[p * a.size(1) + i] : A[i * a.size(1) + p];
        const double bv = tb ? B[j * b.size(1) + p] : B[p * b.size(1) + j];
        s += av * bv;
      }
      c[i * n + j] = alpha * s + beta * c0[i * n + j];
    }
  return c;
}
}  // namespace

TEST_CASE("matmul in every transpose combination, float32 and float64") {
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const int64_t m = 5, n = 3, k = 7;
        Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, dt, 1);
        Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, dt, 2);
        Tensor c = random_tensor({m, n}, dt, 3);
        const auto c0 = to_doubles(c);
        cpu().matmul(a, ta, b, tb, c, 0.5, 2.0);
        const double tol = dt == DType::kF32 ? 1e-5 : 1e-12;
        GPIPE_EXPECT_CLOSE(c, naive_matmul(a, ta, b, tb, c0, 0.5, 2.0), tol, tol);
      }
    }
  }
}

TEST_CASE("matmul rejects shapes that do not fit") {
  Tensor a = random_tensor({2, 3}, DType::kF32, 1), b = random_tensor({4, 2}, DType::kF32, 2);
  Tensor c = cpu().empty({2, 2}, DType::kF32);
  CHECK_THROWS_WITH(cpu().matmul(a, false, b, false, c), doctest::Contains("shapes do not fit"));
}

TEST_CASE("bias add and its reduction") {
  Tensor y = random_tensor({4, 3}, DType::kF64, 1);
  Tensor bias = random_tensor({3}, DType::kF64, 2);
  auto y0 = to_doubles(y);
  cpu().add_bias(y, bias);
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 3; ++j) CHECK(y.data<double>()[r * 3 + j] == doctest::Approx(y0[r * 3 + j] + bias.data<double>()[j]));
  Tensor db = Tensor::from_vector<double>({1, 1, 1}, {3});
  cpu().bias_grad(y, db, 0.5);
  for (int j = 0; j < 3; ++j) {
    double s = 0.5;
    for (int r = 0; r < 4; ++r) s += y.data<double>()[r * 3 + j];
    CHECK(db.data<double>()[j] == doctest::Approx(s));
  }
}

TEST_CASE("elementwise ops") {
  Tensor x = Tensor::from_vector<double>({-2, -0.5, 0, 0.5, 3}, {5});
  Tensor y = cpu().empty({5}, DType::kF64);
  cpu().relu(x, y);
  CHECK(y.to_vector<double>() == std::vector<double>{0, 0, 0, 0.5, 3});
  cpu().gelu(x, y);
  for (int i = 0; i < 5; ++i) {
    const double v = x.data<double>()[i];
    CHECK(y.data<double>()[i] == doctest::Approx(0.5 * v * (1 + std::erf(v / std::sqrt(2.0)))));
  }
  Tensor z = Tensor::from_vector<double>({1, 2, 3, 4, 5}, {5});
  cpu().axpy(2.0, x, z);
  CHECK(z.to_vector<double>() == std::vector<double>{-3, 1, 3, 5, 11});
  cpu().scale(z, 0.5);
  CHECK(z.to_vector<double>() == std::vector<double>{-1.5, 0.5, 1.5, 2.5, 5.5});
  z.data<double>()[0] = NAN;
  cpu().scale(z, 0.0);  // clears, even NaN
  CHECK(z.to_vector<double>() == std::vector<double>{0, 0, 0, 0, 0});
  cpu().fill(z, 7);
  CHECK(cpu().item(z.narrow_rows(2, 1)) == 7.0);
}

TEST_CASE("softmax with large logits equals a float64 reference") {
  // Logits far beyond exp's float32 range (e^89 overflows): a softmax that does not
  // subtract the row's maximum gives inf/NaN, a wrong one gives other probabilities.
  // The last row spreads wider than that range with its maximum in the last class, so
  // subtracting any other logit of the row (or a maximum that misses a class) overflows.
  const std::vector<double> z = {1000, 1001, 999, -5, 0, 5, 1e4, 1e4 + 1, 1e4 + 2.5, -50, 0, 100};
  const std::vector<int32_t> y = {1, 2, 0, 1};
  const int64_t R = 4, C = 3;
  Tensor logits = Tensor::from_vector<float>(std::vector<float>(z.begin(), z.end()), {R, C});
  Tensor labels = Tensor::from_vector<int32_t>(y, {R});
  Tensor probs = cpu().empty({R, C}, DType::kF32), loss = cpu().empty({1}, DType::kF32);
  cpu().softmax_xent(logits, labels, 0.5, -100, probs, loss);
  // The reference: p = e^(z - max) / sum over the row, in float64; loss = 0.5 * sum -log p[label].
  std::vector<double> want(R * C);
  double want_loss = 0;
  for (int64_t r = 0; r < R; ++r) {
    const double mx = std::max({z[r * C], z[r * C + 1], z[r * C + 2]});
    double sum = 0;
    for (int64_t j = 0; j < C; ++j) sum += std::exp(z[r * C + j] - mx);
    for (int64_t j = 0; j < C; ++j) want[r * C + j] = std::exp(z[r * C + j] - mx) / sum;
    want_loss += -0.5 * std::log(want[r * C + y[r]]);
  }
  // Row 2's logits hold float32's rounding of 1e4 + 2.5 (spacing 1/1024): exact here.
  GPIPE_EXPECT_CLOSE(probs, want, 1e-6, 1e-7);
  CHECK(cpu().item(loss) == doctest::Approx(want_loss).epsilon(1e-6));
  // Not a softmax that merely sums to one: the rows are far from uniform.
  CHECK(probs.data<float>()[1] > 0.66f);
  CHECK(probs.data<float>()[8] > 0.75f);
}

TEST_CASE("argmax_correct counts rows whose first largest logit is the label, ignored rows left out") {
  // Row 0: max at 2 (label 2, correct). Row 1: tie between 0 and 3, the first wins
  // (label 3, wrong). Row 2: label ignored (its argmax would match). Row 3: a label
  // outside the classes never matches. Row 4: max at 1 (label 1, correct).
  const std::vector<double> v = {0, 1, 5, 2, 7, 1, 2, 7, 9, 0, 0, 0, 1, 2, 3, 4, -1, 3, -2, -3};
  const std::vector<int32_t> y = {2, 3, 0, 9, 1};
  for (DType dt : {DType::kF32, DType::kF64}) {
    CAPTURE(dtype_name(dt));
    Tensor logits = dt == DType::kF32 ? Tensor::from_vector(std::vector<float>(v.begin(), v.end()), {5, 4})
                                      : Tensor::from_vector(v, {5, 4});
    Tensor labels = Tensor::from_vector(y, {5});
    CHECK(cpu().argmax_correct(logits, labels, /*ignore_index=*/0) == 2);
    CHECK(cpu().argmax_correct(logits, labels, /*ignore_index=*/-100) == 3);  // row 2 counts now
  }
  Tensor logits = random_tensor({3, 4}, DType::kF32, 1);
  CHECK_THROWS_WITH_AS(cpu().argmax_correct(logits, Tensor::from_vector<int32_t>({0, 1}, {2}), -100),
                       doctest::Contains("one label per row"), Error);
}

TEST_CASE("float32 GELU agrees with the exact erf form") {
  std::vector<float> xs;
  for (int i = -2000; i <= 2000; ++i) xs.push_back(i * 0.005f);  // [-10, 10]
  Tensor x = Tensor::from_vector<float>(xs, {static_cast<int64_t>(xs.size())});
  Tensor y = cpu().empty(x.shape(), DType::kF32), dx = cpu().empty(x.shape(), DType::kF32);
  Tensor ones = cpu().empty(x.shape(), DType::kF32);
  cpu().fill(ones, 1.0);
  cpu().gelu(x, y);
  cpu().gelu_backward(x, ones, dx);
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    const double cdf = 0.5 * (1 + std::erf(v / std::sqrt(2.0)));
    const double want_y = v * cdf, want_dx = cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2 * M_PI);
    CAPTURE(v);
    CHECK(std::fabs(y.data<float>()[i] - want_y) <= 1e-6 + 1e-5 * std::fabs(want_y));
    CHECK(std::fabs(dx.data<float>()[i] - want_dx) <= 1e-6 + 1e-5 * std::fabs(want_dx));
  }
}

TEST_CASE("generic elementwise and row ops against naive loops, float32 and float64") {
  const int64_t R = 6, C = 5;  // x: (3, 2, 5) viewed as (6, 5)
  for (DType dt : {DType::kF32, DType::kF64}) {
    CAPTURE(dtype_name(dt));
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-14;
    Tensor a = random_tensor({3, 2, C}, dt, 1, -2, 2), b = random_tensor({3, 2, C}, dt, 2, -2, 2);
    Tensor rows = random_tensor({R}, dt, 3, 0.5, 1.5), cols = random_tensor({C}, dt, 4, 0.5, 1.5);
    const auto A = to_doubles(a), B = to_doubles(b), S = to_doubles(rows), G = to_doubles(cols);
    std::vector<double> mul(R * C), by_row(R * C), by_col(R * C), dot(R), rms(R);
    for (int64_t r = 0; r < R; ++r) {
      double ab = 0, aa = 0;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = r * C + c;
        mul[i] = A[i] * B[i];
        by_row[i] = A[i] * S[r];
        by_col[i] = A[i] * G[c];
        ab += A[i] * B[i];
        aa += A[i] * A[i];
      }
      dot[r] = -0.5 * ab;
      rms[r] = 1 / std::sqrt(aa / C + 1e-3);
    }
    Tensor y = cpu().empty(a.shape(), dt), out = cpu().empty({R}, dt);
    cpu().mul(a, b, y);
    GPIPE_EXPECT_CLOSE(y, mul, tol, tol);
    cpu().scale_rows(a, rows, y);
    GPIPE_EXPECT_CLOSE(y, by_row, tol, tol);
    cpu().scale_columns(a, cols, y);
    GPIPE_EXPECT_CLOSE(y, by_col, tol, tol);
    cpu().row_dot(a, b, -0.5, out);
    GPIPE_EXPECT_CLOSE(out, dot, tol, tol);
    cpu().row_inverse_rms(a, 1e-3, out);
    GPIPE_EXPECT_CLOSE(out, rms, tol, tol);
    // In place: the output may be an input.
    cpu().scale_rows(a, rows, a);
    GPIPE_EXPECT_CLOSE(a, by_row, tol, tol);
  }
}

TEST_CASE("generic row ops reject factors of the wrong size or type") {
  Tensor x = random_tensor({4, 3}, DType::kF32, 1), y = cpu().empty({4, 3}, DType::kF32);
  CHECK_THROWS_WITH(cpu().scale_rows(x, random_tensor({3}, DType::kF32, 2), y),
                    doctest::Contains("scale_rows: s float32(3) on cpu:0 must be float32 with 4 contiguous elements"));
  CHECK_THROWS_WITH(cpu().scale_columns(x, random_tensor({3}, DType::kF64, 2), y),
                    doctest::Contains("must be float32 with 3 contiguous elements"));
  Tensor out = cpu().empty({3}, DType::kF32);
  CHECK_THROWS_WITH(cpu().row_inverse_rms(x, 1e-5, out), doctest::Contains("with 4 contiguous elements"));
  CHECK_THROWS_WITH(cpu().mul(x, random_tensor({3, 4}, DType::kF32, 3), y), doctest::Contains("differ in dtype or shape"));
}

TEST_CASE("cast between float32, float64 and bfloat16 converts each element as runtime/bf16.h does") {
  Backend& be = cpu();
  Tensor f32 = random_tensor({3, 257}, DType::kF32, 31);
  Tensor f64 = random_tensor({3, 257}, DType::kF64, 32);
  Tensor b16 = be.empty({3, 257}, DType::kBF16);
  be.cast(f32, b16);
  const float* pf = f32.data<float>();
  const BFloat16* pb = b16.data<BFloat16>();
  for (int64_t i = 0; i < f32.numel(); ++i) REQUIRE(pb[i].bits == float_to_bf16(pf[i]).bits);
  Tensor back = be.empty({3, 257}, DType::kF32);
  be.cast(b16, back);
  for (int64_t i = 0; i < back.numel(); ++i) {
    REQUIRE(back.data<float>()[i] == bf16_to_float(pb[i]));
    CHECK(std::fabs(back.data<float>()[i] - pf[i]) <= std::ldexp(std::fabs(pf[i]), -8));  // half an ulp of 8 bits
  }
  be.cast(f64, b16);
  for (int64_t i = 0; i < f64.numel(); ++i) REQUIRE(pb[i].bits == double_to_bf16(f64.data<double>()[i]).bits);
  Tensor wide = be.empty({3, 257}, DType::kF64);
  be.cast(b16, wide);
  for (int64_t i = 0; i < wide.numel(); ++i) REQUIRE(wide.data<double>()[i] == bf16_to_float(pb[i]));
  Tensor narrow = be.empty({3, 257}, DType::kF32);
  be.cast(f64, narrow);
  for (int64_t i = 0; i < f64.numel(); ++i) REQUIRE(narrow.data<float>()[i] == static_cast<float>(f64.data<double>()[i]));
  // Refused: labels, and sizes that differ.
  Tensor labels = be.empty({3, 257}, DType::kI32);
  CHECK_THROWS_WITH_AS(be.cast(labels, b16), doctest::Contains("float32, float64, bfloat16 and float16 only"), Error);
  Tensor short_one = be.empty({3, 256}, DType::kBF16);
  CHECK_THROWS_WITH_AS(be.cast(f32, short_one), doctest::Contains("differ in size"), Error);
}
