// End to end: a small config trains (the loss falls), K=2 gives the same losses as
// K=1, validation scores what the unpartitioned model scores on the same samples,
// report.json has its fields, and a diverging run stops with a clear error.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "kernels/backend.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/config/config.h"
#include "pipeline/planning/device_peak.h"
#include "pipeline/planning/memory_check.h"
#include "pipeline/planning/plan.h"
#include "pipeline/train/datasets.h"
#include "pipeline/train/gemm_rates.h"
#include "pipeline/train/trainer.h"
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
      const TrainResult many = run({"output.dir=" + out_dir(std::string("k") + k + mode), "train.steps=10",
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
  for (int i = 0; i < 5; ++i) {
    CHECK(j["steps"][i]["step"] == i + 1);  // numbered from 1, as the progress lines are
    CHECK(j["steps"][i]["loss"].get<double>() == r.losses[i]);  // every step's loss, as trained
  }
  CHECK(j["timed_steps"] == 4);  // the first step is a warm-up
  const double span = j["span_ms"].get<double>(), step_ms = j["step_ms"].get<double>();
  CHECK(span > 0);
  CHECK(span <= step_ms);  // the span ends inside the step
  CHECK(j["samples_per_second"].get<double>() == doctest::Approx(32 / (step_ms / 1000)).epsilon(1e-9));
  REQUIRE(j["stages"].size() == 2);
  double util_sum = 0;
  for (const auto& s : j["stages"]) {
    CAPTURE(s.dump());
    const double busy = s["busy_ms"].get<double>(), idle = s["idle_ms"].get<double>(), comm = s["comm_ms"].get<double>();
    // Busy is exactly the compute: forward, recompute (3 of the 4 micro-batches are
    // checkpointed with except_last) and backward.
    CHECK(s["recompute_ms"].get<double>() > 0);
    CHECK(busy == doctest::Approx(s["forward_ms"].get<double>() + s["recompute_ms"].get<double>() +
                                  s["backward_ms"].get<double>()).epsilon(1e-9));
    CHECK(s["utilization"].get<double>() == doctest::Approx(busy / span).epsilon(1e-9));
    // Busy, communication and idle fill the span (idle is clamped at 0 per step, so at
    // least the span), and idle is never more than the span.
    CHECK(busy + comm + idle >= span * (1 - 1e-9));
    CHECK(idle <= span);
    CHECK(s["optimizer_ms"].get<double>() > 0);
    CHECK(s["peak_activation_bytes"].get<int64_t>() > 0);
    // The device's allocator at its most holds the stage's optimizer state (and its weights,
    // gradients and activations beside it).
    CHECK(s["device_peak_bytes"].get<int64_t>() > s["optimizer_bytes"].get<int64_t>());
    util_sum += s["utilization"].get<double>();
  }
  CHECK(j["bubble"]["measured"].get<double>() == doctest::Approx(1 - util_sum / 2).epsilon(1e-9));
  CHECK(j["bubble"]["theoretical"].get<double>() == doctest::Approx(1.0 / 5));  // (K-1)/(M+K-1), K=2, M=4
  CHECK(j["balance"] == nlohmann::json(r.balance));
  CHECK(r.balance == std::vector<int>{2, 3});
  // The ops each stage's layers called per step, measured, are the ones the plan counted
  // on shapes (the meta backend, before the run); the step's other instructions (the
  // optimizer's update and the gradients' zeroing) add a few more.
  REQUIRE(j.contains("prediction"));
  for (size_t k = 0; k < 2; ++k) {
    CAPTURE(k);
    const int64_t planned = j["prediction"]["stages"][k]["ops_per_step"].get<int64_t>();
    CHECK(planned > 0);
    CHECK(j["stages"][k]["ops_per_step"].get<int64_t>() == planned);
    CHECK(j["stages"][k]["ops_per_step_all"].get<int64_t>() > planned);
  }
  // By hand: stage 0 (linear, the first layer, and relu; 4 micro-batches, 3 of them
  // recomputed): F linear_bias 1 + relu 1 = 2, recomputed 2, B relu 1, W linear_weight_grad
  // 1: 4 x 2 + 3 x 2 + 4 x 2 = 22.
  CHECK(j["stages"][0]["ops_per_step"].get<int64_t>() == 22);
  // Each matrix product, timed alone after the run (gemm_rates.h), against a hand list of
  // the layers' products at the micro-batch of 8: linear 16 -> 32 (the first layer: no
  // input gradient), 32 -> 32 and 32 -> 4, each with its bias, on stages 0 and 1 (2, 3).
  //   F: linear_bias x (8, in) W^T (in, out): m 8, n out, k in;
  //   B: matmul_weight dy (8, out) W (out, in): m 8, n in, k out;
  //   W: linear_weight_grad dy^T (out, 8) x (8, in): m out, n in, k 8.
  REQUIRE(j.contains("gemms"));
  using Product = std::tuple<std::string, int64_t, int64_t, int64_t, std::string, std::string, std::vector<int>>;
  std::set<Product> got;
  const std::set<Product> want = {
      {"linear_bias", 8, 32, 16, "F", "0", {0}},          {"linear_weight_grad", 32, 16, 8, "W", "0", {0}},
      {"linear_bias", 8, 32, 32, "F", "2", {1}},          {"matmul_weight", 8, 32, 32, "B", "2", {1}},
      {"linear_weight_grad", 32, 32, 8, "W", "2", {1}},   {"linear_bias", 8, 4, 32, "F", "4", {1}},
      {"matmul_weight", 8, 32, 4, "B", "4", {1}},         {"linear_weight_grad", 4, 32, 8, "W", "4", {1}}};
  for (const auto& g : j["gemms"]) {
    CAPTURE(g.dump());
    // Its stage's device (cpu:0, cpu:1: one stage each) and that device's peak.
    const int stage = g["stages"][0].get<int>();
    CHECK(g["device"] == j["stages"][stage]["device"]);
    const double peak = j["stages"][stage]["peak_flops_per_second"].get<double>();
    got.insert({g["op"], g["m"], g["n"], g["k"], g["phases"], g["layers"], g["stages"].get<std::vector<int>>()});
    const double flops = 2.0 * g["m"].get<double>() * g["n"].get<double>() * g["k"].get<double>();
    CHECK(g["flops"].get<double>() == flops);
    CHECK(g["calls_per_micro_batch"] == 1);
    CHECK(g["timed_calls"].get<int>() >= 1);
    CHECK(g["ms"].get<double>() > 0);
    CHECK(g["flops_per_second"].get<double>() == doctest::Approx(flops / (g["ms"].get<double>() / 1e3)).epsilon(1e-9));
    CHECK(g["peak_flops_per_second"].get<double>() == doctest::Approx(peak).epsilon(1e-9));
    CHECK(g["peak_fraction"].get<double>() ==
          doctest::Approx(g["flops_per_second"].get<double>() / peak).epsilon(1e-9));
    CHECK(g["dtype"] == "float32");
  }
  CHECK(got == want);
  CHECK(j["stages"][0]["layers"] == "0-1 linear, relu");
  CHECK(!std::filesystem::exists(r.report_path + ".tmp"));
}

namespace {
// The unpartitioned model as the config builds it (its weights seeded per layer),
// scored in one batch on validation samples [0, n), in evaluation mode: the mean
// negative log-likelihood and the accuracy over the targets other than
// `ignore_index`, from the logits on the host in double precision.
std::pair<double, double> direct_validation(const Config& c, int64_t n, int ignore_index = -100) {
  auto model = layers::build_model(c.model);
  const auto data = make_dataset(c);
  auto [x, y] = data->validation(0, n);
  layers::ForwardArgs args;
  args.training = false;
  Backend& be = backend_for(Device::cpu());
  Tensor h = x;
  for (int i = 0; i < model->size(); ++i) h = model->layer(i).forward(be, h, nullptr, args);
  const int64_t classes = h.shape().back(), rows = h.numel() / classes;
  const std::vector<float> logits = h.to_vector<float>();
  const std::vector<int32_t> targets = y.to_vector<int32_t>();
  REQUIRE(static_cast<int64_t>(targets.size()) == rows);
  double loss = 0, correct = 0, counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    const float* row = logits.data() + r * classes;
    int64_t best = 0;
    double top = row[0];
    for (int64_t j = 1; j < classes; ++j) {
      if (row[j] > row[best]) best = j;
      top = std::max(top, static_cast<double>(row[j]));
    }
    double sum = 0;
    for (int64_t j = 0; j < classes; ++j) sum += std::exp(row[j] - top);
    loss += top + std::log(sum) - row[targets[r]];
    correct += best == targets[r];
    counted += 1;
  }
  return {loss / counted, correct / counted};
}
}  // namespace

