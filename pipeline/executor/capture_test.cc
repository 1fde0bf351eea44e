// pipeline.capture (ExecutorOptions::capture) on the CPU: a stage's training step
// captured once (the backend's calls, WideningBackend::begin_capture) and replayed at
// every later step trains exactly as the same run op by op: the same losses, norms and
// parameters, bit for bit, with dropout, clipping, loss scaling and recomputation; a step
// of other sizes, one without the optimizer, and evaluation in between run op by op and
// leave the capture valid; a step that cannot be captured runs op by op, as before.
// The GPU's capture (a CUDA graph) is checked the same way by tests/gpu_pipeline_test.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "pipeline/executor/executor.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

layers::ModelSpec mlp_spec() {
  layers::ModelSpec s;
  s.input = {6};
  s.dtype = DType::kF32;
  s.seed = 29;
  s.layers = {{"linear", {{"out", "8"}}, {}, ""},    {"gelu", {}, {}, ""},       {"dropout", {{"p", "0.25"}}, {}, ""},
              {"layernorm", {}, {}, ""},             {"linear", {{"out", "8"}}, {}, ""},
              {"relu", {}, {}, ""},                  {"linear", {{"out", "4"}}, {}, ""}};
  s.loss = {"softmax_cross_entropy", {}, {}, ""};
  return s;
}

// A small LLaMA: token embedding, two blocks with dropout, RMSNorm, an untied head.
layers::ModelSpec llama_spec(DType dtype) {
  layers::ModelSpec s;
  s.input = {6};
  s.input_dtype = DType::kI32;
  s.dtype = dtype;
  s.seed = 31;
  s.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}, {"positions", "0"}}, {}, ""}};
  for (int b = 0; b < 2; ++b) {
    s.layers.push_back({"llama_block", {{"heads", "2"}, {"kv_heads", "1"}, {"hidden", "12"}, {"dropout", "0.2"}}, {}, ""});
  }
  s.layers.push_back({"rmsnorm", {}, {}, ""});
  s.layers.push_back({"linear", {{"out", "16"}, {"bias", "false"}}, {}, ""});
  s.loss = {"softmax_cross_entropy", {}, {}, ""};
  return s;
}

// conv -> [BN] -> relu -> basic_block [with BN] -> pooling -> linear, on (3, 8, 8) images.
layers::ModelSpec conv_spec(bool batchnorm) {
  const std::string bn = batchnorm ? "true" : "false";
  layers::ModelSpec s;
  s.input = {3, 8, 8};
  s.dtype = DType::kF32;
  s.seed = 17;
  s.layers.push_back({"conv2d", {{"out", "4"}, {"kernel", "3"}, {"bias", batchnorm ? "false" : "true"}}, {}, ""});
  if (batchnorm) s.layers.push_back({"batchnorm2d", {}, {}, ""});
  s.layers.push_back({"relu", {}, {}, ""});
  s.layers.push_back({"basic_block", {{"out", "6"}, {"stride", "2"}, {"batchnorm", bn}}, {}, ""});
  s.layers.push_back({"global_avgpool", {}, {}, ""});
  s.layers.push_back({"flatten", {}, {}, ""});
  s.layers.push_back({"linear", {{"out", "4"}}, {}, ""});
  s.loss = {"softmax_cross_entropy", {}, {}, ""};
  return s;
}

struct Batch {
  Tensor x, y;
};

Batch batch(const layers::ModelSpec& spec, int64_t n, uint64_t seed) {
  if (spec.input.size() == 3) {
    return {gpipe::testing::random_tensor({n, 3, 8, 8}, DType::kF32, seed, -2, 2),
            gpipe::testing::random_labels(n, 4, seed + 1)};
  }
  if (spec.input_dtype == DType::kI32) {
    return {gpipe::testing::random_labels(n * 6, 16, seed).reshape({n, 6}),
            gpipe::testing::random_labels(n * 6, 16, seed + 1).reshape({n, 6})};
  }
  return {gpipe::testing::random_tensor({n, 6}, DType::kF32, seed, -2, 2), gpipe::testing::random_labels(n, 4, seed + 1)};
}

struct Run {
  std::vector<StepResult> steps;
  std::vector<EvalResult> evals;
  std::vector<std::vector<float>> params;  // after the run, as float32
};

