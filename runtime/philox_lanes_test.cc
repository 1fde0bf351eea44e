// philox4x32_10_lanes without AVX2 (this test is built with -march=x86-64, where the
// lanes run one by one): each lane equals philox4x32_10 of its counter. The AVX2 path,
// which the build's x86-64-v3 compiles everywhere else, is checked the same way by
// kernels:cpu_transformer_ops_test.
#include <doctest/doctest.h>

#include <cstdint>
#include <initializer_list>

#include "runtime/philox.h"

#if defined(__AVX2__)
#error "philox_lanes_test checks the lanes without AVX2: build it with -march=x86-64"
#endif

using namespace gpipe;

TEST_CASE("Philox's lanes one by one are philox4x32_10 of each lane's counter") {
  for (uint64_t sample : {0ull, 5ull, 0x123456789ull}) {
    for (uint64_t first : {0ull, 7ull, 0xFFFFFFFCull, 0x1FFFFFFF9ull}) {
      uint32_t out[4][kPhiloxLanes];
      philox4x32_10_lanes(first, sample, 0xDEADBEEFu, 0x12345678u, out);
      bool same = true;
      for (int j = 0; j < kPhiloxLanes; ++j) {
        const uint64_t block = first + static_cast<uint64_t>(j);
        const Philox4x32 r = philox4x32_10(
            Philox4x32{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(sample),
                        static_cast<uint32_t>(sample >> 32)}},
            0xDEADBEEFu, 0x12345678u);
        for (int w = 0; w < 4; ++w) same &= r.v[w] == out[w][j];
      }
      CHECK(same);
    }
  }
}
