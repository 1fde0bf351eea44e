// For the tests of philox4x32_10_lanes (runtime/philox.h): whether each of its lanes, for
// counters whose low word carries into the high one inside the eight lanes and samples with a
// high word, equals philox4x32_10 of that lane's counter. kernels:cpu_transformer_ops_test
// runs it as the build compiles the lanes (AVX2), runtime:philox_lanes_test without AVX2.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "runtime/philox.h"

namespace gpipe {

inline bool philox_lanes_match_blocks() {
  bool same = true;
  for (uint64_t sample : {0ull, 5ull, 0x123456789ull}) {
    for (uint64_t first : {0ull, 7ull, 0xFFFFFFFCull, 0x1FFFFFFF9ull}) {
      uint32_t out[4][kPhiloxLanes];
      philox4x32_10_lanes(first, sample, 0xDEADBEEFu, 0x12345678u, out);
      for (int j = 0; j < kPhiloxLanes; ++j) {
        const uint64_t block = first + static_cast<uint64_t>(j);
        const Philox4x32 r = philox4x32_10(
            Philox4x32{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(sample),
                        static_cast<uint32_t>(sample >> 32)}},
            0xDEADBEEFu, 0x12345678u);
        for (int w = 0; w < 4; ++w) same = same && r.v[w] == out[w][j];
      }
    }
  }
  return same;
}

}  // namespace gpipe
