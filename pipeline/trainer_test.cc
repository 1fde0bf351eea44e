// End to end: a small config trains (the loss falls), K=2 gives the same losses as
// K=1, report.json has its fields, and a diverging run stops with a clear error.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "layers/registry.h"
#include "pipeline/config.h"
#include "pipeline/trainer.h"
#include "runtime/device.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {
const char* kSmall = R"(model:
  input: [16]
  layers:
    - {type: linear, out: 32}
    - {type: relu}
    - {type: linear, out: 32}
    - {type: gelu}
    - {type: linear, out: 4}
  loss: {type: softmax_cross_entropy}
data: {classes: 4, teacher_hidden: 8, eval_samples: 256}
pipeline: {partitions: 1, micro_batches: 4}
optimizer: {lr: 0.1, momentum: 0.9}
train: {steps: 60, batch_size: 32, log_interval: 20}
)";

std::string out_dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp") + "/" + name;
}

TrainResult run(const std::vector<std::string>& overrides) {
  std::ostringstream out;
  return train(parse_config(kSmall, "small.yaml", overrides), out);
}
}  // namespace

TEST_CASE("a small MLP learns the teacher task") {
  const TrainResult r = run({"output.dir=" + out_dir("learn")});
  REQUIRE(r.losses.size() == 60);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += r.losses[i] / 10;
  for (int i = 50; i < 60; ++i) last += r.losses[i] / 10;
  CHECK(last < 0.7 * first);
  CHECK(r.eval_accuracy > 0.5);  // chance is 0.25
}

TEST_CASE("K=2 and K=3 train exactly like K=1 up to float32 rounding") {
  const TrainResult one = run({"output.dir=" + out_dir("k1"), "train.steps=10"});
  for (const char* k : {"2", "3"}) {
    for (const char* mode : {"always", "never"}) {
      const TrainResult many = run({"output.dir=" + out_dir(std::string("k") + k), "train.steps=10",
                                    std::string("pipeline.partitions=") + k, std::string("pipeline.checkpoint=") + mode});
      REQUIRE(many.losses.size() == one.losses.size());
      for (size_t i = 0; i < one.losses.size(); ++i) CHECK(many.losses[i] == doctest::Approx(one.losses[i]).epsilon(1e-4));
    }
  }
}

TEST_CASE("report.json carries steps, stages and the bubble") {
  const TrainResult r = run({"output.dir=" + out_dir("report"), "pipeline.partitions=2", "train.steps=5"});
  std::ifstream f(r.report_path);
  REQUIRE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  REQUIRE(j["steps"].size() == 5);
  CHECK(j["steps"][4]["step"] == 4);
  CHECK(j["steps"][4]["loss"].get<double>() == doctest::Approx(r.losses[4]));
  REQUIRE(j["stages"].size() == 2);
  for (const auto& s : j["stages"]) {
    CHECK(s["busy_ms"].get<double>() > 0);
    CHECK(s["idle_ms"].get<double>() >= 0);
    CHECK(s["utilization"].get<double>() > 0);
    CHECK(s["utilization"].get<double>() <= 1.0);
  }
  CHECK(j["bubble"]["theoretical"].get<double>() == doctest::Approx(1.0 / 5));
  CHECK(j["bubble"]["measured"].get<double>() >= 0);
  CHECK(j["balance"].size() == 2);
  CHECK(!std::filesystem::exists(r.report_path + ".tmp"));
}

TEST_CASE("a diverging run stops with a message naming the fix") {
  CHECK_THROWS_WITH_AS(run({"output.dir=" + out_dir("nan"), "optimizer.lr=1e30", "train.steps=20"}),
                       doctest::Contains("lower optimizer.lr"), UserError);
  CHECK(!std::filesystem::exists(out_dir("nan") + "/report.json"));
}

TEST_CASE("requests that cannot work are refused before training") {
  CHECK_THROWS_WITH_AS(run({"pipeline.partitions=6"}), doctest::Contains("only 5 layers"), UserError);
  CHECK_THROWS_WITH_AS(run({"pipeline.partitions=2", "pipeline.balance=[2,2]"}), doctest::Contains("sums to 4"),
                       UserError);
  CHECK_THROWS_WITH_AS(run({"pipeline.micro_batches=64"}), doctest::Contains("raise train.batch_size"), UserError);
  CHECK_THROWS_WITH_AS(run({"data.classes=5"}), doctest::Contains("the data needs (5) (5 classes)"), UserError);
  // 2^20-wide layers at batch 2^16: terabytes, refused before anything is allocated.
  CHECK_THROWS_WITH_AS(run({"model.layers.0.out=1048576", "train.batch_size=65536", "pipeline.checkpoint=never"}),
                       doctest::Contains("of host memory"), UserError);
  // One GPU more than this machine has (cuda:0 on a machine without any): refused on any machine.
  const std::string missing = "cuda:" + std::to_string(cuda_device_count());
  CHECK_THROWS_WITH_AS(run({"pipeline.partitions=2", "pipeline.devices=[cpu:0, " + missing + "]"}),
                       doctest::Contains(("pipeline.devices names " + missing + " but this machine has").c_str()), UserError);
}

