// The tensor group's collectives as instructions of the program (issue 38): where
// lower_tensor_collectives puts each (after the compute instruction that asks it, in the
// order asked; a layer's once-a-step sum where its gradients become final), what the
// checker refuses, an evaluation's program, the simulator's timing of them, and the file
// form, which leaves them out.
#include <doctest/doctest.h>

#include <string>

#include "pipeline/schedule/schedule.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

// Bytes per sample, or with per_sample false whatever the micro-batch.
TensorOp sum(int64_t bytes, bool per_sample = true) {
  return {Op::kTensorSum, per_sample ? 0 : bytes, per_sample ? bytes : 0};
}
TensorOp max_of(int64_t bytes) { return {Op::kTensorMax, 0, bytes}; }
TensorOp gather(int64_t bytes) { return {Op::kTensorGather, 0, bytes}; }
TensorOp scatter(int64_t bytes) { return {Op::kTensorScatter, 0, bytes}; }

// Two cells. Cell 0: one layer that does all its backward in B, whose gradients are
// partial (a sum once a step). Cell 1 (the model's last): a layer that splits its
// backward (a sum of its weight gradients in W), then the loss (a maximum in F).
TensorProgram program() {
  TensorProgram t;
  t.members = 2;
  t.cells.resize(2);
  CellTensorOps& a = t.cells[0];
  a.forward = a.recompute = a.evaluate = {sum(10)};
  CellTensorOps::Layer la;
  la.backward = la.backward_input = {sum(10)};
  la.step = {sum(3, false)};
  a.layers = {la};
  CellTensorOps& b = t.cells[1];
  b.forward = b.recompute = {gather(20), sum(10), max_of(5)};
  b.evaluate = {gather(20), sum(10), max_of(5), max_of(5)};  // and the count's maximum
  CellTensorOps::Layer lb;
  lb.splits = true;
  lb.backward = {scatter(20), sum(7, false)};
  lb.backward_input = {scatter(20)};
  lb.weight = {sum(7, false)};
  b.layers = {lb};
  return t;
}

