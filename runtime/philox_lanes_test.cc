// philox4x32_10_lanes without AVX2 (this test is built with -march=x86-64, where the
// lanes run one by one): each lane equals philox4x32_10 of its counter. The AVX2 path,
// which the build's x86-64-v3 compiles everywhere else, is checked the same way by
// kernels:cpu_transformer_ops_test.
#include <doctest/doctest.h>

#include "runtime/philox_lanes_check.h"

#if defined(__AVX2__)
#error "philox_lanes_test checks the lanes without AVX2: build it with -march=x86-64"
#endif

TEST_CASE("Philox's lanes one by one are philox4x32_10 of each lane's counter") {
  CHECK(gpipe::philox_lanes_match_blocks());
}
