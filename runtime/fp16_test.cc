// float16 conversions (runtime/fp16.h) against a reference that works on values: the
// nearest multiple of the float16 quantum at the value's binade, ties to even, and
// infinity from 65520 up.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "runtime/fp16.h"

using namespace gpipe;

namespace {

// The float16 nearest to x (finite), as a double: infinity at or above 65504 + 16.
double reference(double x) {
  const double a = std::fabs(x);
  if (a >= 65520.0) return std::copysign(std::numeric_limits<double>::infinity(), x);
  if (a == 0) return x;
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), -14);
  const double q = std::ldexp(1.0, e - 10);  // the quantum of x's binade (subnormals: 2^-24)
  const double r = a / q;                    // exact: a power-of-two scaling
  double n = std::floor(r);
  const double frac = r - n;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(n, 2.0) != 0)) n += 1;
  return std::copysign(n * q, x);
}

}  // namespace

TEST_CASE("every float16 pattern converts to float32 and back to itself") {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const Half h{static_cast<uint16_t>(b)};
    const float f = half_to_float(h);
    const Half back = float_to_half(f);
    if ((b & 0x7fffu) > 0x7c00u) {  // NaN: stays a NaN of its sign, quieted
      REQUIRE(std::isnan(f));
      REQUIRE(back.bits == (b | 0x0200u));
      REQUIRE(std::isnan(half_to_double(h)));
    } else {
      REQUIRE(back.bits == b);
      REQUIRE(static_cast<double>(f) == half_to_double(h));
      REQUIRE(double_to_half(static_cast<double>(f)).bits == b);
    }
  }
  CHECK(half_to_float(Half{0x7bff}) == 65504.0f);
  CHECK(half_to_float(Half{0x0001}) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(Half{0x3c00}) == 1.0f);
}

TEST_CASE("float32 and float64 round to the nearest float16, ties to even, once") {
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  std::uniform_int_distribution<int> binade(-27, 17);
  for (int i = 0; i < 200000; ++i) {
    const double x = std::ldexp(unit(gen), binade(gen));
    const float f = static_cast<float>(x);
    CAPTURE(f);
    REQUIRE(static_cast<double>(half_to_float(float_to_half(f))) == reference(f));
    CAPTURE(x);
    REQUIRE(half_to_double(double_to_half(x)) == reference(x));
  }
  // On and a hair off the ties: 1 + 2^-11 is the tie between 1 and 1 + 2^-10.
  const double tie = 1.0 + std::ldexp(1.0, -11);
  CHECK(half_to_double(double_to_half(tie)) == 1.0);  // to even
  CHECK(half_to_double(double_to_half(tie + std::ldexp(1.0, -40))) == 1.0 + std::ldexp(1.0, -10));  // once, not twice
  CHECK(half_to_float(float_to_half(65519.0f)) == 65504.0f);
  CHECK(std::isinf(half_to_float(float_to_half(65520.0f))));
  CHECK(half_to_float(float_to_half(std::ldexp(1.0f, -25))) == 0.0f);  // the tie below the smallest subnormal: to even
  CHECK(half_to_float(float_to_half(std::ldexp(1.5f, -25))) == std::ldexp(1.0f, -24));
  CHECK(std::signbit(half_to_float(float_to_half(-0.0f))));
}
