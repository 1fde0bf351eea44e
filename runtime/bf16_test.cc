// bfloat16 conversions (runtime/bf16.h) against a reference that works on values, not
// bits: the nearest of the bfloat16 neighbours of x, compared in double arithmetic, the
// one with an even last mantissa bit on a tie.
#include "runtime/bf16.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

using namespace gpipe;

namespace {

BFloat16 bits(uint16_t b) { return {b}; }

// The bfloat16 nearest to the finite d (ties to even) by value, or infinity past the
// largest finite one by half an ulp or more.
uint16_t reference(double d) {
  const uint16_t sign = std::signbit(d) ? 0x8000 : 0;
  const double a = std::fabs(d);
  // The largest bfloat16 magnitude at or below a, by walking the patterns' order (the
  // magnitudes of the non-negative patterns grow with the pattern).
  uint32_t lo = 0, hi = 0x7f80;  // +0 .. +inf
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    (static_cast<double>(bf16_to_float(bits(static_cast<uint16_t>(mid)))) <= a ? lo : hi) = mid;
  }
  if (static_cast<double>(bf16_to_float(bits(static_cast<uint16_t>(hi)))) <= a) lo = hi;
  if (lo == 0x7f80) return sign | 0x7f80;
  const double below = bf16_to_float(bits(static_cast<uint16_t>(lo)));
  // Above the largest finite value, the next step up is infinity at the distance of one
  // more ulp (IEEE: round as if the exponent range were unbounded).
  const double above = lo == 0x7f7f ? std::ldexp(1.0, 128) : bf16_to_float(bits(static_cast<uint16_t>(lo + 1)));
  const double down = a - below, up = above - a;
  uint32_t pick = down < up ? lo : up < down ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return static_cast<uint16_t>(sign | pick);
}

bool is_nan(BFloat16 b) { return (b.bits & 0x7fff) > 0x7f80; }

}  // namespace

TEST_CASE("every bfloat16 converts to float32 and back to itself; NaN stays NaN") {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const BFloat16 x = bits(static_cast<uint16_t>(b));
    const float f = bf16_to_float(x);
    if (is_nan(x)) {
      CHECK(std::isnan(f));
      CHECK(is_nan(float_to_bf16(f)));
      CHECK(std::signbit(bf16_to_float(float_to_bf16(f))) == std::signbit(f));
      CHECK(is_nan(double_to_bf16(f)));
      // Through float64 by bits: sign and payload kept, quieted.
      CHECK(std::isnan(bf16_to_double(x)));
      CHECK(double_to_bf16(bf16_to_double(x)).bits == (b | 0x0040));
    } else {
      CHECK(bf16_to_double(x) == static_cast<double>(f));
      CHECK(float_to_bf16(f).bits == b);
      CHECK(double_to_bf16(static_cast<double>(f)).bits == b);
    }
  }
}

TEST_CASE("float32 to bfloat16 rounds to nearest, ties to even, as the value reference does") {
  // Ties: 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7 (odd): down; 1 + 3 * 2^-8
  // halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3f80);
  CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits == 0x3f82);
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -23)).bits == 0x3f81);  // past the tie
  CHECK(float_to_bf16(-0.0f).bits == 0x8000);
  CHECK(float_to_bf16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(float_to_bf16(std::numeric_limits<float>::max()).bits == 0x7f80);  // past the largest by more than half an ulp
  CHECK(float_to_bf16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  std::mt19937 gen(7);
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = gen();
    float f;
    std::memcpy(&f, &u, sizeof f);
    if (std::isnan(f)) continue;
    INFO("float32 bits ", u);
    REQUIRE(float_to_bf16(f).bits == reference(f));
    ++checked;
  }
  CHECK(checked > 190000);
}

TEST_CASE("float64 to bfloat16 rounds once, also where float32 would have made a tie") {
  const double d = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);  // just above the tie: up
  CHECK(reference(d) == 0x3f81);
  CHECK(double_to_bf16(d).bits == 0x3f81);
  CHECK(float_to_bf16(static_cast<float>(d)).bits == 0x3f80);  // what rounding twice would give
  CHECK(double_to_bf16(-d).bits == 0xbf81);
  CHECK(double_to_bf16(1e300).bits == 0x7f80);
  CHECK(double_to_bf16(1e-300).bits == 0x0000);
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-140, 130);
  for (int i = 0; i < 200000; ++i) {
    double x = std::ldexp(mant(gen), expo(gen));
    if (i % 2) x = -x;
    if (i % 4 == 0) {  // on or a hair off a bfloat16 tie, where rounding twice goes wrong
      const uint16_t b = static_cast<uint16_t>(gen() % 0x7f7f);
      const double lo = bf16_to_float(bits(b)), hi = bf16_to_float(bits(static_cast<uint16_t>(b + 1)));
      const double tie = lo + (hi - lo) / 2;
      x = tie + tie * std::ldexp(1.0, -30) * static_cast<double>(static_cast<int>(gen() % 3) - 1);
      if (i % 8 == 0) x = -x;
    }
    INFO("float64 ", x);
    REQUIRE(double_to_bf16(x).bits == reference(x));
  }
}
