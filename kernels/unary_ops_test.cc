// Backend::unary and unary_backward on the CPU reference: each function against an
// independent formula in long double, its derivative against central differences of that
// formula, float32 against float64, bfloat16 as float32 widened and rounded once, and
// ReLU and GELU as the relu and gelu ops themselves.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/unary_math.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_tensor;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

const Unary kComputed[] = {Unary::kSilu, Unary::kSigmoid, Unary::kTanh, Unary::kExp, Unary::kSquare, Unary::kRsqrt};

// The reference: each function written from its definition, in long double.
long double reference(Unary f, long double x) {
  switch (f) {
    case Unary::kSilu: return x / (1.0L + std::exp(-x));
    case Unary::kSigmoid: return 1.0L / (1.0L + std::exp(-x));
    case Unary::kTanh: return std::tanh(x);
    case Unary::kExp: return std::exp(x);
    case Unary::kSquare: return x * x;
    case Unary::kRsqrt: return 1.0L / std::sqrt(x);
    default: FAIL("no reference for ", unary_name(f)); return 0;
  }
}

// The derivative, differentiated by hand from the definitions above and written in
// another algebraic form than kernels/unary_math.h's, in long double.
long double reference_slope(Unary f, long double x) {
  const long double e = std::exp(-x);
  switch (f) {
    case Unary::kSilu: return (1.0L + e + x * e) / ((1.0L + e) * (1.0L + e));
    case Unary::kSigmoid: return e / ((1.0L + e) * (1.0L + e));
    case Unary::kTanh: return 1.0L / (std::cosh(x) * std::cosh(x));
    case Unary::kExp: return std::exp(x);
    case Unary::kSquare: return 2.0L * x;
    case Unary::kRsqrt: return -0.5L * std::pow(x, -1.5L);
    default: FAIL("no reference for ", unary_name(f)); return 0;
  }
}

// Central differences of the reference (error ~ h^2 |f'''|): a check of the hand-derived
// slopes themselves.
long double difference_slope(Unary f, long double x) {
  const long double h = 1e-6L * std::max(std::fabs(x), 1e-2L);
  return (reference(f, x + h) - reference(f, x - h)) / (2 * h);
}

// The size of the terms a slope's formula adds (silu's s + x s (1 - s), sigmoid's s - s^2,
// tanh's 1 - t^2): a rounding of each is relative to them, not to the slope, where they
// cancel (silu's near x = -1.28, tanh's far out).
long double slope_terms(Unary f, long double x) {
  const long double s = reference(Unary::kSigmoid, x);
  switch (f) {
    case Unary::kSilu: return s * (1 + std::fabs(x));
    case Unary::kSigmoid: return s;
    case Unary::kTanh: return 1;
    default: return std::fabs(reference_slope(f, x));
  }
}

// Points to evaluate f at: a spread over its domain, and the edges that need care
// (sigmoid far left, where 1 - s and e^x must not lose their digits; zero).
std::vector<double> points(Unary f) {
  std::vector<double> xs;
  if (f == Unary::kRsqrt) {
    for (double x : {1e-4, 0.01, 0.5, 1.0, 2.0, 37.0, 1e4}) xs.push_back(x);
    const Tensor r = random_tensor({200}, DType::kF64, 11, 0.05, 20.0);
    for (int i = 0; i < 200; ++i) xs.push_back(r.data<double>()[i]);
  } else {
    for (double x : {0.0, 1e-8, -1e-8, 1.0, -1.0, -1.2784645, 8.0, -8.0, 30.0, -30.0}) xs.push_back(x);
    const Tensor r = random_tensor({300}, DType::kF64, 12, -8.0, 8.0);
    for (int i = 0; i < 300; ++i) xs.push_back(r.data<double>()[i]);
  }
  return xs;
}

Tensor from(const std::vector<double>& v, DType dtype) {
  Tensor t = Tensor::from_vector<double>(v, {static_cast<int64_t>(v.size())});
  if (dtype == DType::kF64) return t;
  Tensor out = Tensor::empty(t.shape(), dtype, Device::cpu());
  cpu().cast(t, out);
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

}  // namespace

