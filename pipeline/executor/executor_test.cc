// The defining test: the pipelined model's loss and every parameter gradient equal the
// unpartitioned model's on the same batch, for K in 1..4, M in {1, 2, 4, 8} and every
// recompute mode. Also: the optimizer step, failure propagation, memory accounting.
#include <doctest/doctest.h>

#include <cmath>
#include <thread>

#include "layers/embedding.h"
#include "layers/linear.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "runtime/allocator.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::to_doubles;

namespace {

using gpipe::testing::cpu_devices;

layers::ModelSpec mlp_spec(DType dtype) {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.dtype = dtype;
  spec.seed = 5;
  spec.layers = {{"linear", {{"out", "8"}}, {}, ""}, {"relu", {}, {}, ""}, {"linear", {{"out", "8"}}, {}, ""},
                 {"gelu", {}, {}, ""},              {"linear", {{"out", "7"}}, {}, ""}, {"relu", {}, {}, ""},
                 {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

std::vector<int> even_balance(int layers, int k) {
  return partition::balance_by_cost(std::vector<double>(layers, 1.0), k);
}

}  // namespace

TEST_CASE("pipelined loss and gradients equal the unpartitioned model's") {
  const int64_t N = 13;  // not divisible by most M: uneven micro-batches
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF64, 21);
  Tensor y = gpipe::testing::random_labels(N, 4, 22);

  auto reference = layers::build_model(mlp_spec(DType::kF64));
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
  auto ref_params = reference->named_parameters();

  for (int K = 1; K <= 4; ++K) {
    for (int M : {1, 2, 4, 8}) {
      for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever}) {
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        auto model = layers::build_model(mlp_spec(DType::kF64));
        InProcessTransport transport(K);
        Executor ex(*model, make_stages(even_balance(model->size(), K), cpu_devices(K)),
                    gpipe_schedule(K, M, mode), transport, {});
        const StepResult r = ex.step(x, y, /*apply_optimizer=*/false);
        CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
        auto params = model->named_parameters();
        REQUIRE(params.size() == ref_params.size());
        for (size_t i = 0; i < params.size(); ++i) {
          INFO("gradient of ", params[i].first);
          GPIPE_EXPECT_CLOSE(params[i].second->grad, ref_params[i].second->grad, 1e-10, 1e-12);
        }
        CHECK(transport.pending() == 0);
        CHECK(r.stages.size() == static_cast<size_t>(K));
      }
    }
  }
}

TEST_CASE("float32 pipelines agree with the reference to float32 rounding") {
  const int64_t N = 32;
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF32, 1);
  Tensor y = gpipe::testing::random_labels(N, 4, 2);
  auto reference = layers::build_model(mlp_spec(DType::kF32));
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
  auto model = layers::build_model(mlp_spec(DType::kF32));
  InProcessTransport transport(3);
  Executor ex(*model, make_stages({3, 2, 2}, cpu_devices(3)), gpipe_schedule(3, 4, RecomputeMode::kExceptLast),
              transport, {});
  const StepResult r = ex.step(x, y, false);
  CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-5));
  auto a = model->named_parameters(), b = reference->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) GPIPE_EXPECT_CLOSE(a[i].second->grad, b[i].second->grad, 1e-4, 1e-6);
}

TEST_CASE("one pipelined step equals one SGD step on the whole batch") {
  const int64_t N = 10;
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF64, 3);
  Tensor y = gpipe::testing::random_labels(N, 4, 4);
  SgdParams sgd;
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  sgd.weight_decay = 0.01;

  auto reference = layers::build_model(mlp_spec(DType::kF64));
  std::vector<layers::Parameter*> ref_params;
  for (auto& np : reference->named_parameters()) ref_params.push_back(np.second);
  layers::Sgd ref_opt(ref_params, sgd);

  auto model = layers::build_model(mlp_spec(DType::kF64));
  InProcessTransport transport(2);
  ExecutorOptions opts;
  opts.optimizer.type = "sgd";
  opts.optimizer.lr = sgd.lr;
  opts.optimizer.momentum = sgd.momentum;
  opts.optimizer.weight_decay = sgd.weight_decay;
  Executor ex(*model, make_stages({4, 3}, cpu_devices(2)), gpipe_schedule(2, 4, RecomputeMode::kAlways), transport,
              opts);
  for (int step = 0; step < 3; ++step) {
    reference->zero_grad();
    const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
    ref_opt.step();
    const StepResult r = ex.step(x, y);
    CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
  }
  auto a = model->named_parameters(), b = reference->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) GPIPE_EXPECT_CLOSE(a[i].second->value, b[i].second->value, 1e-12, 1e-12);
}

