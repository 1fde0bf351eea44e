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

// Its own name: runtime/philox.h defines GPIPE_HOST_DEVICE differently.
#if defined(__CUDACC__)
#define GPIPE_BF16_FN __host__ __device__ inline
#else
#define GPIPE_BF16_FN inline
#endif

namespace gpipe {

struct BFloat16 {
  uint16_t bits = 0;
};

template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBF16;
};

GPIPE_BF16_FN float bf16_to_float(BFloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

GPIPE_BF16_FN BFloat16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x0040u)};  // NaN: quiet it
  u += 0x7fffu + ((u >> 16) & 1u);  // half an ulp, a hair less when the kept part is even: ties to even
  return {static_cast<uint16_t>(u >> 16)};
}

// Exactly, by bits, so that a NaN keeps its sign and payload (quieted) on the host and on
// a GPU alike (a GPU's float-to-double conversion may return its canonical NaN).
GPIPE_BF16_FN double bf16_to_double(BFloat16 b) {
  uint64_t u;
  if ((b.bits & 0x7fffu) > 0x7f80u) {
    u = (static_cast<uint64_t>(b.bits & 0x8000u) << 48) | 0x7ff8000000000000ull |
        (static_cast<uint64_t>(b.bits & 0x007fu) << 45);
  } else {
    const double d = static_cast<double>(bf16_to_float(b));
    std::memcpy(&u, &d, sizeof u);
  }
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

// float64 to float32 rounded to odd: an inexact result gets its last bit set (the odd one
// of the two neighbours of d). Rounding that once more, to bfloat16 or float16, rounds d
// once: the first rounding cannot land on a tie the second would then break wrongly
// (1 + 2^-8 + 2^-30 must round up to bfloat16; through the nearest float32 it becomes the
// tie 1 + 2^-8 and rounds down). For finite and infinite d; NaN is the caller's.
GPIPE_BF16_FN float double_to_float_odd(double d) {
  float f = static_cast<float>(d);
  const double back = static_cast<double>(f);
  if (back != d && back - back == 0.0) {  // inexact and finite
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 1u) == 0) {
      const bool rounded_away = (back < 0 ? -back : back) > (d < 0 ? -d : d);
      u = rounded_away ? u - 1 : u + 1;  // the odd neighbour on d's side
      std::memcpy(&f, &u, sizeof f);
    }
  }
  return f;
}

// float64 straight to bfloat16, rounded once (double_to_float_odd).
GPIPE_BF16_FN BFloat16 double_to_bf16(double d) {
  if (d != d) {  // NaN: the quiet NaN of its sign and the top of its payload, by bits
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    return {static_cast<uint16_t>(((u >> 48) & 0x8000u) | 0x7fc0u | ((u >> 45) & 0x7fu))};
  }
  return float_to_bf16(double_to_float_odd(d));
}

}  // namespace gpipe
