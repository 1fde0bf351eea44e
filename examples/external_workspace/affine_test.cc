// The project's layer checked with gpipe's public gradient checker.
#include <doctest/doctest.h>

#include "affine.h"
#include "layers/gradcheck.h"

TEST_CASE("affine backward matches finite differences") {
  my_project::Affine layer({3, 4}, gpipe::DType::kF64);
  gpipe::backend_for(gpipe::Device::cpu()).fill(layer.scale().value, 0.7);  // not ones: dx depends on it
  const gpipe::layers::GradCheckReport r = gpipe::layers::check_layer_gradients(layer, /*batch=*/2);
  CHECK_MESSAGE(r.ok, r.str());
  CHECK(r.entries.size() == 3);  // input, scale, shift
}