// The gradients are cleared at each stage's first receive (or first backward), inside
// the wait, not after the optimizer step: after an applied step they still hold what
// the optimizer applied, and the next step's are its own, for a stage that waits
// first for an activation (GPipe's last), for a gradient (GPipe's first, 1F1B's) and
// one that never receives (K = 1).
TEST_CASE("after an applied step the gradients are that step's; the next step starts from zero") {
  const int64_t N = 10;
  SgdParams sgd;
  sgd.lr = 0.3;
  sgd.momentum = 0.9;
  for (int K : {1, 2, 3}) {
    for (bool one_f_one_b : {false, true}) {
      CAPTURE(K);
      CAPTURE(one_f_one_b);
      auto reference = layers::build_model(mlp_spec(DType::kF64));
      std::vector<layers::Parameter*> ref_params;
      for (auto& np : reference->named_parameters()) ref_params.push_back(np.second);
      layers::Sgd ref_opt(ref_params, sgd);
      auto model = layers::build_model(mlp_spec(DType::kF64));
      InProcessTransport transport(K);
      ExecutorOptions opts;
      opts.optimizer.type = "sgd";
      opts.optimizer.lr = sgd.lr;
      opts.optimizer.momentum = sgd.momentum;
      Executor ex(*model, make_stages(even_balance(model->size(), K), cpu_devices(K)),
                  one_f_one_b ? one_f_one_b_schedule(K, 4, RecomputeMode::kNever)
                              : gpipe_schedule(K, 4, RecomputeMode::kNever),
                  transport, opts);
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF64, 40 + step);
        Tensor y = gpipe::testing::random_labels(N, 4, 50 + step);
        reference->zero_grad();
        reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
        ex.step(x, y);  // applies the optimizer
        auto a = model->named_parameters(), b = reference->named_parameters();
        for (size_t i = 0; i < a.size(); ++i) {
          INFO("gradient of ", a[i].first);
          GPIPE_EXPECT_CLOSE(a[i].second->grad, b[i].second->grad, 1e-11, 1e-12);
        }
        ref_opt.step();
      }
    }
  }
}

TEST_CASE("rematerialization lowers the activation memory a stage holds") {
  const int64_t N = 64;
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF32, 3);
  Tensor y = gpipe::testing::random_labels(N, 4, 4);
  int64_t peak[2];
  int i = 0;
  for (auto mode : {RecomputeMode::kNever, RecomputeMode::kAlways}) {
    auto model = layers::build_model(mlp_spec(DType::kF32));
    InProcessTransport transport(2);
    Executor ex(*model, make_stages({4, 3}, cpu_devices(2)), gpipe_schedule(2, 8, mode), transport, {});
    peak[i++] = ex.step(x, y, false).stages[0].peak_activation_bytes;
  }
  CHECK(peak[0] > 0);
  CHECK(peak[1] < peak[0]);
}

