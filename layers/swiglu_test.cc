// The built-in SwiGLU feed-forward layer: its forward against the definition computed
// element by element here, its gradients against finite differences, its cost against a
// hand count and its context, and its config form.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "layers/gradcheck.h"
#include "layers/registry.h"
#include "layers/sequential.h"
#include "layers/swiglu.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::random_tensor;
using gpipe::testing::context_bytes;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

SwiGLU make(DType dtype, int64_t dim = 6, int64_t hidden = 10) {
  SwiGLUOptions o(dim, hidden);
  o.leading = {3};
  o.dtype = dtype;
  o.seed = 7;
  return SwiGLU(o);
}

}  // namespace

TEST_CASE("swiglu's forward is down(silu(gate x) * up x), computed element by element") {
  SwiGLU l = make(DType::kF64);
  auto params = l.parameters();
  REQUIRE(params.size() == 3);
  CHECK(params[0]->name == "gate.weight");
  CHECK(params[1]->name == "up.weight");
  CHECK(params[2]->name == "down.weight");
  const std::vector<double> w1 = to_doubles(params[0]->value), w3 = to_doubles(params[1]->value),
                            w2 = to_doubles(params[2]->value);  // (hidden, dim), (hidden, dim), (dim, hidden)
  const int64_t D = 6, H = 10, rows = 2 * 3;
  const Tensor x = random_tensor({2, 3, D}, DType::kF64, 1);
  const std::vector<double> xv = to_doubles(x), y = to_doubles(l.forward(cpu(), x, nullptr));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> g(H);
    for (int64_t j = 0; j < H; ++j) {
      double a = 0, b = 0;
      for (int64_t k = 0; k < D; ++k) {
        a += w1[j * D + k] * xv[r * D + k];
        b += w3[j * D + k] * xv[r * D + k];
      }
      g[j] = a / (1 + std::exp(-a)) * b;
    }
    for (int64_t i = 0; i < D; ++i) {
      double want = 0;
      for (int64_t j = 0; j < H; ++j) want += w2[i * H + j] * g[j];
      CHECK(y[r * D + i] == doctest::Approx(want).epsilon(1e-12));
    }
  }
}

TEST_CASE("swiglu's gradients equal finite differences") {
  SwiGLU l = make(DType::kF64);
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, random_tensor({2, 3, 6}, DType::kF64, 2)));
}

TEST_CASE("swiglu's cost: the three products and the gating by hand, and what its context keeps") {
  SwiGLU l = make(DType::kF32, 8, 12);
  const int64_t batch = 5;
  const double rows = batch * 3.0, D = 8, H = 12, h = rows * H;
  const LayerCost c = l.cost(batch);
  check_cost(l, batch, c);  // the checks every model's costs go through (parts sum to totals, ...)
  CHECK(c.forward_flops == 3 * 2 * rows * D * H + 30 * h);
  CHECK(c.weight_grad_flops == 3 * (2 * rows * D * H + D * H));  // dW += dy^T x per projection
  CHECK(c.backward_flops == 3 * (2 * rows * D * H) + c.weight_grad_flops + 36 * h + rows * D);
  CHECK(c.input_grad_flops == 2 * (2 * rows * D * H) + rows * D);  // the gate's and up's dx, and their sum
  CHECK(c.param_bytes == 4 * 3 * 8 * 12);
  Context ctx;
  l.forward(cpu(), random_tensor({batch, 3, 8}, DType::kF32, 3), &ctx);
  CHECK(c.saved_bytes == context_bytes(ctx));
}

TEST_CASE("swiglu from a config: hidden is required, its parameters take the layer's name") {
  ModelSpec spec;
  spec.input = {4, 8};
  spec.dtype = DType::kF64;
  spec.layers = {{"swiglu", {{"hidden", "16"}}, {}, "cfg.yaml:3:5"}, {"linear", {{"out", "3"}}, {}, ""}};
  spec.layers[0].name = "ffn";
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  CHECK(model->layer(0).describe() == "swiglu(8, hidden 16)");
  CHECK(model->named_parameters()[0].first == "ffn.gate.weight");
  CHECK(model->named_parameters()[2].first == "ffn.down.weight");
  spec.layers[0].args.clear();
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("hidden"), UserError);
}