// What happens between the training steps of a run.
struct Plan {
  int steps = 6;
  int other_size_at = -1;   // this step's batch is split into other micro-batch sizes
  int no_update_at = -1;    // this step does not apply the optimizer
  bool evaluate = false;    // an evaluation pass after every step
  int restore_at = -1;      // after this step, the stages' state saved and restored
  bool restore_first_only = false;  // ... only stage 0's
  std::string schedule = "gpipe";
  int chunks = 1;  // cells per stage (interleaved_1f1b)
  int micro_batches = 3;
  // Layers per cell; one stage unless given. Its stages all on cpu:0, which they share
  // (their steps captured together, Executor::CaptureGroup).
  std::vector<int> balance;
};

Run train(const layers::ModelSpec& spec, const layers::OptimizerConfig& opt, double clip, double loss_scale,
          RecomputeMode recompute, bool capture, const Plan& plan) {
  auto model = layers::build_model(spec);
  const std::vector<int> balance = plan.balance.empty() ? std::vector<int>{model->size()} : plan.balance;
  const int K = static_cast<int>(balance.size()) / plan.chunks;
  InProcessTransport transport(K);
  ExecutorOptions o;
  o.optimizer = opt;
  o.clip_grad_norm = clip;
  o.loss_scale = loss_scale;
  o.loss_scale_window = 2;  // the scale changes during the run
  o.capture = capture;
  ScheduleRequest request;
  request.name = plan.schedule;
  request.num_stages = K;
  request.num_chunks = plan.chunks;
  request.num_micro_batches = plan.micro_batches;
  request.mode = recompute;
  const Schedule s = make_schedule(request);
  Executor ex(*model, make_cells(balance, s, std::vector<Device>(static_cast<size_t>(K), Device::cpu(0))), s, transport,
              o);
  Run run;
  for (int t = 0; t < plan.steps; ++t) {
    ex.set_lr(0.01 * (1.0 + 0.1 * t));  // a learning rate of its own every step
    const int64_t n = t == plan.other_size_at ? 7 : 9;
    const Batch b = batch(spec, n, 100 + 3 * t);
    run.steps.push_back(ex.step(b.x, b.y, t != plan.no_update_at));
    if (plan.evaluate) {
      const Batch e = batch(spec, 5, 500 + t);
      run.evals.push_back(ex.evaluate(e.x, e.y, 2));
    }
    if (t == plan.restore_at) {
      for (int k = 0; k < (plan.restore_first_only ? 1 : K); ++k) {
        const StageState saved = ex.save_state(k);
        ex.restore_state(k, saved.model, saved.optimizer);
      }
    }
  }
  for (int i = 0; i < model->size(); ++i) {
    for (layers::Parameter* p : model->layer(i).parameters()) {
      Tensor host = Tensor::empty(p->value.shape(), DType::kF32, Device::cpu());
      backend_for(p->value.device()).cast(p->value, host);
      run.params.push_back(host.to_vector<float>());
    }
  }
  return run;
}

void check_equal(const Run& eager, const Run& captured) {
  REQUIRE(eager.steps.size() == captured.steps.size());
  for (size_t t = 0; t < eager.steps.size(); ++t) {
    CAPTURE(t);
    CHECK(captured.steps[t].loss == eager.steps[t].loss);  // bit for bit
    CHECK(captured.steps[t].grad_norm == eager.steps[t].grad_norm);
    CHECK(captured.steps[t].skipped == eager.steps[t].skipped);
    CHECK(captured.steps[t].loss_scale == eager.steps[t].loss_scale);
  }
  REQUIRE(eager.evals.size() == captured.evals.size());
  for (size_t t = 0; t < eager.evals.size(); ++t) {
    CHECK(captured.evals[t].loss_sum == eager.evals[t].loss_sum);
    CHECK(captured.evals[t].correct == eager.evals[t].correct);
  }
  REQUIRE(eager.params.size() == captured.params.size());
  for (size_t i = 0; i < eager.params.size(); ++i) {
    CAPTURE(i);
    CHECK(captured.params[i] == eager.params[i]);
  }
}

// The run without capture and with it, checked equal (check_equal).
std::pair<Run, Run> eager_and_captured(const layers::ModelSpec& spec, const layers::OptimizerConfig& opt, double clip,
                                       double loss_scale, RecomputeMode recompute, const Plan& plan) {
  Run eager = train(spec, opt, clip, loss_scale, recompute, false, plan);
  Run captured = train(spec, opt, clip, loss_scale, recompute, true, plan);
  check_equal(eager, captured);
  return {std::move(eager), std::move(captured)};
}