// StageTrace::device_peak_bytes: the allocator of the stage's device at its most from the
// first step on. Devices cpu:6 and cpu:7 are this test's alone (the other tests of this file
// use cpu:0 to cpu:3), so what the count must hold is known: the weights, gradients and
// optimizer state of the stages on the device, held throughout. (Activations are not all
// their stage's device's: CPU stages hand messages over without a copy, so stage 2's inputs
// count on cpu:6, where stage 1 made them, and stage 0's on cpu:0, the host's batch.)
TEST_CASE("a stage's device peak counts its device's tensors from the first step on") {
  const Device a = Device::cpu(6), b = Device::cpu(7);
  {
    // Start-up's work on a device (a probe, a checkpoint loaded) is not the run's.
    Tensor big = Tensor::empty({int64_t{8} << 20}, DType::kF32, a);  // 32 MiB, freed before step 1
    backend_for(a).fill(big, 1.0);
  }
  REQUIRE(allocator_for(a).stats().peak >= int64_t{32} << 20);
  auto model = layers::build_model(mlp_spec(DType::kF32));
  InProcessTransport transport(3);
  ExecutorOptions opts;
  opts.optimizer.type = "adamw";  // two state slots a parameter, made in the first step
  // Stages 0 and 1 take turns on cpu:6, stage 2 has cpu:7 (layers 0-2, 3-4, 5-6).
  Executor ex(*model, make_stages({3, 2, 2}, {a, a, b}), gpipe_schedule(3, 4, RecomputeMode::kNever), transport,
              opts);
  Tensor x = gpipe::testing::random_tensor({16, 6}, DType::kF32, 1);
  Tensor y = gpipe::testing::random_labels(16, 4, 2);
  ex.step(x, y);
  const StepResult r = ex.step(x, y);  // the optimizer's state held throughout
  // Floats of each stage's parameters: linear 6->8 and 8->8; 8->7; 7->4, with biases.
  const int64_t floats[3] = {6 * 8 + 8 + 8 * 8 + 8, 8 * 7 + 7, 7 * 4 + 4};
  auto held = [&](int k) { return 4 * floats[k] * 2 + r.stages[k].optimizer_bytes; };  // weights, gradients, state
  for (int k = 0; k < 3; ++k) {
    CAPTURE(k);
    CHECK(r.stages[k].optimizer_bytes == 4 * floats[k] * 2);  // AdamW: exp_avg and exp_avg_sq
    CHECK(r.stages[k].peak_activation_bytes > 0);
    CHECK(r.stages[k].device_peak_bytes < int64_t{32} << 20);  // the freed start-up tensor is not counted
  }
  // One device, one count: both stages on cpu:6 read its allocator's.
  CHECK(r.stages[0].device_peak_bytes == r.stages[1].device_peak_bytes);
  CHECK(r.stages[0].device_peak_bytes == allocator_for(a).stats().peak);
  CHECK(r.stages[2].device_peak_bytes == allocator_for(b).stats().peak);
  // Every weight, gradient and state of the device's stages is held throughout, with
  // activations beside them.
  CHECK(r.stages[0].device_peak_bytes > held(0) + held(1));
  CHECK(r.stages[2].device_peak_bytes > held(2));
  // The model is tiny: everything on cpu:7 (one stage, its inputs and activations of 16
  // rows) is far below a megabyte.
  CHECK(r.stages[2].device_peak_bytes < int64_t{1} << 20);
}

