// A model built in C++ gets the whole trainer: handed over as a factory with a config
// filled in C++, or registered by name and written as model: {cpp: NAME} in YAML. Both
// train exactly like the same model written as YAML layers; a layer that breaks the
// layer contract is named before or at the first step.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/registry.h"
#include "pipeline/config/config.h"
#include "pipeline/train/trainer.h"
#include "runtime/error.h"
#include "runtime/random.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

std::string out_dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp") + "/" + name;
}

// linear(16 -> hidden), relu, linear(hidden -> 4), seeded per layer as build_model
// seeds YAML layers (mix_seed(seed, i)), so that it equals the YAML model below.
std::unique_ptr<layers::Sequential> mlp(int64_t hidden, uint64_t seed = 0) {
  auto m = std::make_unique<layers::Sequential>(Shape{16}, DType::kF32);
  layers::LinearOptions a(16, hidden);
  a.seed = mix_seed(seed, 0);
  m->emplace<layers::Linear>(a);
  m->emplace<layers::Relu>(Shape{hidden});
  layers::LinearOptions b(hidden, 4);
  b.seed = mix_seed(seed, 2);
  m->emplace<layers::Linear>(b);
  m->set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(4));
  return m;
}

const char* kYamlMlp = R"(model:
  input: [16]
  layers: [{type: linear, out: 12}, {type: relu}, {type: linear, out: 4}]
  loss: {type: softmax_cross_entropy}
data: {classes: 4, teacher_hidden: 8, eval_samples: 128}
pipeline: {partitions: 2, micro_batches: 4}
optimizer: {lr: 0.1, momentum: 0.9}
train: {steps: 30, batch_size: 32, log_interval: 10}
)";

// The same run, filled in C++ (no YAML), but for the model.
Config config_in_cpp(const std::string& dir) {
  Config c;
  c.name = "cpp";
  c.data.classes = 4;
  c.data.teacher_hidden = 8;
  c.data.eval_samples = 128;
  c.pipeline.partitions = 2;
  c.pipeline.micro_batches = 4;
  c.optimizer.optimizer.lr = 0.1;
  c.optimizer.optimizer.momentum = 0.9;
  c.train.steps = 30;
  c.train.batch_size = 32;
  c.train.log_interval = 10;
  c.output.dir = dir;
  return c;
}

}  // namespace

TEST_CASE("a config names a model registered in C++, with its options and --set") {
  const Config c = parse_config("model: {cpp: tiny, hidden: 12, act: relu}\ntrain: {steps: 1, batch_size: 4}\n",
                                "m.yaml", {"model.hidden=10"});
  REQUIRE(c.model.cpp.has_value());
  CHECK(c.model.cpp->type == "tiny");
  CHECK(c.model.cpp->args == std::map<std::string, std::string>{{"act", "relu"}, {"hidden", "10"}});
  CHECK(c.model.cpp->where == "m.yaml:1:8");
  CHECK(c.model.layers.empty());
  CHECK_THROWS_WITH_AS(parse_config("model: {cpp: tiny, sizes: [1, 2]}\ntrain: {steps: 1, batch_size: 4}\n", "m.yaml"),
                       doctest::Contains("model.sizes: the options of a C++ model take single values"), UserError);
}

TEST_CASE("a factory's model trains like the same model written in YAML, with a report") {
  std::ostringstream yaml_out, cpp_out;
  const TrainResult yaml = train(parse_config(kYamlMlp, "mlp.yaml", {"output.dir=" + out_dir("yaml")}), yaml_out);
  const std::string dir = out_dir("factory");
  std::filesystem::remove_all(dir);
  const TrainResult cpp = train(config_in_cpp(dir), [] { return mlp(12); }, cpp_out);
  REQUIRE(cpp.losses.size() == 30);
  CHECK(cpp.losses == yaml.losses);  // same weights, data, balance and schedule: the same run
  CHECK(cpp.balance == yaml.balance);
  CHECK(cpp.losses.back() < 0.8 * cpp.losses.front());
  CHECK(cpp.eval_accuracy == yaml.eval_accuracy);
  CHECK(std::filesystem::exists(dir + "/report.json"));
  CHECK(cpp_out.str().find("step    30/30") != std::string::npos);
}

TEST_CASE("a registered model named in YAML trains like the factory's") {
  layers::register_model("test_mlp", [](layers::LayerArgs& o) { return mlp(o.get_int("hidden")); });
  std::ostringstream out;
  const std::string yaml = std::string(kYamlMlp).substr(std::string(kYamlMlp).find("data:"));
  const TrainResult named =
      train(parse_config("model: {cpp: test_mlp, hidden: 12}\n" + yaml, "named.yaml", {"output.dir=" + out_dir("n")}),
            out);
  const TrainResult factory = train(config_in_cpp(out_dir("f")), [] { return mlp(12); }, out);
  CHECK(named.losses == factory.losses);
  // The model section of a config is ignored when a factory is given.
  const TrainResult both = train(parse_config("model: {cpp: test_mlp, hidden: 5}\n" + yaml, "both.yaml",
                                              {"output.dir=" + out_dir("b")}),
                                 [] { return mlp(12); }, out);
  CHECK(both.losses == factory.losses);
}

TEST_CASE("a model that does not fit the data, or no model, is refused with the fix") {
  std::ostringstream out;
  Config c = config_in_cpp(out_dir("misfit"));
  c.data.classes = 5;
  CHECK_THROWS_WITH_AS(train(c, [] { return mlp(12); }, out),
                       doctest::Contains("the model's last layer produces (4) per sample but the data needs (5)"),
                       UserError);
  CHECK_THROWS_WITH_AS(train(config_in_cpp(out_dir("none")), [] { return std::unique_ptr<layers::Sequential>(); }, out),
                       doctest::Contains("the model factory returned no model"), UserError);
  CHECK_THROWS_WITH_AS(train(config_in_cpp(out_dir("empty")), out),
                       doctest::Contains("the model has no layers; list them in model.layers, or name a model "
                                         "registered in C++ with model.cpp"),
                       UserError);
}

namespace {

// A layer of one's own whose forward returns one feature too many.
class TooWide : public layers::Layer {
 public:
  explicit TooWide(int64_t c) : Layer({c}, {c}, DType::kF32) {}
  std::string type() const override { return "too_wide"; }
  std::string describe() const override { return "too_wide(" + std::to_string(input_shape()[0]) + ")"; }
  layers::LayerCost cost(int64_t batch) const override {
    layers::LayerCost c;
    c.forward_flops = c.backward_flops = static_cast<double>(batch * input_shape()[0]);
    c.output_bytes = batch * input_shape()[0] * 4;
    return c;
  }

 protected:
  Tensor forward_impl(Backend& be, const Tensor& x, layers::Context*, const layers::ForwardArgs&) override {
    return be.zeros({x.size(0), input_shape()[0] + 1}, DType::kF32);
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const layers::Context&, bool) override { return dy; }
};

}  // namespace

TEST_CASE("a layer of one's own that returns the wrong shape stops the first step with its name") {
  std::ostringstream out;
  auto broken = [] {
    auto m = mlp(12);
    m->emplace<TooWide>(4);
    return m;
  };
  CHECK_THROWS_WITH_AS(train(config_in_cpp(out_dir("wide")), broken, out),
                       doctest::Contains("layer 3 (too_wide(4), type 'too_wide'): forward returned float32(8, 5)"),
                       UserError);
  CHECK(out.str().find("step") == std::string::npos);  // no step completed
}
