// Every built-in layer in bfloat16 (model.dtype: bf16) against the same layer in
// float32, from the same float32 weights and input: forward, input gradient and the
// float32 weight gradients stay within bounds drawn from bfloat16's rounding.
//
// The analysis. bfloat16 keeps 8 significant bits: rounding to nearest errs by at most
// u = 2^-8 relative. A bfloat16 layer reads its input and its weights rounded and
// computes in float32 (errors ~2^-24, negligible), then rounds what it stores: one
// rounding of the output (u), and a product of two rounded factors errs by 2u + u^2.
// On random data these errors are independent and add like a random walk, so the
// normwise relative error of a sum stays near u per rounded factor, whatever the
// length. Bounds, normwise, for a layer that rounds once inside (most): forward 2u,
// input gradient 3u (dy, the kept tensors and the weights rounded, dx stored), weight
// gradients 2u (float32 sums of rounded products). A layer with S rounded stages inside
// (attention keeps its projections and probabilities: S = 2; the transformer block rounds
// between its sub-layers: S = 6) gets (1 + S) times these. Measured on these inputs the
// errors are 0.5u to 1u for the simple layers, to 2.8u for the block's gradients
// (MESSAGE lines with -s): the bounds leave a factor of 3 to 8. Each op's own rounding is
// checked bit for bit in kernels/widening_backend_test.cc; this test bounds what a
// layer's composition of them does.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "layers/registry.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

double rel_error(const Tensor& got, const Tensor& want) {
  const auto a = to_doubles(got), b = to_doubles(want);
  REQUIRE(a.size() == b.size());
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    n += b[i] * b[i];
  }
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}

Tensor as(const Tensor& t, DType dtype) {
  Tensor out = Tensor::empty(t.shape(), dtype, Device::cpu());
  backend_for(Device::cpu()).cast(t, out);
  return out;
}

struct Case {
  std::string type;
  std::map<std::string, std::string> args;
  Shape input;
  DType input_dtype = DType::kF32;  // int32 for token ids
  double stages = 0;  // rounded stages inside the layer, beyond its output
};

}  // namespace

TEST_CASE("every built-in layer in bfloat16 and float16 stays within their rounding of float32") {
 for (const DType narrow : {DType::kBF16, DType::kF16}) {
  const std::string precision = dtype_name(narrow);
  CAPTURE(precision);
  // float16 keeps 11 significant bits: u = 2^-11; its range (65504) is far above these values.
  const double u = std::ldexp(1.0, narrow == DType::kBF16 ? -8 : -11);
  const std::vector<Case> cases = {
      {"linear", {{"out", "24"}}, {32}},
      {"relu", {}, {40}},
      {"gelu", {}, {40}},
      {"layernorm", {}, {4, 32}},
      {"dropout", {{"p", "0.2"}}, {40}},
      {"embedding", {{"vocab", "20"}, {"dim", "16"}}, {6}, DType::kI32},
      {"attention", {{"heads", "2"}}, {6, 16}, DType::kF32, 2},
      {"transformer_block", {{"heads", "2"}}, {6, 16}, DType::kF32, 6},
      {"swiglu", {{"hidden", "24"}}, {6, 16}, DType::kF32, 3},  // a, b and the gated product rounded
      {"rmsnorm", {}, {4, 32}, DType::kF32, 1},  // xhat rounded before the scale
      // q, k, v; their rotations; the probabilities and the heads' outputs.
      {"gqa_attention", {{"heads", "2"}, {"kv_heads", "1"}}, {6, 16}, DType::kF32, 4},
      // Two norms, the attention's 4, SwiGLU's 3, the first residual sum.
      {"llama_block", {{"heads", "2"}, {"kv_heads", "1"}, {"hidden", "24"}}, {6, 16}, DType::kF32, 10},
      {"conv2d", {{"out", "6"}, {"kernel", "3"}}, {3, 6, 6}},
      {"batchnorm2d", {}, {3, 6, 6}},
      {"maxpool2d", {{"kernel", "2"}}, {3, 6, 6}},
      {"avgpool2d", {{"kernel", "2"}}, {3, 6, 6}},
      {"flatten", {}, {3, 4, 4}},
  };
  const int64_t N = 5;
  for (const Case& c : cases) {
    CAPTURE(c.type);
    LayerSpec spec{c.type, c.args, {}, "", ""};
    auto f32 = make_layer(spec, c.input, DType::kF32, 7);
    auto b16 = make_layer(spec, c.input, narrow, 7);
    Backend& be = backend_for(Device::cpu());
    // The same weights: bfloat16's masters are float32's values.
    auto pf = f32->parameters(), pb = b16->parameters();
    REQUIRE(pf.size() == pb.size());
    for (size_t i = 0; i < pf.size(); ++i) {
      CHECK(pb[i]->value.dtype() == DType::kF32);
      CHECK(pb[i]->working.dtype() == narrow);
      CHECK(rel_error(pb[i]->value, pf[i]->value) == 0.0);
      CHECK(rel_error(pb[i]->working, pf[i]->value) <= u);  // each element within u of it
    }
    Shape shape{N};
    shape.insert(shape.end(), c.input.begin(), c.input.end());
    Tensor x32, x16;
    if (c.input_dtype == DType::kI32) {
      x32 = x16 = gpipe::testing::random_labels(shape_numel(shape), 20, 1).reshape(shape);
    } else {
      x32 = as(random_tensor(shape, DType::kBF16, 1), DType::kF32);  // representable in both: the input is not rounded
      x16 = as(x32, narrow);
    }
    ForwardArgs args;
    args.step = 3;
    Context cf, cb;
    const Tensor y32 = f32->forward(be, x32, &cf, args), y16 = b16->forward(be, x16, &cb, args);
    CHECK(y16.dtype() == narrow);
    if (c.type == "layernorm" || c.type == "batchnorm2d") {  // the statistics kept in float32
      REQUIRE(cb.saved.size() == 3);
      CHECK(cb.saved[0].dtype() == narrow);
      CHECK(cb.saved[1].dtype() == DType::kF32);
      CHECK(cb.saved[2].dtype() == DType::kF32);
    }
    Shape out{N};
    out.insert(out.end(), f32->output_shape().begin(), f32->output_shape().end());
    const Tensor dy32 = as(random_tensor(out, DType::kBF16, 2), DType::kF32), dy16 = as(dy32, narrow);
    const Tensor dx32 = f32->backward(be, dy32, cf), dx16 = b16->backward(be, dy16, cb);
    const double fwd = rel_error(y16, y32), tol_fwd = 2 * u * (1 + c.stages);
    MESSAGE(c.type, ": forward ", fwd / u, " u");
    CHECK(fwd <= tol_fwd);
    if (dx32.defined()) {
      CHECK(dx16.dtype() == narrow);
      const double bwd = rel_error(dx16, dx32), tol_bwd = 3 * u * (1 + c.stages);
      MESSAGE(c.type, ": input gradient ", bwd / u, " u");
      CHECK(bwd <= tol_bwd);
    }
    for (size_t i = 0; i < pf.size(); ++i) {
      CAPTURE(pf[i]->name);
      CHECK(pb[i]->grad.dtype() == DType::kF32);
      const double g = rel_error(pb[i]->grad, pf[i]->grad), tol_g = 2 * u * (1 + c.stages);
      MESSAGE(c.type, ".", pf[i]->name, ": gradient ", g / u, " u");
      CHECK(g <= tol_g);
    }
  }
 }
}