TEST_CASE("every instruction is timed, in order, within the step") {
  auto model = layers::build_model(mlp_spec(DType::kF32));
  InProcessTransport transport(2);
  Executor ex(*model, make_stages({4, 3}, cpu_devices(2)), gpipe_schedule(2, 4, RecomputeMode::kExceptLast),
              transport, {});
  Tensor x = gpipe::testing::random_tensor({16, 6}, DType::kF32, 1);
  Tensor y = gpipe::testing::random_labels(16, 4, 2);
  const StepResult r = ex.step(x, y);
  for (int k = 0; k < 2; ++k) {
    CAPTURE(k);
    const auto& ops = r.stages[k].ops;
    REQUIRE(ops.size() == ex.schedule().stages[k].size());
    for (size_t j = 0; j < ops.size(); ++j) {
      const Instruction& ins = ex.schedule().stages[k][j];
      CAPTURE(j);
      CHECK(ops[j].op == ins.op);
      CHECK(ops[j].micro_batch == ins.micro_batch);
      CHECK(ops[j].chunk == ins.chunk);
      CHECK(ops[j].start_ms <= ops[j].end_ms);
      if (j > 0) CHECK(ops[j - 1].end_ms <= ops[j].start_ms);
      CHECK(ops[j].end_ms <= r.wall_ms);
      // A message names the other stage and its size: 4 rows (16 / M) of layer 3's 8
      // float32 outputs forward, of their gradient backward.
      CHECK(ops[j].peer == (is_communication(ins.op) ? 1 - k : -1));
      CHECK(ops[j].bytes == (is_communication(ins.op) ? 4 * 8 * 4 : 0));
    }
    // Stages of other processes send their trace as numbers: it comes back whole.
    StageTrace sent = r.stages[k];
    sent.optimizer_bytes = 12345 + k;  // whatever the optimizer holds, it travels
    sent.ops.front().group_ms = 0.25 + k;  // a tensor group's sums inside a compute op too
    sent.other_ops = 7 + k;
    sent.captured_nodes = 300 + k;  // a replayed step's, as pipeline.capture sets it
    sent.device_peak_bytes = (int64_t{7} << 40) + k;  // a large device's, exactly (below 2^53)
    sent.op_times = {{"matmul_weight", 12 + k, 3.5}, {"", 1, 0.0}, {"fused_attention_backward", 2, 0.125 + k}};  // trace.ops
    const StageTrace back = decode_trace(encode_trace(sent), k);
    REQUIRE(back.op_times.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      CHECK(back.op_times[i].op == sent.op_times[i].op);
      CHECK(back.op_times[i].calls == sent.op_times[i].calls);
      CHECK(back.op_times[i].ms == sent.op_times[i].ms);
    }
    CHECK(decode_trace(encode_trace(r.stages[k]), k).op_times.empty());  // none timed: none back
    // A name's length that is not a count within the message is refused, not read.
    std::vector<double> bad = encode_trace(sent);
    for (double len : {-1.0, 1e30, 2.5, std::nan("")}) {
      bad[7 + 2] = len;  // the first op time's name length, after the header (7) and its calls and ms
      CHECK_THROWS_WITH_AS(decode_trace(bad, k), doctest::Contains("malformed timings from stage"), Error);
    }
    CHECK(back.peak_activation_bytes == r.stages[k].peak_activation_bytes);
    CHECK(back.optimizer_bytes == 12345 + k);
    CHECK(back.other_ops == 7 + k);
    CHECK(back.captured_nodes == 300 + k);
    CHECK(back.device_peak_bytes == (int64_t{7} << 40) + k);
    CHECK(back.start_ms == r.stages[k].start_ms);
    REQUIRE(back.ops.size() == ops.size());
    for (size_t j = 0; j < ops.size(); ++j) {
      CAPTURE(j);
      CHECK(back.ops[j].op == ops[j].op);
      CHECK(back.ops[j].micro_batch == ops[j].micro_batch);
      CHECK(back.ops[j].start_ms == ops[j].start_ms);
      CHECK(back.ops[j].end_ms == ops[j].end_ms);
      CHECK(back.ops[j].chunk == ops[j].chunk);
      CHECK(back.ops[j].bytes == ops[j].bytes);
      CHECK(back.ops[j].peer == ops[j].peer);
      CHECK(back.ops[j].live_bytes == ops[j].live_bytes);
      CHECK(back.ops[j].group_ms == (j == 0 ? 0.25 + k : 0.0));
      CHECK(back.ops[j].ops == ops[j].ops);
    }
  }
}

namespace {
// A layer that fails in forward, to test failure propagation.
class Exploding : public layers::Layer {
 public:
  explicit Exploding(const Shape& s) : Layer(s, s, DType::kF32) {}
  std::string type() const override { return "exploding"; }
  std::string describe() const override { return "exploding"; }
  layers::LayerCost cost(int64_t) const override { return {}; }

 private:
  Tensor forward_impl(Backend&, const Tensor&, layers::Context*, const layers::ForwardArgs&) override {
    throw UserError("exploding layer went off");
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const layers::Context&, bool) override { return dy; }
};
}  // namespace