TEST_CASE("a resumed run's report.json keeps every validation of the launches before it, the last one included") {
  const std::string dir = out_dir("resume_validations");
  std::filesystem::remove_all(dir);
  const std::vector<std::string> common = {"output.dir=" + dir, "train.eval_interval=3", "checkpoint.every=3"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return more;
  };
  const TrainResult first = run(with({"train.steps=6"}));
  const TrainResult second = run(with({"train.steps=9", "checkpoint.resume=auto"}));
  CHECK(second.start_step == 6);
  std::ifstream f(second.report_path);
  const nlohmann::json v = nlohmann::json::parse(f)["validation"];
  REQUIRE(v.size() == 3);
  const int steps[3] = {3, 6, 9}, launches[3] = {1, 1, 2};
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(v[i]["step"].get<int>() == steps[i]);
    CHECK(v[i]["launch"].get<int>() == launches[i]);
  }
  // The first launch's last validation is the one it scored, and the second's its own.
  CHECK(v[1]["loss"].get<double>() == first.eval_loss);
  CHECK(v[1]["accuracy"].get<double>() == first.eval_accuracy);
  CHECK(v[2]["loss"].get<double>() == second.eval_loss);
}

TEST_CASE("stages taking turns on cpu:0: each has half its peak, a product all of it, and a wait for the turn is not work") {
  // Two stages on cpu:0 take turns on it (Plan::turns): the device is probed once, alone,
  // each stage's peak is half of it, and a product timed alone has all of it. A peak cache
  // of this test's own, which no other test process rewrites meanwhile.
  const char* shared_cache = std::getenv("GPIPE_PEAK_CACHE");
  const std::string saved_cache = shared_cache != nullptr ? shared_cache : "";
  const std::string own_cache = out_dir("gemm_shared_peaks.json");
  std::filesystem::remove(own_cache);
  ::setenv("GPIPE_PEAK_CACHE", own_cache.c_str(), 1);
  struct Restore {
    const char* was;
    std::string value;
    ~Restore() { was != nullptr ? ::setenv("GPIPE_PEAK_CACHE", value.c_str(), 1) : ::unsetenv("GPIPE_PEAK_CACHE"); }
  } restore{shared_cache, saved_cache};
  const TrainResult r = run({"output.dir=" + out_dir("gemm_shared"), "train.steps=8", "pipeline.partitions=2",
                             "pipeline.devices=[cpu:0, cpu:0]"});
  std::ifstream f(r.report_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  REQUIRE(j["stages"].size() == 2);
  REQUIRE(j["gemms"].size() == 8);
  const double s0 = j["stages"][0]["peak_flops_per_second"].get<double>();
  const double s1 = j["stages"][1]["peak_flops_per_second"].get<double>();
  CHECK(s0 == s1);
  // The cache's entry for cpu:0 alone, as the run stored it (the run's one BLAS thread).
  CHECK(s0 + s1 == doctest::Approx(device_peaks({Device::cpu(0)}, DType::kF32, 1).at(0).flops_per_second));
  CHECK(j["peak_flops_per_second"].get<double>() == doctest::Approx(s0 + s1));  // MFU's: the device once
  for (const auto& g : j["gemms"]) {
    CAPTURE(g.dump());
    CHECK(g["device"] == "cpu:0");
    CHECK(g["peak_flops_per_second"].get<double>() == doctest::Approx(s0 + s1).epsilon(1e-9));
  }
  // Their compute never overlaps in the trace (one holds the device at a time), and each
  // stage's busy time is its own work: the two add up to at most the step. (A stage waits
  // for its turn only now and then: 7 traced steps give the check waits to see.)
  std::ifstream t(std::filesystem::path(r.report_path).parent_path() / j["trace"]["file"].get<std::string>());
  const nlohmann::json trace = nlohmann::json::parse(t);
  std::map<int, std::vector<std::pair<double, double>>> by_step;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    const std::string cat = e.value("cat", "");
    if (cat != op_name(Op::kForward) && cat != op_name(Op::kRecompute) && cat != op_name(Op::kBackward) &&
        cat != op_name(Op::kBackwardWeight) && cat != op_name(Op::kOptimizerStep)) {
      continue;
    }
    const double ts = e["ts"].get<double>();
    by_step[e["args"]["step"].get<int>()].push_back({ts, ts + e["dur"].get<double>()});
  }
  REQUIRE(!by_step.empty());
  for (const auto& [step, spans] : by_step) CHECK(spans.size() == 2 * (4 + 4 + 3) + 2);  // F, B, R and OPT of both
  for (auto& [step, spans] : by_step) {
    CAPTURE(step);
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) CHECK(spans[i].first >= spans[i - 1].second - 0.01);  // us
  }
  CHECK(j["stages"][0]["busy_ms"].get<double>() + j["stages"][1]["busy_ms"].get<double>() <=
        j["span_ms"].get<double>() * 1.001);

  // By hand: GPUs: device_peaks gives each of the stages on cuda:0 its share (here 40 and
  // 60), and a product timed alone has the whole GPU: 100; cuda:1's one stage, its own 70.
  // CPU stages taking turns on cpu:0 likewise (1 + 2); under mpirun (no turns) each its own.
  Plan plan;
  plan.devices = {Device::cuda(0), Device::cuda(0), Device::cuda(1), Device::cpu(0), Device::cpu(0)};
  plan.turns = device_turns(plan.devices, true);
  const std::vector<double> peaks = {40e12, 60e12, 70e12, 1e11, 2e11};
  CHECK(product_peak(plan, peaks, 0) == 100e12);
  CHECK(product_peak(plan, peaks, 1) == 100e12);
  CHECK(product_peak(plan, peaks, 2) == 70e12);
  CHECK(product_peak(plan, peaks, 3) == 3e11);
  CHECK(product_peak(plan, peaks, 4) == 3e11);
  plan.turns = device_turns(plan.devices, false);
  CHECK(product_peak(plan, peaks, 3) == 1e11);
  CHECK(product_peak(plan, peaks, 4) == 2e11);
  CHECK(product_peak(plan, {}, 0) == 0);  // no peak probed: no fraction
}

