// Every layer's backward against central finite differences in double precision (the
// public checker, layers/gradcheck.h), plus costs, the registry and the model's shape
// checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "layers/sequential.h"
#include "runtime/random.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::random_labels;
using gpipe::testing::random_tensor;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

}  // namespace

TEST_CASE("linear backward matches finite differences") {
  for (bool bias : {true, false}) {
    LinearOptions o(7, 5);
    o.bias = bias;
    o.dtype = DType::kF64;
    o.seed = 3;
    Linear l(o);
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, 4));
  }
}

TEST_CASE("relu and gelu backward match finite differences") {
  Relu relu({9}, DType::kF64);
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(relu, 3));
  Gelu gelu({9}, DType::kF64);
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(gelu, 3));
}

TEST_CASE("gradients accumulate across backward calls") {
  LinearOptions o(3, 2);
  o.dtype = DType::kF64;
  Linear l(o);
  Tensor x = random_tensor({2, 3}, DType::kF64, 1);
  Tensor r = random_tensor({2, 2}, DType::kF64, 2);
  Context c;
  l.forward(cpu(), x, &c);
  l.backward(cpu(), r, c);
  const auto once = gpipe::testing::to_doubles(l.weight().grad);
  l.backward(cpu(), r, c);
  const auto twice = gpipe::testing::to_doubles(l.weight().grad);
  for (size_t i = 0; i < once.size(); ++i) CHECK(twice[i] == doctest::Approx(2 * once[i]));
}

TEST_CASE("softmax cross-entropy backward matches finite differences") {
  const int64_t batch = 5, classes = 4;
  SoftmaxCrossEntropy loss(classes, DType::kF64, /*ignore_index=*/-1);
  Tensor logits = random_tensor({batch, classes}, DType::kF64, 5, -3, 3);
  Tensor labels = random_labels(batch, classes, 6);
  labels.data<int32_t>()[2] = -1;  // ignored row
  const double scale = 1.0 / 4;
  Context ctx;
  Tensor value = loss.forward(cpu(), logits, labels, scale, &ctx);
  Tensor d = loss.backward(cpu(), ctx);
  const auto numeric = gpipe::testing::numeric_gradient(
      logits, [&] { return cpu().item(loss.forward(cpu(), logits, labels, scale, nullptr)); });
  GPIPE_EXPECT_CLOSE(d, numeric, 1e-6, 1e-7);
  for (int64_t j = 0; j < classes; ++j) CHECK(d.data<double>()[2 * classes + j] == 0.0);

  // The value itself: mean negative log-likelihood of the labelled class.
  double expect = 0;
  for (int64_t r = 0; r < batch; ++r) {
    if (r == 2) continue;
    const double* row = logits.data<double>() + r * classes;
    double z = 0;
    for (int64_t j = 0; j < classes; ++j) z += std::exp(row[j]);
    expect += std::log(z) - row[labels.data<int32_t>()[r]];
  }
  CHECK(cpu().item(value) == doctest::Approx(expect * scale).epsilon(1e-12));
}

TEST_CASE("an out-of-range label is a user error naming the fix") {
  SoftmaxCrossEntropy loss(3, DType::kF64);
  Tensor logits = random_tensor({2, 3}, DType::kF64, 1);
  Tensor labels = Tensor::from_vector<int32_t>({0, 3}, {2});
  CHECK_THROWS_WITH_AS(loss.forward(cpu(), logits, labels, 1.0, nullptr),
                       doctest::Contains("outside [0, 3)"), UserError);
}

TEST_CASE("linear cost counts the exact matrix-product flops") {
  LinearOptions o(1024, 512);
  Linear l(o);
  const LayerCost c = l.cost(256);
  CHECK(c.forward_flops == 2.0 * 256 * 1024 * 512 + 256 * 512);
  CHECK(c.backward_flops == 4.0 * 256 * 1024 * 512 + 1024 * 512 + 256 * 512);
  CHECK(c.param_bytes == 4 * (1024 * 512 + 512));
  CHECK(c.output_bytes == 4 * 256 * 512);
  CHECK(c.saved_bytes == 4 * 256 * 1024);
}