TEST_CASE("a failure inside one stage stops every stage with that stage's message") {
  for (int bad_stage : {0, 1, 2}) {
    CAPTURE(bad_stage);
    layers::Sequential model({6}, DType::kF32);
    model.emplace<layers::Linear>(layers::LinearOptions(6, 6));
    if (bad_stage == 0) model.emplace<Exploding>(Shape{6});
    model.emplace<layers::Linear>(layers::LinearOptions(6, 6));
    if (bad_stage == 1) model.emplace<Exploding>(Shape{6});
    model.emplace<layers::Linear>(layers::LinearOptions(6, 4));
    if (bad_stage == 2) model.emplace<Exploding>(Shape{4});
    model.set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(4));
    std::vector<int> balance = {1, 1, 1};
    balance[bad_stage] = 2;
    InProcessTransport transport(3);
    Executor ex(model, make_stages(balance, cpu_devices(3)), gpipe_schedule(3, 4, RecomputeMode::kNever), transport,
                {});
    Tensor x = gpipe::testing::random_tensor({8, 6}, DType::kF32, 1);
    Tensor y = gpipe::testing::random_labels(8, 4, 2);
    const std::string expected = "stage " + std::to_string(bad_stage) + " (layers";
    try {
      ex.step(x, y);
      FAIL("no error");
    } catch (const UserError& e) {
      CHECK(std::string(e.what()).find(expected) != std::string::npos);
      CHECK(std::string(e.what()).find("exploding layer went off") != std::string::npos);
    }
    CHECK_THROWS_WITH(ex.step(x, y), doctest::Contains("earlier failure"));
  }
}

TEST_CASE("micro-batch sizes") {
  CHECK(split_sizes(10, 4) == std::vector<int64_t>{3, 3, 2, 2});
  CHECK(split_sizes(8, 8) == std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 1});
  CHECK_THROWS_WITH_AS(split_sizes(3, 4), doctest::Contains("raise train.batch_size"), UserError);
}

TEST_CASE("a step runs the plan's micro-batch sizes, and refuses a batch of another size") {
  const int64_t N = 13;
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF64, 21);
  Tensor y = gpipe::testing::random_labels(N, 4, 22);
  auto reference = layers::build_model(mlp_spec(DType::kF64));
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
  auto model = layers::build_model(mlp_spec(DType::kF64));
  InProcessTransport transport(2);
  ExecutorOptions opts;
  opts.micro_batch_sizes = {1, 5, 7};  // not split_sizes(13, 3) = {5, 4, 4}
  Executor ex(*model, make_stages(even_balance(model->size(), 2), cpu_devices(2)),
              gpipe_schedule(2, 3, RecomputeMode::kNever), transport, opts);
  const StepResult r = ex.step(x, y, /*apply_optimizer=*/false);
  CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
  // Stage 0 sends each micro-batch's activation: rows x the boundary's 8 float64 values.
  std::vector<int64_t> sent;
  for (const TimedOp& op : r.stages[0].ops) {
    if (op.op == Op::kSendActivation) sent.push_back(op.bytes);
  }
  CHECK(sent == std::vector<int64_t>{1 * 8 * 8, 5 * 8 * 8, 7 * 8 * 8});
  CHECK_THROWS_WITH_AS(ex.step(x.narrow_rows(0, 12), y.narrow_rows(0, 12), false),
                       "step() got a batch of 12 rows; the plan's 3 micro-batches take 13 "
                       "(train.batch_size / pipeline.replicas)",
                       UserError);
  auto other = layers::build_model(mlp_spec(DType::kF64));
  InProcessTransport transport2(2);
  ExecutorOptions two;
  two.micro_batch_sizes = {6, 7};
  CHECK_THROWS_WITH_AS(Executor(*other, make_stages(even_balance(other->size(), 2), cpu_devices(2)),
                                gpipe_schedule(2, 3, RecomputeMode::kNever), transport2, two),
                       "the plan has 2 micro-batch sizes for a 3-micro-batch schedule", Error);
}

