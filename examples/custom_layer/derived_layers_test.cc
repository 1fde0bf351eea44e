// The example's forward-only layers (derived_layers.h) pass the public gradient checker
// in float64 and their derived costs pass the cost checks, as any layer must.
#include <doctest/doctest.h>

#include "examples/custom_layer/derived_layers.h"
#include "layers/gradcheck.h"

using namespace gpipe;

TEST_CASE("the derived SwiGLU and RMSNorm pass the gradient checker and the cost checks") {
  example::MySwiGLU swiglu({3, 6}, 10, DType::kF64, 1);
  layers::GradCheckReport r = layers::check_layer_gradients(swiglu, 4);
  CHECK_MESSAGE(r.ok, r.str());
  layers::check_cost(swiglu, 4, swiglu.cost(4));
  example::DerivedRmsNorm norm({3, 6}, 1e-5, DType::kF64, 2);
  r = layers::check_layer_gradients(norm, 4);
  CHECK_MESSAGE(r.ok, r.str());
  layers::check_cost(norm, 4, norm.cost(4));
}