namespace {
std::string write_text(const std::string& name, int repeats) {
  const std::string path = out_dir(name);
  std::ofstream f(path);
  for (int i = 0; i < repeats; ++i) f << "the quick brown fox jumps over the lazy dog. ";
  return path;
}

const char* kTinyGpt = R"(model:
  input: [16]
  layers:
    - {type: embedding, vocab: 256, dim: 32}
    - {type: transformer_block, heads: 2, dropout: 0.1}
    - {type: transformer_block, heads: 2}
    - {type: layernorm}
    - {type: linear, out: 256}
  loss: softmax_cross_entropy
data: {type: text, seq_len: 16, validation_fraction: 0.2}
pipeline: {partitions: 2, micro_batches: 4, checkpoint: except_last}
optimizer: {type: adamw, lr: 0.01, weight_decay: 0.01, schedule: cosine, warmup_steps: 5, clip_grad_norm: 1.0}
train: {steps: 60, batch_size: 8, log_interval: 20, eval_interval: 30, eval_samples: 16}
)";
}  // namespace

TEST_CASE("a tiny GPT learns a text file through the pipeline, with validation") {
  const std::string text = write_text("fox.txt", 60);
  std::ostringstream log;
  const Config c = parse_config(kTinyGpt, "tiny_gpt.yaml", {"data.path=" + text, "output.dir=" + out_dir("gpt")});
  const TrainResult r = train(c, log);
  REQUIRE(r.losses.size() == 60);
  CHECK(r.losses.front() > 4.0);  // about log(256) at the start
  CHECK(r.losses.back() < 0.5 * r.losses.front());
  CHECK(r.eval_loss < 0.6 * r.losses.front());
  CHECK(log.str().find("val_loss") != std::string::npos);
  std::ifstream f(r.report_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  CHECK(j["validation"].size() == 2);  // step 30 and the end
}

TEST_CASE("data and model must agree, and files must exist") {
  const std::string text = write_text("fox2.txt", 10);
  std::ostringstream log;
  CHECK_THROWS_WITH_AS(
      train(parse_config(kTinyGpt, "t.yaml", {"data.path=" + text, "data.seq_len=8"}), log),
      doctest::Contains("the data gives int32(8) per sample but the model takes int32(16)"), UserError);
  CHECK_THROWS_WITH_AS(train(parse_config(kTinyGpt, "t.yaml", {"data.path=/no/such.txt"}), log),
                       doctest::Contains("'/no/such.txt' cannot be read"), UserError);
  CHECK_THROWS_WITH_AS(parse_config(kTinyGpt, "t.yaml"), doctest::Contains("set data.path"), UserError);
}

TEST_CASE("the shipped configs parse, build and balance") {
  for (const char* path : {"configs/default.yaml", "configs/mlp.yaml", "configs/gpt.yaml", "configs/resnet.yaml"}) {
    CAPTURE(path);
    const Config c = load_config(path);
    auto model = layers::build_model(c.model);
    const auto balance = plan_balance(c, *model);
    CHECK(static_cast<int>(balance.size()) == c.pipeline.partitions);
  }
}

TEST_CASE("the ResNet config trains on a CIFAR-10 binary file") {
  const std::string path = out_dir("cifar_batch.bin");
  {
    std::ofstream f(path, std::ios::binary);
    for (int r = 0; r < 64; ++r) {
      f.put(static_cast<char>(r % 10));
      for (int p = 0; p < 3072; ++p) f.put(static_cast<char>((p * (r % 10 + 1)) % 251));
    }
  }
  std::ostringstream log;
  const Config c = load_config("configs/resnet.yaml", {"data.path=" + path, "train.steps=3", "train.batch_size=8",
                                                       "train.eval_samples=8", "output.dir=" + out_dir("resnet")});
  const TrainResult r = train(c, log);
  REQUIRE(r.losses.size() == 3);
  for (double l : r.losses) CHECK(std::isfinite(l));
  CHECK(r.balance.size() == 2);
}
