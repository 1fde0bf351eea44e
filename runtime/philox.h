// Philox4x32-10, the counter-based generator of Salmon et al. (SC'11), as used by
// cuRAND and PyTorch. A random value is a pure function of (key, counter), so a
// dropout mask keyed by (seed, step, layer) and counted by (sample, element) is the
// same however the batch is split into micro-batches, on every backend, and when a
// checkpointed micro-batch is recomputed. Usable from host and device code.
#pragma once

#include <cstdint>

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
// run side by side, one round at a time, so that the compiler turns them into vector
// instructions (a host's dropout draws a block for every four elements).
constexpr int kPhiloxLanes = 8;
inline void philox4x32_10_lanes(uint64_t first_block, uint64_t sample, uint32_t k0, uint32_t k1,
                                uint32_t out[4][kPhiloxLanes]) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t v0[kPhiloxLanes], v1[kPhiloxLanes], v2[kPhiloxLanes], v3[kPhiloxLanes];
  for (int j = 0; j < kPhiloxLanes; ++j) {
    const uint64_t block = first_block + static_cast<uint64_t>(j);
    v0[j] = static_cast<uint32_t>(block);
    v1[j] = static_cast<uint32_t>(block >> 32);
    v2[j] = static_cast<uint32_t>(sample);
    v3[j] = static_cast<uint32_t>(sample >> 32);
  }
  for (int round = 0; round < 10; ++round) {
    for (int j = 0; j < kPhiloxLanes; ++j) {
      const uint64_t p0 = static_cast<uint64_t>(kM0) * v0[j];
      const uint64_t p1 = static_cast<uint64_t>(kM1) * v2[j];
      const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ v1[j] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ v3[j] ^ k1;
      v0[j] = n0;
      v1[j] = static_cast<uint32_t>(p1);
      v2[j] = n2;
      v3[j] = static_cast<uint32_t>(p0);
    }
    k0 += kW0;
    k1 += kW1;
  }
  for (int j = 0; j < kPhiloxLanes; ++j) {
    out[0][j] = v0[j];
    out[1][j] = v1[j];
    out[2][j] = v2[j];
    out[3][j] = v3[j];
  }
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
