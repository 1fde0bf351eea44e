// The report's accounting on timings written by hand: every number the table and
// report.json show (busy, communication, idle, utilization, span, measured and ideal
// bubble, throughput, peak memory) is worked out below from a two-stage schedule whose
// instruction times are known, so a wrong sum or a wrong denominator fails here. Then the
// run's history across launches: saved, carried over exactly, refused when malformed.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "pipeline/report/report.h"
#include "pipeline/report/report_html.h"
#include "pipeline/schedule/schedule.h"
#include "runtime/error.h"

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

// The program hand_step's timings come from (in a run, the Plan's schedule).
Schedule hand_program() {
  Schedule s;
  s.name = "gpipe";
  s.num_stages = 2;
  s.num_micro_batches = 2;
  s.cells = {{0}, {1}};
  for (const StageTrace& stage : hand_step(1.0, 0, 0).stages) {
    std::vector<Instruction> program;
    for (const TimedOp& t : stage.ops) program.push_back({t.op, t.micro_batch, t.chunk});
    s.stages.push_back(program);
  }
  return s;
}

ReportBuilder builder() {
  return ReportBuilder({"0-1 linear, relu", "2-3 linear x2"}, {"cpu:0", "cpu:1"}, hand_program(),
                       RecomputeMode::kExceptLast, 8);
}

}  // namespace

