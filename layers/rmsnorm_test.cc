// The built-in RMSNorm: its forward against the definition computed element by element
// here, its gradients against finite differences, its cost against a hand count and
// its context, its config form and its errors.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "layers/gradcheck.h"
#include "layers/registry.h"
#include "layers/rmsnorm.h"
#include "layers/sequential.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::context_bytes;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

RmsNorm make(DType dtype, Shape shape = {3, 6}, double eps = 1e-6) {
  RmsNormOptions o(std::move(shape));
  o.eps = eps;
  o.dtype = dtype;
  return RmsNorm(o);
}

}  // namespace

TEST_CASE("rmsnorm's forward is x / sqrt(mean(x^2) + eps) * g, computed element by element") {
  RmsNorm l = make(DType::kF64, {3, 6}, 1e-3);
  REQUIRE(l.parameters().size() == 1);
  CHECK(l.parameters()[0]->name == "weight");
  CHECK(to_doubles(l.weight().value) == std::vector<double>(6, 1.0));  // starts at ones
  // A scale that is not ones, so that a forward ignoring it fails.
  const Tensor g = random_tensor({6}, DType::kF64, 4, 0.5, 1.5);
  cpu().copy(g, l.weight().value);
  const std::vector<double> gv = to_doubles(g);
  const Tensor x = random_tensor({2, 3, 6}, DType::kF64, 1);
  const std::vector<double> xv = to_doubles(x), y = to_doubles(l.forward(cpu(), x, nullptr));
  for (int64_t r = 0; r < 6; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < 6; ++c) ms += xv[r * 6 + c] * xv[r * 6 + c];
    const double inv = 1 / std::sqrt(ms / 6 + 1e-3);
    for (int64_t c = 0; c < 6; ++c) CHECK(y[r * 6 + c] == doctest::Approx(xv[r * 6 + c] * inv * gv[c]).epsilon(1e-13));
  }
}

TEST_CASE("rmsnorm's gradients equal finite differences") {
  RmsNorm l = make(DType::kF64);
  cpu().copy(random_tensor({6}, DType::kF64, 5, 0.5, 1.5), l.weight().value);
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, random_tensor({2, 3, 6}, DType::kF64, 2)));
}

TEST_CASE("rmsnorm's cost: the backend ops by hand, and what its context keeps") {
  const int64_t batch = 5;
  const double R = batch * 3.0, C = 8;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CAPTURE(dtype_name(dtype));
    RmsNorm l = make(dtype, {3, 8});
    const double es = dtype_size(dtype), ss = 4;  // the inverse RMS is float32 in both
    const LayerCost c = l.cost(batch);
    check_cost(l, batch, c);  // the checks every model's costs go through (parts sum to totals, ...)
    CHECK(c.forward_flops == 4 * R * C + 3 * R);
    CHECK(c.input_grad_flops == 8 * R * C + R);
    CHECK(c.weight_grad_flops == 3 * R * C + 2 * C);
    CHECK(c.backward_flops == 11 * R * C + R + 2 * C);
    CHECK(c.forward_bytes == es * (5 * R * C + C) + ss * 2 * R);
    CHECK(c.backward_bytes == es * (13 * R * C + C) + ss * 4 * R + es * 6 * R * C + ss * R + 4 * 2 * C);
    CHECK(c.param_bytes == es * C);
    Context ctx;
    l.forward(cpu(), random_tensor({batch, 3, 8}, dtype, 3), &ctx);
    CHECK(c.saved_bytes == context_bytes(ctx));
  }
}

TEST_CASE("rmsnorm from a config: eps is optional, bad shapes and eps are refused with the fix") {
  ModelSpec spec;
  spec.input = {4, 8};
  spec.dtype = DType::kF64;
  spec.layers = {{"rmsnorm", {}, {}, "cfg.yaml:3:5"}, {"linear", {{"out", "3"}}, {}, ""}};
  spec.layers[0].name = "norm";
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  CHECK(model->layer(0).describe() == "rmsnorm(4, 8)");
  CHECK(model->named_parameters()[0].first == "norm.weight");
  spec.layers[0].args["eps"] = "1e-5";
  CHECK(build_model(spec)->layer(0).describe() == "rmsnorm(4, 8), eps 1e-05");
  spec.layers[0].args["eps"] = "0";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("eps must be positive"), UserError);
  spec.layers[0].args.clear();
  spec.layers[0].args["epz"] = "1";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("did you mean eps?"), UserError);
  // A built-in type's name cannot be taken by a layer of one's own.
  CHECK_THROWS_WITH_AS(register_layer("rmsnorm", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) {
                         return std::unique_ptr<Layer>(std::make_unique<RmsNorm>(RmsNormOptions(in)));
                       }),
                       doctest::Contains("'rmsnorm' is a built-in layer type"), UserError);
}
