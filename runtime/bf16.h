// bfloat16: the upper 16 bits of an IEEE float32 (sign, the same 8 exponent bits, 7 of
// the 23 mantissa bits), the storage type of mixed precision (issue 23). Conversions
// are exact from bfloat16 and round to nearest, ties to even, into it; a NaN stays a
// (quiet) NaN with its sign, an infinity stays infinite, and a float32 above the largest
// bfloat16 by half an ulp or more becomes infinite, as IEEE rounding has it. The same
// functions run on the host and, compiled by nvcc, on a GPU, so the CUDA backend's
// conversions equal the CPU reference's bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "runtime/dtype.h"

#if defined(__CUDACC__)
#define GPIPE_HOST_DEVICE __host__ __device__
#else
#define GPIPE_HOST_DEVICE
#endif

namespace gpipe {

struct BFloat16 {
  uint16_t bits = 0;
};

template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBF16;
};

GPIPE_HOST_DEVICE inline float bf16_to_float(BFloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

GPIPE_HOST_DEVICE inline BFloat16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x0040u)};  // NaN: quiet it
  u += 0x7fffu + ((u >> 16) & 1u);  // half an ulp, a hair less when the kept part is even: ties to even
  return {static_cast<uint16_t>(u >> 16)};
}

// float64 straight to bfloat16, rounded once: through float32 rounded to odd (an inexact
// result gets its last bit set), which keeps the second rounding from landing on a tie
// the first one made (1 + 2^-8 + 2^-30 must round up; through a nearest float32 it
// becomes the tie 1 + 2^-8 and rounds down).
GPIPE_HOST_DEVICE inline BFloat16 double_to_bf16(double d) {
  float f = static_cast<float>(d);
  const double back = static_cast<double>(f);
  if (back != d && back - back == 0.0 && d == d) {  // inexact, finite, not NaN
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 1u) == 0) {
      const bool rounded_away = (back < 0 ? -back : back) > (d < 0 ? -d : d);
      u = rounded_away ? u - 1 : u + 1;  // the odd neighbour on d's side
      std::memcpy(&f, &u, sizeof f);
    }
  }
  return float_to_bf16(f);
}

}  // namespace gpipe