TEST_CASE("one timed step: every figure from the hand-written timings") {
  ReportBuilder b = builder();
  b.add_step(1, 2.5, hand_step(1.0, 1000, 3000), /*timed=*/true);
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

TEST_CASE("a collective is communication, its wait for the other stages idle, never optimizer time") {
  // The hand-written step with a NORM before each OPT: stage 0 arrives at 16 and it ends
  // at 16.5; stage 1 arrives at 12 and waits for stage 0 until 16 (idle), the norm's
  // own 0.5 ms (the quickest stage's duration) is communication.
  StepResult r = hand_step(1.0, 1000, 3000);
  auto with_norm = [](std::vector<TimedOp>& ops, double arrive, double opt_ms) {
    ops.back() = TimedOp{Op::kGradientNorm, -1, arrive, 16.5};
    ops.push_back(TimedOp{Op::kOptimizerStep, -1, 16.5, 16.5 + opt_ms});
  };
  with_norm(r.stages[0].ops, 16, 1);
  with_norm(r.stages[1].ops, 12, 3.5);
  ReportBuilder b = builder();
  b.add_step(1, 2.5, r, true);
  const RunSummary s = b.summary();
  CHECK(s.span_ms == 16.5);  // the collectives are inside the span, the optimizer steps are not
  const StageSummary &a = s.stages[0], &c = s.stages[1];
  CHECK(a.comm_ms == 1.5);
  CHECK(a.collective_ms == 0.5);
  CHECK(a.idle_ms == 5.0);  // 16.5 - busy 10 - comm 1.5
  CHECK(a.optimizer_ms == 1.0);
  CHECK(c.comm_ms == 1.5);
  CHECK(c.collective_ms == 0.5);
  CHECK(c.idle_ms == 6.5);  // 16.5 - busy 8.5 - comm 1.5: its 4 ms wait for stage 0 is idle
  CHECK(c.optimizer_ms == 3.5);
}

TEST_CASE("a tensor group's sums inside F and B: the report's comm, its own figure, report.json and the table") {
  // Stage 0's F0 [0,2] spent 0.5 ms in its group's sums and B0 [13,16] 1 ms; stage 1's
  // F1 [5,7.5] 0.25 ms. Two timed steps alike: the averages are the same figures.
  StepResult r = hand_step(1.0, 1000, 3000);
  r.stages[0].ops[0].group_ms = 0.5;   // F0
  r.stages[0].ops[7].group_ms = 1.0;   // B0
  r.stages[1].ops[3].group_ms = 0.25;  // F1
  ReportBuilder b = builder();
  b.add_step(1, 2.5, r, true);
  b.add_step(2, 2.4, r, true);
  const RunSummary s = b.summary();
  const StageSummary &a = s.stages[0], &c = s.stages[1];
  CHECK(a.group_ms == doctest::Approx(1.5));
  CHECK(a.forward_ms == doctest::Approx(3.5));   // 4 - 0.5
  CHECK(a.backward_ms == doctest::Approx(5.0));  // 6 - 1
  CHECK(a.busy_ms == doctest::Approx(8.5));
  CHECK(a.comm_ms == doctest::Approx(2.5));  // the sends' 1 and the sums' 1.5
  CHECK(a.idle_ms == doctest::Approx(5.0));  // 16 - 8.5 - 2.5: unchanged
  CHECK(c.group_ms == doctest::Approx(0.25));
  CHECK(c.forward_ms == doctest::Approx(4.75));
  CHECK(c.comm_ms == doctest::Approx(1.25));
  const nlohmann::json j = b.json();
  CHECK(j["stages"][0]["tensor_group_ms"].get<double>() == doctest::Approx(1.5));
  CHECK(j["stages"][1]["tensor_group_ms"].get<double>() == doctest::Approx(0.25));
  const std::string table = b.table();
  CHECK(table.find("Tensor group's collectives, waits for the other members included (in comm ms, not in fwd, recomp "
                   "or bwd): stage 0 1.50 ms (60% of its comm), "
                   "stage 1 0.25 ms (20% of its comm)") != std::string::npos);
  // The page: stage 0's sends 1 and its group's 1.5 apart (forward 3.5, recompute 0, B 5,
  // W 0, sends 1, collectives 0, tensor group 1.5, idle 5).
  HtmlReportInput in;
  in.title = "t";
  in.summary = s;
  in.schedule = hand_program();
  in.losses = b.losses();
  const std::string page = render_report_html(in);
  CHECK(page.find("<th>sends</th><th>collectives</th><th>tensor group</th><th>idle</th>") != std::string::npos);
  CHECK(page.find("<td>3.50</td><td>0.00</td><td>5.00</td><td>0.00</td><td>1.00</td><td>0.00</td><td>1.50</td>"
                  "<td>5.00</td>") != std::string::npos);
  // The job's axes in the table's first line and the page's heading.
  b.set_layout(2, 4, true);
  const std::string axes = "batch=8, tensor parallel T=4 (sequence parallel), replicas D=2\n";
  CHECK(b.table().find(axes) != std::string::npos);
  in.summary = b.summary();
  CHECK(render_report_html(in).find("batch 8, tensor parallel T=4 (sequence parallel), replicas D=2 &middot;") !=
        std::string::npos);
  // Without a tensor group: no such line.
  ReportBuilder plain = builder();
  plain.add_step(1, 2.5, hand_step(1.0, 1000, 3000), true);
  CHECK(plain.table().find("Tensor group") == std::string::npos);
  CHECK(plain.json()["stages"][0]["tensor_group_ms"].get<double>() == 0);
  CHECK(plain.table().find("batch=8\n") != std::string::npos);
  CHECK(plain.table().find("Device memory") == std::string::npos);  // no device measured (traces from before it)
}

TEST_CASE("several steps: warm-up left out, the rest averaged, peaks kept") {
  ReportBuilder b = builder();
  b.add_step(1, 3.0, hand_step(100.0, 99999, 99999), /*timed=*/false);  // a slow warm-up: loss only
  StepResult second = hand_step(1.0, 1000, 3000), third = hand_step(3.0, 2000, 2500);  // every time x3
  second.stages[0].device_peak_bytes = 6000;
  third.stages[0].device_peak_bytes = 4000;  // stage 1's device measured nothing: no count
  b.add_step(2, 2.0, second, true);
  b.add_step(3, 1.0, third, true);
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
  CHECK(s.stages[0].optimizer_bytes == 0);  // hand_step's optimizer holds no state
  CHECK(s.stages[0].device_peak_bytes == 6000);  // the most of any timed step
  CHECK(s.stages[1].device_peak_bytes == 0);

  const nlohmann::json j = b.json();
  REQUIRE(j["steps"].size() == 3);  // every step's loss, the warm-up's too
  CHECK(j["steps"][0]["loss"] == 3.0);
  CHECK(j["steps"][2]["step"] == 3);  // numbered from 1, as the terminal numbers them
  CHECK(j["timed_steps"] == 2);
  CHECK(j["span_ms"].get<double>() == doctest::Approx(32.0));
  CHECK(j["bubble"]["measured"].get<double>() == doctest::Approx(1 - 18.5 / 32));
  CHECK(j["bubble"]["theoretical"].get<double>() == doctest::Approx(1.0 / 3));
  CHECK(j["stages"][1]["idle_ms"].get<double>() == doctest::Approx(13.0));
  CHECK(j["stages"][1]["recompute_ms"].get<double>() == doctest::Approx(2.0));
  CHECK(j["stages"][1]["layers"] == "2-3 linear x2");
  CHECK(j["stages"][1]["device"] == "cpu:1");
  CHECK(j["recompute"] == "except_last");
  CHECK(j["checkpoint"] == "except_last");  // the old name, kept one release
  CHECK(j["num_stages"] == 2);
  CHECK(j["partitions"] == 2);
  CHECK(j["batch_size"] == 8);
  CHECK(!j.contains("eval"));
}

TEST_CASE("the table and report.json show the same figures, and the scores") {
  ReportBuilder b = builder();
  // Backend ops per instruction: F 3, R 3, B 4 and OPT 6 on both stages, and the zeroing's
  // 1 in stage 0's first receive: stage 0 F 2 x 3 + B 2 x 4 = 14 of 14 + 1 + 6 = 21;
  // stage 1 F 2 x 3 + R 3 + B 2 x 4 = 17 of 17 + 6 + 2 outside its instructions = 25.
  StepResult step = hand_step(1.0, 2 << 20, 3 << 20);
  for (StageTrace& st : step.stages) {
    for (TimedOp& op : st.ops) {
      op.ops = op.op == Op::kBackward ? 4 : op.op == Op::kOptimizerStep ? 6 : is_compute(op.op) ? 3 : 0;
    }
  }
  step.stages[0].ops[4].ops = 1;  // rG1
  step.stages[1].other_ops = 2;  // the zeroing, the scalars' write (outside any instruction's own)
  step.stages[0].device_peak_bytes = (5 << 20) + (512 << 10);  // 5.5 MiB
  step.stages[1].device_peak_bytes = 7 << 20;
  b.add_step(1, 2.0, step, true);
  b.add_validation(1, 1.75, 0.5);
  b.set_eval(1.5, 0.625);
  const std::string t = b.table();
  CAPTURE(t);
  CHECK(t.find("K=2 stages, M=2 micro-batches, recompute=except_last, schedule=gpipe, batch=8") != std::string::npos);
  CHECK(t.find("averaged over 1 timed steps (span 16.00 ms, wall 20.50 ms)") != std::string::npos);
  // stage 0: fwd 4, recomp 0, bwd 6, comm 1, idle 5, opt 1, util 62.5%, no MFU (no FLOPs given), 2 MiB
  CHECK(t.find("cpu:0        4.00      0.00      6.00     1.00     5.00     1.00  62.5%      -   2.00 MiB") != std::string::npos);
  CHECK(t.find("cpu:1        5.00      1.00      2.50     1.00     6.50     8.00  53.1%      -   3.00 MiB") != std::string::npos);
  CHECK(t.find("MFU:") == std::string::npos);
  CHECK(t.find("layers:") == std::string::npos);  // every stage's layers fit their column
  // The predicted bubble, by hand: no receive waited past its send's end, so every
  // delivery is 0; the mean op times are stage 0 F 2, sA 0.5, B 3 and stage 1 F 2.5,
  // B 1.25, R 1, sG 0.5 (OPT counts 0). Stage 1 runs F0 2.5-5, F1 5-7.5, B1 7.5-8.75,
  // sG1 -9.25, R0 -10.25, B0 -11.5, sG0 -12; stage 0 F0 0-2, F1 2.5-4.5, B1 9.25-12.25,
  // B0 12.25-15.25. Busy 10 + 8.5 over 2 x 15.25: 1 - 18.5 / 30.5 = 0.393.
  CHECK(t.find("Bubble: measured 0.422, predicted 0.393 (the schedule simulated with the measured op and delivery "
               "times), formula 0.333") != std::string::npos);
  CHECK(t.find("Throughput: 390.2 samples/s") != std::string::npos);
  CHECK(t.find("Device memory, measured (the most the stage's device's allocator had handed out at once from this "
               "launch's first step: every tensor of its process there, the temporaries too; stages sharing a device in one process read "
               "one count): stage 0 cpu:0 5.50 MiB, stage 1 cpu:1 7.00 MiB\n") != std::string::npos);
  CHECK(t.find("Validation: loss 1.5000, accuracy 62.50%") != std::string::npos);
  CHECK(t.find("Ops per step, measured (backend calls: on a GPU most launch one kernel or more, none captured in a "
               "graph): stage 0 14 in F, R, B and W of 21 in all, stage 1 17 in F, R, B and W of 25 in all\n") !=
        std::string::npos);
  const nlohmann::json j = b.json();
  CHECK(j["stages"][0]["device_peak_bytes"] == (5 << 20) + (512 << 10));
  CHECK(j["stages"][1]["device_peak_bytes"] == 7 << 20);
  CHECK(j["stages"][0]["ops_per_step"] == 14);
  CHECK(j["stages"][0]["ops_per_step_all"] == 21);
  CHECK(j["stages"][1]["ops_per_step"] == 17);
  CHECK(j["stages"][1]["ops_per_step_all"] == 25);
  CHECK(j["eval"]["loss"] == 1.5);
  CHECK(j["eval"]["accuracy"] == 0.625);
  REQUIRE(j["validation"].size() == 1);
  CHECK(j["validation"][0]["loss"] == 1.75);
  CHECK(j["stages"][0]["captured_ops"] == 0);
  // A step that was a replay of a captured one (pipeline.capture): the line says so and
  // gives each stage's captured ops; the JSON has them.
  step.stages[0].captured_nodes = 15;
  step.stages[1].captured_nodes = 19;
  b.add_step(2, 2.0, step, true);
  const std::string t2 = b.table();
  CAPTURE(t2);
  CHECK(t2.find("Ops per step, measured (backend calls, captured once and replayed: on a GPU one graph launch a step): "
                "stage 0 14 in F, R, B and W of 21 in all, 15 of them replayed, stage 1 17 in F, R, B and W of 25 in "
                "all, 19 of them replayed\n") != std::string::npos);
  CHECK(b.json()["stages"][1]["captured_ops"] == 19);
}

TEST_CASE("the matrix products timed alone: a line each, the first 8, and every one in report.json") {
  ReportBuilder b = builder();
  b.add_step(1, 2.0, hand_step(1.0, 1, 1), true);
  std::vector<GemmRate> gemms;
  for (int i = 0; i < 9; ++i) {
    GemmRate g;
    g.op = i == 0 ? "linear_weight_grad" : "matmul";
    g.m = 64;
    g.n = 32;
    g.k = 128 + i;
    g.trans_a = i == 0;  // a is (k, m): shown as it is stored, 128x64
    g.dtype = "bfloat16";
    g.c_dtype = i == 0 ? "float32" : "bfloat16";
    g.device = "cuda:0";
    g.stages = {0, 1};
    g.layers = "1-16";
    g.phases = "W";
    g.calls = 16;
    g.timed_calls = 20;
    g.ms = 0.002;
    g.flops_per_second = g.flops() / (g.ms / 1e3);  // 2 x 64 x 32 x 128 = 524288 / 2 us = 262.1 GFLOP/s
    g.peak_flops_per_second = i == 0 ? 1000e9 : 0;
    gemms.push_back(g);
  }
  b.set_gemms(gemms);
  const std::string t = b.table();
  CAPTURE(t);
  CHECK(t.find("  linear_weight_grad (128x64)^T @ 128x32 -> 64x32, bfloat16 in, float32 out: stage 0, 1, layers "
               "1-16, W, 16 a micro-batch: 0.002 ms, 262.1 GFLOP/s, 26.2% of 1000.0\n") != std::string::npos);
  CHECK(t.find("  matmul 64x135 @ 135x32 -> 64x32, bfloat16 in, bfloat16 out: stage 0, 1, layers 1-16, W, 16 a "
               "micro-batch: 0.002 ms, 276.5 GFLOP/s\n") != std::string::npos);  // no peak: no fraction
  CHECK(t.find("matmul 64x136") == std::string::npos);  // the ninth: only in report.json
  CHECK(t.find("  and 1 more in report.json\n") != std::string::npos);
  const nlohmann::json j = b.json();
  REQUIRE(j["gemms"].size() == 9);
  CHECK(j["gemms"][0]["flops"] == 524288.0);
  CHECK(j["gemms"][0]["peak_fraction"].get<double>() == doctest::Approx(524288.0 / 2e-6 / 1000e9));
  CHECK_FALSE(j["gemms"][1].contains("peak_fraction"));
  CHECK(j["gemms"][8]["k"] == 136);
  CHECK(j["gemms"][8]["stages"] == nlohmann::json({0, 1}));
}

TEST_CASE("attention's line names its operands, and report.json its operands and the FLOPs of its products") {
  ReportBuilder b = builder();
  b.add_step(1, 2.0, hand_step(1.0, 1, 1), true);
  GemmRate g;
  g.op = "fused_attention";
  g.operands = "q 4x16x32, k 4x16x16, v 4x16x16, heads 2 -> out 4x16x32, stats 4x2x16";
  g.op_flops = 131072;  // 4 B T^2 C
  g.dtype = g.c_dtype = "bfloat16";
  g.device = "cuda:0";
  g.stages = {1};
  g.layers = "2";
  g.phases = "F";
  g.calls = 1;
  g.timed_calls = 20;
  g.ms = 0.004;
  g.flops_per_second = g.flops() / (g.ms / 1e3);  // 131072 / 4 us = 32.8 GFLOP/s
  g.peak_flops_per_second = 100e9;
  b.set_gemms({g});
  const std::string t = b.table();
  CAPTURE(t);
  CHECK(t.find("  fused_attention q 4x16x32, k 4x16x16, v 4x16x16, heads 2 -> out 4x16x32, stats 4x2x16, bfloat16 "
               "in, bfloat16 out: stage 1, layers 2, F, 1 a micro-batch: 0.004 ms, 32.8 GFLOP/s, 32.8% of 100.0\n") !=
        std::string::npos);
  const nlohmann::json j = b.json();
  REQUIRE(j["gemms"].size() == 1);
  CHECK(j["gemms"][0]["operands"] == g.operands);
  CHECK(j["gemms"][0]["flops"] == 131072.0);
  CHECK(j["gemms"][0]["m"] == 0);
  CHECK(j["gemms"][0]["peak_fraction"].get<double>() == doctest::Approx(131072.0 / 4e-6 / 100e9));
}

TEST_CASE("MFU: each stage's useful FLOPs per second of step over its peak, and the pipeline's over their sum") {
  ReportBuilder b = builder();
  b.add_step(1, 2.0, hand_step(1.0, 1, 1), true);  // a step of 20.5 ms wall
  // 0.41 and 0.205 GFLOP per step over 100 and 50 GFLOP/s peaks: 0.41 / 0.0205 s = 20
  // GFLOP/s, 20% of stage 0's peak; 10 GFLOP/s, 20% of stage 1's; 30 of 150 overall.
  b.set_flops({0.41e9, 0.205e9}, {100e9, 50e9});
  const RunSummary s = b.summary();
  CHECK(s.stages[0].mfu == doctest::Approx(0.2));
  CHECK(s.stages[1].mfu == doctest::Approx(0.2));
  CHECK(s.mfu == doctest::Approx(30.0 / 150));
  CHECK(s.useful_flops == doctest::Approx(0.615e9));
  CHECK(s.peak_flops_per_second == doctest::Approx(150e9));
  const std::string t = b.table();
  CAPTURE(t);
  CHECK(t.find("  62.5%  20.0%   0.00 MiB") != std::string::npos);
  CHECK(t.find("MFU: 20.0% (0.61 GFLOP of forward and backward per step in 20.50 ms: 30.0 GFLOP/s of the devices' "
               "150.0 GFLOP/s peak)") != std::string::npos);
  const nlohmann::json j = b.json();
  CHECK(j["mfu"].get<double>() == doctest::Approx(0.2));
  CHECK(j["peak_flops_per_second"].get<double>() == doctest::Approx(150e9));
  CHECK(j["stages"][1]["mfu"].get<double>() == doctest::Approx(0.2));
  CHECK(j["stages"][1]["useful_flops"].get<double>() == doctest::Approx(0.205e9));
}

TEST_CASE("the report describes the stages of the program it is given") {
  CHECK_THROWS_WITH_AS(ReportBuilder({"0-3 linear x4"}, {"cpu:0"}, hand_program(), RecomputeMode::kNever, 8),
                       "ReportBuilder: 1 stage descriptions and 1 devices for a program of 2 stages", Error);
}

TEST_CASE("a run with no timed step reports zeros, not NaN") {
  ReportBuilder b = builder();
  b.add_step(1, 2.0, hand_step(1.0, 1, 1), false);
  const RunSummary s = b.summary();
  CHECK(s.timed_steps == 0);
  CHECK(s.span_ms == 0);
  CHECK(s.samples_per_second == 0);
  CHECK(s.measured_bubble == 0);
  CHECK(s.stages[0].utilization == 0);
  CHECK(s.ideal_bubble == doctest::Approx(1.0 / 3));
  CHECK(b.table().find("Bubble: measured 0.000, ideal (K-1)/(M+K-1) = 0.333") != std::string::npos);
}

TEST_CASE("the simulation charges each receive the delivery time measured when it waited") {
  // GPipe, K = 2, M = 1, no recompute: stage 0 F0 sA0 rG0 B0 OPT, stage 1 rA0 F0 B0 sG0 OPT.
  const Schedule sched = gpipe_schedule(2, 1, RecomputeMode::kNever);
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
  ReportBuilder b({"0 linear", "1 linear"}, {"cpu:0", "cpu:1"}, sched, RecomputeMode::kNever, 8);
  b.add_step(1, 1.0, r, true);
  const RunSummary s = b.summary();
  CHECK(s.stages[1].delivery_ms == doctest::Approx(0.1));
  CHECK(s.stages[0].delivery_ms == doctest::Approx(0.3));
  // F0 [0,2] on 0; delivered at 2.1, F0 [2.1,4.1] B0 [4.1,7.1] on 1; delivered at 7.4,
  // B0 [7.4,9.4] on 0: a span of 9.4 where free messages would give 9.
  CHECK(s.predicted_span_ms == doctest::Approx(9.4));
  CHECK(s.predicted_bubble == doctest::Approx(1 - 9.0 / (2 * 9.4)));
  CHECK(b.json()["stages"][0]["delivery_ms"].get<double>() == doctest::Approx(0.3));
}

TEST_CASE("stages that took turns on one device are simulated taking turns (Plan::turns)") {
  // GPipe, K = 2, M = 2, F 1 and B 2 on each stage, timed as they ran on one device: by
  // hand (schedule_test), stage 0 F0 0-1 F1 1-2 B1 6-8 B0 10-12, stage 1 F0 2-3 F1 3-4
  // B1 4-6 B0 8-10. Taking turns, the measured times give that span again, 12; each on its
  // own device they would give GPipe's (M + K - 1)(F + B) = 9.
  const Schedule sched = gpipe_schedule(2, 2, RecomputeMode::kNever);
  const CostFn f1b2 = [](int, const Instruction& i) {
    return i.op == Op::kForward ? 1.0 : i.op == Op::kBackward ? 2.0 : 0.0;
  };
  const Simulation ran = simulate(sched, f1b2, CommModel::kBuffered, {0, 0});
  REQUIRE(ran.makespan == doctest::Approx(12.0));
  StepResult r;
  r.loss = 1.0;
  r.wall_ms = 12;
  for (const auto& timeline : ran.timeline) {
    StageTrace t;
    for (const TimedInstruction& ti : timeline) t.ops.push_back({ti.ins.op, ti.ins.micro_batch, ti.start, ti.end, ti.ins.chunk});
    r.stages.push_back(t);
  }
  auto predicted = [&](bool turns) {
    ReportBuilder b({"0 linear", "1 linear"}, {"cpu:0", "cpu:0"}, sched, RecomputeMode::kNever, 8);
    if (turns) b.set_turns({0, 0});
    b.add_step(1, 1.0, r, true);
    return b.summary();
  };
  const RunSummary shared = predicted(true);
  CHECK(shared.predicted_span_ms == doctest::Approx(12.0));
  CHECK(shared.predicted_bubble == doctest::Approx(0.5));
  CHECK(shared.measured_bubble == doctest::Approx(0.5));
  CHECK(predicted(false).predicted_span_ms == doctest::Approx(9.0));
}

TEST_CASE("the simulation charges each tensor collective its own measured time, each compute instruction its own less them") {
  // GPipe, K = 2, M = 2, no recompute; stage 0's cell asks one sum in F and one in B, stage
  // 1's none: stage 0 F0 tAR0 sA0 F1 tAR1 sA1 rG1 B1 tAR1 rG0 B0 tAR0 OPT.
  Schedule sched = gpipe_schedule(2, 2, RecomputeMode::kNever);
  TensorProgram t;
  t.members = 2;
  t.cells.resize(2);
  t.cells[0].forward = {{Op::kTensorSum, 0, 8}};
  t.cells[0].layers.resize(1);
  t.cells[0].layers[0].backward = {{Op::kTensorSum, 0, 8}};
  t.cells[1].layers.resize(1);
  lower_tensor_collectives(sched, t);
  REQUIRE(schedule_table(sched) ==
          "stage 0: F0 tAR0 sA0 F1 tAR1 sA1 rG1 B1 tAR1 rG0 B0 tAR0 OPT\n"
          "stage 1: rA0 F0 rA1 F1 B1 sG1 B0 sG0 OPT\n");
  // Stage 0: each F 3 ms, 2 of them its sum; each B 1 ms, 0.2 of it its sum. Stage 1: F 2,
  // B 3. Every message is taken when it is sent.
  StepResult r;
  r.loss = 1.0;
  r.wall_ms = 16;
  StageTrace s0, s1;
  s0.ops = {{Op::kForward, 0, 0, 3},       {Op::kTensorSum, 0, 1, 3},      {Op::kSendActivation, 0, 3, 3},
            {Op::kForward, 1, 3, 6},       {Op::kTensorSum, 1, 4, 6},      {Op::kSendActivation, 1, 6, 6},
            {Op::kRecvGradient, 1, 6, 11}, {Op::kBackward, 1, 11, 12},     {Op::kTensorSum, 1, 11.8, 12},
            {Op::kRecvGradient, 0, 12, 14}, {Op::kBackward, 0, 14, 15},    {Op::kTensorSum, 0, 14.8, 15},
            {Op::kOptimizerStep, -1, 15, 16}};
  s0.ops[0].group_ms = s0.ops[3].group_ms = 2;
  s0.ops[7].group_ms = s0.ops[10].group_ms = 0.2;
  s1.ops = {{Op::kRecvActivation, 0, 3, 3}, {Op::kForward, 0, 3, 5},  {Op::kRecvActivation, 1, 5, 6},
            {Op::kForward, 1, 6, 8},        {Op::kBackward, 1, 8, 11}, {Op::kSendGradient, 1, 11, 11},
            {Op::kBackward, 0, 11, 14},     {Op::kSendGradient, 0, 14, 14}, {Op::kOptimizerStep, -1, 14, 15}};
  r.stages = {s0, s1};
  ReportBuilder b({"0 linear", "1 linear"}, {"cpu:0", "cpu:1"}, sched, RecomputeMode::kNever, 8);
  b.add_step(1, 1.0, r, true);
  const RunSummary s = b.summary();
  // Stage 0's compute is F 1 + 1 and B 0.8 + 0.8, its tensor group 4.4.
  CHECK(s.stages[0].forward_ms == doctest::Approx(2.0));
  CHECK(s.stages[0].backward_ms == doctest::Approx(1.6));
  CHECK(s.stages[0].group_ms == doctest::Approx(4.4));
  // Simulated with each collective's own time (F's 2, B's 0.2) the step is as measured:
  // F0 [0,1] tAR0 [1,3], F1 [3,4] tAR1 [4,6]; stage 1 F0 [3,5], F1 [6,8], B1 [8,11], B0
  // [11,14]; stage 0 B1 [11,11.8] tAR1 [11.8,12], B0 [14,14.8] tAR0 [14.8,15]: a span of
  // 15. (With one mean for every tAR of the stage, 1.1 ms, it would be 14.1.)
  CHECK(s.predicted_span_ms == doctest::Approx(15.0));
}

// ---- A run across launches: history() saved with a checkpoint, carry_over() on resume.
//
// The losses below are chosen to be hard to print: random bit patterns, a denormal, -0,
// 1/3, values one ulp apart. The expected steps, launches and positions are worked out
// from the launches' first steps by hand, not with the builder's own launch_of().

namespace {

uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

// n losses that are hard to print; another seed gives other ones (a redone step's loss differs).
std::vector<double> awkward_losses(int n, uint64_t seed) {
  std::vector<double> out = {5.59, 0.1, 1.0 / 3, -0.0, 4.9e-324, 2.2250738585072014e-308, 1e300,
                             std::nextafter(1.0, 2.0), 1.0, std::nextafter(1.0, 0.0)};
  std::mt19937_64 rng(seed);
  while (static_cast<int>(out.size()) < n) {
    const uint64_t u = rng();
    double d;
    std::memcpy(&d, &u, sizeof d);
    if (std::isfinite(d)) out.push_back(d);
  }
  out.resize(n);
  return out;
}

// Through text, as trainer_state.json carries it.
nlohmann::json through_file(const nlohmann::json& h) { return nlohmann::json::parse(h.dump()); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const gpipe::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("a fresh run is launch 1 from step 1, and its history is compact JSON") {
  ReportBuilder b = builder();
  b.add_step(1, 0.5, hand_step(1.0, 1, 1), false);
  b.add_step(2, 0.25, hand_step(1.0, 1, 1), true);
  b.add_validation(2, 0.75, 0.5);
  CHECK(b.history(2).dump() ==
        R"({"launches":[{"first_step":1,"launch":1}],"steps":[[1,0.5],[2,0.25]],"validations":[[2,0.75,0.5]],"version":2})");
  CHECK(b.history(1).dump() ==
        R"({"launches":[{"first_step":1,"launch":1}],"steps":[[1,0.5]],"validations":[],"version":2})");
  const nlohmann::json j = b.json();
  CHECK(j["timed_launch"] == 1);
  CHECK(j["launches"] == nlohmann::json::parse(R"([{"launch":1,"first_step":1,"last_step":2,"steps":2}])"));
  CHECK(j["steps"][1] == nlohmann::json::parse(R"({"step":2,"loss":0.25,"launch":1})"));
  CHECK(j["validation"][0]["launch"] == 1);
  CHECK(b.table().find("Run:") == std::string::npos);  // one launch: nothing to say
}

TEST_CASE("every double survives the history's text exactly") {
  const std::vector<double> l = awkward_losses(20000, 7);
  ReportBuilder a = builder();
  for (int i = 0; i < static_cast<int>(l.size()); ++i) a.add_step(i + 1, l[i], hand_step(1.0, 1, 1), false);
  ReportBuilder b = builder();
  b.carry_over(through_file(a.history(static_cast<int>(l.size()))), static_cast<int>(l.size()) + 1);
  REQUIRE(b.losses().size() == l.size());
  int differ = 0;
  for (size_t i = 0; i < l.size(); ++i) differ += bits(b.losses()[i].second) != bits(l[i]);
  CHECK(differ == 0);
}

TEST_CASE("history, carry_over: three launches, the third redoing steps after a crash") {
  // Launch 1: steps 1-30, validations after 10, 20 and 30, checkpoint after step 30.
  // Launch 2: resumes at 31, runs 31-50 with a validation after 40, checkpoint after step 45, crashes after 50.
  // Launch 3: resumes at 46 from that checkpoint, runs 46-60.
  const std::vector<double> l1 = awkward_losses(30, 1), l2 = awkward_losses(20, 2), l3 = awkward_losses(15, 3);
  ReportBuilder first = builder();
  for (int s = 1; s <= 30; ++s) first.add_step(s, l1[s - 1], hand_step(1.0, 1, 1), s > 1);
  for (int s : {10, 20, 30}) first.add_validation(s, 2.0 + s, 0.01 * s);
  const nlohmann::json h1 = through_file(first.history(30));

  ReportBuilder second = builder();
  second.carry_over(h1, 31);
  CHECK(second.launch() == 2);
  for (int s = 31; s <= 50; ++s) second.add_step(s, l2[s - 31], hand_step(1.0, 1, 1), s > 31);
  second.add_validation(40, 1.5, 0.4);
  second.add_validation(50, 1.25, 0.45);  // after the checkpoint: lost with the crash
  const nlohmann::json h2 = through_file(second.history(45));
  CHECK(h2["launches"] == nlohmann::json::parse(R"([{"launch":1,"first_step":1},{"launch":2,"first_step":31}])"));
  REQUIRE(h2["steps"].size() == 45);  // 1..45; 46..50 are left out
  CHECK(h2["steps"].back()[0] == 45);
  REQUIRE(h2["validations"].size() == 4);  // 10, 20, 30, 40
  CHECK(h2["validations"][3] == nlohmann::json::parse("[40, 1.5, 0.4]"));

  ReportBuilder third = builder();
  third.carry_over(h2, 46);
  CHECK(third.launch() == 3);
  for (int s = 46; s <= 60; ++s) third.add_step(s, l3[s - 46], hand_step(2.0, 1, 1), s > 46);
  third.add_validation(60, 1.0, 0.5);

  // Every step once, with its loss bit for bit: launch 1's, launch 2's up to 45, launch 3's.
  const nlohmann::json j = third.json();
  REQUIRE(j["steps"].size() == 60);
  for (int s = 1; s <= 60; ++s) {
    CAPTURE(s);
    const double want = s <= 30 ? l1[s - 1] : s <= 45 ? l2[s - 31] : l3[s - 46];
    const int launch = s <= 30 ? 1 : s <= 45 ? 2 : 3;
    CHECK(j["steps"][s - 1]["step"] == s);
    CHECK(bits(j["steps"][s - 1]["loss"].get<double>()) == bits(want));
    CHECK(bits(third.losses()[s - 1].second) == bits(want));
    CHECK(j["steps"][s - 1]["launch"] == launch);
  }
  CHECK(j["launches"] == nlohmann::json::parse(R"([{"launch":1,"first_step":1,"last_step":30,"steps":30},
                                                   {"launch":2,"first_step":31,"last_step":45,"steps":15},
                                                   {"launch":3,"first_step":46,"last_step":60,"steps":15}])"));
  REQUIRE(j["validation"].size() == 5);
  const int vsteps[] = {10, 20, 30, 40, 60}, vlaunch[] = {1, 1, 1, 2, 3};
  for (int i = 0; i < 5; ++i) {
    CHECK(j["validation"][i]["step"] == vsteps[i]);
    CHECK(j["validation"][i]["launch"] == vlaunch[i]);
  }
  CHECK(j["validation"][1]["loss"] == 22.0);
  CHECK(j["validation"][1]["accuracy"] == 0.01 * 20);  // as it went in
  // The timings are launch 3's own: 14 timed steps of hand_step at x2 (span 32 ms).
  CHECK(j["timed_launch"] == 3);
  CHECK(j["timed_steps"] == 14);
  CHECK(j["span_ms"].get<double>() == doctest::Approx(32.0));
  const std::string t = third.table();
  CAPTURE(t);
  CHECK(t.find("Run: steps 1-60 in 3 launches; timings are from launch 3 (steps 46-60)\n") != std::string::npos);
  CHECK(t.find("averaged over 14 timed steps") != std::string::npos);
}

TEST_CASE("a launch that starts after up_to_step is left out of the history") {
  ReportBuilder a = builder();
  a.carry_over(nlohmann::json::parse(R"({"version":2,"launches":[{"launch":1,"first_step":1}],
                                         "steps":[[1,3.0],[2,2.0]],"validations":[]})"),
               3);
  // A checkpoint saved again after step 2 before this launch ran a step: resuming from it is launch 2 again.
  const nlohmann::json h = a.history(2);
  CHECK(h["launches"].size() == 1);
  ReportBuilder b = builder();
  b.carry_over(through_file(h), 3);
  CHECK(b.launch() == 2);
}

TEST_CASE("a malformed history throws, naming what is wrong, and leaves the builder as it was") {
  const std::string good = R"({"version":2,"launches":[{"launch":1,"first_step":1},{"launch":2,"first_step":4}],
                               "steps":[[1,1.0],[2,0.9],[3,0.8],[4,0.7],[5,0.6]],"validations":[[5,0.5,0.25]]})";
  struct Case {
    const char* history;
    const char* says;
  };
  const Case cases[] = {
      {"[]", "not an object"},
      {R"({"launches":[],"steps":[],"validations":[]})", "\"version\""},
      {R"({"version":3,"launches":[],"steps":[],"validations":[]})", "version 3"},
      {R"({"version":"2","launches":[],"steps":[],"validations":[]})", "\"version\""},
      {R"({"version":2,"steps":[],"validations":[]})", "no \"launches\""},
      {R"({"version":2,"launches":{},"steps":[],"validations":[]})", "\"launches\" is object"},
      {R"({"version":2,"launches":[{"launch":2,"first_step":1}],"steps":[],"validations":[]})", "numbered 2"},
      {R"({"version":2,"launches":[{"launch":1}],"steps":[],"validations":[]})", "not {\"launch\""},
      {R"({"version":2,"launches":[{"launch":1,"first_step":0}],"steps":[],"validations":[]})", "not a step from 1"},
      {R"({"version":1,"launches":[{"launch":1,"first_step":-1}],"steps":[],"validations":[]})", "not a step from 0"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1.5}],"steps":[],"validations":[]})", "not an integer"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1},{"launch":2,"first_step":1}],"steps":[],
           "validations":[]})", "not after launch 1's 1"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":10}],"steps":[],"validations":[]})",
       "not before this launch's first step 10"},
      {R"({"version":2,"launches":[],"steps":[[1,1.0]],"validations":[]})", "steps without a launch"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[1]],"validations":[]})",
       "not [step, loss]"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[1,"x"]],"validations":[]})",
       "steps[0]'s loss"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[1,null]],"validations":[]})",
       "steps[0]'s loss"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[10,1.0]],"validations":[]})",
       "outside the history's steps 1 to 9"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":3}],"steps":[[2,1.0]],"validations":[]})",
       "outside the history's steps 3 to 9"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[2,1.0],[2,0.5]],"validations":[]})",
       "not after step 2"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[18446744073709551615,1.0]],
           "validations":[]})", "not a step from 1"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[],"validations":[[3,1.0]]})",
       "not [step, loss, accuracy]"},
      {R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[],"validations":[[5,1,1],[4,1,1]]})",
       "before step 5"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.history);
    ReportBuilder b = builder();
    const std::string what = error_of([&] { b.carry_over(nlohmann::json::parse(c.history), 10); });
    CAPTURE(what);
    CHECK(what.find("malformed report history") != std::string::npos);
    CHECK(what.find(c.says) != std::string::npos);
    // Nothing was taken: the good history still goes in.
    CHECK(b.launch() == 1);
    CHECK(b.losses().empty());
    b.carry_over(nlohmann::json::parse(good), 6);
    CHECK(b.launch() == 3);
    CHECK(b.losses().size() == 5);
  }
  // A validation whose score was NaN (written as null) is kept, as NaN.
  ReportBuilder b = builder();
  b.carry_over(nlohmann::json::parse(R"({"version":2,"launches":[{"launch":1,"first_step":1}],"steps":[[1,1.0]],
                                         "validations":[[1,null,0.5]]})"),
               2);
  REQUIRE(b.validations().size() == 1);
  CHECK(std::isnan(b.validations()[0].loss));
  // Once is all: carry_over after the launch's first step is the caller's mistake.
  ReportBuilder late = builder();
  late.add_step(1, 1.0, hand_step(1.0, 1, 1), false);
  CHECK(error_of([&] { late.carry_over(nlohmann::json::parse(good), 6); }).find("carry_over") != std::string::npos);
}