// Per step, the captured ops stage `k` replayed (StageTrace::captured_nodes; 0: op by op).
std::vector<int64_t> replays(const Run& r, size_t k = 0) {
  std::vector<int64_t> out;
  for (const StepResult& s : r.steps) out.push_back(s.stages.at(k).captured_nodes);
  return out;
}

// Stage k's replays against the same steps op by op: the first step runs op by op (it
// makes the optimizer's state), the second is captured and run as a replay, and so is
// every later one, each replaying at least `least` ops. A replay's trace is the capture's:
// each instruction's ops (the count the report shows) and the activations it held are the
// eager step's, but NORM's where `norm_ops` >= 0 (its ops then); its times this replay's own,
// from the events it recorded, within its step; the captured ops those of the instructions
// plus the zeroing of the gradients.
void check_replays(const Run& eager, const Run& captured, size_t k, int64_t least, int64_t norm_ops = -1) {
  CAPTURE(k);
  const std::vector<int64_t> r = replays(captured, k);
  CHECK(r[0] == 0);
  for (size_t t = 1; t < r.size(); ++t) {
    CHECK(r[t] > least);
    CHECK(r[t] == r[1]);
  }
  for (int64_t nodes : replays(eager, k)) CHECK(nodes == 0);
  for (size_t t = 1; t < r.size(); ++t) {
    const StageTrace& a = eager.steps[t].stages[k];
    const StageTrace& b = captured.steps[t].stages[k];
    REQUIRE(a.ops.size() == b.ops.size());
    int64_t instructions = 0;
    for (size_t i = 0; i < a.ops.size(); ++i) {
      CHECK(b.ops[i].op == a.ops[i].op);
      const bool norm = a.ops[i].op == Op::kGradientNorm && norm_ops >= 0;
      CHECK(b.ops[i].ops == (norm ? norm_ops : a.ops[i].ops));
      CHECK(b.ops[i].live_bytes == a.ops[i].live_bytes);
      CHECK(b.ops[i].start_ms >= 0);
      CHECK(b.ops[i].end_ms >= b.ops[i].start_ms);
      CHECK(b.ops[i].end_ms <= captured.steps[t].wall_ms);
      instructions += b.ops[i].ops;
    }
    CHECK(b.peak_activation_bytes == a.peak_activation_bytes);
    CHECK(r[t] == instructions + 1);  // and fill_all, the gradients' zeroing
  }
}

layers::OptimizerConfig adamw() {
  layers::OptimizerConfig o;
  o.type = "adamw";
  o.weight_decay = 0.1;
  return o;
}

// Steps of every kind around the captured ones: 9 steps, evaluation after each, step 3's
// batch in other micro-batch sizes, step 4 without the optimizer, and a restore after step 6.
Plan mixed_steps() {
  Plan plan;
  plan.other_size_at = 3;
  plan.no_update_at = 4;
  plan.evaluate = true;
  plan.steps = 9;
  plan.restore_at = 6;
  return plan;
}

// Replays per step of such a run: step 0 warms up, step 1 captures; the steps of other
// sizes (7 rows), without the optimizer and right after the restore run op by op; the
// others replay the capture.
void check_mixed_replays(const std::vector<int64_t>& r) {
  CHECK(r[0] == 0);
  CHECK(r[1] > 0);
  for (size_t t : {2, 5, 6, 8}) CHECK(r[t] == r[1]);
  for (size_t t : {3, 4, 7}) CHECK(r[t] == 0);
}

layers::OptimizerConfig sgd_momentum() {
  layers::OptimizerConfig o;
  o.type = "sgd";
  o.momentum = 0.9;
  return o;
}

// A run's schedule and stages (Plan's; one stage without a balance).
Plan run_as(const std::string& schedule, std::vector<int> balance = {}, int chunks = 1, int micro_batches = 3) {
  Plan p;
  p.schedule = schedule;
  p.balance = std::move(balance);
  p.chunks = chunks;
  p.micro_batches = micro_batches;
  return p;
}

struct CaptureCase {
  std::string name;
  layers::ModelSpec spec;
  layers::OptimizerConfig opt;
  double clip, loss_scale;
  RecomputeMode recompute;
  Plan plan = run_as("gpipe");
};

