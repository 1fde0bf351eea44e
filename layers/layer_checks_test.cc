// A layer of one's own that breaks the layer contract is named early, with what is
// wrong and the fix: a forward or backward returning the wrong shape (checked by the
// public Layer::forward/backward) and a cost() the balancer cannot trust (checked when
// the model's costs are taken).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/sequential.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

enum class Mistake { kNone, kForwardShape, kForwardDtype, kBackwardShape, kNegativeCost, kNanCost, kNoFlops,
                     kParamBytes, kOutputBytes, kWeightGradWithoutSplit, kPartsShort, kNoForwardFlops,
                     kLookup };

// y = w * x elementwise over C features, with one chosen mistake.
class Broken : public Layer {
 public:
  Broken(int64_t c, Mistake m) : Layer({c}, {c}, DType::kF32), m_(m) { w_ = make_parameter("weight", {c}, 1.0, 1); }
  std::string type() const override { return "broken"; }
  std::string describe() const override { return "broken(" + std::to_string(input_shape()[0]) + ")"; }
  std::vector<Parameter*> parameters() override { return {&w_}; }
  LayerCost cost(int64_t batch) const override {
    const double n = static_cast<double>(batch * input_shape()[0]);
    LayerCost c;
    // kNoForwardFlops counts no forward arithmetic and only its output's bytes; kLookup
    // counts none either but reads as much as it writes (as a table lookup would, which
    // a layer of float input is not).
    const bool no_forward = m_ == Mistake::kNoFlops || m_ == Mistake::kNoForwardFlops || m_ == Mistake::kLookup;
    c.forward_flops = no_forward ? 0 : n;
    c.backward_flops = m_ == Mistake::kNoFlops ? 0 : 3 * n;
    c.input_grad_flops = m_ == Mistake::kNoFlops ? 0 : n;
    c.forward_bytes = m_ == Mistake::kNegativeCost     ? -1
                      : m_ == Mistake::kNoForwardFlops ? 4 * n
                      : m_ == Mistake::kLookup         ? 8 * n
                                                       : 12 * n;
    c.backward_bytes = m_ == Mistake::kNanCost ? std::numeric_limits<double>::quiet_NaN() : 16 * n;
    c.param_bytes = m_ == Mistake::kParamBytes ? 0 : static_cast<int64_t>(w_.value.nbytes());
    c.output_bytes = static_cast<int64_t>(4 * n) * (m_ == Mistake::kOutputBytes ? 2 : 1);
    c.saved_bytes = static_cast<int64_t>(4 * n);
    if (m_ == Mistake::kWeightGradWithoutSplit) c.weight_grad_flops = n;  // but its W does nothing
    if (m_ == Mistake::kPartsShort) c.backward_parts = {{false, 2 * n, 16 * n}};  // 2n of its 3n flops
    return c;
  }

 protected:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs&) override {
    const int64_t C = input_shape()[0] + (m_ == Mistake::kForwardShape ? 1 : 0);
    Tensor y = be.zeros({x.size(0), C}, m_ == Mistake::kForwardDtype ? DType::kF64 : DType::kF32);
    if (ctx != nullptr) ctx->saved = {x};
    return y;
  }
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context&, bool need_dx) override {
    if (!need_dx) return Tensor();
    return be.zeros(m_ == Mistake::kBackwardShape ? Shape{dy.size(0)} : dy.shape(), DType::kF32);
  }

 private:
  Mistake m_;
  Parameter w_;
};

// linear(4 -> 4), then the broken layer at index 1, then a loss.
Sequential model_with(Mistake m) {
  Sequential model({4}, DType::kF32);
  model.emplace<Linear>(LinearOptions(4, 4));
  model.emplace<Broken>(4, m);
  model.set_loss(std::make_unique<SoftmaxCrossEntropy>(4));
  return model;
}

}  // namespace

