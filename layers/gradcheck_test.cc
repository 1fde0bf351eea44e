// The public gradient checker: it passes correct layers and models (float and token
// inputs, dropout, a tied head) and fails broken ones with a report that names the
// parameter and its worst element.
#include "layers/gradcheck.h"

#include <doctest/doctest.h>

#include "layers/dropout.h"
#include "layers/embedding.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/registry.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::layers;

namespace {

// y[b, c] = w[c] x[b, c], with a chosen mistake in its backward.
class Scale : public Layer {
 public:
  enum Bug { kNone, kWrongElement, kOverwrites, kNoInputGrad };
  Scale(int64_t c, Bug bug) : Layer({c}, {c}, DType::kF64), bug_(bug) { w_ = make_parameter("weight", {c}, 1.0, 3); }
  std::string type() const override { return "scale"; }
  std::string describe() const override { return "scale(" + std::to_string(input_shape()[0]) + ")"; }
  LayerCost cost(int64_t batch) const override {
    LayerCost c;
    c.forward_flops = c.backward_flops = static_cast<double>(batch * input_shape()[0]);
    c.param_bytes = static_cast<int64_t>(w_.value.nbytes());
    c.output_bytes = batch * input_shape()[0] * 8;
    return c;
  }
  std::vector<Parameter*> parameters() override { return {&w_}; }

 protected:
  Tensor forward_impl(Backend&, const Tensor& x, Context* ctx, const ForwardArgs&) override {
    Tensor y = Tensor::empty(x.shape(), DType::kF64, Device::cpu());
    const int64_t C = input_shape()[0];
    for (int64_t i = 0; i < x.numel(); ++i) y.data<double>()[i] = w_.value.data<double>()[i % C] * x.data<double>()[i];
    if (ctx != nullptr) ctx->saved = {x};
    return y;
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const Context& ctx, bool need_dx) override {
    const Tensor& x = ctx.saved[0];
    const int64_t C = input_shape()[0];
    double* dw = w_.grad.data<double>();
    if (bug_ == kOverwrites) std::fill(dw, dw + C, 0.0);
    for (int64_t i = 0; i < x.numel(); ++i) {
      dw[i % C] += dy.data<double>()[i] * x.data<double>()[i] * (bug_ == kWrongElement && i % C == 2 ? 2.0 : 1.0);
    }
    if (!need_dx || bug_ == kNoInputGrad) return Tensor();
    Tensor dx = Tensor::empty(x.shape(), DType::kF64, Device::cpu());
    for (int64_t i = 0; i < x.numel(); ++i) dx.data<double>()[i] = w_.value.data<double>()[i % C] * dy.data<double>()[i];
    return dx;
  }