TEST_CASE("a version-1 history (steps from 0, before 2026-11-26) is read and renumbered from 1") {
  ReportBuilder b = builder();
  b.carry_over(nlohmann::json::parse(R"({"version":1,"launches":[{"launch":1,"first_step":0},{"launch":2,"first_step":3}],
                                         "steps":[[0,1.0],[1,0.9],[2,0.8],[3,0.7],[4,0.6]],
                                         "validations":[[4,0.5,0.25]]})"),
               6);
  REQUIRE(b.losses().size() == 5);
  CHECK(b.losses().front() == std::make_pair(1, 1.0));
  CHECK(b.losses().back() == std::make_pair(5, 0.6));
  REQUIRE(b.validations().size() == 1);
  CHECK(b.validations()[0].step == 5);
  const auto launches = b.launches();
  REQUIRE(launches.size() == 3);
  CHECK(launches[0].first_step == 1);
  CHECK(launches[1].first_step == 4);
  CHECK(launches[1].last_step == 5);
  CHECK(launches[2].first_step == 6);
  CHECK(b.history(5)["version"] == 2);  // saved again in the current numbering
  CHECK(b.history(5)["steps"][0][0] == 1);
}

TEST_CASE("the page charts every launch's losses with a marker where each later one began") {
  ReportBuilder b = builder();
  nlohmann::json h = {{"version", 2},
                      {"launches", {{{"launch", 1}, {"first_step", 1}}, {{"launch", 2}, {"first_step", 31}}}},
                      {"steps", nlohmann::json::array()},
                      {"validations", {{10, 2.5, 0.25}}}};
  for (int s = 1; s <= 45; ++s) h["steps"].push_back({s, 3.0 - 0.01 * s});
  b.carry_over(h, 46);
  for (int s = 46; s <= 60; ++s) b.add_step(s, 2.0 - 0.01 * s, hand_step(1.0, 1, 1), s > 46);
  HtmlReportInput in;
  in.title = "t";
  in.summary = b.summary();
  in.losses = b.losses();
  in.validations = b.validations();
  const std::string page = render_report_html(in);
  auto count = [&](const std::string& what) {
    int n = 0;
    for (size_t at = page.find(what); at != std::string::npos; at = page.find(what, at + 1)) ++n;
    return n;
  };
  CHECK(count("class=\"launchmark\"") == 2);
  // The chart is 720 px wide with 56 px left and 16 px right of the plot: step s is at
  // 56 + 648 (s - 1) / 59 (steps 1 to 60).
  CHECK(page.find("<line x1=\"385.5\" x2=\"385.5\"") != std::string::npos);  // step 31
  CHECK(page.find("<line x1=\"550.2\" x2=\"550.2\"") != std::string::npos);  // step 46
  CHECK(page.find(">launch 2: resumed at step 31<title>") != std::string::npos);
  CHECK(page.find(">launch 3: resumed at step 46<title>") != std::string::npos);
  // Labels are about 6 px a character (28 here). Launch 2's runs right of its marker,
  // from 389.5 to 557.5. Launch 3's would end at 550.2 + 4 + 168 = 722.2, past the chart's
  // 720: it ends at its marker instead, from 378.2, under launch 2's: the second row, and
  // the plot moves down for both rows.
  CHECK(page.find("<text x=\"389.5\" y=\"22\" class=\"launchlabel\">launch 2") != std::string::npos);
  CHECK(page.find("<text x=\"546.2\" y=\"36\" class=\"launchlabel end\">launch 3") != std::string::npos);
  CHECK(page.find("height=\"288\" viewBox=\"0 0 720 288\"") != std::string::npos);
  // One loss point per step of the whole run.
  const size_t poly = page.find("<polyline class=\"loss\" points=\"");
  REQUIRE(poly != std::string::npos);
  const std::string points = page.substr(poly + 32, page.find('"', poly + 32) - poly - 32);
  CHECK(std::count(points.begin(), points.end(), ',') == 60);
  CHECK(page.find("14 timed steps of launch 3 (steps 46 to 60); the loss chart covers all 3 launches") !=
        std::string::npos);
  CHECK(page.find("launch 1, steps 1 to 30 (30 steps); launch 2, steps 31 to 45 (15 steps); launch 3, steps 46 to 60 "
                  "(15 steps)") != std::string::npos);
}