TEST_CASE("a tensor group's products are listed at its member's shards, and the run's group is kept") {
  // Two members as threads; the column layer's 32 outputs and the row layer's 32 inputs
  // are 16 a member. Micro-batches of 2 (batch 8, M = 4).
  const char* split = R"(model:
  input: [12]
  layers:
    - {type: linear, out: 12}
    - {type: linear, out: 32, parallel: column}
    - {type: gelu}
    - {type: linear, out: 12, parallel: row}
  loss: softmax_cross_entropy
data: {classes: 12}
pipeline: {partitions: 1, micro_batches: 4, tensor_parallel: 2}
train: {steps: 2, batch_size: 8}
)";
  std::ostringstream log;
  const TrainResult r = train(parse_config(split, "split.yaml", {"output.dir=" + out_dir("gemm_split")}), log);
  std::ifstream f(r.report_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  REQUIRE(j.contains("gemms"));
  bool column = false, row = false;
  for (const auto& g : j["gemms"]) {
    CAPTURE(g.dump());
    // The column layer's forward, with its bias: x (2, 12) W^T, its 16 rows of W.
    if (g["layers"] == "1" && g["phases"] == "F") {
      column = true;
      CHECK(g["op"] == "linear_bias");
      CHECK(g["m"] == 2);
      CHECK(g["n"] == 16);
      CHECK(g["k"] == 12);
    }
    // The row layer's: a partial product over its 16 inputs, summed over the group, then
    // the bias (so not linear_bias).
    if (g["layers"] == "3" && g["phases"] == "F") {
      row = true;
      CHECK(g["op"] == "matmul_weight");
      CHECK(g["m"] == 2);
      CHECK(g["n"] == 12);
      CHECK(g["k"] == 16);
    }
  }
  CHECK(column);
  CHECK(row);
  CHECK(r.losses.size() == 2);
}

TEST_CASE("validation over a partial last chunk scores exactly eval_samples samples") {
  // 67 = 2 * 32 + 3: chunks of 32, 32 and 3, through K=2. One step at a learning rate
  // far too small to move a float32 weight keeps the initial weights, so the
  // unpartitioned model built from the same config, run on the same 67 samples in one
  // batch, must score the same.
  for (const char* k : {"1", "2"}) {
    CAPTURE(k);
    const Config c = parse_config(kSmall, "small.yaml",
                                  {"output.dir=" + out_dir(std::string("eval_partial_k") + k), "train.steps=1",
                                   "optimizer.lr=1e-30", "train.eval_samples=67", std::string("pipeline.partitions=") + k});
    std::ostringstream log;
    const TrainResult r = train(c, log);
    const auto [loss, accuracy] = direct_validation(c, 67);
    CHECK(r.eval_loss == doctest::Approx(loss).epsilon(1e-5));
    CHECK(r.eval_accuracy == doctest::Approx(accuracy).epsilon(1e-12));
    // A count of correct samples over 67, not over 64 or 96.
    CHECK(r.eval_accuracy * 67 == doctest::Approx(std::round(r.eval_accuracy * 67)).epsilon(1e-9));
  }
}

TEST_CASE("a diverging run stops with a message naming the fix") {
  // The config reader refuses a learning rate above 10; set in C++, one diverges.
  Config c = parse_config(kSmall, "small.yaml", {"output.dir=" + out_dir("nan"), "train.steps=20"});
  c.optimizer.optimizer.lr = 1e30;
  std::ostringstream out;
  CHECK_THROWS_WITH_AS(train(c, out), doctest::Contains("lower optimizer.lr"), UserError);
  CHECK(!std::filesystem::exists(out_dir("nan") + "/report.json"));
}