 private:
  Bug bug_;
  Parameter w_;
};

const GradCheckEntry& entry(const GradCheckReport& r, const std::string& name) {
  for (const auto& e : r.entries) {
    if (e.name == name) return e;
  }
  FAIL("no entry " << name << " in\n" << r.str());
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("numeric_gradient of a sum of squares is 2t") {
  Tensor t = Tensor::from_vector<double>({1.0, -2.0, 0.5}, {3});
  const auto g = numeric_gradient(t, [&] {
    double s = 0;
    for (int i = 0; i < 3; ++i) s += t.data<double>()[i] * t.data<double>()[i];
    return s;
  });
  CHECK(g[0] == doctest::Approx(2.0));
  CHECK(g[1] == doctest::Approx(-4.0));
  CHECK(g[2] == doctest::Approx(1.0));
  CHECK(t.to_vector<double>() == std::vector<double>{1.0, -2.0, 0.5});  // restored
}

TEST_CASE("a correct layer passes, with every gradient listed") {
  Scale ok(4, Scale::kNone);
  const GradCheckReport r = check_layer_gradients(ok, 3);
  CHECK_MESSAGE(r.ok, r.str());
  CHECK(r.entries.size() == 2);
  CHECK(entry(r, "input").shape == Shape{3, 4});
  CHECK(entry(r, "weight").max_abs_err < 1e-8);
  CHECK(r.str().find("gradient check of scale(4): ok") == 0);
  CHECK_NOTHROW(r.require());
  LinearOptions o(5, 3);
  o.dtype = DType::kF64;
  Linear linear(o);
  CHECK_MESSAGE(check_layer_gradients(linear, 2).ok, check_layer_gradients(linear, 2).str());
}

TEST_CASE("a wrong parameter gradient is reported at its worst element") {
  Scale bad(4, Scale::kWrongElement);
  const GradCheckReport r = check_layer_gradients(bad, 3);
  CHECK_FALSE(r.ok);
  CHECK(entry(r, "input").ok);
  const GradCheckEntry& w = entry(r, "weight");
  CHECK_FALSE(w.ok);
  CHECK(w.worst == std::vector<int64_t>{2});
  CHECK(w.analytic - 0.5 == doctest::Approx(2 * (w.numeric - 0.5)));  // the gradient started at 0.5
  const std::string text = r.str();
  INFO(text);
  CHECK(text.find("gradient check of scale(4): FAILED") == 0);
  CHECK(text.find("weight (4): FAILED, worst at [2]: analytic ") != std::string::npos);
  CHECK(text.find("input (3, 4): ok") != std::string::npos);
  CHECK_THROWS_AS(r.require(), GradCheckFailure);
  CHECK_THROWS_WITH(r.require(), doctest::Contains("worst at [2]"));
}

TEST_CASE("a backward that overwrites the gradient instead of adding fails") {
  Scale bad(4, Scale::kOverwrites);
  const GradCheckReport r = check_layer_gradients(bad, 3);
  CHECK_FALSE(entry(r, "weight").ok);
  GradCheckOptions from_zero;
  from_zero.initial_grad = 0.0;  // the mistake is invisible when gradients start at zero
  CHECK(check_layer_gradients(bad, 3, from_zero).ok);
}

TEST_CASE("a layer that breaks the layer contract is named before any comparison") {
  Scale bad(4, Scale::kNoInputGrad);
  CHECK_THROWS_WITH_AS(check_layer_gradients(bad, 2),
                       doctest::Contains("layer (scale(4), type 'scale'): backward returned no tensor as the input "
                                         "gradient"),
                       UserError);
}

TEST_CASE("token-id layers have no input gradient and need a vocabulary to draw ids") {
  EmbeddingOptions o(/*vocab=*/7, /*dim=*/4, /*seq_len=*/3);
  o.dtype = DType::kF64;
  Embedding e(o);
  CHECK_THROWS_WITH_AS(check_layer_gradients(e, 2), doctest::Contains("set GradCheckOptions::vocab"), UserError);
  GradCheckOptions opts;
  opts.vocab = 7;
  const GradCheckReport r = check_layer_gradients(e, 2, opts);
  CHECK_MESSAGE(r.ok, r.str());
  for (const auto& en : r.entries) CHECK(en.name != "input");
  CHECK(r.entries.size() == 2);  // token and position tables
}

TEST_CASE("dropout is checked under fixed forward arguments") {
  DropoutOptions o({6}, 0.5);
  o.dtype = DType::kF64;
  Dropout d(o);
  GradCheckOptions opts;
  opts.args.step = 4;
  opts.args.sample_offset = 9;
  const GradCheckReport r = check_layer_gradients(d, 3, opts);
  CHECK_MESSAGE(r.ok, r.str());
}

TEST_CASE("float32 layers are refused with the fix") {
  Linear l(LinearOptions(3, 2));
  CHECK_THROWS_WITH_AS(check_layer_gradients(l, 2), doctest::Contains("build it with dtype float64"), UserError);
}

TEST_CASE("a model with a tied head passes, the tied pair checked as one weight") {
  ModelSpec spec;
  spec.input = {3};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.layers = {{"embedding", {{"vocab", "5"}, {"dim", "4"}}, {}, ""},
                 {"gelu", {}, {}, ""},
                 {"linear", {{"out", "5"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.layers[0].name = "wte";  // named as in a config (name: wte); the others keep layers.<i>
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  GradCheckOptions opts;
  opts.vocab = 5;
  const GradCheckReport r = check_model_gradients(*model, 2, opts);
  CHECK_MESSAGE(r.ok, r.str());
  // The names are the checkpoint's (Sequential::qualified_name, as Executor::state_names has them).
  CHECK(entry(r, "wte.token (tied with layers.2.weight)").ok);
  for (const auto& e : r.entries) CHECK(e.name != "layers.2.weight");
  CHECK(r.str().find("wte.token") != std::string::npos);
}

TEST_CASE("a broken layer inside a model is named by its checkpoint name") {
  Sequential model({4}, DType::kF64);
  LinearOptions o(4, 4);
  o.dtype = DType::kF64;
  model.emplace<Linear>(o);
  model.emplace<Scale>(4, Scale::kWrongElement);
  model.set_loss(std::make_unique<SoftmaxCrossEntropy>(4, DType::kF64));
  const GradCheckReport r = check_model_gradients(model, 3);
  CHECK_FALSE(r.ok);
  CHECK(entry(r, "input").ok);
  CHECK(entry(r, "layers.0.weight").ok);
  CHECK_FALSE(entry(r, "layers.1.weight").ok);
  CHECK(entry(r, "layers.1.weight").worst == std::vector<int64_t>{2});
}
