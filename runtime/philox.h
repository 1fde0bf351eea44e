// Philox4x32-10, the counter-based generator of Salmon et al. (SC'11), as used by
// cuRAND and PyTorch. A random value is a pure function of (key, counter), so a
// dropout mask keyed by (seed, step, layer) and counted by (sample, element) is the
// same however the batch is split into micro-batches, on every backend, and when a
// checkpointed micro-batch is recomputed. Usable from host and device code.
#pragma once

#include <cstdint>

#if !defined(__CUDACC__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__CUDACC__)
#define GPIPE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GPIPE_HOST_DEVICE inline
#endif

namespace gpipe {

// mix_seed (runtime/random.h) with one identifier left for last, so that a kernel can
// finish a key whose step it reads from the device: mixed_key(base, multiplier, step) is
// the first value of an Rng seeded with base ^ step * multiplier, where base holds the
// seed and the other identifiers, and multiplier is the step's slot's constant in
// mix_seed (kernels:cpu_transformer_ops_test checks it against mix_seed).
GPIPE_HOST_DEVICE uint64_t mixed_key(uint64_t base, uint64_t multiplier, uint64_t step) {
  uint64_t z = (base ^ (step * multiplier)) * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct Philox4x32 {
  uint32_t v[4];
};

GPIPE_HOST_DEVICE uint32_t philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Ten rounds of Philox4x32 on counter c with key k.
GPIPE_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = philox_mulhilo(kM0, c.v[0], &hi0);
    const uint32_t lo1 = philox_mulhilo(kM1, c.v[2], &hi1);
    c = Philox4x32{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

#if !defined(__CUDACC__)
// Philox4x32-10 on kPhiloxLanes consecutive blocks of one sample, counters (first_block +
// j, sample) for lane j: word w of lane j in out[w][j], philox4x32_10's values. The lanes
// run side by side, one round at a time: with AVX2 (the build's x86-64-v3), in vector
// registers, 32 x 32 -> 64-bit products of the even and the odd lanes; else lane by lane.
// A host's dropout draws a block for every four elements.
// Internal linkage (static): its body depends on the including file's -march.
constexpr int kPhiloxLanes = 8;
static inline void philox4x32_10_lanes(uint64_t first_block, uint64_t sample, uint32_t k0, uint32_t k1,
                                uint32_t out[4][kPhiloxLanes]) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t v[4][kPhiloxLanes];
  for (int j = 0; j < kPhiloxLanes; ++j) {
    const uint64_t block = first_block + static_cast<uint64_t>(j);
    v[0][j] = static_cast<uint32_t>(block);
    v[1][j] = static_cast<uint32_t>(block >> 32);
    v[2][j] = static_cast<uint32_t>(sample);
    v[3][j] = static_cast<uint32_t>(sample >> 32);
  }
#if defined(__AVX2__)
  static_assert(kPhiloxLanes == 8, "one AVX2 register of 32-bit lanes");
  __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[0]));
  __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[1]));
  __m256i v2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[2]));
  __m256i v3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[3]));
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0)), m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  // (lo, hi) of m * x in every 32-bit lane: the even lanes' 64-bit products, and the odd
  // lanes' from x shifted down, recombined.
  auto mulhilo = [](__m256i m, __m256i x, __m256i* hi) {
    const __m256i even = _mm256_mul_epu32(m, x);
    const __m256i odd = _mm256_mul_epu32(m, _mm256_srli_epi64(x, 32));
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  };
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, hi1;
    const __m256i lo0 = mulhilo(m0, v0, &hi0);
    const __m256i lo1 = mulhilo(m1, v2, &hi1);
    const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(hi1, v1), _mm256_set1_epi32(static_cast<int>(k0)));
    const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(hi0, v3), _mm256_set1_epi32(static_cast<int>(k1)));
    v0 = n0;
    v1 = lo1;
    v2 = n2;
    v3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[0]), v0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[1]), v1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[2]), v2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[3]), v3);
#else
  for (int round = 0; round < 10; ++round) {
    for (int j = 0; j < kPhiloxLanes; ++j) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * v[0][j];
      const uint64_t p1 = static_cast<uint64_t>(kM1) * v[2][j];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ v[1][j] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ v[3][j] ^ k1;
      v[0][j] = n0;
      v[1][j] = static_cast<uint32_t>(p1);
      v[2][j] = n2;
      v[3][j] = static_cast<uint32_t>(p0);
    }
    k0 += kW0;
    k1 += kW1;
  }
  for (int w = 0; w < 4; ++w) {
    for (int j = 0; j < kPhiloxLanes; ++j) out[w][j] = v[w][j];
  }
#endif
}
#endif

// A uniform float in [0, 1) for element `element` of sample `sample` under a 64-bit
// key. Four consecutive elements share one Philox block.
GPIPE_HOST_DEVICE float philox_uniform(uint64_t key, uint64_t sample, uint64_t element) {
  const Philox4x32 c{{static_cast<uint32_t>(element >> 2), static_cast<uint32_t>(element >> 34),
                      static_cast<uint32_t>(sample), static_cast<uint32_t>(sample >> 32)}};
  const Philox4x32 r = philox4x32_10(c, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
  return static_cast<float>(r.v[element & 3] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace gpipe
