// The report's accounting on timings written by hand: every number the table and
// report.json show (busy, communication, idle, utilization, span, measured and ideal
// bubble, throughput, peak memory) is worked out below from a two-stage schedule whose
// instruction times are known, so a wrong sum or a wrong denominator fails here.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "pipeline/report.h"
#include "pipeline/schedule.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

// K = 2, M = 2, stage 0 recomputes nothing, stage 1 recomputes micro-batch 0. Times in
// ms since the step began:
//
//   stage 0: F0 [0,2] sA0 [2,2.5] F1 [2.5,4.5] sA1 [4.5,5] rG1 [5,9] B1 [9,12] rG0 [12,13] B0 [13,16] OPT [16,17]
//   stage 1: rA0 [0,2.5] F0 [2.5,5] rA1 [5,5] F1 [5,7.5] B1 [7.5,9] sG1 [9,9.5] R0 [9.5,10.5] B0 [10.5,11.5]
//            sG0 [11.5,12] OPT [12,20]
//
// The span is the last non-optimizer end, 16 (stage 0's B0): the optimizer steps are
// reported on their own.
//   stage 0: forward 4, recompute 0, backward 6, busy 10, comm 1, idle 16 - 11 = 5, opt 1
//   stage 1: forward 5, recompute 1, backward 2.5, busy 8.5, comm 1, idle 16 - 9.5 = 6.5, opt 8
StepResult hand_step(double scale, int64_t peak0, int64_t peak1) {
  auto op = [&](Op o, int m, double a, double b) { return TimedOp{o, m, a * scale, b * scale}; };
  StepResult r;
  r.loss = 1.0;
  r.wall_ms = 20.5 * scale;
  StageTrace s0, s1;
  s0.ops = {op(Op::kForward, 0, 0, 2),         op(Op::kSendActivation, 0, 2, 2.5), op(Op::kForward, 1, 2.5, 4.5),
            op(Op::kSendActivation, 1, 4.5, 5), op(Op::kRecvGradient, 1, 5, 9),     op(Op::kBackward, 1, 9, 12),
            op(Op::kRecvGradient, 0, 12, 13),   op(Op::kBackward, 0, 13, 16),       op(Op::kOptimizerStep, -1, 16, 17)};
  s0.peak_activation_bytes = peak0;
  s1.ops = {op(Op::kRecvActivation, 0, 0, 2.5), op(Op::kForward, 0, 2.5, 5),       op(Op::kRecvActivation, 1, 5, 5),
            op(Op::kForward, 1, 5, 7.5),         op(Op::kBackward, 1, 7.5, 9),     op(Op::kSendGradient, 1, 9, 9.5),
            op(Op::kRecompute, 0, 9.5, 10.5),    op(Op::kBackward, 0, 10.5, 11.5), op(Op::kSendGradient, 0, 11.5, 12),
            op(Op::kOptimizerStep, -1, 12, 20)};
  s1.peak_activation_bytes = peak1;
  r.stages = {s0, s1};
  return r;
}

ReportBuilder builder() {
  return ReportBuilder({"0-1 linear, relu", "2-3 linear x2"}, {"cpu:0", "cpu:1"}, 2, "except_last", "gpipe", 8);
}

}  // namespace

TEST_CASE("one timed step: every figure from the hand-written timings") {
  ReportBuilder b = builder();
  b.add_step(0, 2.5, hand_step(1.0, 1000, 3000), /*timed=*/true);
  const RunSummary s = b.summary();
  CHECK(s.partitions == 2);
  CHECK(s.micro_batches == 2);
  CHECK(s.timed_steps == 1);
  CHECK(s.span_ms == 16.0);
  CHECK(s.step_ms == 20.5);
  CHECK(s.samples_per_second == doctest::Approx(8 / 0.0205));
  REQUIRE(s.stages.size() == 2);
  const StageSummary& a = s.stages[0];
  CHECK(a.forward_ms == 4.0);
  CHECK(a.recompute_ms == 0.0);
  CHECK(a.backward_ms == 6.0);
  CHECK(a.busy_ms == 10.0);
  CHECK(a.comm_ms == 1.0);
  CHECK(a.idle_ms == 5.0);  // rG1 4 + rG0 1: the waits for stage 1
  CHECK(a.optimizer_ms == 1.0);
  CHECK(a.utilization == doctest::Approx(10.0 / 16));
  CHECK(a.peak_activation_bytes == 1000);
  const StageSummary& c = s.stages[1];
  CHECK(c.forward_ms == 5.0);
  CHECK(c.recompute_ms == 1.0);
  CHECK(c.backward_ms == 2.5);
  CHECK(c.busy_ms == 8.5);
  CHECK(c.comm_ms == 1.0);
  CHECK(c.idle_ms == 6.5);  // rA0 2.5 and the 4 ms after its last send, before the span ends
  CHECK(c.optimizer_ms == 8.0);
  CHECK(c.utilization == doctest::Approx(8.5 / 16));
  CHECK(c.peak_activation_bytes == 3000);
  CHECK(s.measured_bubble == doctest::Approx(1 - 18.5 / 32));  // 1 - total busy / (K x span)
  CHECK(s.ideal_bubble == doctest::Approx(1.0 / 3));           // (K-1)/(M+K-1) = 1/3
}