TEST_CASE("layer inputs of the wrong shape are rejected with the layer's name") {
  Linear l(LinearOptions(4, 2));
  Tensor x = random_tensor({3, 5}, DType::kF32, 1);
  CHECK_THROWS_WITH_AS(l.forward(cpu(), x, nullptr), doctest::Contains("linear(4 -> 2)"), UserError);
  // A layer that does not fit what it receives: both named, by the names the user gave them.
  Sequential m({4}, DType::kF32);
  CHECK_THROWS_WITH_AS(m.add(std::make_unique<Linear>(LinearOptions(5, 8)), "proj"),
                       "layer 0 'proj' (linear(5 -> 8), type 'linear') takes float32(5) per sample, but the model's "
                       "input is float32(4); fix its input size or type",
                       UserError);
  m.add(std::make_unique<Linear>(LinearOptions(4, 8)), "proj");
  CHECK_THROWS_WITH_AS(m.add(std::make_unique<Linear>(LinearOptions(7, 2)), "ffn.1"),
                       "layer 1 'ffn.1' (linear(7 -> 2), type 'linear') takes float32(7) per sample, but layer 0 'proj' "
                       "(linear(4 -> 8), type 'linear') outputs float32(8); fix its input size or type",
                       UserError);
  m.emplace<Relu>(Shape{8});  // unnamed: its index alone
  CHECK_THROWS_WITH_AS(m.emplace<Linear>(LinearOptions(7, 2)),
                       doctest::Contains("layer 2 (linear(7 -> 2), type 'linear') takes float32(7) per sample, but "
                                         "layer 1 (relu"),
                       UserError);
}