// ---- The page: every kind of work in a column of its own, whole layer names, chunks told apart.

namespace {

// hand_step with stage 0's B1 [9,12] split into B1 [9,11] and W1 [11,12].
StepResult split_step() {
  StepResult r = hand_step(1.0, 2 << 20, 3 << 20);
  auto& ops = r.stages[0].ops;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].op == Op::kBackward && ops[i].micro_batch == 1) {
      ops[i].end_ms = 11;
      ops.insert(ops.begin() + static_cast<long>(i) + 1, TimedOp{Op::kBackwardWeight, 1, 11, 12});
      break;
    }
  }
  return r;
}

int count_of(const std::string& page, const std::string& what) {
  int n = 0;
  for (size_t at = page.find(what); at != std::string::npos; at = page.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the page shows B, W, sends and collectives apart, and the peak card one stage measured and planned") {
  const StepResult r = split_step();
  Schedule program = hand_program();
  program.stages[0].clear();
  for (const TimedOp& t : r.stages[0].ops) program.stages[0].push_back({t.op, t.micro_batch, t.chunk});
  ReportBuilder b({"0-1 linear, relu", "2-3 linear x2"}, {"cpu:0", "cpu:1"}, program, RecomputeMode::kExceptLast, 8);
  PlannedRun plan;
  plan.source = "test";
  plan.stages.resize(2);
  plan.stages[0].activation_bytes = 4 << 20;  // the plan's largest is stage 0; the measured largest, stage 1
  plan.stages[1].activation_bytes = 5 << 19;  // 2.5 MiB
  plan.stages[0].optimizer_bytes = 3 << 20;   // a plan of 3 MiB of optimizer state
  b.set_prediction(plan);
  StepResult with_state = r;
  with_state.stages[0].optimizer_bytes = 3 << 20;  // and the step's trace measuring 3 MiB
  with_state.stages[1].optimizer_bytes = 1 << 20;
  with_state.stages[0].device_peak_bytes = 9 << 20;  // stage 1's device measured nothing
  b.add_step(1, 2.0, with_state, true);
  HtmlReportInput in;
  in.title = "t";
  in.summary = b.summary();
  in.schedule = program;
  in.losses = b.losses();
  const std::string page = render_report_html(in);
  CAPTURE(page);
  // Stage 0 by hand: forward 4, recompute 0, B 3 + 2 = 5, W 1, sends 1, collectives 0,
  // idle 16 - 10 - 1 = 5, optimizer 1, util 10 / 16 (no tensor group: no column for it).
  CHECK(page.find("<td>4.00</td><td>0.00</td><td>5.00</td><td>1.00</td><td>1.00</td><td>0.00</td><td>5.00</td>"
                  "<td>1.00</td><td>62.5%</td>") != std::string::npos);
  CHECK(page.find("<th>backward (B)</th><th>weight grad (W)</th><th>sends</th><th>collectives</th><th>idle</th>") !=
        std::string::npos);
  CHECK(page.find("peak activations (stage 1, the largest)</div><div class=\"v\">3.00 MiB</div>") != std::string::npos);
  CHECK(page.find("planned 2.50 MiB for stage 1 (-16.7%) &middot; the plan's largest: stage 0, 4.00 MiB") !=
        std::string::npos);
  // Memory per stage: measured beside planned, stage by stage; the optimizer state planned
  // (weights and gradients 0 here), then measured.
  CHECK(page.find("<td class=\"l\">0</td><td>2.00 MiB</td><td>4.00 MiB</td><td>+100.0%</td><td>0.00 MiB</td>"
                  "<td>0.00 MiB</td><td>3.00 MiB</td><td>3.00 MiB</td>") != std::string::npos);
  CHECK(page.find("<th>optimizer state planned</th><th>optimizer state measured</th><th>total planned</th>"
                  "<th>device at its most, measured</th>") != std::string::npos);
  // The total planned is the plan's weights, gradients, optimizer state and activations:
  // stage 0's 3 + 4 MiB; its device measured 9 MiB; stage 1's device nothing.
  CHECK(page.find("<td>3.00 MiB</td><td>7.00 MiB</td><td>9.00 MiB (cpu:0)</td></tr>") != std::string::npos);
  CHECK(page.find("<td>1.00 MiB</td><td>2.50 MiB</td><td>-</td></tr>") != std::string::npos);
  // A measured step more than 15% off the planned one is said; within 15%, nothing.
  CHECK(page.find("id=\"prediction-off\"") == std::string::npos);  // no planned step time here
  REQUIRE(in.summary.step_ms > 0);
  in.summary.plan.step_ms = in.summary.step_ms / 1.5;
  CHECK(render_report_html(in).find("id=\"prediction-off\">The measured step time is +50% off the planned") !=
        std::string::npos);
  in.summary.plan.step_ms = in.summary.step_ms / 0.8;
  CHECK(render_report_html(in).find("The measured step time is -20% off the planned") != std::string::npos);
  in.summary.plan.step_ms = in.summary.step_ms / 1.1;
  CHECK(render_report_html(in).find("id=\"prediction-off\"") == std::string::npos);
  // report.json and the terminal's table carry the measured figure too.
  CHECK(b.json()["stages"][1]["optimizer_bytes"] == (1 << 20));
  CHECK(b.summary().stages[1].optimizer_bytes == (1 << 20));
  const std::string table = b.table();
  CHECK(table.find("opt state MiB plan/meas") != std::string::npos);
  CHECK(table.find("        3.00 /     3.00\n") != std::string::npos);  // stage 0: plan / measured
}

TEST_CASE("the page lists each stage's layers in full, chunk by chunk, and labels interleaved blocks by chunk") {
  const std::string long0 = "0-3 embedding, transformer_block x3, layernorm";
  const std::string long1 = "12-15 transformer_block x4";
  ReportBuilder b({long0 + " | " + long1, "4-11 transformer_block x8 | 16-17 layernorm, linear"}, {"cpu:0", "cpu:1"},
                  interleaved_1f1b_schedule(2, 2, 4, RecomputeMode::kNever), RecomputeMode::kNever, 8);
  HtmlReportInput in;
  in.title = "t";
  in.summary = b.summary();
  in.schedule = interleaved_1f1b_schedule(2, 2, 4, RecomputeMode::kNever);
  OpCosts costs;
  costs.forward = 10;
  costs.backward = 20;
  in.measured_simulation = simulate(in.schedule, costs);
  const std::string page = render_report_html(in);
  CHECK(page.find("<li><b>stage 0</b> &middot; cpu:0: chunk a: layers " + long0 + "; chunk b: layers " + long1 +
                  "</li>") != std::string::npos);
  // Every compute block of the simulated step is labelled: micro-batch and chunk.
  for (const char* label : {">0a</text>", ">3a</text>", ">0b</text>", ">3b</text>"}) {
    CAPTURE(label);
    CHECK(page.find(label) != std::string::npos);
  }
  // Chunk b's blocks are drawn lighter: its forwards and backwards on both stages, 2 x 2 x 4.
  CHECK(count_of(page, "class=\"later\"") == 16);
  CHECK(page.find("chunk a or b") != std::string::npos);  // the legend says what the letters mean
  // The time axis's labels stay inside the drawing (118 + 800 + 34 units wide).
  size_t at = 0;
  while ((at = page.find("class=\"tick", at)) != std::string::npos) {
    const size_t x = page.rfind("<text x=\"", at) + 9;
    const double pos = std::stod(page.substr(x, page.find('"', x) - x));
    const bool end = page.compare(at, 16, "class=\"tick end\"") == 0;
    const size_t text = page.find('>', at) + 1;
    const double chars = static_cast<double>(page.find('<', text) - text);
    CAPTURE(page.substr(text, page.find('<', text) - text));
    CHECK((end ? pos : pos + 3.5 * chars) <= 952.0);  // about 7 units a character, centred unless at the end
    ++at;
  }
}