TEST_CASE("gradient clipping uses the global norm over all stages") {
  const int64_t N = 12;
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF64, 8, -3, 3);
  Tensor y = gpipe::testing::random_labels(N, 4, 9);
  const double max_norm = 0.05;  // small enough to clip

  auto reference = layers::build_model(mlp_spec(DType::kF64));
  reference->zero_grad();
  reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
  double sq = 0;
  for (auto& np : reference->named_parameters()) {
    for (double g : to_doubles(np.second->grad)) sq += g * g;
  }
  const double norm = std::sqrt(sq);
  REQUIRE(norm > max_norm);
  std::vector<layers::Parameter*> ref_params;
  for (auto& np : reference->named_parameters()) {
    backend_for(Device::cpu()).scale(np.second->grad, max_norm / (norm + 1e-6));
    ref_params.push_back(np.second);
  }
  SgdParams sgd;
  sgd.lr = 0.1;
  layers::Sgd(ref_params, sgd).step();

  auto model = layers::build_model(mlp_spec(DType::kF64));
  InProcessTransport transport(3);
  ExecutorOptions opts;
  opts.optimizer.lr = 0.1;
  opts.clip_grad_norm = max_norm;
  Executor ex(*model, make_stages({3, 2, 2}, cpu_devices(3)), gpipe_schedule(3, 4, RecomputeMode::kExceptLast),
              transport, opts);
  const StepResult r = ex.step(x, y);
  CHECK(r.grad_norm == doctest::Approx(norm).epsilon(1e-10));
  auto a = model->named_parameters(), b = reference->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) GPIPE_EXPECT_CLOSE(a[i].second->value, b[i].second->value, 1e-12, 1e-12);
}

TEST_CASE("sequence targets: a loss per position, averaged over all positions") {
  // (N, T, F) inputs through Linear over the last dimension, (N, T) targets.
  layers::ModelSpec spec;
  spec.input = {3, 5};
  spec.dtype = DType::kF64;
  spec.layers = {{"linear", {{"out", "6"}}, {}, ""}, {"gelu", {}, {}, ""}, {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {{"ignore_index", "-1"}}, {}, ""};
  const int64_t N = 7;
  Tensor x = gpipe::testing::random_tensor({N, 3, 5}, DType::kF64, 1);
  Tensor y = gpipe::testing::random_labels(N * 3, 4, 2).reshape({N, 3});
  y.data<int32_t>()[4] = -1;  // an ignored position
  auto reference = layers::build_model(spec);
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 3 - 1));
  auto model = layers::build_model(spec);
  InProcessTransport transport(2);
  Executor ex(*model, make_stages({2, 1}, cpu_devices(2)), gpipe_schedule(2, 3, RecomputeMode::kAlways), transport,
              {});
  const StepResult r = ex.step(x, y, false);
  CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
  auto a = model->named_parameters(), b = reference->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) GPIPE_EXPECT_CLOSE(a[i].second->grad, b[i].second->grad, 1e-10, 1e-12);
}