TEST_CASE("the registry builds models and names unknown types and options") {
  ModelSpec spec;
  spec.input = {6};
  spec.dtype = DType::kF64;
  spec.layers = {{"linear", {{"out", "8"}}, {}, ""}, {"gelu", {}, {}, ""}, {"linear", {{"out", "3"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  CHECK(model->size() == 3);
  CHECK(model->output_shape() == Shape{3});
  CHECK(model->parameter_count() == 6 * 8 + 8 + 8 * 3 + 3);

  spec.layers[1] = {"relux", {}, {}, "cfg.yaml:4:7"};
  std::string valid;
  for (const auto& t : layer_types()) valid += (valid.empty() ? "" : ", ") + t;
  for (const char* t : {"linear", "relu", "gelu", "embedding", "transformer_block", "conv2d", "basic_block"}) {
    CHECK(valid.find(t) != std::string::npos);
  }
  // What was meant, every valid type, and (no type of this program's own is registered
  // here) where a type of one's own is registered.
  CHECK_THROWS_WITH_AS(build_model(spec),
                       doctest::Contains(("unknown layer type 'relux' (at cfg.yaml:4:7); did you mean relu? valid types: " +
                                          valid + ". A layer type of your own is registered in your own program "
                                                  "(layers::register_layer before gpipe::cli::main)")
                                             .c_str()),
                       UserError);
  spec.layers[1] = {"layer_norm", {}, {}, "cfg.yaml:4:7"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("'layer_norm' (at cfg.yaml:4:7); did you mean layernorm?"),
                       UserError);
  spec.layers[1] = {"rope", {}, {}, "cfg.yaml:4:7"};  // nothing close: no guess
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("'rope' (at cfg.yaml:4:7); valid types: "), UserError);
  spec.layers[1] = {"linear", {{"out", "4"}, {"outs", "3"}}, {}, "cfg.yaml:5:7"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("unknown option 'outs'; did you mean out? valid options: "),
                       UserError);
  spec.layers[1] = {"linear", {}, {}, "cfg.yaml:5:7"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("needs the option 'out'"), UserError);
}

TEST_CASE("registering a type twice, or under a built-in type's name, is refused at once") {
  const LayerFactory relu = [](LayerArgs&, const Shape& in, DType dtype, uint64_t) -> std::unique_ptr<Layer> {
    return std::make_unique<Relu>(in, dtype);
  };
  CHECK_THROWS_WITH_AS(register_layer("linear", relu),
                       "register_layer(\"linear\"): 'linear' is a built-in layer type; register yours under another "
                       "name, e.g. 'my_linear'",
                       UserError);
  CHECK_THROWS_WITH_AS(register_layer("basic_block", relu), doctest::Contains("built-in layer type"), UserError);
  CHECK_THROWS_WITH_AS(register_layer("my relu", relu), doctest::Contains("letters, digits and '_'"), UserError);
  CHECK_THROWS_WITH_AS(register_layer("my_relu", nullptr), doctest::Contains("the factory is empty"), UserError);
  register_layer("test_relu", relu);
  CHECK_THROWS_WITH_AS(register_layer("test_relu", relu),
                       doctest::Contains("'test_relu' is registered already; register each layer once"), UserError);
  const LossFactory xent = [](LayerArgs&, const Shape& in, DType dtype) -> std::unique_ptr<Loss> {
    return std::make_unique<SoftmaxCrossEntropy>(in, dtype);
  };
  CHECK_THROWS_WITH_AS(register_loss("softmax_cross_entropy", xent), doctest::Contains("built-in loss type"), UserError);
  register_loss("test_xent", xent);
  CHECK_THROWS_WITH_AS(register_loss("test_xent", xent), doctest::Contains("registered already"), UserError);

  // The first registrations stand.
  ModelSpec spec;
  spec.input = {3};
  spec.layers = {{"test_relu", {}, {}, ""}};
  spec.loss = {"test_xent", {}, {}, ""};
  CHECK(build_model(spec)->layer(0).type() == "relu");
}

TEST_CASE("a model registered in C++ is built by name with its options") {
  register_model("test_mlp", [](LayerArgs& o) {
    const int64_t hidden = o.get_int("hidden");
    auto m = std::make_unique<Sequential>(Shape{4}, DType::kF32);
    m->emplace<Linear>(LinearOptions(4, hidden));
    m->emplace<Relu>(Shape{hidden});
    m->emplace<Linear>(LinearOptions(hidden, 3));
    m->set_loss(std::make_unique<SoftmaxCrossEntropy>(3));
    return m;
  });
  const auto names = model_names();
  CHECK(std::count(names.begin(), names.end(), "test_mlp") == 1);
  ModelSpec spec;
  spec.cpp = LayerSpec{"test_mlp", {{"hidden", "6"}}, {}, "m.yaml:2:3"};
  auto m = build_model(spec);
  CHECK(m->size() == 3);
  CHECK(m->layer(0).output_shape() == Shape{6});
  spec.cpp->args["hiden"] = "5";
  CHECK_THROWS_WITH_AS(build_model(spec),
                       "model 'test_mlp' (at m.yaml:2:3): unknown option 'hiden'; did you mean hidden? valid options: "
                       "hidden",
                       UserError);
  spec.cpp->args.clear();
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("needs the option 'hidden', e.g. {cpp: test_mlp, hidden:"),
                       UserError);
  spec.cpp->type = "test_mpl";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("no model 'test_mpl' is registered in this program; "
                                                            "registered: "),
                       UserError);
  CHECK_THROWS_WITH_AS(register_model("test_mlp", [](LayerArgs&) { return std::unique_ptr<Sequential>(); }),
                       doctest::Contains("'test_mlp' is registered already"), UserError);
  register_model("test_empty", [](LayerArgs&) { return std::unique_ptr<Sequential>(); });
  spec.cpp->type = "test_empty";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("its factory returned no model"), UserError);
}