TEST_CASE("a layer whose forward returns the wrong shape or dtype is named with the fix") {
  Tensor x = gpipe::testing::random_tensor({3, 4}, DType::kF32, 1);
  Sequential ok = model_with(Mistake::kNone);
  CHECK_NOTHROW(ok.layer(1).forward(cpu(), x, nullptr));
  Sequential shape = model_with(Mistake::kForwardShape);
  CHECK_THROWS_WITH_AS(shape.layer(1).forward(cpu(), x, nullptr),
                       "layer 1 (broken(4), type 'broken'): forward returned float32(3, 5) on cpu:0 for a batch of 3, "
                       "but it must return (batch, *output_shape()) = float32(3, 4) on cpu:0; fix forward_impl, or "
                       "the output shape and dtype the layer gives its Layer constructor",
                       UserError);
  // Through the whole model too, before the next layer or the loss sees it.
  CHECK_THROWS_WITH_AS(shape.forward_backward(cpu(), x, gpipe::testing::random_labels(3, 4, 2), 1.0),
                       doctest::Contains("layer 1 (broken(4), type 'broken'): forward returned"), UserError);
  Sequential dtype = model_with(Mistake::kForwardDtype);
  CHECK_THROWS_WITH_AS(dtype.layer(1).forward(cpu(), x, nullptr), doctest::Contains("forward returned float64(3, 4)"),
                       UserError);
  // A layer named in its model carries the name into its errors.
  Sequential named = model_with(Mistake::kForwardShape);
  named.set_layer_name(1, "ffn.1");
  CHECK_THROWS_WITH_AS(named.layer(1).forward(cpu(), x, nullptr),
                       doctest::Contains("layer 1 'ffn.1' (broken(4), type 'broken'): forward returned"), UserError);
  // A layer on its own has no index.
  Broken alone(4, Mistake::kForwardShape);
  CHECK_THROWS_WITH_AS(alone.forward(cpu(), x, nullptr), doctest::Contains("layer (broken(4), type 'broken')"),
                       UserError);
}

TEST_CASE("a layer whose backward returns a misshapen input gradient is named") {
  Sequential m = model_with(Mistake::kBackwardShape);
  Tensor x = gpipe::testing::random_tensor({3, 4}, DType::kF32, 1);
  Context ctx;
  Tensor y = m.layer(1).forward(cpu(), x, &ctx);
  CHECK_THROWS_WITH_AS(m.layer(1).backward(cpu(), y, ctx),
                       doctest::Contains("layer 1 (broken(4), type 'broken'): backward returned float32(3) on cpu:0 as "
                                         "the input gradient, but it must return dx shaped like the input, "
                                         "float32(3, 4)"),
                       UserError);
  CHECK_NOTHROW(m.layer(1).backward(cpu(), y, ctx, /*need_dx=*/false));  // no dx asked for, none checked
}

TEST_CASE("a cost the balancer cannot trust is named when the model's costs are taken") {
  CHECK(model_with(Mistake::kNone).costs(8).size() == 2);
  // No forward arithmetic passes only for a lookup of int32 ids (an embedding without
  // positions, llama_test): a float layer that counts none forgot its arithmetic, even where
  // it counts as many bytes as a lookup moves.
  CHECK_THROWS_WITH_AS(model_with(Mistake::kLookup).costs(8), doctest::Contains("counts forward_flops = 0"), UserError);
  struct Case {
    Mistake m;
    const char* says;
  };
  for (Case c : {Case{Mistake::kNegativeCost, "forward_bytes = -1; every count must be finite and non-negative"},
                 Case{Mistake::kNanCost, "backward_bytes = nan; every count must be finite and non-negative"},
                 Case{Mistake::kNoFlops, "it has parameters but counts forward_flops = 0 and backward_flops = 0"},
                 Case{Mistake::kNoForwardFlops, "it has parameters but counts forward_flops = 0 and backward_flops = 96"},
                 Case{Mistake::kParamBytes, "param_bytes = 0 but its parameters() hold 16 bytes"},
                 Case{Mistake::kOutputBytes,
                      "output_bytes = 256 but its output for this batch, 8 x float32(4), is 128 bytes"},
                 Case{Mistake::kWeightGradWithoutSplit,
                      "weight_grad_flops = 32 and weight_grad_bytes = 0 but it does not split its backward"},
                 Case{Mistake::kPartsShort,
                      "the flops of its backward_parts sum to 64 but backward_flops = 96; every kernel of backward "
                      "is one part"}}) {
    CAPTURE(c.says);
    Sequential m = model_with(c.m);
    const std::string says = std::string("layer 1 (broken(4), type 'broken'): cost(8) is wrong: ") + c.says;
    CHECK_THROWS_WITH_AS(m.costs(8), doctest::Contains(says.c_str()), UserError);
    CHECK_THROWS_WITH_AS(m.costs(8), doctest::Contains("fix the layer's cost()"), UserError);
  }
}

TEST_CASE("every built-in layer's cost passes the check") {
  // The rule is the built-in layers' own behaviour; layers_test, transformer_test and
  // conv_layers_test build models of every type, which take their costs through the
  // same check. Here: a layer without parameters may count no FLOPs (a view).
  Sequential m({2, 3}, DType::kF32);
  m.emplace<Relu>(Shape{2, 3}, DType::kF32);
  CHECK_NOTHROW(m.costs(5));
}