TEST_CASE("several steps: warm-up left out, the rest averaged, peaks kept") {
  ReportBuilder b = builder();
  b.add_step(0, 3.0, hand_step(100.0, 99999, 99999), /*timed=*/false);  // a slow warm-up: loss only
  b.add_step(1, 2.0, hand_step(1.0, 1000, 3000), true);
  b.add_step(2, 1.0, hand_step(3.0, 2000, 2500), true);  // every time x3
  const RunSummary s = b.summary();
  CHECK(s.timed_steps == 2);
  CHECK(s.span_ms == doctest::Approx((16 + 48) / 2.0));
  CHECK(s.step_ms == doctest::Approx((20.5 + 61.5) / 2.0));
  CHECK(s.samples_per_second == doctest::Approx(8 * 2 / ((20.5 + 61.5) / 1000)));
  CHECK(s.stages[0].busy_ms == doctest::Approx(20.0));  // (10 + 30) / 2
  CHECK(s.stages[0].idle_ms == doctest::Approx(10.0));
  CHECK(s.stages[1].idle_ms == doctest::Approx(13.0));
  CHECK(s.stages[1].optimizer_ms == doctest::Approx(16.0));
  CHECK(s.stages[0].utilization == doctest::Approx(10.0 / 16));  // scaling every time keeps the ratios
  CHECK(s.measured_bubble == doctest::Approx(1 - 18.5 / 32));
  CHECK(s.stages[0].peak_activation_bytes == 2000);  // the most of any timed step
  CHECK(s.stages[1].peak_activation_bytes == 3000);

  const nlohmann::json j = b.json();
  REQUIRE(j["steps"].size() == 3);  // every step's loss, the warm-up's too
  CHECK(j["steps"][0]["loss"] == 3.0);
  CHECK(j["steps"][2]["step"] == 2);
  CHECK(j["timed_steps"] == 2);
  CHECK(j["span_ms"].get<double>() == doctest::Approx(32.0));
  CHECK(j["bubble"]["measured"].get<double>() == doctest::Approx(1 - 18.5 / 32));
  CHECK(j["bubble"]["theoretical"].get<double>() == doctest::Approx(1.0 / 3));
  CHECK(j["stages"][1]["idle_ms"].get<double>() == doctest::Approx(13.0));
  CHECK(j["stages"][1]["recompute_ms"].get<double>() == doctest::Approx(2.0));
  CHECK(j["stages"][1]["layers"] == "2-3 linear x2");
  CHECK(j["stages"][1]["device"] == "cpu:1");
  CHECK(j["checkpoint"] == "except_last");
  CHECK(j["batch_size"] == 8);
  CHECK(!j.contains("eval"));
}

