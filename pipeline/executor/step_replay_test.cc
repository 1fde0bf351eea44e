// A training step that can be captured once and replayed (a CUDA graph, issue 37 item
// 4) calls the same ops with the same arguments at every step: nothing the host decides
// from step to step (the learning rate, Adam's step count, the clip) may reach a kernel
// as an argument, and the host must not wait for the device inside the step. The step's
// scalars on the device (kernels/step_scalars.h) carry those numbers; this test records
// every op call of a stage's steps (OpLog) and compares them, step after step.
// Dropout's keys take the step's index from there too, and the loss its factor.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "kernels/op_log.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "pipeline/executor/executor.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

using gpipe::testing::cpu_devices;

layers::ModelSpec spec(bool dropout) {
  layers::ModelSpec s;
  s.input = {6};
  s.dtype = DType::kF32;
  s.seed = 29;
  s.layers = {{"linear", {{"out", "8"}}, {}, ""},    {"gelu", {}, {}, ""},
              {"layernorm", {}, {}, ""},             {"linear", {{"out", "8"}}, {}, ""},
              {"relu", {}, {}, ""},                  {"linear", {{"out", "4"}}, {}, ""}};
  if (dropout) s.layers.insert(s.layers.begin() + 2, {"dropout", {{"p", "0.25"}}, {}, ""});
  s.loss = {"softmax_cross_entropy", {}, {}, ""};
  return s;
}

struct Setup {
  std::string name;
  layers::OptimizerConfig opt;
  layers::LrSchedule lr;
  double clip = 0;
  double loss_scale = 0;
};

std::vector<Setup> setups() {
  std::vector<Setup> out(3);
  out[0].name = "adamw, warm-up and cosine, clip";
  out[0].opt.type = "adamw";
  out[0].opt.weight_decay = 0.1;
  out[0].lr = {"cosine", 0.01, 2, 6, 0.001};
  out[0].clip = 0.05;  // below the gradients' norm: every step clips, by a scale of its own
  out[1].name = "sgd with momentum, cosine, clip";
  out[1].opt.type = "sgd";
  out[1].opt.momentum = 0.9;  // its first step differs on the device (kStepNumber)
  out[1].lr = {"cosine", 0.1, 0, 6, 0.0};
  out[1].clip = 0.05;
  out[2].name = "adam, loss scaling";
  out[2].opt.type = "adam";
  out[2].lr = {"constant", 0.01, 0, 6, 0.0};
  out[2].loss_scale = 256;  // the window below is longer than the run: a constant scale
  return out;
}

// Each step's calls by thread: the stages' workers (one thread per stage here); the
// caller's own calls (before and after its workers run) are left out.
using Calls = std::map<std::thread::id, std::vector<OpLog::Call>>;

std::vector<Calls> run_steps(const Setup& c, int K, bool dropout, int steps, int loss_scale_window = 1000,
                             int64_t batch = 9) {
  auto model = layers::build_model(spec(dropout));
  InProcessTransport transport(K);
  ExecutorOptions o;
  o.optimizer = c.opt;
  o.clip_grad_norm = c.clip;
  o.loss_scale = c.loss_scale;
  o.loss_scale_window = loss_scale_window;
  const Schedule s = make_schedule("1f1b", K, 3, RecomputeMode::kExceptLast);
  Executor ex(*model, make_cells(K == 1 ? std::vector<int>{model->size()} : std::vector<int>{3, model->size() - 3},
                                 s, cpu_devices(K)),
              s, transport, o);
  std::vector<Calls> out;
  OpLog log;
  for (int t = 0; t < steps; ++t) {
    ex.set_lr(c.lr.at(t));
    const Tensor x = gpipe::testing::random_tensor({batch, 6}, DType::kF32, 40 + t, -2, 2);
    const Tensor y = gpipe::testing::random_labels(batch, 4, 50 + t);
    log.take();
    const StepResult r = ex.step(x, y);
    REQUIRE(!r.skipped);
    Calls calls;
    for (OpLog::Call& call : log.take()) {
      if (call.thread != std::this_thread::get_id()) calls[call.thread].push_back(std::move(call));
    }
    REQUIRE(static_cast<int>(calls.size()) == K);
    // Each instruction's count of ops (TimedOp::ops, which the report sums) is what it
    // called; outside them (other_ops) the scalars' write before the step, the gradients'
    // zeroing, the final wait and the scalars' read after it: the stages' calls, all logged.
    int64_t counted = 0, other = 0, logged = 0;
    for (const StageTrace& trace : r.stages) {
      for (const TimedOp& op : trace.ops) counted += op.ops;
      other += trace.other_ops;
    }
    for (const auto& [thread, list] : calls) logged += static_cast<int64_t>(list.size());
    CHECK(other == 4 * K);
    CHECK(counted + other == logged);
    out.push_back(std::move(calls));
  }
  return out;
}

