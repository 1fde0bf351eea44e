// The trace's parts: the device-event path of a stage's op times (what CUDA stages
// use, run here on CPU events), the step window and its median, and chrome_trace's
// refusal of timings that do not follow the schedule. The files of real runs are
// checked by trace_report_test.
#include <doctest/doctest.h>

#include <string>

#include "layers/registry.h"
#include "pipeline/executor/executor.h"
#include "pipeline/executor/op_clock.h"
#include "pipeline/report/trace.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

layers::ModelSpec mlp_spec() {
  layers::ModelSpec spec;
  spec.input = {8};
  spec.dtype = DType::kF32;
  for (int i = 0; i < 4; ++i) {
    spec.layers.push_back({"linear", {{"out", "32"}}, {}, ""});
    spec.layers.push_back({"relu", {}, {}, ""});
  }
  spec.layers.push_back({"linear", {{"out", "4"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

StepResult run_step(bool device_clock, Schedule* schedule_out) {
  auto model = layers::build_model(mlp_spec());
  const Schedule s = make_schedule("1f1b", 2, 4, RecomputeMode::kExceptLast);
  *schedule_out = s;
  InProcessTransport transport(2);
  ExecutorOptions o;
  o.pin_threads = false;
  o.device_clock_on_cpu = device_clock;
  Executor ex(*model, make_stages({5, 4}, {Device::cpu(0), Device::cpu(1)}), s, transport, o);
  Tensor x = gpipe::testing::random_tensor({16, 8}, DType::kF32, 1);
  Tensor y = gpipe::testing::random_labels(16, 4, 2);
  ex.step(x, y);
  return ex.step(x, y);
}

}  // namespace

TEST_CASE("device times replace the host's for compute, in program order, inside the step") {
  Schedule s;
  const StepResult r = run_step(/*device_clock=*/true, &s);
  REQUIRE(r.stages.size() == 2);
  for (int k = 0; k < 2; ++k) {
    const StageTrace& t = r.stages[k];
    REQUIRE(t.ops.size() == s.stages[k].size());
    double last_end = 0;
    for (const TimedOp& op : t.ops) {
      CAPTURE(k);
      CAPTURE(op_name(op.op));
      CHECK(op.start_ms >= 0);
      CHECK(op.end_ms >= op.start_ms);
      CHECK(op.end_ms <= r.wall_ms);
      if (is_compute(op.op)) {  // one device stream: compute never overlaps
        CHECK(op.start_ms >= last_end);
        last_end = op.end_ms;
      }
    }
    CHECK(t.start_ms > 0);
  }
}

TEST_CASE("the op clock pairs each before with its after and resolves on the host clock") {
  OpClock off(Device::cpu());
  CHECK_FALSE(off.enabled());
  OpClock clock(Device::cpu(), /*force=*/true);
  REQUIRE(clock.enabled());
  CpuStream stream(Device::cpu());
  clock.start_step(stream, 100.0);
  clock.before(stream, 3);
  clock.after(stream, 3);
  clock.before(stream, 7);
  clock.after(stream, 7);
  const auto spans = clock.resolve();
  REQUIRE(spans.size() == 2);
  CHECK(spans[0].index == 3);
  CHECK(spans[1].index == 7);
  CHECK(spans[0].start_ms >= 100.0);
  CHECK(spans[0].end_ms >= spans[0].start_ms);
  CHECK(spans[1].start_ms >= spans[0].end_ms);
  CHECK_THROWS(clock.after(stream, 8));  // an after without its before
}

TEST_CASE("the step window keeps its steps and names the median one") {
  Schedule s;
  StepResult r = run_step(false, &s);
  StepRecorder rec(2, 4);
  for (int step = 0; step < 7; ++step) {
    r.wall_ms = step == 3 ? 1.0 : 10.0 + step;  // walls of the kept steps 2, 3, 4: 12, 1, 14
    rec.add(step, 0.5, r);
  }
  REQUIRE(rec.steps().size() == 3);
  CHECK(rec.steps().front().step == 2);
  CHECK(rec.median_step()->step == 2);
  CHECK(StepRecorder(0, 0).median_step() == nullptr);
}

TEST_CASE("chrome_trace refuses timings that do not follow the schedule") {
  Schedule s;
  StepResult r = run_step(false, &s);
  std::vector<TraceProcess> procs = {{0, 0, "cpu:0", "0-4"}, {1, 0, "cpu:1", "5-8"}};
  RecordedStep good{1, 0.5, r.wall_ms, r.stages};
  const nlohmann::json j = chrome_trace(s, procs, {good}, good.stages[0].start_ms);
  CHECK(j.at("traceEvents").size() > s.stages[0].size() + s.stages[1].size());
  // A step replayed from a capture (pipeline.capture) says so in its step event, per stage.
  RecordedStep replayed = good;
  replayed.stages[0].captured_nodes = 42;
  int steps_seen = 0;
  for (const auto& [trace, want] : {std::make_pair(j, nlohmann::json()),
                                    std::make_pair(chrome_trace(s, procs, {replayed}, good.stages[0].start_ms),
                                                   nlohmann::json::array({42, 0}))}) {
    for (const auto& e : trace.at("traceEvents")) {
      if (e.value("cat", "") != "step") continue;
      ++steps_seen;
      CHECK(e.at("args").value("captured_ops", nlohmann::json()) == want);
    }
  }
  CHECK(steps_seen == 2);
  RecordedStep short_step = good;
  short_step.stages[1].ops.pop_back();
  CHECK_THROWS_AS(chrome_trace(s, procs, {short_step}, 0), Error);
  RecordedStep swapped = good;
  std::swap(swapped.stages[0].ops[0], swapped.stages[0].ops[1]);
  CHECK_THROWS_AS(chrome_trace(s, procs, {swapped}, 0), Error);
}