TEST_CASE("each function and its derivative in float64 against long double and central differences") {
  for (Unary f : kComputed) {
    CAPTURE(unary_name(f));
    const std::vector<double> xs = points(f);
    const Tensor x = from(xs, DType::kF64);
    const std::vector<double> dys(xs.size(), 1.0);
    Tensor y = cpu().empty(x.shape(), DType::kF64), dx = cpu().empty(x.shape(), DType::kF64);
    cpu().unary(f, x, y);
    cpu().unary_backward(f, x, from(dys, DType::kF64), dx);
    for (size_t i = 0; i < xs.size(); ++i) {
      CAPTURE(xs[i]);
      const long double want = reference(f, xs[i]);
      const long double got = y.data<double>()[i];
      // A few roundings of double's (u = 2^-53) relative to the value: libm's exp and tanh
      // are within an ulp, and each formula adds at most three operations.
      CHECK(std::fabs(got - want) <= 8 * 0x1p-53L * std::fabs(want) + 1e-300L);
      const long double slope = reference_slope(f, xs[i]);
      // The hand-derived slope is the reference's: central differences agree to their own
      // error (relative h^2 = 1e-12 of the terms, and long double's rounding over h).
      const long double scale = std::fabs(slope) + std::fabs(want) / std::max(std::fabs(xs[i]), 1e-2);
      CHECK(std::fabs(difference_slope(f, xs[i]) - slope) <= 1e-8L * scale);
      // The backend's slope: a few roundings of the terms it adds (slope_terms).
      const long double got_slope = dx.data<double>()[i];
      CHECK(std::fabs(got_slope - slope) <= 16 * 0x1p-53L * slope_terms(f, xs[i]));
    }
  }
}

TEST_CASE("float32 equals float64 to float32's rounding, and the upstream gradient multiplies") {
  for (Unary f : kComputed) {
    CAPTURE(unary_name(f));
    std::vector<double> xs = points(f);
    for (double& v : xs) v = static_cast<float>(v);  // the same inputs in both types
    const Tensor dy64 = random_tensor({static_cast<int64_t>(xs.size())}, DType::kF64, 13);
    std::vector<double> dys(dy64.data<double>(), dy64.data<double>() + xs.size());
    for (double& v : dys) v = static_cast<float>(v);
    for (DType t : {DType::kF32, DType::kF64}) {
      CAPTURE(dtype_name(t));
      const Tensor x = from(xs, t), dy = from(dys, t);
      Tensor y = cpu().empty(x.shape(), t), dx = cpu().empty(x.shape(), t);
      cpu().unary(f, x, y);
      cpu().unary_backward(f, x, dy, dx);
      const std::vector<double> yv = gpipe::testing::to_doubles(y), dxv = gpipe::testing::to_doubles(dx);
      const double u = t == DType::kF32 ? 0x1p-24 : 0x1p-53;
      for (size_t i = 0; i < xs.size(); ++i) {
        CAPTURE(xs[i]);
        const double want = static_cast<double>(reference(f, xs[i]));
        const double slope = static_cast<double>(reference_slope(f, xs[i])) * dys[i];
        // 16 roundings of the type's, relative to the value, and for the slope to its
        // terms (slope_terms) times the upstream gradient.
        CHECK(std::fabs(yv[i] - want) <= 16 * u * std::fabs(want) + 1e-300);
        CHECK(std::fabs(dxv[i] - slope) <= 16 * u * static_cast<double>(slope_terms(f, xs[i])) * std::fabs(dys[i]) + 1e-300);
      }
    }
  }
}

TEST_CASE("the CPU's silu and sigmoid, forward and backward, are unary_math.h's formulas in every bit") {
  // The CPU takes their exponentials a run at a time and the divisions after
  // (cpu_elementwise_ops.cc); each element must still be unary_value's and unary_slope's,
  // across runs (1500 elements), both branches of the sigmoid, large arguments and zeros.
  for (Unary f : {Unary::kSilu, Unary::kSigmoid}) {
    for (DType t : {DType::kF32, DType::kF64}) {
      CAPTURE(unary_name(f));
      CAPTURE(dtype_name(t));
      const int64_t n = 1500;
      Tensor x = random_tensor({n}, t, 31, -20.0, 20.0), dy = random_tensor({n}, t, 32);
      const double specials[] = {0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 104.0, -104.0, 750.0, -750.0};
      const std::vector<double> xs0 = gpipe::testing::to_doubles(x);
      std::vector<double> xs(xs0);
      for (size_t i = 0; i < std::size(specials); ++i) xs[i * 97] = specials[i];
      x = from(xs, t);
      Tensor y = cpu().empty(x.shape(), t), dx = cpu().empty(x.shape(), t);
      cpu().unary(f, x, y);
      cpu().unary_backward(f, x, dy, dx);
      bool same = true;
      for (int64_t i = 0; i < n; ++i) {
        if (t == DType::kF32) {
          const float xv = x.data<float>()[i], want = ops::unary_value(f, xv);
          const float want_dx = dy.data<float>()[i] * ops::unary_slope(f, xv);
          same &= std::memcmp(&want, y.data<float>() + i, sizeof want) == 0;
          same &= std::memcmp(&want_dx, dx.data<float>() + i, sizeof want_dx) == 0;
        } else {
          const double xv = x.data<double>()[i], want = ops::unary_value(f, xv);
          const double want_dx = dy.data<double>()[i] * ops::unary_slope(f, xv);
          same &= std::memcmp(&want, y.data<double>() + i, sizeof want) == 0;
          same &= std::memcmp(&want_dx, dx.data<double>() + i, sizeof want_dx) == 0;
        }
      }
      CHECK(same);
    }
  }
}