std::vector<std::string> lines(const std::vector<OpLog::Call>& calls) {
  std::vector<std::string> out;
  for (const OpLog::Call& c : calls) out.push_back(c.op + "(" + c.args + ")");
  return out;
}

// The calls that hand the host a value (the host waits for the device for them).
std::vector<std::string> host_reads(const std::vector<OpLog::Call>& calls) {
  std::vector<std::string> out;
  for (const OpLog::Call& c : calls) {
    if (c.returns) out.push_back(c.op);
  }
  return out;
}

}  // namespace

TEST_CASE("a stage calls the same ops with the same arguments at every step: the step's numbers are on the device") {
  for (const Setup& c : setups()) {
    for (int K : {1, 2}) {
    for (bool dropout : {false, true}) {  // dropout's keys take the step from the device
      CAPTURE(c.name);
      CAPTURE(K);
      CAPTURE(dropout);
      const std::vector<Calls> steps = run_steps(c, K, dropout, 5);
      for (const auto& [thread, first] : steps[0]) {
        const std::vector<std::string> want = lines(first);
        CHECK(want.size() > 20);
        for (size_t t = 1; t < steps.size(); ++t) {
          CAPTURE(t);
          REQUIRE(steps[t].count(thread) == 1);
          const std::vector<std::string> got = lines(steps[t].at(thread));
          CHECK(got.size() == want.size());
          for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
            if (got[i] == want[i]) continue;
            INFO("call ", i, ": step 0 ", want[i], ", step ", t, " ", got[i]);
            CHECK(got[i] == want[i]);
            break;  // the first difference
          }
        }
        // The optimizer's update and the clip read the scalars; no host value reaches them.
        int updates = 0;
        for (const OpLog::Call& call : first) updates += call.op == "adam_step_all" || call.op == "sgd_step_all";
        CHECK(updates == 1);
        // The host writes the step's scalars once before it and waits and reads them once
        // at its end, except where NORM sums the stages' norms on the host (K > 1): one
        // number read per stage there, and the total written back.
        std::vector<std::string> expected_reads;
        const bool host_norm = K > 1 && (c.clip > 0 || c.loss_scale > 0);
        if (host_norm) expected_reads.push_back("sum_squares_all");
        expected_reads.insert(expected_reads.end(), {"synchronize", "read_step_scalars"});
        CHECK(host_reads(first) == expected_reads);
        CHECK(first.front().op == "write_step_scalars");
        CHECK(first.back().op == "read_step_scalars");
        int writes = 0;
        for (const OpLog::Call& call : first) writes += call.op == "write_step_scalars";
        CHECK(writes == (host_norm ? 2 : 1));
      }
    }
    }
  }
}

TEST_CASE("a changing loss scale changes no call; a step of another micro-batch split does") {
  // Loss scaling's scale, with a window of one step, doubles at every clean step: the loss
  // and the clip read it from the step's scalars, so every step's calls are the same.
  const Setup c = setups()[2];
  REQUIRE(c.loss_scale > 0);
  const std::vector<Calls> steps = run_steps(c, 1, /*dropout=*/true, 3, /*loss_scale_window=*/1);
  const auto& a = steps[0].begin()->second;
  for (size_t t = 1; t < steps.size(); ++t) CHECK(lines(steps[t].begin()->second) == lines(a));
  // The comparison is not blind: the same run with another batch (other micro-batch
  // sizes) calls the ops with other shapes.
  const std::vector<Calls> other = run_steps(c, 1, /*dropout=*/true, 1, 1, /*batch=*/12);
  const std::vector<std::string> b = lines(other[0].begin()->second);
  REQUIRE(b.size() == a.size());
  CHECK(b != lines(a));
}