TEST_CASE("a tied head needs an embedding before it with the same table shape") {
  ModelSpec spec;
  spec.input = {4};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.layers = {{"embedding", {{"vocab", "10"}, {"dim", "6"}}, {}, ""},
                 {"linear", {{"out", "10"}, {"bias", "false"}, {"tied", "true"}}, {}, "cfg.yaml:3:7"}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto tied = build_model(spec);
  CHECK(tied->ties().size() == 1);
  const Tie t = tied->ties()[0];
  CHECK_THROWS_WITH_AS(tied->tie(0, *t.owner, 1, *t.copy), doctest::Contains("tied already"), UserError);
  spec.layers[1].args["out"] = "9";
  CHECK_THROWS_WITH_AS(build_model(spec),
                       doctest::Contains("tied (at cfg.yaml:3:7): the head's weight (9, 6) must match embedding layer 0"),
                       UserError);
  spec.layers[1].args["out"] = "10";
  spec.layers[1].args["tied"] = "maybe";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("expected true or false, got 'maybe'"), UserError);
  spec.layers[1].args["tied"] = "on";  // a boolean as YAML 1.1 writes it (runtime/text.h)
  CHECK(build_model(spec)->ties().size() == 1);
  spec.layers[1].args["tied"] = "Off";
  CHECK(build_model(spec)->ties().empty());
  spec.input_dtype.reset();
  spec.input = {4, 6};
  spec.layers.erase(spec.layers.begin());
  spec.layers[0].args["tied"] = "true";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("no embedding layer before this one"), UserError);
}