// A case run without capture and with it: equal bit for bit (eager_and_captured), and each
// stage's replays as check_replays says. Stages on one device capture together, and their
// NORM sums on the device (this stage's sum, then the K stages' parts added into its
// scalars), where op by op the host sums it.
void check_case(const CaptureCase& c) {
  CAPTURE(c.name);
  const auto [eager, captured] = eager_and_captured(c.spec, c.opt, c.clip, c.loss_scale, c.recompute, c.plan);
  const size_t K = c.plan.balance.empty() ? 1 : c.plan.balance.size() / static_cast<size_t>(c.plan.chunks);
  for (size_t k = 0; k < K; ++k) {
    check_replays(eager, captured, k, K == 1 ? 20 : 5, K == 1 ? -1 : 1 + static_cast<int64_t>(K));
  }
}

}  // namespace

TEST_CASE("a captured step replayed trains as the same steps op by op, bit for bit") {
  const std::vector<CaptureCase> cases = {
           {"mlp, adamw, clip, recompute except last", mlp_spec(), adamw(), 0.05, 0, RecomputeMode::kExceptLast},
           {"mlp, sgd with momentum, recompute always", mlp_spec(), sgd_momentum(), 0, 0, RecomputeMode::kAlways},
           {"llama float32, adamw, clip", llama_spec(DType::kF32), adamw(), 0.5, 0, RecomputeMode::kExceptLast},
           {"llama bfloat16, adamw, clip", llama_spec(DType::kBF16), adamw(), 0.5, 0, RecomputeMode::kNever},
           {"llama float16, adamw, loss scaling", llama_spec(DType::kF16), adamw(), 0, 1024,
            RecomputeMode::kExceptLast},
           // Weight gradients split off the backward (W instructions).
           {"llama float32, zero bubble", llama_spec(DType::kF32), adamw(), 0.5, 0, RecomputeMode::kNever,
            run_as("zero_bubble")},
  };
  for (const CaptureCase& c : cases) check_case(c);
}

TEST_CASE("steps of other sizes, without the optimizer, and evaluation run op by op and keep the capture") {
  // A checkpoint loaded after step 6: the next step runs op by op, the one after is captured again.
  for (const layers::ModelSpec& spec : {mlp_spec(), llama_spec(DType::kBF16)}) {
    const auto [eager, captured] = eager_and_captured(spec, adamw(), 0.05, 0, RecomputeMode::kExceptLast, mixed_steps());
    check_mixed_replays(replays(captured));
  }
}

TEST_CASE("a first step without the optimizer is no warm-up: the first with it is, and the next one is captured") {
  Plan plan;
  plan.steps = 4;
  plan.no_update_at = 0;
  const auto [eager, captured] =
      eager_and_captured(llama_spec(DType::kBF16), adamw(), 0.5, 0, RecomputeMode::kExceptLast, plan);
  const std::vector<int64_t> r = replays(captured);
  CHECK(r[0] == 0);
  CHECK(r[1] == 0);
  CHECK(r[2] > 0);
  CHECK(r[3] == r[2]);
}

namespace {
// An identity that reads a value back from its device in forward (as a layer whose work
// depends on its data would): its step cannot be captured.
class HostReading : public layers::Layer {
 public:
  HostReading(const Shape& shape, DType dtype) : Layer(shape, shape, dtype) {}
  std::string type() const override { return "test_host_reading"; }
  std::string describe() const override { return "test_host_reading"; }
  layers::LayerCost cost(int64_t) const override { return {}; }

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, layers::Context*, const layers::ForwardArgs&) override {
    sum_ += be.sum_squares(x);
    return x;
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const layers::Context&, bool need_dx) override {
    return need_dx ? dy : Tensor();
  }
  double sum_ = 0;
};

layers::ModelSpec host_reading_spec() {
  static const bool registered = [] {
    layers::register_layer("test_host_reading", [](layers::LayerArgs&, const Shape& input, DType dtype, uint64_t) {
      return std::unique_ptr<layers::Layer>(std::make_unique<HostReading>(input, dtype));
    });
    return true;
  }();
  (void)registered;
  layers::ModelSpec s = mlp_spec();
  s.layers.insert(s.layers.begin() + 1, {"test_host_reading", {}, {}, ""});
  return s;
}
}  // namespace

TEST_CASE("a step that reads the device back inside cannot be captured: it runs op by op, as before") {
  const Plan plan;
  const auto [eager, captured] =
      eager_and_captured(host_reading_spec(), adamw(), 0.05, 0, RecomputeMode::kExceptLast, plan);
  for (int64_t nodes : replays(captured)) CHECK(nodes == 0);
}

