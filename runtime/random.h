// A small, portable, seedable generator (splitmix64) so that initial weights and
// synthetic data are the same on every machine and standard library.
#pragma once

#include <cmath>
#include <cstdint>

namespace gpipe {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Skips the next n values: splitmix64's state advances by a constant per value, so a
  // generator that discards n draws exactly what this one would after n calls. Parallel
  // initialisation splits one stream among threads this way, with the same values.
  void discard(uint64_t n) { state_ += n * 0x9E3779B97F4A7C15ULL; }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller; one value per call, for simplicity).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * uniform());
  }

 private:
  uint64_t state_;
};

// The constants mix_seed multiplies its identifiers by (mixed_key, runtime/philox.h,
// finishes a key from all but one of them).
constexpr uint64_t kMixA = 0xD1B54A32D192ED03ULL, kMixB = 0xABC98388FB8FAC03ULL, kMixC = 0x8CB92BA72F3D8DD7ULL;

// A seed derived from a base seed and up to three stream identifiers (step, layer, ...).
inline uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  Rng r(seed ^ (a * kMixA) ^ (b * kMixB) ^ (c * kMixC));
  return r.next();
}
// mix_seed's argument before the one identifier left out (mixed_key, runtime/philox.h,
// mixes it in): mix_seed(seed, a, b, c) == mixed_key(mix_seed_base(seed, 0, b, c), kMixA, a),
// and likewise for b (kMixB) or c (kMixC) left out as 0.
inline uint64_t mix_seed_base(uint64_t seed, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0) {
  return seed ^ (a * kMixA) ^ (b * kMixB) ^ (c * kMixC);
}

}  // namespace gpipe