std::string refusal(const Schedule& s) {
  try {
    check_schedule(s);
  } catch (const UserError& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("the tensor collectives follow the compute instruction that asks them, in order") {
  Schedule s = gpipe_schedule(2, 2, RecomputeMode::kExceptLast);
  REQUIRE(schedule_table(s) ==
          "stage 0: F0 sA0 F1 sA1 rG1 B1 R0 rG0 B0 OPT\n"
          "stage 1: rA0 F0 rA1 F1 B1 sG1 R0 B0 sG0 OPT\n");
  lower_tensor_collectives(s, program());
  // Stage 0: B0, its last backward, sums the layer's partial gradients after its own.
  // Stage 1: no W in GPipe, so each B is the whole backward (the W's sum inside it).
  CHECK(schedule_table(s) ==
        "stage 0: F0 tAR0 sA0 F1 tAR1 sA1 rG1 B1 tAR1 R0 tAR0 rG0 B0 tAR0 tAR0 OPT\n"
        "stage 1: rA0 F0 tAG0 tAR0 tMAX0 rA1 F1 tAG1 tAR1 tMAX1 B1 tRS1 tAR1 sG1 R0 tAG0 tAR0 tMAX0 B0 tRS0 tAR0 sG0 "
        "OPT\n");
  CHECK(refusal(s) == "accepted");
  CHECK(s.tensor_lowered);
  // gpipe plan's form writes a run of one collective once.
  CHECK(compact_schedule_table(s) ==
        "stage 0: F0 tAR0 sA0 F1 tAR1 sA1 rG1 B1 tAR1 R0 tAR0 rG0 B0 tAR0*2 OPT\n"
        "stage 1: rA0 F0 tAG0 tAR0 tMAX0 rA1 F1 tAG1 tAR1 tMAX1 B1 tRS1 tAR1 sG1 R0 tAG0 tAR0 tMAX0 B0 tRS0 tAR0 sG0 "
        "OPT\n");
  CHECK(compact_schedule_table(gpipe_schedule(2, 2, RecomputeMode::kExceptLast)) ==
        schedule_table(gpipe_schedule(2, 2, RecomputeMode::kExceptLast)));
  // Again with the same facts: nothing changes; with others, an Error.
  const Schedule before = s;
  lower_tensor_collectives(s, program());
  CHECK(schedule_table(s) == schedule_table(before));
  TensorProgram other = program();
  other.cells[0].forward.push_back(sum(1));
  CHECK_THROWS_AS(lower_tensor_collectives(s, other), Error);
  // T = 1: nothing to lower.
  Schedule one = gpipe_schedule(2, 2, RecomputeMode::kExceptLast);
  lower_tensor_collectives(one, TensorProgram{});
  CHECK(schedule_table(one) == schedule_table(gpipe_schedule(2, 2, RecomputeMode::kExceptLast)));
}

TEST_CASE("with B and W apart, W asks the weight gradients' sums, and each once-a-step sum comes where the layer's gradients become final") {
  // Zero bubble, K = 1: B1 B0 each followed by its W. Cell 0's layer does all in B: its
  // sum after the last B. (One stage holds both cells here: interleaving's v = 2.)
  Schedule s = zero_bubble_schedule(1, 2, 2, RecomputeMode::kNever);
  lower_tensor_collectives(s, program());
  CHECK(refusal(s) == "accepted");
  const MicroBatchRoles roles = micro_batch_roles(s, 0);
  const ChunkFinals finals = chunk_finals(s, 0, roles);
  const auto& prog = s.stages[0];
  const std::vector<std::vector<TensorOp>> asked = stage_tensor_ops(s, s.tensor, 0);
  int weights = 0, steps = 0;
  for (size_t pc = 0; pc < prog.size(); ++pc) {
    const Instruction& ins = prog[pc];
    if (!is_compute(ins.op)) continue;
    const int cell = s.cell(0, ins.chunk);
    CAPTURE(instruction_str(s, 0, ins));
    std::vector<TensorOp> want;
    if (ins.op == Op::kForward) want = s.tensor.cells[cell].forward;
    if (ins.op == Op::kBackward) {
      want = cell == 0 ? std::vector<TensorOp>{sum(10)}
                       : (roles.split[ins.chunk][ins.micro_batch] ? std::vector<TensorOp>{scatter(20)}
                                                                  : std::vector<TensorOp>{scatter(20), sum(7, false)});
      if (cell == 0 && static_cast<long>(pc) == finals.last_backward[ins.chunk]) {
        want.push_back(sum(3, false));
        ++steps;
      }
    }
    if (ins.op == Op::kBackwardWeight) {
      want = cell == 1 ? std::vector<TensorOp>{sum(7, false)} : std::vector<TensorOp>{};
      weights += cell == 1;
    }
    CHECK(asked[pc] == want);
    // And the program holds exactly those, right after it.
    for (size_t j = 0; j < want.size(); ++j) {
      REQUIRE(pc + 1 + j < prog.size());
      CHECK(prog[pc + 1 + j].op == want[j].op);
      CHECK(prog[pc + 1 + j].micro_batch == ins.micro_batch);
      CHECK(prog[pc + 1 + j].chunk == ins.chunk);
    }
  }
  CHECK(weights > 0);
  CHECK(steps == 1);
}

TEST_CASE("the checker refuses tensor collectives out of place, missing, of the wrong kind, or written by hand") {
  Schedule s = gpipe_schedule(2, 2, RecomputeMode::kNever);
  lower_tensor_collectives(s, program());
  auto& p1 = s.stages[1];
  // rA0 F0 tAG0 tAR0 tMAX0 ...
  REQUIRE(p1[2].op == Op::kTensorGather);
  {
    Schedule bad = s;
    bad.stages[1].erase(bad.stages[1].begin() + 4);  // F0's tMAX0
    CHECK(refusal(bad).find("F0: its cell asks the tensor group for 3 collectives and the program has 2 after it") !=
          std::string::npos);
  }
  {
    Schedule bad = s;
    std::swap(bad.stages[1][2], bad.stages[1][3]);  // tAR before tAG
    CHECK(refusal(bad).find("tAR0: its cell asks for tAG here") != std::string::npos);
  }
  {
    Schedule bad = s;
    bad.stages[1].insert(bad.stages[1].begin() + 5, Instruction{Op::kTensorSum, 0, 0});  // a fourth after F0
    CHECK(refusal(bad).find("not more") != std::string::npos);
  }
  {
    Schedule bad = s;
    bad.stages[0].insert(bad.stages[0].begin() + 2, bad.stages[0][1]);  // F0 tAR0 sA0 tAR0
    std::swap(bad.stages[0][2], bad.stages[0][3]);
    CHECK(refusal(bad).find("runs inside a compute instruction (F, R, B, W), after it") != std::string::npos);
  }
  {
    Schedule bad = s;
    bad.stages[1][3].micro_batch = 1;  // F0's tAR as micro-batch 1's
    CHECK(refusal(bad).find("carries its compute instruction's micro-batch and chunk") != std::string::npos);
  }
  {
    Schedule unlowered = gpipe_schedule(2, 2, RecomputeMode::kNever);
    unlowered.stages[0].insert(unlowered.stages[0].begin() + 1, Instruction{Op::kTensorSum, 0, 0});
    CHECK(refusal(unlowered).find("inserted by lower_tensor_collectives, not written") != std::string::npos);
  }
}

TEST_CASE("an evaluation's program asks what an evaluation's forwards ask") {
  Schedule s = gpipe_schedule(2, 2, RecomputeMode::kNever);
  lower_tensor_collectives(s, program());
  const Schedule eval = forward_only_program(s, 2);
  CHECK(eval.tensor_lowered);
  CHECK(schedule_table(eval) ==
        "stage 0: F0 tAR0 sA0 F1 tAR1 sA1\n"
        "stage 1: rA0 F0 tAG0 tAR0 tMAX0 tMAX0 rA1 F1 tAG1 tAR1 tMAX1 tMAX1\n");
  CHECK(refusal(eval) == "accepted");
}

TEST_CASE("the simulator runs each tensor collective after its compute instruction, before what it sends") {
  Schedule s = gpipe_schedule(2, 1, RecomputeMode::kNever);
  lower_tensor_collectives(s, program());
  // F 1, B 2, each tensor collective 0.25.
  const CostFn cost = [](int, const Instruction& ins) {
    if (is_tensor_collective(ins.op)) return 0.25;
    return ins.op == Op::kForward ? 1.0 : ins.op == Op::kBackward ? 2.0 : 0.0;
  };
  for (CommModel comm : {CommModel::kBuffered, CommModel::kRendezvous}) {
    CAPTURE(static_cast<int>(comm));
    const Simulation sim = simulate(s, cost, comm);
    // Stage 0: F0 [0, 1], tAR0 [1, 1.25], sA0; stage 1's F0 from 1.25, then its three
    // tensor collectives to 3.0; its B0 [3, 5], tRS0 tAR0 to 5.5, sG0; stage 0's B0 from
    // 5.5 to 7.5 and its two sums to 8.
    auto at = [&](int k, const std::string& what) {
      for (const TimedInstruction& t : sim.timeline[k]) {
        if (instruction_str(s, k, t.ins) == what) return t;
      }
      FAIL("no " << what);
      return TimedInstruction{};
    };
    CHECK(at(0, "tAR0").start == doctest::Approx(1.0));
    CHECK(at(1, "F0").start == doctest::Approx(1.25));
    CHECK(at(1, "B0").start == doctest::Approx(3.0));
    CHECK(at(0, "B0").start == doctest::Approx(5.5));
    CHECK(sim.makespan == doctest::Approx(8.0));
    // Busy is compute only: the collectives are the tensor group's communication.
    CHECK(sim.busy[0] == doctest::Approx(3.0));
    CHECK(sim.busy[1] == doctest::Approx(3.0));
  }
}

TEST_CASE("the file form leaves the tensor collectives out: they are the run's facts, lowered again") {
  Schedule s = one_f_one_b_schedule(2, 3, RecomputeMode::kExceptLast);
  const std::string plain = schedule_file_text(s, ScheduleNotation::kCsv);
  lower_tensor_collectives(s, program());
  CHECK(schedule_file_text(s, ScheduleNotation::kCsv) == plain);
  Schedule back = parse_schedule_text(plain, "f.csv", 2, 1, 3, RecomputeMode::kExceptLast);
  lower_tensor_collectives(back, program());
  CHECK(schedule_table(back) == schedule_table(s));
}