TEST_CASE("a float64 loss that grows huge before it overflows still ends with the message") {
  // With lr 5e299 (warm-up) step 2's loss is finite with over 200 digits, which the
  // progress line must survive (it used to write past its buffer and crash), and step
  // 3's is NaN. The config reader refuses such a learning rate; it is set in C++.
  const char* wide = R"(model:
  input: [32]
  dtype: float64
  layers:
    - {type: linear, out: 64}
    - {type: gelu}
    - {type: linear, out: 64}
    - {type: relu}
    - {type: linear, out: 64}
    - {type: gelu}
    - {type: linear, out: 64}
    - {type: relu}
    - {type: linear, out: 6}
  loss: {type: softmax_cross_entropy}
data: {type: teacher, classes: 6, teacher_hidden: 16, seed: 3, eval_samples: 96}
pipeline: {partitions: 2, micro_batches: 2}
optimizer: {type: sgd, lr: 0.1, weight_decay: 0.01, warmup_steps: 2}
train: {steps: 6, batch_size: 24, log_interval: 1}
)";
  std::ostringstream log;
  Config c = parse_config(wide, "wide.yaml", {"output.dir=" + out_dir("huge")});
  c.optimizer.optimizer.lr = 1e300;
  CHECK_THROWS_WITH_AS(train(c, log), doctest::Contains("the loss became NaN at step 3; lower optimizer.lr (now 1e+300)"),
                       UserError);
  CAPTURE(log.str());
  CHECK(log.str().find("step     2/6  loss 888") != std::string::npos);
  CHECK(!std::filesystem::exists(out_dir("huge") + "/report.json"));
}

TEST_CASE("requests that cannot work are refused before training") {
  CHECK_THROWS_WITH_AS(run({"pipeline.partitions=6"}), doctest::Contains("only 5 layers"), UserError);
  CHECK_THROWS_WITH_AS(run({"pipeline.partitions=2", "pipeline.balance=[2,2]"}), doctest::Contains("sums to 4"),
                       UserError);
  CHECK_THROWS_WITH_AS(run({"pipeline.micro_batches=64"}), doctest::Contains("raise train.batch_size"), UserError);
  CHECK_THROWS_WITH_AS(run({"data.classes=5"}), doctest::Contains("the data needs (5) (5 classes)"), UserError);
  // 2^20-wide layers at batch 2^16: terabytes of activations, refused before anything is
  // allocated.
  CHECK_THROWS_WITH_AS(run({"model.layers.0.out=1048576", "train.batch_size=65536", "pipeline.checkpoint=never"}),
                       doctest::Contains("for the activations its schedule keeps at their peak"), UserError);
  // One GPU more than this machine has (cuda:0 on a machine without any): refused on any machine.
  const std::string missing = "cuda:" + std::to_string(cuda_device_count());
  CHECK_THROWS_WITH_AS(run({"pipeline.partitions=2", "pipeline.devices=[cpu:0, " + missing + "]"}),
                       doctest::Contains(("pipeline.devices names " + missing + " but this machine has").c_str()), UserError);
}

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("weights that cannot fit are refused before any is allocated, with the advice for weights") {
  // 200000 x 200000 float64: 320 GB of weights, as many of gradients, and with Adam
  // twice as many of optimizer state; 64 GiB available.
  const int64_t gib = int64_t{1} << 30;
  const Config c = parse_config(kSmall, "small.yaml",
                                {"model.dtype=float64", "model.input=[200000]", "model.layers.0.out=200000",
                                 "optimizer.type=adam"});
  Allocator& host = allocator_for(Device::cpu());
  host.reset_peak();
  const int64_t before = host.stats().in_use;
  const std::string e = error_of([&] { check_weights_fit(c, 64 * gib); });
  CHECK(host.stats().peak - before < (1 << 20));
  CAPTURE(e);
  CHECK(e.find("the model's weights cannot fit in host memory: with their gradients and optimizer state they need "
               "1192.29 GiB (weights 298.07 GiB, gradients 298.07 GiB, adam state 596.14 GiB (2 values per weight)); the largest is "
               "layer 0, linear(200000 -> 200000) at small.yaml:4:7, with 298.02 GiB of weights, but only 64.00 GiB is "
               "available. Weights do not depend on pipeline.micro_batches or train.batch_size: use a smaller model "
               "(fewer or narrower layers), set model.dtype: float32 instead of float64 (half the bytes), or use "
               "optimizer.type: sgd without momentum") == 0);
  CHECK(e.find("More pipeline.partitions do not help on one machine either: its memory holds every stage's weights") !=
        std::string::npos);
  CHECK(e.find("micro_batches") == e.find("micro_batches or train.batch_size"));  // not advised to raise them
  // On GPUs the optimizer's state is not on the host: the weights and gradients the host
  // builds before they move.
  Config gpu = c;
  gpu.pipeline.devices = {"cuda:0"};
  const std::string two = error_of([&] { check_weights_fit(gpu, 64 * gib); });
  CHECK(two.find("with their gradients they need 596.14 GiB (weights 298.07 GiB, gradients 298.07 GiB);") !=
        std::string::npos);
  // Fits: 1.3 TiB available. Unknown availability (-1): no check.
  CHECK(error_of([&] { check_weights_fit(c, 1300 * gib); }) == "no error");
  CHECK(error_of([&] { check_weights_fit(c, -1); }) == "no error");
  // SGD without momentum keeps no state; float32 halves the rest.
  const Config sgd = parse_config(kSmall, "small.yaml",
                                  {"model.input=[200000]", "model.layers.0.out=200000", "optimizer.momentum=0"});
  const std::string s = error_of([&] { check_weights_fit(sgd, 64 * gib); });
  CHECK(s.find("they need 298.07 GiB (weights 149.04 GiB, gradients 149.04 GiB)") != std::string::npos);
  CHECK(s.find("float64") == std::string::npos);
  CHECK(s.find("optimizer") == std::string::npos);
}

TEST_CASE("a planned run that does not fit says how much is weights and how much activations") {
  Config c = parse_config(kSmall, "small.yaml", {"model.layers.0.out=1024", "train.batch_size=65536"});
  auto model = layers::build_model(c.model);
  const Plan plan = make_plan(c, *model);
  const auto mem = estimate_memory(plan, *model, c.optimizer.optimizer);
  REQUIRE(mem.size() == 1);
  // The model holds its weights and gradients already: `available` is what is left.
  const int64_t held = 2 * mem[0].weight_bytes;
  const int64_t weights = mem[0].parameter_bytes, activations = mem[0].activation_bytes;
  REQUIRE(activations > weights);
  CHECK(error_of([&] { check_run_fits(c, *model, plan, weights + activations - held); }) == "no error");
  // Weights fit, activations do not: the micro-batch advice, with both parts.
  const std::string a = error_of([&] { check_run_fits(c, *model, plan, weights + activations / 2 - held); });
  CAPTURE(a);
  CHECK(a.find("the run needs about ") == 0);
  CHECK(a.find(" for the weights with their gradients and optimizer state and ") != std::string::npos);
  CHECK(a.find(" for the activations its schedule keeps at their peak, but only ") != std::string::npos);
  CHECK(a.find("the built model holds)") != std::string::npos);
  CHECK(a.find("lower train.batch_size, raise pipeline.micro_batches, set pipeline.recompute: always") !=
        std::string::npos);
  // Not even the weights fit (a model built in C++ is checked only here): the advice for
  // weights, not for micro-batches.
  const std::string w = error_of([&] { check_run_fits(c, *model, plan, 1000); });
  CAPTURE(w);
  CHECK(w.find("the model's weights cannot fit in host memory") == 0);
  CHECK(w.find("raise pipeline.micro_batches") == std::string::npos);
}