TEST_CASE("the table and report.json show the same figures, and the scores") {
  ReportBuilder b = builder();
  b.add_step(0, 2.0, hand_step(1.0, 2000000, 3000000), true);
  b.add_validation(0, 1.75, 0.5);
  b.set_eval(1.5, 0.625);
  const std::string t = b.table();
  CAPTURE(t);
  CHECK(t.find("K=2 stages, M=2 micro-batches, checkpoint=except_last, schedule=gpipe, batch=8") != std::string::npos);
  CHECK(t.find("averaged over 1 timed steps (span 16.00 ms, wall 20.50 ms)") != std::string::npos);
  // stage 0: fwd 4, recomp 0, bwd 6, comm 1, idle 5, opt 1, util 62.5%, 2 MB
  CHECK(t.find("cpu:0        4.00      0.00      6.00     1.00     5.00     1.00  62.5%    2.00 MB") != std::string::npos);
  CHECK(t.find("cpu:1        5.00      1.00      2.50     1.00     6.50     8.00  53.1%    3.00 MB") != std::string::npos);
  CHECK(t.find("Bubble: measured 0.422, ideal (K-1)/(M+K-1) = 0.333") != std::string::npos);
  CHECK(t.find("Throughput: 390.2 samples/s") != std::string::npos);
  CHECK(t.find("Validation: loss 1.5000, accuracy 62.50%") != std::string::npos);
  const nlohmann::json j = b.json();
  CHECK(j["eval"]["loss"] == 1.5);
  CHECK(j["eval"]["accuracy"] == 0.625);
  REQUIRE(j["validation"].size() == 1);
  CHECK(j["validation"][0]["loss"] == 1.75);
}

TEST_CASE("a run with no timed step reports zeros, not NaN") {
  ReportBuilder b = builder();
  b.add_step(0, 2.0, hand_step(1.0, 1, 1), false);
  const RunSummary s = b.summary();
  CHECK(s.timed_steps == 0);
  CHECK(s.span_ms == 0);
  CHECK(s.samples_per_second == 0);
  CHECK(s.measured_bubble == 0);
  CHECK(s.stages[0].utilization == 0);
  CHECK(s.ideal_bubble == doctest::Approx(1.0 / 3));
}

TEST_CASE("the simulation charges each receive the delivery time measured when it waited") {
  // GPipe, K = 2, M = 1, no recompute: stage 0 F0 sA0 rG0 B0 OPT, stage 1 rA0 F0 B0 sG0 OPT.
  const Schedule sched = gpipe_schedule(2, 1, CheckpointMode::kNever);
  REQUIRE(sched.stages[0].size() == 5);
  REQUIRE(sched.stages[1].size() == 5);
  REQUIRE(sched.stages[0][2].op == Op::kRecvGradient);
  REQUIRE(sched.stages[1][0].op == Op::kRecvActivation);
  // Stage 1 waits for activation 0 from 0 ms and takes it 0.1 ms after stage 0's send
  // ends at 2; stage 0 waits for the gradient from 2 ms and takes it 0.3 ms after stage
  // 1's send ends at 7.1. Stage 1's clock starts 0.5 ms later than stage 0's (its times
  // are relative to its own start).
  StepResult r;
  r.loss = 1.0;
  r.wall_ms = 10;
  StageTrace s0, s1;
  s0.ops = {{Op::kForward, 0, 0, 2}, {Op::kSendActivation, 0, 2, 2}, {Op::kRecvGradient, 0, 2, 7.4},
            {Op::kBackward, 0, 7.4, 9.4}, {Op::kOptimizerStep, -1, 9.4, 9.5}};
  s1.start_ms = 0.5;
  s1.ops = {{Op::kRecvActivation, 0, -0.5, 1.6}, {Op::kForward, 0, 1.6, 3.6}, {Op::kBackward, 0, 3.6, 6.6},
            {Op::kSendGradient, 0, 6.6, 6.6}, {Op::kOptimizerStep, -1, 6.6, 7}};
  r.stages = {s0, s1};
  ReportBuilder b({"0 linear", "1 linear"}, {"cpu:0", "cpu:1"}, 1, "never", "gpipe", 8);
  b.set_schedule(sched);
  b.add_step(0, 1.0, r, true);
  const RunSummary s = b.summary();
  CHECK(s.stages[1].delivery_ms == doctest::Approx(0.1));
  CHECK(s.stages[0].delivery_ms == doctest::Approx(0.3));
  // F0 [0,2] on 0; delivered at 2.1, F0 [2.1,4.1] B0 [4.1,7.1] on 1; delivered at 7.4,
  // B0 [7.4,9.4] on 0: a span of 9.4 where free messages would give 9.
  CHECK(s.predicted_span_ms == doctest::Approx(9.4));
  CHECK(s.predicted_bubble == doctest::Approx(1 - 9.0 / (2 * 9.4)));
  CHECK(b.json()["stages"][0]["delivery_ms"].get<double>() == doctest::Approx(0.3));
}