TEST_CASE("a model with batch norms is not captured (its statistics fold on the host); without, a conv net is") {
  // BatchNorm keeps each micro-batch's statistics and folds them into its running ones on
  // the host after the step: a replay would skip that. Such a stage never tries to capture,
  // and trains and evaluates (with the running statistics) as without capture.
  layers::OptimizerConfig sgd;
  sgd.type = "sgd";
  sgd.momentum = 0.9;
  Plan plan;
  plan.evaluate = true;
  for (bool batchnorm : {true, false}) {
    CAPTURE(batchnorm);
    const auto [eager, captured] = eager_and_captured(conv_spec(batchnorm), sgd, 0, 0, RecomputeMode::kExceptLast, plan);
    const std::vector<int64_t> r = replays(captured);
    for (size_t t = 0; t < r.size(); ++t) CHECK((r[t] > 0) == (!batchnorm && t > 0));
  }
}

TEST_CASE("capture needs one stage, or stages one process runs on one device, without replicas or a tensor group") {
  auto model = layers::build_model(mlp_spec());
  InProcessTransport transport(2);
  ExecutorOptions o;
  o.capture = true;
  const Schedule s = make_schedule("gpipe", 2, 2, RecomputeMode::kExceptLast);
  auto refused = [&](const std::vector<Device>& devices, const std::string& why) {
    CAPTURE(why);
    try {
      Executor ex(*model, make_cells({3, model->size() - 3}, s, devices), s, transport, o);
      FAIL("a two-stage pipeline was accepted for capture");
    } catch (const UserError& e) {
      const std::string what = e.what();
      CHECK(what.find("pipeline.capture") != std::string::npos);
      CHECK(what.find("2 stages " + why) != std::string::npos);
      CHECK(what.find("pipeline.capture: false") != std::string::npos);
      CHECK(what.find("pipeline.devices") != std::string::npos);
    }
  };
  refused(gpipe::testing::cpu_devices(2), "on several devices");
  o.local_stage = 1;  // this process runs stage 1 only
  refused({Device::cpu(0), Device::cpu(0)}, "in several processes");
}

TEST_CASE("stages sharing one device capture their step together and train as op by op, bit for bit") {
  const std::vector<CaptureCase> cases = {
           {"mlp, K 2, adamw, clip", mlp_spec(), adamw(), 0.05, 0, RecomputeMode::kExceptLast, run_as("gpipe", {3, 4})},
           {"mlp, K 3, sgd, 1f1b, recompute always", mlp_spec(), sgd_momentum(), 0, 0, RecomputeMode::kAlways,
            run_as("1f1b", {2, 2, 3})},
           {"llama float32, K 2, 1f1b, clip", llama_spec(DType::kF32), adamw(), 0.5, 0, RecomputeMode::kExceptLast,
            run_as("1f1b", {2, 3})},
           {"llama bfloat16, K 3, clip", llama_spec(DType::kBF16), adamw(), 0.5, 0, RecomputeMode::kNever,
            run_as("gpipe", {1, 2, 2})},
           {"llama float16, K 2, loss scaling", llama_spec(DType::kF16), adamw(), 0, 1024, RecomputeMode::kExceptLast,
            run_as("gpipe", {2, 3})},
           {"llama float32, K 2, zero bubble", llama_spec(DType::kF32), adamw(), 0.5, 0, RecomputeMode::kNever,
            run_as("zero_bubble", {2, 3})},
           {"llama float32, K 2, interleaved", llama_spec(DType::kF32), adamw(), 0.5, 0, RecomputeMode::kExceptLast,
            run_as("interleaved_1f1b", {1, 1, 1, 2}, 2, 4)},
  };
  for (const CaptureCase& c : cases) check_case(c);
}

TEST_CASE("stages captured together: steps of other sizes, without the optimizer, evaluation and a restore") {
  Plan plan = mixed_steps();  // every stage restored: all run the next step op by op and capture the one after
  plan.balance = {2, 3};
  for (bool first_only : {false, true}) {
    // Stage 0 alone restored: the stages still capture again together (a stage replaying
    // while another runs op by op would wait for it at the replay).
    CAPTURE(first_only);
    plan.restore_first_only = first_only;
    const auto [eager, captured] =
        eager_and_captured(llama_spec(DType::kBF16), adamw(), 0.05, 0, RecomputeMode::kExceptLast, plan);
    for (size_t k = 0; k < 2; ++k) {
      CAPTURE(k);
      check_mixed_replays(replays(captured, k));
    }
  }
}