TEST_CASE("measure_parameters counts what build_model makes, without allocating it") {
  ModelSpec spec;
  spec.input = {8};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.layers = {{"embedding", {{"vocab", "10"}, {"dim", "12"}}, {}, "m.yaml:2:5"},
                 {"transformer_block", {{"heads", "2"}}, {}, ""},
                 {"attention", {{"heads", "3"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"dropout", {{"p", "0.1"}}, {}, ""},
                 {"gelu", {}, {}, ""},
                 {"linear", {{"out", "10"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  const auto measured = measure_parameters(spec);
  REQUIRE(measured.has_value());
  auto model = build_model(spec);
  REQUIRE(measured->size() == static_cast<size_t>(model->size()));
  for (int i = 0; i < model->size(); ++i) {
    CAPTURE(i);
    int64_t bytes = 0;  // what the built layer holds, a tied head's copy included
    for (const Parameter* p : model->layer(i).parameters()) bytes += static_cast<int64_t>(p->value.nbytes());
    CHECK((*measured)[i].bytes == bytes);
    CHECK((*measured)[i].describe == model->layer(i).describe());
  }
  CHECK((*measured)[0].where == "m.yaml:2:5");
  CHECK((*measured)[0].bytes == (10 * 12 + 8 * 12) * 8);  // token and position tables

  // 200000 x 200000 float64 (320 GB): measured, and not one weight of it allocated.
  ModelSpec huge;
  huge.input = {200000};
  huge.dtype = DType::kF64;
  huge.layers = {{"linear", {{"out", "200000"}}, {}, ""}, {"relu", {}, {}, ""}, {"linear", {{"out", "4"}}, {}, ""}};
  huge.loss = {"softmax_cross_entropy", {}, {}, ""};
  Allocator& host = allocator_for(Device::cpu());
  host.reset_peak();
  const int64_t before = host.stats().in_use;
  const auto big = measure_parameters(huge);
  CHECK(host.stats().peak - before < (1 << 20));
  REQUIRE(big.has_value());
  CHECK((*big)[0].bytes == (200000LL * 200000 + 200000) * 8);
  CHECK((*big)[0].describe == "linear(200000 -> 200000)");
  CHECK((*big)[2].bytes == (200000LL * 4 + 4) * 8);
  CHECK(!ShapesOnly::active());  // only while measuring

  // The errors build_model gives, the same.
  huge.layers[2].args["outt"] = "4";
  CHECK_THROWS_WITH_AS(measure_parameters(huge), doctest::Contains("unknown option 'outt'"), UserError);
  // A model registered in C++, or a layer type of one's own, may write its parameters as
  // it makes them: not measured.
  ModelSpec cpp;
  cpp.cpp = LayerSpec{"some_model", {}, {}, ""};
  CHECK(!measure_parameters(cpp).has_value());
  register_layer("measure_test_own", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) -> std::unique_ptr<Layer> {
    return std::make_unique<Relu>(in, dtype);
  });
  huge.layers[2] = {"measure_test_own", {}, {}, ""};
  CHECK(!measure_parameters(huge).has_value());
}

TEST_CASE("weights do not depend on anything but the seed and position") {
  // Three layers of one size, so that a difference can only come from the seed or the
  // position, never from the shape.
  ModelSpec spec;
  spec.input = {4};
  spec.layers = {{"linear", {{"out", "4"}}, {}, ""}, {"linear", {{"out", "4"}}, {}, ""}, {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  spec.seed = 9;
  auto values = [](Sequential& m, int layer) {
    std::vector<float> v;
    for (Parameter* p : m.layer(layer).parameters()) {
      const auto part = p->value.to_vector<float>();
      v.insert(v.end(), part.begin(), part.end());
    }
    return v;
  };
  auto a = build_model(spec);
  auto b = build_model(spec);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(values(*a, i).size() == 4 * 4 + 4);
    CHECK(values(*a, i) == values(*b, i));  // same seed, same position: same weights
  }
  CHECK(values(*a, 0) != values(*a, 1));  // another position
  CHECK(values(*a, 1) != values(*a, 2));
  ModelSpec other = spec;
  other.seed = 10;
  auto c = build_model(other);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(values(*a, i) != values(*c, i));  // another seed
  }
  // What comes before a layer does not matter, only its position: a parameter-free
  // layer in front leaves layer 1's weights as they were.
  ModelSpec shifted = spec;
  shifted.layers[0] = {"relu", {}, {}, ""};
  auto d = build_model(shifted);
  CHECK(values(*d, 1) == values(*a, 1));
  CHECK(values(*d, 2) == values(*a, 2));
}

TEST_CASE("a weight filled by every core at once has the values of one thread's draws") {
  // 3.5 M elements: several chunks of 2^20 on a machine of several cores.
  const int64_t n = (int64_t{7} << 20) / 2;
  for (DType dtype : {DType::kF32, DType::kF64}) {
    Tensor t = Tensor::empty({n}, dtype, Device::cpu());
    fill_uniform(t, 0.5, 1234);
    Rng rng(1234);
    bool same = true;
    for (int64_t i = 0; i < n && same; ++i) {
      const double want = rng.uniform(-0.5, 0.5);
      same = dtype == DType::kF32 ? t.data<float>()[i] == static_cast<float>(want) : t.data<double>()[i] == want;
    }
    CHECK(same);
  }
  Rng a(7), b(7);
  b.discard(3);
  for (int i = 0; i < 3; ++i) a.next();
  CHECK(a.next() == b.next());
}

TEST_CASE("a model built with one stage's weights has those of the whole model there, and shapes elsewhere") {
  // An embedding, a block, a head tied to the embedding: a stage of layers 1-2 gets the
  // embedding's weights too (the tie), and the filter's other layers only shapes.
  ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""},
                 {"linear", {{"out", "8"}}, {}, ""},
                 {"linear", {{"out", "8"}}, {}, ""},
                 {"linear", {{"out", "16"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  spec.seed = 5;
  Allocator& host = allocator_for(Device::cpu());
  const int64_t at_start = host.stats().in_use;
  auto whole = build_model(spec);
  const int64_t whole_bytes = host.stats().in_use - at_start;
  auto stage = build_model(spec, [](int i) { return i == 2 || i == 3; });
  auto early = build_model(spec, [](int i) { return i == 1; });
  auto none = build_model(spec, [](int) { return false; });
  const int64_t before_owner = host.stats().in_use;
  auto owner = build_model(spec, [](int i) { return i == 0; });  // the embedding alone: its head stays shapes
  const int64_t owner_bytes = host.stats().in_use - before_owner;
  CHECK_FALSE(owner->layer(0).parameters()[0]->value.is_meta());
  CHECK(owner->layer(3).parameters()[0]->value.is_meta());
  // The two stages together hold what the whole model holds (every layer once), and a
  // model of shapes only holds nothing.
  CHECK(host.stats().in_use - at_start == 2 * whole_bytes + owner_bytes);
  CHECK(owner_bytes > 0);
  CHECK(owner_bytes < whole_bytes / 2);
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    const bool in_stage = i != 1, in_early = i == 1;  // the tie brings layer 0 into the stage of 3
    const auto& w = whole->layer(i).parameters();
    const auto& s = stage->layer(i).parameters();
    const auto& e = early->layer(i).parameters();
    REQUIRE(w.size() == s.size());
    for (size_t j = 0; j < w.size(); ++j) {
      CHECK(s[j]->value.is_meta() == !in_stage);
      CHECK(e[j]->value.is_meta() == !in_early);
      CHECK(none->layer(i).parameters()[j]->value.is_meta());
      CHECK(s[j]->value.shape() == w[j]->value.shape());
      if (in_stage) CHECK(s[j]->value.to_vector<float>() == w[j]->value.to_vector<float>());
      if (in_early) CHECK(e[j]->value.to_vector<float>() == w[j]->value.to_vector<float>());
    }
  }
  CHECK(stage->parameter_count() == whole->parameter_count());
}

TEST_CASE("SGD with momentum and weight decay follows PyTorch's update") {
  Parameter p;
  p.value = Tensor::from_vector<double>({1.0, -2.0}, {2});
  p.grad = Tensor::from_vector<double>({0.5, 0.25}, {2});
  SgdParams sp;
  sp.lr = 0.1;
  sp.momentum = 0.9;
  sp.weight_decay = 0.01;
  Sgd opt({&p}, sp);
  opt.step();  // buf = g + wd w;  w -= lr buf
  const double b0 = 0.5 + 0.01 * 1.0, b1 = 0.25 + 0.01 * -2.0;
  const double w0 = 1.0 - 0.1 * b0, w1 = -2.0 - 0.1 * b1;
  CHECK(p.value.data<double>()[0] == doctest::Approx(w0));
  CHECK(p.value.data<double>()[1] == doctest::Approx(w1));
  opt.step();  // buf = 0.9 buf + g + wd w
  const double c0 = 0.9 * b0 + 0.5 + 0.01 * w0;
  CHECK(p.value.data<double>()[0] == doctest::Approx(w0 - 0.1 * c0));
}

TEST_CASE("Adam and AdamW follow PyTorch's update") {
  for (bool decoupled : {false, true}) {
    Parameter p;
    p.value = Tensor::from_vector<double>({1.0, -2.0}, {2});
    p.grad = Tensor::from_vector<double>({0.5, 0.25}, {2});
    OptimizerConfig c;
    c.type = decoupled ? "adamw" : "adam";
    c.lr = 0.1;
    c.weight_decay = 0.01;
    auto opt = make_optimizer({&p}, c);
    double w = 1.0, m = 0, v = 0;
    for (int step = 1; step <= 3; ++step) {
      opt->step();
      double g = 0.5;
      if (decoupled) {
        w *= 1 - 0.1 * 0.01;
      } else {
        g += 0.01 * w;
      }
      m = 0.9 * m + 0.1 * g;
      v = 0.999 * v + 0.001 * g * g;
      const double mhat = m / (1 - std::pow(0.9, step)), vhat = v / (1 - std::pow(0.999, step));
      w -= 0.1 * mhat / (std::sqrt(vhat) + 1e-8);
      CHECK(p.value.data<double>()[0] == doctest::Approx(w).epsilon(1e-12));
    }
  }
  Parameter p;
  CHECK_THROWS_WITH_AS(make_optimizer({&p}, OptimizerConfig{"lamb"}), doctest::Contains("valid: sgd, adam, adamw"),
                       UserError);
}

TEST_CASE("learning-rate warmup and cosine decay") {
  LrSchedule s;
  s.kind = "cosine";
  s.base_lr = 1.0;
  s.warmup_steps = 4;
  s.total_steps = 14;
  s.min_lr = 0.1;
  CHECK(s.at(0) == doctest::Approx(0.25));
  CHECK(s.at(3) == doctest::Approx(1.0));
  CHECK(s.at(4) == doctest::Approx(1.0));
  CHECK(s.at(13) == doctest::Approx(0.1));
  CHECK(s.at(8) < s.at(5));
  s.kind = "constant";
  CHECK(s.at(10) == 1.0);
}
