// The executor on CUDA stages against the same pipeline on CPU stages, through the
// public API (gpipe_schedule, make_stages, Executor, step), with the in-process
// transport's GPU paths: stages sharing a GPU hand tensors over on its one compute
// stream; stages on two GPUs copy peer to peer on a transfer stream ordered by events.
// The first step's loss and every gradient must agree to float32 rounding, and a few
// AdamW steps (clipped by the global norm, which all-reduces over the stages) must
// track the CPU run. Also: a pipeline that uses only GPU 1 leaves no context on GPU 0
// (runtime/device_binding.h). Skipped without a GPU; the two-GPU cases say when they
// are skipped with one.
#include "tests/gpu_testing.h"

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "kernels/op_log.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/profile.h"
#include "runtime/device.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

#ifdef GPIPE_WITH_CUDA
#include "runtime/cuda_runtime.h"
#endif

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::random_labels;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

// A small GPT with its head tied to the embedding (on different stages when K > 2),
// dropout included: the CPU and CUDA masks are the same bits.
layers::ModelSpec gpt_spec() {
  layers::ModelSpec spec;
  spec.input = {16};
  spec.input_dtype = DType::kI32;
  spec.seed = 7;
  spec.layers = {{"embedding", {{"vocab", "64"}, {"dim", "32"}}, {}, ""},
                 {"transformer_block", {{"heads", "4"}, {"dropout", "0.1"}}, {}, ""},
                 {"transformer_block", {{"heads", "4"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", "64"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

layers::ModelSpec mlp_spec() {
  layers::ModelSpec spec;
  spec.input = {24};
  spec.seed = 3;
  spec.layers = {{"linear", {{"out", "64"}}, {}, ""}, {"gelu", {}, {}, ""}, {"linear", {{"out", "64"}}, {}, ""},
                 {"relu", {}, {}, ""},              {"linear", {{"out", "32"}}, {}, ""}, {"relu", {}, {}, ""},
                 {"linear", {{"out", "10"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

struct Run {
  double first_loss = 0;
  std::vector<std::vector<double>> grads;  // after the first step, in named_parameters order
  std::vector<double> losses;              // of the training steps that follow
};

Run run(const layers::ModelSpec& spec, const std::vector<Device>& devices, int M, const Tensor& x, const Tensor& y) {
  auto model = layers::build_model(spec);
  const int K = static_cast<int>(devices.size());
  InProcessTransport transport(K);
  ExecutorOptions opts;
  opts.optimizer.type = "adamw";
  opts.optimizer.lr = 3e-3;
  opts.optimizer.weight_decay = 0.01;
  opts.clip_grad_norm = 1.0;
  opts.pin_threads = false;
  const std::vector<int> balance = partition::balance_by_cost(std::vector<double>(model->size(), 1.0), K);
  Executor ex(*model, make_stages(balance, devices), gpipe_schedule(K, M, RecomputeMode::kExceptLast), transport,
              opts);
  Run r;
  r.first_loss = ex.step(x, y, /*apply_optimizer=*/false).loss;
  for (const auto& np : model->named_parameters()) r.grads.push_back(to_doubles(np.second->grad));
  for (int step = 0; step < 4; ++step) r.losses.push_back(ex.step(x, y).loss);
  CHECK(transport.pending() == 0);
  return r;
}

void compare(const Run& gpu, const Run& cpu) {
  CHECK(gpu.first_loss == doctest::Approx(cpu.first_loss).epsilon(1e-4));
  REQUIRE(gpu.grads.size() == cpu.grads.size());
  for (size_t i = 0; i < gpu.grads.size(); ++i) {
    INFO("gradient " << i);
    GPIPE_EXPECT_CLOSE(gpu.grads[i], cpu.grads[i], 2e-3, 2e-5);
  }
  REQUIRE(gpu.losses.size() == cpu.losses.size());
  for (size_t i = 0; i < gpu.losses.size(); ++i) {
    INFO("training step " << i);
    CHECK(gpu.losses[i] == doctest::Approx(cpu.losses[i]).epsilon(2e-3));
  }
}

std::vector<Device> cpus(int k) {
  std::vector<Device> d;
  for (int i = 0; i < k; ++i) d.push_back(Device::cpu(i));
  return d;
}

}  // namespace

// First in the file (doctest runs a file's cases in order), before anything touches
// GPU 0: the process must not create a context there.
TEST_CASE("a pipeline on GPU 1 alone leaves no context on GPU 0") {
  if (cuda_device_count() < 2) {
    MESSAGE("skipped: needs two GPUs");
    return;
  }
  Tensor x = random_tensor({12, 24}, DType::kF32, 1);
  Tensor y = random_labels(12, 10, 2);
  const Run gpu = run(mlp_spec(), {Device::cuda(1), Device::cuda(1)}, 3, x, y);
  const Run cpu = run(mlp_spec(), cpus(2), 3, x, y);
  compare(gpu, cpu);
#ifdef GPIPE_WITH_CUDA
  CHECK_FALSE(cuda_device_selector().has_context(0));
  CHECK(cuda_device_selector().has_context(1));
#endif
}

TEST_CASE("one stage on cuda:0 keeps the norm, the clip and dropout's step on the device, and equals one CPU stage") {
  // K = 1: NORM and OPT do not wait for the GPU (kernels/step_scalars.h); the clipped
  // AdamW steps and the dropout masks must still track the CPU's.
  const Tensor ids = random_labels(12 * 16, 64, 7).reshape({12, 16});
  const Tensor y = random_labels(12 * 16, 64, 8).reshape({12, 16});
  compare(run(gpt_spec(), {Device::cuda(0)}, 3, ids, y), run(gpt_spec(), cpus(1), 3, ids, y));
  // The stage's thread calls the same ops with the same arguments at every step, and the
  // host reads nothing back before the step's end (its wait and the scalars' one copy).
  auto model = layers::build_model(gpt_spec());
  InProcessTransport transport(1);
  ExecutorOptions opts;
  opts.optimizer.type = "adamw";
  opts.clip_grad_norm = 1.0;
  Executor ex(*model, make_stages({model->size()}, {Device::cuda(0)}), gpipe_schedule(1, 3, RecomputeMode::kExceptLast),
              transport, opts);
  ex.step(ids, y);  // warm-up: tables and graphs built on first use
  OpLog log;
  std::vector<std::vector<std::string>> steps;
  for (int t = 0; t < 3; ++t) {
    ex.set_lr(1e-3 * (t + 1));
    log.take();
    ex.step(ids, y);
    std::vector<std::string> calls, reads;
    for (const OpLog::Call& c : log.take()) {
      if (c.thread == std::this_thread::get_id()) continue;  // the caller's, after the step
      calls.push_back(c.op + "(" + c.args + ")");
      if (c.returns) reads.push_back(c.op);
    }
    CHECK(reads == std::vector<std::string>{"synchronize", "read_step_scalars"});
    steps.push_back(calls);
  }
  CHECK(steps[1] == steps[0]);
  CHECK(steps[2] == steps[0]);
}

namespace {
// A small bf16 LLaMA (cuDNN's fused attention where the build has its frontend).
layers::ModelSpec small_llama(uint64_t seed) {
  layers::ModelSpec llama;
  llama.input = {16};
  llama.input_dtype = DType::kI32;
  llama.dtype = DType::kBF16;
  llama.seed = seed;
  llama.layers = {{"embedding", {{"vocab", "64"}, {"dim", "64"}, {"positions", "0"}}, {}, ""},
                  {"llama_block", {{"heads", "4"}, {"kv_heads", "2"}, {"hidden", "96"}, {"dropout", "0.1"}}, {}, ""},
                  {"llama_block", {{"heads", "4"}, {"kv_heads", "2"}, {"hidden", "96"}}, {}, ""},
                  {"rmsnorm", {}, {}, ""},
                  {"linear", {{"out", "64"}, {"bias", "false"}}, {}, ""}};
  llama.loss = {"softmax_cross_entropy", {}, {}, ""};
  return llama;
}

// `spec` on stages of `balance` layers, all on cuda:0, five steps op by op and five with
// pipeline.capture (data from `seed`): the second step is captured and every later one
// is one launch of it. It must train as the same stages op by op (the same kernels:
// equal to float32 rounding, in practice bit for bit), each stage replaying more than
// `least` ops every step after the first, time its instructions with the graph's event
// nodes, and still report a bad label of a replayed step (its deferred checks put back
// before each launch).
void check_captured_training(const layers::ModelSpec& spec, const std::vector<int>& balance, uint64_t seed,
                             int64_t least) {
  CAPTURE(dtype_name(spec.dtype));
  const int K = static_cast<int>(balance.size());
  auto train = [&](bool capture, std::vector<StepResult>& out) {
    auto model = layers::build_model(spec);
    InProcessTransport transport(K);
    ExecutorOptions opts;
    opts.optimizer.type = "adamw";
    opts.optimizer.weight_decay = 0.01;
    opts.clip_grad_norm = 1.0;
    opts.capture = capture;
    Executor ex(*model, make_stages(balance, std::vector<Device>(static_cast<size_t>(K), Device::cuda(0))),
                gpipe_schedule(K, 3, RecomputeMode::kExceptLast), transport, opts);
    for (int t = 0; t < 5; ++t) {
      ex.set_lr(1e-3 * (t + 1));
      const Tensor ids = random_labels(12 * 16, 64, seed + 2 * t).reshape({12, 16});
      const Tensor y = random_labels(12 * 16, 64, seed + 1 + 2 * t).reshape({12, 16});
      out.push_back(ex.step(ids, y));
    }
    if (capture) {
      // A label outside the vocabulary in a replayed step: the CPU's error, at its end.
      Tensor ids = random_labels(12 * 16, 64, seed + 70).reshape({12, 16});
      Tensor y = random_labels(12 * 16, 64, seed + 71).reshape({12, 16});
      y.data<int32_t>()[37] = 64;
      CHECK_THROWS_AS(ex.step(ids, y), UserError);
    }
  };
  std::vector<StepResult> eager, captured;
  train(false, eager);
  train(true, captured);
  for (size_t t = 0; t < eager.size(); ++t) {
    INFO("step " << t);
    CHECK(captured[t].loss == doctest::Approx(eager[t].loss).epsilon(1e-6));
    CHECK(captured[t].grad_norm == doctest::Approx(eager[t].grad_norm).epsilon(1e-5));
    for (size_t k = 0; k < balance.size(); ++k) {
      const StageTrace& trace = captured[t].stages.at(k);
      CHECK(trace.captured_nodes == (t == 0 ? 0 : captured[1].stages[k].captured_nodes));
      if (t > 0) {
        CHECK(trace.captured_nodes > least);
        for (const TimedOp& op : trace.ops) CHECK(op.end_ms >= op.start_ms);  // the graph's event nodes
      }
    }
    if (captured[t].loss != eager[t].loss) MESSAGE("step " << t << ": captured and eager losses differ in their bits");
  }
}
}  // namespace

// pipeline.capture on cuda:0 (kernels/cuda_capture.cc), one stage: its step is one graph.
TEST_CASE("one stage on cuda:0 captured as a CUDA graph trains as the same stage op by op") {
  for (const layers::ModelSpec& spec : {gpt_spec(), small_llama(11)}) check_captured_training(spec, {5}, 20, 20);
}

// pipeline.capture with stages that share cuda:0 (pipeline/executor/executor_capture.cc):
// their training step is captured together, one CUDA graph on the device's stream, which
// stage 0's thread launches once a step. Their host sums the gradient norm op by op; the
// graph sums it on the device, in the same order. The GPT's tied head's gradient crosses
// stages 0 and 2 inside the graph.
TEST_CASE("stages sharing cuda:0 captured together as one CUDA graph train as the same stages op by op") {
  check_captured_training(gpt_spec(), {2, 1, 2}, 40, 5);
  check_captured_training(small_llama(13), {2, 3}, 40, 5);
}

TEST_CASE("two stages sharing cuda:0 equal two CPU stages (MLP, uneven micro-batches)") {
  Tensor x = random_tensor({13, 24}, DType::kF32, 3);
  Tensor y = random_labels(13, 10, 4);
  compare(run(mlp_spec(), {Device::cuda(0), Device::cuda(0)}, 4, x, y), run(mlp_spec(), cpus(2), 4, x, y));
}

TEST_CASE("a GPT with a tied head on three stages sharing cuda:0 equals three CPU stages") {
  Tensor x = random_labels(8 * 16, 64, 5).reshape({8, 16});
  Tensor y = random_labels(8 * 16, 64, 6).reshape({8, 16});
  compare(run(gpt_spec(), {Device::cuda(0), Device::cuda(0), Device::cuda(0)}, 4, x, y),
          run(gpt_spec(), cpus(3), 4, x, y));
}

TEST_CASE("stages on two GPUs (peer copies on the transfer stream) equal CPU stages") {
  if (cuda_device_count() < 2) {
    MESSAGE("skipped: needs two GPUs");
    return;
  }
  Tensor x = random_labels(8 * 16, 64, 7).reshape({8, 16});
  Tensor y = random_labels(8 * 16, 64, 8).reshape({8, 16});
  // Hops between the GPUs and between stages sharing one, both ways, and the tied
  // gradient between the first and the last stage.
  const std::vector<Device> devices = {Device::cuda(0), Device::cuda(0), Device::cuda(1), Device::cuda(1)};
  compare(run(gpt_spec(), devices, 4, x, y), run(gpt_spec(), cpus(4), 4, x, y));
  Tensor xm = random_tensor({16, 24}, DType::kF32, 9);
  Tensor ym = random_labels(16, 10, 10);
  compare(run(mlp_spec(), {Device::cuda(0), Device::cuda(1)}, 8, xm, ym), run(mlp_spec(), cpus(2), 8, xm, ym));
}

int main(int argc, char** argv) { return gpipe::gpu_testing::run_gpu_tests(argc, argv); }

// `gpipe profile` on a GPU: every layer timed, by events on the device's stream (device
// time, pipeline/planning/profile.cc), each time positive and finite, and the whole
// measurement's sum below the host's wall clock around it.
TEST_CASE("a profile measured on cuda:0 times every layer with device events") {
  auto model = layers::build_model(mlp_spec());
  Tensor x = random_tensor({8, 24}, DType::kF32, 7);
  Tensor y = random_labels(8, 10, 8);
  layers::OptimizerConfig adamw;
  adamw.type = "adamw";
  const auto t0 = std::chrono::steady_clock::now();
  const ProfileEntry e = measure_layers(*model, x, y, Device::cuda(0), adamw, 2, 5, 1);
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(e.key.device == "cuda");
  REQUIRE(e.layers.size() == static_cast<size_t>(model->size()));
  double sum = 0;
  for (const LayerProfile& l : e.layers) {
    CHECK(l.forward_ms > 0);
    CHECK(l.backward_ms > 0);
    CHECK(std::isfinite(l.forward_ms));
    CHECK(std::isfinite(l.backward_ms));
    sum += l.forward_ms + l.backward_ms;
  }
  CHECK(sum < wall_ms);
}