// pipeline.memory_limit holds for a run the config fixes, as for the sweep's: a stage
// over it is refused, with the advice for the part that is over.
TEST_CASE("a planned run over pipeline.memory_limit is refused, naming the stage and the part over it") {
  Config c = parse_config(kSmall, "small.yaml", {"model.layers.0.out=1024", "train.batch_size=65536"});
  auto model = layers::build_model(c.model);
  const Plan plan = make_plan(c, *model);
  REQUIRE(plan.memory.size() == 1);
  const StageMemory& m = plan.memory[0];
  REQUIRE(m.activation_bytes > 0);
  c.pipeline.memory_limit = m.total();
  CHECK(error_of([&] { check_memory_limit(c, plan); }) == "no error");
  c.pipeline.memory_limit = 0;  // no limit
  CHECK(error_of([&] { check_memory_limit(c, plan); }) == "no error");
  c.pipeline.memory_limit = m.total() - 1;  // the activations do not fit
  const std::string a = error_of([&] { check_memory_limit(c, plan); });
  CAPTURE(a);
  CHECK(a.find("stage 0 would hold ") == 0);
  CHECK(a.find("over pipeline.memory_limit of ") != std::string::npos);
  CHECK(a.find("set pipeline.recompute: always, raise pipeline.micro_batches") != std::string::npos);
  c.pipeline.memory_limit = m.parameter_bytes - 1;  // nor do the weights with their state
  const std::string w = error_of([&] { check_memory_limit(c, plan); });
  CAPTURE(w);
  CHECK(w.find("alone are over it, whatever the micro-batches: use more pipeline.partitions") != std::string::npos);
  CHECK(w.find("raise pipeline.micro_batches") == std::string::npos);
}

