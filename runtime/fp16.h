// float16 (IEEE binary16: 1 sign, 5 exponent and 10 mantissa bits), the storage type of
// fp16 mixed precision (issue 23). Conversions are exact from float16 and round to
// nearest, ties to even, into it, subnormals included; a float32 of magnitude 65520 or
// more (the largest float16, 65504, plus half an ulp) becomes infinite, a NaN a quiet NaN
// of its sign. Its narrow range is why fp16 training scales its loss (docs/ARCHITECTURE.md,
// "Mixed precision"). The same functions run on the host and, compiled by nvcc, on a GPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "runtime/bf16.h"
#include "runtime/dtype.h"

namespace gpipe {

struct Half {
  uint16_t bits = 0;
};

template <>
struct DTypeOf<Half> {
  static constexpr DType value = DType::kF16;
};

GPIPE_BF16_FN Half float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu))};  // NaN, quiet
  if (u >= 0x47800000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // 65536 and up, infinity: overflow
  if (u < 0x38800000u) {  // below 2^-14: a subnormal (or zero) result
    // Adding 0.5 (2^-1) puts the result's 10 bits at the bottom of the sum's mantissa,
    // rounded to nearest even by the float32 addition itself.
    float a;
    std::memcpy(&a, &u, sizeof a);
    a += 0.5f;
    uint32_t v;
    std::memcpy(&v, &a, sizeof v);
    return {static_cast<uint16_t>(sign | (v - 0x3f000000u))};
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias the exponent (-112 << 23) and round half to even
  return {static_cast<uint16_t>(sign | (u >> 13))};  // 65520 and up carry into infinity
}

GPIPE_BF16_FN float half_to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (mant << 13);  // infinity, or a NaN with its payload
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant x 2^-24, exact in float32
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

GPIPE_BF16_FN double half_to_double(Half h) {
  if ((h.bits & 0x7fffu) > 0x7c00u) {  // NaN: by bits, sign and payload kept
    const uint64_t u = (static_cast<uint64_t>(h.bits & 0x8000u) << 48) | 0x7ff8000000000000ull |
                       (static_cast<uint64_t>(h.bits & 0x3ffu) << 42);
    double d;
    std::memcpy(&d, &u, sizeof d);
    return d;
  }
  return static_cast<double>(half_to_float(h));
}

// float64 rounded once: through float32 rounded to odd (24 bits keep more than the 2
// extra float16 needs), as double_to_bf16 does.
GPIPE_BF16_FN Half double_to_half(double d) {
  if (d != d) {
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    return {static_cast<uint16_t>(((u >> 48) & 0x8000u) | 0x7e00u | ((u >> 42) & 0x3ffu))};
  }
  return float_to_half(double_to_float_odd(d));
}

}  // namespace gpipe