// Evaluation is a forward-only program on the same executor: in evaluation mode (the
// dropout does nothing), its summed loss, correct predictions and counted targets equal
// the unpartitioned model's forward on the whole batch, for 1F1B and interleaved
// schedules, however the batch is cut into micro-batches and calls; it leaves the
// gradients and the step count alone.
TEST_CASE("evaluation scores what the unpartitioned model's forward scores") {
  layers::ModelSpec spec = mlp_spec(DType::kF64);
  spec.layers.insert(spec.layers.begin() + 2, {"dropout", {{"p", "0.5"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {{"ignore_index", "3"}}, {}, ""};
  const int64_t N = 11;
  Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF64, 31);
  Tensor y = gpipe::testing::random_labels(N, 4, 32);
  int ignored = 0;
  for (int32_t t : y.to_vector<int32_t>()) ignored += t == 3;
  REQUIRE(ignored > 0);
  REQUIRE(ignored < N);

  Backend& be = backend_for(Device::cpu());
  auto reference = layers::build_model(spec);
  layers::ForwardArgs eval_mode;
  eval_mode.training = false;
  Tensor h = x;
  for (int i = 0; i < reference->size(); ++i) h = reference->layer(i).forward(be, h, nullptr, eval_mode);
  const double ref_loss = be.item(reference->loss().forward(be, h, y, 1.0, nullptr));
  const double ref_correct = static_cast<double>(be.argmax_correct(h, y, 3));

  for (const std::pair<std::string, int>& named : {std::pair<std::string, int>{"1f1b", 1}, {"interleaved_1f1b", 2}}) {
    const std::string name = named.first;
    const int v = named.second, K = 2, M = 4;
    CAPTURE(name);
    auto model = layers::build_model(spec);
    InProcessTransport transport(K);
    const Schedule schedule = make_schedule(ScheduleRequest{name, K, v, M, RecomputeMode::kExceptLast});
    REQUIRE(schedule.num_chunks() == v);
    Executor ex(*model, make_cells(even_balance(model->size(), K * v), schedule, cpu_devices(K)), schedule, transport,
                {});
    ex.step(x, y, /*apply_optimizer=*/false);  // gradients to leave alone
    std::vector<std::vector<double>> grads;
    for (auto& p : model->named_parameters()) grads.push_back(to_doubles(p.second->grad));
    for (int64_t rows : {3, 4, 11}) {  // 4 micro-batches (3 3 3 2), 3 (4 4 3), 1
      CAPTURE(rows);
      const EvalResult r = ex.evaluate(x, y, rows);
      CHECK(r.loss_sum == doctest::Approx(ref_loss).epsilon(1e-12));
      CHECK(r.correct == ref_correct);
      CHECK(r.counted == N - ignored);
      CHECK(transport.pending() == 0);
    }
    // A pass cut into calls sums as one call.
    EvalResult parts = ex.evaluate(x.narrow_rows(0, 6), y.narrow_rows(0, 6), 3);
    parts = ex.evaluate(x.narrow_rows(6, 5), y.narrow_rows(6, 5), 3, parts);
    const EvalResult whole = ex.evaluate(x, y, 3);
    CHECK(parts.loss_sum == whole.loss_sum);
    CHECK(parts.correct == whole.correct);
    CHECK(parts.counted == whole.counted);
    // One process without replicas: the totals are already everyone's.
    const EvalResult reduced = ex.all_reduce_scores(whole);
    CHECK(reduced.loss_sum == whole.loss_sum);
    CHECK(reduced.counted == whole.counted);
    CHECK_THROWS_WITH_AS(ex.evaluate(x, y, 2), doctest::Contains("at most 4"), Error);
    CHECK(ex.next_step() == 1);
    auto params = model->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      INFO("gradient of ", params[i].first);
      CHECK(to_doubles(params[i].second->grad) == grads[i]);
    }
  }
}

TEST_CASE("a pipelined GPT with dropout equals the unpartitioned model") {
  // Dropout masks are keyed by (seed, step, layer, sample), so they do not depend on the
  // micro-batch split: loss and gradients match exactly, rematerialization included.
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.seed = 11;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}, {"dropout", "0.2"}}, {}, ""},
                 {"dropout", {{"p", "0.1"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}, {"dropout", "0.2"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", "16"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  const int64_t N = 5;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 31).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 32).reshape({N, 6});
  auto reference = layers::build_model(spec);
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 6));
  auto ref_params = reference->named_parameters();
  for (int K = 1; K <= 3; ++K) {
    for (int M : {1, 2, 4}) {
      for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever}) {
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        auto model = layers::build_model(spec);
        InProcessTransport transport(K);
        Executor ex(*model, make_stages(even_balance(model->size(), K), cpu_devices(K)), gpipe_schedule(K, M, mode),
                    transport, {});
        const StepResult r = ex.step(x, y, false);
        CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
        auto params = model->named_parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          INFO("gradient of ", params[i].first);
          GPIPE_EXPECT_CLOSE(params[i].second->grad, ref_params[i].second->grad, 1e-9, 1e-12);
        }
      }
    }
  }
}