namespace {
std::string write_text(const std::string& name, int repeats) {
  const std::string path = out_dir(name);
  std::ofstream f(path);
  for (int i = 0; i < repeats; ++i) f << "the quick brown fox jumps over the lazy dog. ";
  return path;
}

// A run of the config `yaml` with the overrides `sets`: its terminal output and report.json.
std::pair<std::string, nlohmann::json> train_and_report(const char* yaml, const std::vector<std::string>& sets) {
  std::ostringstream log;
  const TrainResult r = train(parse_config(yaml, "t.yaml", sets), log);
  std::ifstream f(r.report_path);
  return {log.str(), nlohmann::json::parse(f)};
}

// report.json's entry for `op` (attention, a convolution: m 0) has these operands, FLOPs
// a call, phases and layers, one call a micro-batch, its rate over its time; and the
// table's line says so where it shows the entry (the first 8).
void check_listed_op(const nlohmann::json& report, const std::string& log, const std::string& op,
                     const std::string& operands, double flops, const std::string& phases, const std::string& layers) {
  CAPTURE(op);
  REQUIRE(report.contains("gemms"));
  int found = 0;
  for (size_t i = 0; i < report["gemms"].size(); ++i) {
    const nlohmann::json& g = report["gemms"][i];
    if (g["op"] != op) continue;
    ++found;
    CHECK(g["m"] == 0);
    CHECK(g["operands"] == operands);
    CHECK(g["flops"].get<double>() == flops);
    CHECK(g["phases"] == phases);
    CHECK(g["layers"] == layers);
    CHECK(g["calls_per_micro_batch"] == 1);
    CHECK(g["dtype"] == "float32");
    CHECK(g["timed_calls"].get<int>() >= 1);
    REQUIRE(g["ms"].get<double>() > 0);
    CHECK(g["flops_per_second"].get<double>() == doctest::Approx(flops / (g["ms"].get<double>() / 1e3)));
    const bool shown = log.find("  " + op + " " + operands + ", float32 in, float32 out: stage 0, layers " + layers +
                                ", " + phases + ", 1 a micro-batch: ") != std::string::npos;
    CHECK(shown == (i < 8));
  }
  CHECK(found == 1);
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

TEST_CASE("attention is timed with the matrix products, its FLOPs those of its products") {
  // Batch 8, M = 2: micro-batches of 4 samples of 16 positions, width 32, two heads.
  // GPT's block: the exact attention on qkv (4, 16, 96), 4 B T^2 C = 4 x 4 x 16^2 x 32 =
  // 131072 FLOPs forward, twice that backward. The LLaMA block's fused attention on q
  // (4, 16, 32) and k, v (4, 16, 16) (one key/value head of 16): the same.
  const std::string text = write_text("fox_ops.txt", 60);
  const char* both = R"(model:
  input: [16]
  layers:
    - {type: embedding, vocab: 256, dim: 32}
    - {type: transformer_block, heads: 2}
    - {type: llama_block, heads: 2, kv_heads: 1, hidden: 64}
    - {type: linear, out: 256}
  loss: softmax_cross_entropy
data: {type: text, seq_len: 16, validation_fraction: 0.2}
pipeline: {partitions: 1, micro_batches: 2}
train: {steps: 2, batch_size: 8, eval_interval: 0}
)";
  const auto [log, j] = train_and_report(both, {"data.path=" + text, "output.dir=" + out_dir("attention_ops")});
  check_listed_op(j, log, "attention", "qkv 4x16x96, heads 2 -> probs 4x2x16x16, out 4x16x32", 131072, "F", "1");
  check_listed_op(j, log, "attention_backward",
                  "dout 4x16x32, qkv 4x16x96, probs 4x2x16x16, heads 2 -> dqkv 4x16x96", 262144, "B", "1");
  check_listed_op(j, log, "fused_attention",
                  "q 4x16x32, k 4x16x16, v 4x16x16, heads 2 -> out 4x16x32, stats 4x2x16", 131072, "F", "2");
  check_listed_op(j, log, "fused_attention_backward",
                  "dout 4x16x32, q 4x16x32, k 4x16x16, v 4x16x16, out 4x16x32, stats 4x2x16, heads 2 -> dq "
                  "4x16x32, dk 4x16x16, dv 4x16x16",
                  262144, "B", "2");
}

TEST_CASE("trace.ops times each op of a step: its calls are the stage's ops, counted apart, and the table says so") {
  // Two stages, M = 4, recompute except_last: stage 0 holds the embedding and one LLaMA
  // block, stage 1 the other block, the norm and the head. A block's fused attention runs
  // in each F (4) and each R (3: the last micro-batch keeps its activations), so 7 calls a
  // step on each stage, and its backward in each B (4); the optimizer one multi-tensor
  // AdamW a step.
  const std::string text = write_text("fox_optimes.txt", 60);
  const char* llama = R"(model:
  input: [16]
  layers:
    - {type: embedding, vocab: 256, dim: 32, positions: 0}
    - {type: llama_block, heads: 2, kv_heads: 1, hidden: 64}
    - {type: llama_block, heads: 2, kv_heads: 1, hidden: 64}
    - {type: rmsnorm}
    - {type: linear, out: 256, bias: false}
  loss: softmax_cross_entropy
data: {type: text, seq_len: 16, validation_fraction: 0.2}
pipeline: {partitions: 2, micro_batches: 4, recompute: except_last, balance: [2, 3]}
optimizer: {type: adamw, lr: 0.001}
train: {steps: 4, batch_size: 8, eval_interval: 0}
trace: {ops: true}
)";
  const auto [log, j] = train_and_report(llama, {"data.path=" + text, "output.dir=" + out_dir("op_times")});
  REQUIRE(j["stages"].size() == 2);
  for (int k = 0; k < 2; ++k) {
    CAPTURE(k);
    const nlohmann::json& st = j["stages"][k];
    REQUIRE(st.contains("op_times"));
    double calls = 0, ms = 0, last_ms = 1e300;
    std::map<std::string, double> by_op;
    for (const nlohmann::json& o : st["op_times"]) {
      const double c = o["calls_per_step"].get<double>(), t = o["ms_per_step"].get<double>();
      CHECK(c == std::floor(c));  // every timed step called the same ops
      CHECK(t >= 0);
      CHECK(t <= last_ms);  // the longest first
      last_ms = t;
      calls += c;
      ms += t;
      by_op[o["op"].get<std::string>()] = c;
    }
    // Every backend call of the step, as the executor's own count has them (OpLog's
    // per-thread counter, not the timer's spans).
    CHECK(calls == st["ops_per_step_all"].get<double>());
    CHECK(by_op["fused_attention"] == 7);
    CHECK(by_op["fused_attention_backward"] == 4);
    CHECK(by_op["adam_step_all"] == 1);
    CHECK(ms > 0);
    CHECK(ms <= j["step_ms"].get<double>());  // the ops ran inside the step
    // That each span runs from its op's start to its end is kernels:op_log_test's, from
    // below with ops of a known least length: a share of busy time here is the machine's.
    // The table shows the 6 longest and counts the rest.
    const std::string rest = ", and " + std::to_string(st["op_times"].size() - 6) + " more ops ";
    CHECK(st["op_times"].size() > 6);
    CHECK(log.find(rest) != std::string::npos);
    // The table's line for the stage, with the JSON's total.
    char head[96];
    std::snprintf(head, sizeof head, "  stage %d: %.3f ms in %.0f calls:", k, ms, calls);
    CHECK(log.find(head) != std::string::npos);
  }
  CHECK(log.find("Time by op (trace.ops:") != std::string::npos);
  // A run without trace.ops has none.
  const auto [plain_log, plain] = train_and_report(llama, {"data.path=" + text, "output.dir=" + out_dir("op_times_off"),
                                                           "trace.ops=false"});
  CHECK_FALSE(plain["stages"][0].contains("op_times"));
  CHECK(plain_log.find("Time by op") == std::string::npos);
}

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
  // The last step's line shows the end's validation, as the report has it.
  char last[64];
  std::snprintf(last, sizeof last, "val_loss %.4f", j["validation"][1]["loss"].get<double>());
  const std::string tail = log.str().substr(log.str().find("step    60/60"));
  CHECK(tail.substr(0, tail.find('\n')).find(last) != std::string::npos);
}

namespace {
// The tiny GPT on a text of its own, without pipeline.capture and with it (`sets` added):
// the losses and the validation equal bit for bit; both reports read back.
struct CapturePair {
  TrainResult plain, captured;
  std::string captured_log;
  nlohmann::json plain_report, captured_report;
};
CapturePair with_and_without_capture(const std::string& name, const std::vector<std::string>& sets) {
  const std::string text = write_text("fox_" + name + ".txt", 60);
  CapturePair out;
  for (bool capture : {false, true}) {
    std::ostringstream log;
    std::vector<std::string> all = {"data.path=" + text, "output.dir=" + out_dir(name + (capture ? "_cap" : "_nocap")),
                                    std::string("pipeline.capture=") + (capture ? "true" : "false")};
    all.insert(all.end(), sets.begin(), sets.end());
    const TrainResult r = train(parse_config(kTinyGpt, "tiny_gpt.yaml", all), log);
    std::ifstream f(r.report_path);
    (capture ? out.captured_report : out.plain_report) = nlohmann::json::parse(f);
    (capture ? out.captured : out.plain) = r;
    if (capture) out.captured_log = log.str();
  }
  REQUIRE(out.captured.losses.size() == out.plain.losses.size());
  for (size_t i = 0; i < out.plain.losses.size(); ++i) CHECK(out.captured.losses[i] == out.plain.losses[i]);
  CHECK(out.captured.eval_loss == out.plain.eval_loss);
  return out;
}
}  // namespace

