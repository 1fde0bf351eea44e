// RMSNorm, a layer of one's own, checked as gpipe checks its own layers: backward
// against float64 finite differences with the public checker (layers/gradcheck.h),
// forward against the formula, its cost through the balancer's check, its registration.
#include "examples/custom_layer/rmsnorm.h"

#include <doctest/doctest.h>

#include <cmath>

#include "layers/gradcheck.h"
#include "layers/registry.h"
#include "runtime/error.h"
#include "runtime/random.h"

using namespace gpipe;

namespace {

// A float64 CPU tensor uniform in [lo, hi).
Tensor uniform(const Shape& shape, uint64_t seed, double lo, double hi) {
  Rng rng(seed);
  Tensor t = Tensor::empty(shape, DType::kF64, Device::cpu());
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = rng.uniform(lo, hi);
  return t;
}

}  // namespace

TEST_CASE("rmsnorm backward matches finite differences") {
  for (Shape sample : {Shape{6}, Shape{3, 5}}) {
    CAPTURE(shape_str(sample));
    example::RmsNormOptions o(sample);
    o.dtype = DType::kF64;
    example::RmsNorm norm(o);
    // A weight other than ones, so that dx's g term and dg are both exercised.
    norm.weight().value = uniform({sample.back()}, 7, 0.5, 1.5);
    const layers::GradCheckReport r = layers::check_layer_gradients(norm, /*batch=*/3);
    CHECK_MESSAGE(r.ok, r.str());
    CHECK(r.entries.size() == 2);  // the input and the weight
  }
}

TEST_CASE("rmsnorm forward is x / sqrt(mean(x^2) + eps) * g") {
  example::RmsNormOptions o({4});
  o.eps = 1e-3;
  example::RmsNorm norm(o);
  Tensor x = Tensor::from_vector<float>({1, -2, 3, 0.5f, 0, 0, 0, 0}, {2, 4});
  const auto y = norm.forward(backend_for(Device::cpu()), x, nullptr).to_vector<float>();
  const double rms = std::sqrt((1 + 4 + 9 + 0.25) / 4 + 1e-3);
  CHECK(y[1] == doctest::Approx(-2 / rms).epsilon(1e-6));
  CHECK(y[3] == doctest::Approx(0.5 / rms).epsilon(1e-6));
  CHECK(y[4] == 0.0f);  // an all-zero row stays zero (eps keeps it finite)
}

TEST_CASE("rmsnorm is registered under its own name, with its cost accepted by the balancer") {
  example::register_rmsnorm();
  layers::ModelSpec spec;
  spec.input = {8, 16};
  spec.layers = {{"linear", {{"out", "16"}}, {}, ""}, {"my_rmsnorm", {{"eps", "1e-5"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = layers::build_model(spec);
  CHECK(model->layer(1).describe() == "my_rmsnorm(8, 16)");
  CHECK_NOTHROW(model->costs(4));  // layers/layer.h check_cost: exact param and output bytes
  CHECK_THROWS_WITH_AS(example::register_rmsnorm(), doctest::Contains("'my_rmsnorm' is registered already"), UserError);
  spec.layers[1].args["epz"] = "1";
  CHECK_THROWS_WITH_AS(layers::build_model(spec), doctest::Contains("unknown option 'epz'; did you mean eps? valid options: eps"),
                       UserError);
}