TEST_CASE("relu and gelu are the relu and gelu ops themselves, forward and backward") {
  const Tensor x = random_tensor({7, 9}, DType::kF32, 21, -3.0, 3.0), dy = random_tensor({7, 9}, DType::kF32, 22);
  Tensor a = cpu().empty(x.shape(), DType::kF32), b = cpu().empty(x.shape(), DType::kF32);
  cpu().unary(Unary::kGelu, x, a);
  cpu().gelu(x, b);
  CHECK(same_bits(a, b));
  cpu().unary_backward(Unary::kGelu, x, dy, a);
  cpu().gelu_backward(x, dy, b);
  CHECK(same_bits(a, b));
  cpu().unary(Unary::kRelu, x, a);
  cpu().relu(x, b);
  CHECK(same_bits(a, b));
  Tensor y = cpu().empty(x.shape(), DType::kF32);
  cpu().relu(x, y);
  cpu().unary_backward(Unary::kRelu, x, dy, a);  // from the input x, not the output
  cpu().relu_backward(y, dy, b);
  CHECK(same_bits(a, b));
}

TEST_CASE("in bfloat16 each function is float32's on the widened values, rounded once") {
  const Tensor x = random_tensor({5, 11}, DType::kBF16, 31, 0.1, 4.0);  // positive: rsqrt's domain too
  const Tensor dy = random_tensor({5, 11}, DType::kBF16, 32);
  CpuBackend bare(Device::cpu());  // float32 and float64 only
  auto widened = [&](const Tensor& t) {
    Tensor w = bare.empty(t.shape(), DType::kF32);
    bare.cast(t, w);
    return w;
  };
  for (Unary f : {Unary::kSilu, Unary::kSigmoid, Unary::kTanh, Unary::kExp, Unary::kSquare, Unary::kRsqrt,
                  Unary::kGelu, Unary::kRelu}) {
    CAPTURE(unary_name(f));
    Tensor y = cpu().empty(x.shape(), DType::kBF16), dx = cpu().empty(x.shape(), DType::kBF16);
    cpu().unary(f, x, y);
    cpu().unary_backward(f, x, dy, dx);
    Tensor y32 = bare.empty(x.shape(), DType::kF32), dx32 = bare.empty(x.shape(), DType::kF32);
    bare.unary(f, widened(x), y32);
    bare.unary_backward(f, widened(x), widened(dy), dx32);
    Tensor y_want = bare.empty(x.shape(), DType::kBF16), dx_want = bare.empty(x.shape(), DType::kBF16);
    bare.cast(y32, y_want);
    bare.cast(dx32, dx_want);
    CHECK(same_bits(y, y_want));
    CHECK(same_bits(dx, dx_want));
  }
}

TEST_CASE("unary refuses operands of different shapes or a non-float type, naming the function") {
  const Tensor x = random_tensor({4, 3}, DType::kF32, 41);
  Tensor wrong = cpu().empty({3, 4}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().unary(Unary::kSilu, x, wrong), doctest::Contains("unary silu"), Error);
  CHECK_THROWS_WITH_AS(cpu().unary_backward(Unary::kTanh, x, x, wrong), doctest::Contains("unary_backward tanh"),
                       Error);
  Tensor ids = Tensor::from_vector<int32_t>({1, 2, 3}, {3});
  Tensor out = Tensor::from_vector<int32_t>({0, 0, 0}, {3});
  CHECK_THROWS_AS(cpu().unary(Unary::kExp, ids, out), Error);
}