TEST_CASE("pipeline.capture: a tiny GPT trains as without it, and the report says its steps were replays") {
  // One stage: the first step runs op by op, the second is captured, every later one is
  // a replay of it (on the CPU the recorded calls), with validation in between.
  const CapturePair p =
      with_and_without_capture("gpt", {"pipeline.partitions=1", "train.steps=12", "train.eval_interval=5"});
  const nlohmann::json& j = p.captured_report;
  const int64_t replayed = j["stages"][0]["captured_ops"].get<int64_t>();
  // What a replay runs: the instructions' ops, and the gradients' zeroing.
  CHECK(replayed == j["stages"][0]["ops_per_step"].get<int64_t>() + 1 + 5);  // + NORM's 1 and OPT's 4
  CHECK(p.captured_log.find("captured once and replayed") != std::string::npos);
  CHECK(p.captured_log.find(std::to_string(replayed) + " of them replayed") != std::string::npos);
  CHECK(p.plain_report["stages"][0]["captured_ops"].get<int64_t>() == 0);
}

TEST_CASE("pipeline.capture with two stages on one device: captured together, trains as without it") {
  const CapturePair p = with_and_without_capture(
      "gpt2", {"pipeline.partitions=2", "pipeline.devices=[cpu:0, cpu:0]", "train.steps=8", "train.eval_interval=4"});
  for (int k = 0; k < 2; ++k) {
    CAPTURE(k);
    // Each stage's share of the one capture: its instructions' ops and more (the zeroing,
    // NORM's and OPT's), all it calls in a step but writing its scalars and inputs.
    const int64_t replayed = p.captured_report["stages"][k]["captured_ops"].get<int64_t>();
    CHECK(replayed > p.captured_report["stages"][k]["ops_per_step"].get<int64_t>());
    CHECK(replayed < p.captured_report["stages"][k]["ops_per_step_all"].get<int64_t>());
    CHECK(p.captured_log.find(std::to_string(replayed) + " of them replayed") != std::string::npos);
    CHECK(p.plain_report["stages"][k]["captured_ops"].get<int64_t>() == 0);
  }
  CHECK(p.captured_log.find("captured once and replayed") != std::string::npos);
}

TEST_CASE("validation runs without dropout: dropout 0.5 or 0 on the same weights scores the same") {
  // One step at a learning rate far too small to move a float32 weight, so both runs
  // keep the initial weights (seeded per layer; dropout has none). Training draws
  // masks, so the step's losses differ; validation is in evaluation mode, so its
  // scores must not.
  const std::string text = write_text("fox_eval.txt", 60);
  auto run_with = [&](const std::string& p) {
    std::ostringstream log;
    const Config c = parse_config(kTinyGpt, "tiny_gpt.yaml",
                                  {"data.path=" + text, "output.dir=" + out_dir("eval_dropout_" + p), "train.steps=1",
                                   "optimizer.lr=1e-30", "optimizer.warmup_steps=0", "model.layers.1.dropout=" + p});
    return train(c, log);
  };
  const TrainResult with = run_with("0.5"), without = run_with("0");
  REQUIRE(with.losses.size() == 1);
  CHECK(std::abs(with.losses[0] - without.losses[0]) > 1e-3 * without.losses[0]);
  CHECK(with.eval_loss == doctest::Approx(without.eval_loss).epsilon(1e-6));
  CHECK(with.eval_accuracy == without.eval_accuracy);
}

TEST_CASE("validation's means are over the targets the loss counts, as PyTorch's ignore_index") {
  // Spaces (byte 32) are ignored: they add nothing to the loss sum, so the mean loss and
  // the accuracy divide by the other targets only (CrossEntropyLoss(ignore_index=32,
  // reduction='mean')), not by every target. 19 = 2 * 8 + 3 windows, a partial chunk too.
  const char* gpt = R"(model:
  input: [16]
  layers:
    - {type: embedding, vocab: 256, dim: 32}
    - {type: transformer_block, heads: 2}
    - {type: layernorm}
    - {type: linear, out: 256}
  loss: {type: softmax_cross_entropy, ignore_index: 32}
data: {type: text, seq_len: 16, validation_fraction: 0.2}
pipeline: {partitions: 2, micro_batches: 2}
optimizer: {type: sgd, lr: 1e-30}
train: {steps: 1, batch_size: 8, eval_samples: 19}
)";
  const std::string text = write_text("fox_ignore.txt", 60);
  const Config c = parse_config(gpt, "ignore.yaml", {"data.path=" + text, "output.dir=" + out_dir("eval_ignore")});
  const auto data = make_dataset(c);
  const std::vector<int32_t> targets = data->validation(0, 19).second.to_vector<int32_t>();
  const auto spaces = std::count(targets.begin(), targets.end(), 32);
  REQUIRE(spaces > 0);  // about one target in five
  REQUIRE(spaces < static_cast<int64_t>(targets.size()));
  std::ostringstream log;
  const TrainResult r = train(c, log);
  const auto [loss, accuracy] = direct_validation(c, 19, 32);
  CHECK(r.eval_loss == doctest::Approx(loss).epsilon(1e-5));
  CHECK(r.eval_accuracy == doctest::Approx(accuracy).epsilon(1e-12));

  // The untrained byte model gets next to nothing right; on the teacher task a quarter
  // of its guesses are, so its accuracy shows the denominator too. Class 0 is ignored.
  std::string small = kSmall;
  const std::string plain = "loss: {type: softmax_cross_entropy}";
  small.replace(small.find(plain), plain.size(), "loss: {type: softmax_cross_entropy, ignore_index: 0}");
  const Config t = parse_config(small, "small.yaml",
                                {"output.dir=" + out_dir("eval_ignore_teacher"), "train.steps=1", "optimizer.lr=1e-30",
                                 "train.eval_samples=67", "pipeline.partitions=2"});
  const std::vector<int32_t> classes = make_dataset(t)->validation(0, 67).second.to_vector<int32_t>();
  const auto zeros = std::count(classes.begin(), classes.end(), 0);
  REQUIRE(zeros > 0);
  REQUIRE(zeros < 67);
  const TrainResult rt = train(t, log);
  const auto [t_loss, t_accuracy] = direct_validation(t, 67, 0);
  REQUIRE(t_accuracy > 0);
  CHECK(rt.eval_loss == doctest::Approx(t_loss).epsilon(1e-5));
  CHECK(rt.eval_accuracy == doctest::Approx(t_accuracy).epsilon(1e-12));
  CHECK(rt.eval_accuracy * (67 - zeros) == doctest::Approx(std::round(rt.eval_accuracy * (67 - zeros))));
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
  // Per config: the balance it gets (the README's `./gpipe plan` shows the same), which
  // must be optimal for the layer-cost estimates (checked against every split), and
  // the memory estimate, whose parameter part is the stage's own parameters with their
  // gradients and the optimizer's state (AdamW two buffers, SGD with momentum one).
  struct Expect {
    const char* path;
    std::vector<int> balance;
    int state_buffers;
  };
  for (const Expect& e : {Expect{"configs/default.yaml", {3, 4}, 2}, Expect{"configs/mlp.yaml", {7, 8}, 1},
                          Expect{"configs/gpt.yaml", {5, 6}, 2}, Expect{"configs/resnet.yaml", {5, 6}, 1},
                          Expect{"configs/llama.yaml", {3, 4}, 2}}) {
    CAPTURE(e.path);
    const Config c = load_config(e.path);
    auto model = layers::build_model(c.model);
    const auto balance = plan_balance(c, *model);
    CHECK(balance == e.balance);
    REQUIRE(c.pipeline.partitions == 2);
    std::vector<std::optional<double>> overrides;
    for (const auto& l : c.model.layers) overrides.push_back(l.cost);
    const int64_t micro = (c.train.batch_size + c.pipeline.micro_batches - 1) / c.pipeline.micro_batches;
    const auto costs =
        partition::layer_costs(*model, micro, c.pipeline.recompute != RecomputeMode::kNever, overrides);
    double best = 1e300;
    for (int first = 1; first < model->size(); ++first) {
      best = std::min(best, partition::max_cell_cost(costs, {first, model->size() - first}));
    }
    CHECK(partition::max_cell_cost(costs, balance) == doctest::Approx(best).epsilon(1e-12));

    const auto mem = estimate_memory(make_plan(c, *model), *model, c.optimizer.optimizer);
    REQUIRE(mem.size() == 2);
    int first = 0;
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      int64_t param_bytes = 0;
      for (int i = first; i < first + balance[k]; ++i) {
        for (auto* p : model->layer(i).parameters()) param_bytes += static_cast<int64_t>(p->value.nbytes());
      }
      CHECK(mem[k].parameter_bytes == (2 + e.state_buffers) * param_bytes);
      // Checkpointed (except_last): at least the stage input of every micro-batch.
      const auto& in = model->layer(first).input_shape();
      const int64_t input_bytes = micro * shape_numel(in) * dtype_size(model->layer(first).input_dtype());
      CHECK(mem[k].activation_bytes > c.pipeline.micro_batches * input_bytes);
      first += balance[k];
    }
  }
}