TEST_CASE("a stage whose part of the step cannot be captured stops the others: all run op by op, as before") {
  // The layer reading the device back on stage 1 (balance 1, 3, 4) or on stage 0, which
  // begins and ends the capture (2, 6): it fails there, inside its F, while the other
  // stages wait for it or run their own part; all stop, and the step runs again op by op.
  for (const std::vector<int>& balance : {std::vector<int>{1, 3, 4}, std::vector<int>{2, 6}}) {
    CAPTURE(balance.size());
    Plan plan;
    plan.balance = balance;
    const auto [eager, captured] = eager_and_captured(host_reading_spec(), adamw(), 0.05, 0, RecomputeMode::kExceptLast, plan);
    for (size_t k = 0; k < balance.size(); ++k) {
      for (int64_t nodes : replays(captured, k)) CHECK(nodes == 0);
    }
  }
}

TEST_CASE("a batch norm on one stage keeps every stage of the device op by op") {
  layers::OptimizerConfig sgd;
  sgd.type = "sgd";
  Plan plan;
  plan.balance = {2, 5};  // the batch norm on stage 0
  const auto [eager, captured] = eager_and_captured(conv_spec(true), sgd, 0, 0, RecomputeMode::kExceptLast, plan);
  for (size_t k = 0; k < 2; ++k) {
    for (int64_t nodes : replays(captured, k)) CHECK(nodes == 0);
  }
}

TEST_CASE("a bad label in a replay of stages captured together fails the step with the CPU's message") {
  auto model = layers::build_model(mlp_spec());
  InProcessTransport transport(2);
  ExecutorOptions o;
  o.optimizer.type = "adamw";
  o.capture = true;
  const Schedule s = make_schedule("1f1b", 2, 3, RecomputeMode::kExceptLast);
  Executor ex(*model, make_cells({3, 4}, s, {Device::cpu(0), Device::cpu(0)}), s, transport, o);
  for (int t = 0; t < 3; ++t) {
    const Batch b = batch(mlp_spec(), 9, 700 + t);
    const StepResult r = ex.step(b.x, b.y);
    CHECK((r.stages[1].captured_nodes > 0) == (t > 0));
  }
  Batch bad = batch(mlp_spec(), 9, 800);
  bad.y.data<int32_t>()[5] = 4;  // 4 classes: 0..3
  // Stage 1's loss found it, as op by op: the replay ran on stage 0's thread, and names stage 1.
  try {
    ex.step(bad.x, bad.y);
    FAIL("a bad label was taken");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("stage 1 (layers 3..6 on cpu:0) failed: label 4") == 0);
    CHECK(std::string(e.what()).find("label 4") != std::string::npos);
  }
  const Batch good = batch(mlp_spec(), 9, 801);
  CHECK_THROWS_WITH(ex.step(good.x, good.y), doctest::Contains("earlier failure"));
  // The step that captures runs the replay first: its bad label is placed the same way.
  auto fresh = layers::build_model(mlp_spec());
  InProcessTransport t2(2);
  Executor ex2(*fresh, make_cells({3, 4}, s, {Device::cpu(0), Device::cpu(0)}), s, t2, o);
  const Batch first = batch(mlp_spec(), 9, 810);
  ex2.step(first.x, first.y);  // op by op; the next is captured, then replayed
  try {
    ex2.step(bad.x, bad.y);
    FAIL("a bad label was taken");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("stage 1 (layers 3..6 on cpu:0) failed: label 4") == 0);
    CHECK(std::string(e.what()).find("label 4") != std::string::npos);
  }
}

TEST_CASE("a bad label in a replayed step fails the step with the CPU's message; the run then stops") {
  auto model = layers::build_model(mlp_spec());
  InProcessTransport transport(1);
  ExecutorOptions o;
  o.optimizer.type = "adamw";
  o.capture = true;
  const Schedule s = make_schedule("gpipe", 1, 3, RecomputeMode::kExceptLast);
  Executor ex(*model, make_cells({model->size()}, s, gpipe::testing::cpu_devices(1)), s, transport, o);
  for (int t = 0; t < 3; ++t) {
    const Batch b = batch(mlp_spec(), 9, 700 + t);
    const StepResult r = ex.step(b.x, b.y);
    CHECK((r.stages[0].captured_nodes > 0) == (t > 0));
  }
  Batch bad = batch(mlp_spec(), 9, 800);
  bad.y.data<int32_t>()[5] = 4;  // 4 classes: 0..3
  CHECK_THROWS_WITH_AS(ex.step(bad.x, bad.y), doctest::Contains("label 4"), UserError);
  const Batch good = batch(mlp_spec(), 9, 801);
  CHECK_THROWS_WITH(ex.step(good.x, good.y), doctest::Contains("earlier failure"));
}