TEST_CASE("a head tied to the embedding: gradients summed across stages, copies kept equal") {
  // The head's weight is the embedding's token table. Split over stages each holds a
  // copy; the pipeline must give both the gradient of the shared weight (the sum of
  // the two uses), count it once in the global norm, and keep the copies equal.
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.seed = 13;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", "16"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  const int64_t N = 6;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 41).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 42).reshape({N, 6});

  auto reference = layers::build_model(spec);
  REQUIRE(reference->ties().size() == 1);
  auto* emb = dynamic_cast<layers::Embedding*>(&reference->layer(0));
  auto* head = dynamic_cast<layers::Linear*>(&reference->layer(3));
  REQUIRE((emb != nullptr && head != nullptr));
  CHECK(to_doubles(head->weight().value) == to_doubles(emb->token().value));
  // Counted once: the untied model has one more 16 x 8 table.
  CHECK(reference->parameter_count() ==
        [&] {
          int64_t n = 0;
          for (auto& np : reference->named_parameters()) n += np.second->value.numel();
          return n;
        }() - 16 * 8);
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 6));
  const std::vector<double> head_only = to_doubles(head->weight().grad);
  reference->sum_tied_gradients(backend_for(Device::cpu()));
  // The shared weight's gradient is the sum of both uses, and the head's alone is not it.
  CHECK(to_doubles(head->weight().grad) == to_doubles(emb->token().grad));
  CHECK(to_doubles(head->weight().grad) != head_only);
  double ref_norm2 = 0;
  for (auto& np : reference->named_parameters()) {
    if (!reference->is_tied_copy(np.second)) {
      for (double g : to_doubles(np.second->grad)) ref_norm2 += g * g;
    }
  }
  auto ref_params = reference->named_parameters();

  // Last: three stages sharing one device, taking turns on its backend (as stages
  // sharing a GPU must), with the tied exchange and the norm's all-reduce between them.
  for (int K : {1, 2, 3, -3}) {
    for (int M : {1, 3}) {
      const bool shared = K < 0;
      K = std::abs(K);
      CAPTURE(K);
      CAPTURE(M);
      CAPTURE(shared);
      auto model = layers::build_model(spec);
      InProcessTransport transport(K);
      ExecutorOptions opts;
      opts.clip_grad_norm = 1e9;  // computes the global norm, never clips
      opts.optimizer.lr = 0.1;
      opts.optimizer.momentum = 0.9;
      opts.optimizer.weight_decay = 0.01;
      Executor ex(*model,
                  make_stages(even_balance(model->size(), K),
                              shared ? std::vector<Device>(K, Device::cpu(0)) : cpu_devices(K)),
                  gpipe_schedule(K, M, RecomputeMode::kExceptLast), transport, opts);
      const StepResult r = ex.step(x, y, false);
      CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
      auto params = model->named_parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        INFO("gradient of ", params[i].first);
        GPIPE_EXPECT_CLOSE(params[i].second->grad, ref_params[i].second->grad, 1e-9, 1e-12);
      }
      // Training steps: the global norm counts the tied weight once, and both copies
      // take the same steps.
      const StepResult s = ex.step(x, y, true);
      CHECK(s.grad_norm == doctest::Approx(std::sqrt(ref_norm2)).epsilon(1e-9));
      // The exchange and the norm are instructions of their own, timed on both stages
      // (the tie joins stage 0's embedding and the last stage's head), before OPT.
      for (int k = 0; k < K; ++k) {
        CAPTURE(k);
        const auto& prog = ex.schedule().stages[k];
        const auto& ops = s.stages[k].ops;
        REQUIRE(ops.size() == prog.size());
        const bool ties_here = K > 1 && (k == 0 || k == K - 1);
        std::vector<Instruction> tail(prog.end() - (ties_here ? 3 : 2), prog.end());
        std::vector<Instruction> want;
        if (ties_here) want.push_back({Op::kTiedGradients, 0, 0});
        want.push_back({Op::kGradientNorm, -1, 0});
        want.push_back({Op::kOptimizerStep, -1, 0});
        CHECK(tail == want);
        for (const TimedOp& op : ops) {
          CHECK(op.op != Op::kReduceGradients);
          if (op.op == Op::kTiedGradients) {
            CHECK(op.peer == (k == 0 ? K - 1 : 0));
            CHECK(op.bytes == 16 * 8 * 8);
          }
          if (op.op == Op::kGradientNorm) CHECK(op.bytes == 8);
        }
      }
      ex.step(x, y, true);
      const auto& tie = model->ties().at(0);
      CHECK(to_doubles(tie.copy->value) == to_doubles(tie.owner->value));
      CHECK(to_doubles(tie.owner->value) != to_doubles(emb->token().value));  // it did train
    }
  }
}