namespace {
// 64 CIFAR-10 records whose image is a function of the label: learnable in a few steps.
std::string write_cifar(const std::string& name) {
  const std::string path = out_dir(name);
  std::ofstream f(path, std::ios::binary);
  for (int r = 0; r < 64; ++r) {
    f.put(static_cast<char>(r % 10));
    for (int p = 0; p < 3072; ++p) f.put(static_cast<char>((p * (r % 10 + 1)) % 251));
  }
  return path;
}
}  // namespace

TEST_CASE("a convolution is timed with the matrix products, its FLOPs those of its products") {
  // Micro-batches of 2 CIFAR images (3, 32, 32), 2 filters of 3 x 3 at stride 2, pad 1:
  // y (2, 2, 16, 16), 2 x 2 x 2 x 16 x 16 x 3 x 3 x 3 = 55296 FLOPs; its backward, the
  // model's first layer, computes dw only (a weight gradient: W): 55296 again.
  const std::string path = write_cifar("cifar_ops.bin");
  const char* conv = R"(model:
  input: [3, 32, 32]
  layers:
    - {type: conv2d, out: 2, kernel: 3, stride: 2, pad: 1, bias: false}
    - {type: flatten}
    - {type: linear, out: 10}
  loss: softmax_cross_entropy
data: {type: cifar10}
pipeline: {partitions: 1, micro_batches: 2}
train: {steps: 2, batch_size: 4, eval_interval: 0}
)";
  const auto [log, j] = train_and_report(conv, {"data.path=" + path, "output.dir=" + out_dir("conv_ops")});
  check_listed_op(j, log, "conv2d", "x 2x3x32x32, w 2x3x3x3, stride 2, pad 1 -> y 2x2x16x16", 55296, "F", "0");
  check_listed_op(j, log, "conv2d_backward",
                  "dy 2x2x16x16, x 2x3x32x32, w 2x3x3x3, stride 2, pad 1 -> dw 2x3x3x3", 55296, "W", "0");
}

TEST_CASE("the ResNet config trains on a CIFAR-10 binary file, as one stage would") {
  const std::string path = write_cifar("cifar_batch.bin");
  auto train_resnet = [&](const std::string& partitions) {
    std::ostringstream log;
    const Config c = load_config("configs/resnet.yaml",
                                 {"data.path=" + path, "train.steps=10", "train.batch_size=16", "train.eval_samples=8",
                                  "optimizer.warmup_steps=0", "optimizer.schedule=constant",
                                  "pipeline.partitions=" + partitions,
                                  "output.dir=" + out_dir("resnet" + partitions)});
    return train(c, log);
  };
  const TrainResult two = train_resnet("2");
  const TrainResult one = train_resnet("1");
  REQUIRE(two.losses.size() == 10);
  CHECK(two.balance == std::vector<int>{5, 6});
  // The same micro-batches (M = 4) through two stages or one: the same losses, batch
  // norm and all, to float32 rounding.
  for (size_t i = 0; i < 10; ++i) {
    CAPTURE(i);
    CHECK(two.losses[i] == doctest::Approx(one.losses[i]).epsilon(1e-5));
  }
  CHECK(two.eval_loss == doctest::Approx(one.eval_loss).epsilon(1e-5));
  // The ops each stage's layers called per step, measured, are those the plan counted on
  // shapes: F with BatchNorm's copies of its micro-batch statistics, R without them.
  std::ifstream f(two.report_path);
  const nlohmann::json j = nlohmann::json::parse(f);
  REQUIRE(j.contains("prediction"));
  for (size_t k = 0; k < 2; ++k) {
    CAPTURE(k);
    CHECK(j["stages"][k]["ops_per_step"].get<int64_t>() == j["prediction"]["stages"][k]["ops_per_step"].get<int64_t>());
  }
  // And it learns: the image determines the label.
  CHECK(two.losses.front() > 1.5);  // about ln 10 = 2.3 at the start
  CHECK((two.losses[7] + two.losses[8] + two.losses[9]) / 3 < 0.5 * (two.losses[0] + two.losses[1] + two.losses[2]) / 3);
}
