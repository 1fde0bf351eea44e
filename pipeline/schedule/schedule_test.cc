// Literal instruction tables for small schedules of every kind, the checker (on
// broken schedules, for both transport models), schedule files, and the simulator.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <string>

#include "pipeline/schedule/schedule.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

TEST_CASE("GPipe, K=2, M=2, checkpoint except_last") {
  CHECK(schedule_table(gpipe_schedule(2, 2, RecomputeMode::kExceptLast)) ==
        "stage 0: F0 sA0 F1 sA1 rG1 B1 R0 rG0 B0 OPT\n"
        "stage 1: rA0 F0 rA1 F1 B1 sG1 R0 B0 sG0 OPT\n");
}

TEST_CASE("GPipe, K=3, M=2, checkpoint always") {
  CHECK(schedule_table(gpipe_schedule(3, 2, RecomputeMode::kAlways)) ==
        "stage 0: F0 sA0 F1 sA1 R1 rG1 B1 R0 rG0 B0 OPT\n"
        "stage 1: rA0 F0 sA0 rA1 F1 sA1 R1 rG1 B1 sG1 R0 rG0 B0 sG0 OPT\n"
        "stage 2: rA0 F0 rA1 F1 R1 B1 sG1 R0 B0 sG0 OPT\n");
}

TEST_CASE("GPipe, K=1, M=3, checkpoint never") {
  CHECK(schedule_table(gpipe_schedule(1, 3, RecomputeMode::kNever)) == "stage 0: F0 F1 F2 B2 B1 B0 OPT\n");
}

TEST_CASE("1F1B, K=2, M=3: a warm-up of K-1-k forwards, then one forward and one backward in turn") {
  CHECK(schedule_table(one_f_one_b_schedule(2, 3, RecomputeMode::kNever)) ==
        "stage 0: F0 sA0 F1 sA1 rG0 B0 F2 sA2 rG1 B1 rG2 B2 OPT\n"
        "stage 1: rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 OPT\n");
  // Recompute right before its backward, the gradient received after it; except_last
  // recomputes what overlaps another context (all of stage 0's), and nothing on the last
  // stage, where each backward follows its own forward.
  CHECK(schedule_table(one_f_one_b_schedule(2, 2, RecomputeMode::kExceptLast)) ==
        "stage 0: F0 sA0 F1 sA1 R0 rG0 B0 R1 rG1 B1 OPT\n"
        "stage 1: rA0 F0 B0 sG0 rA1 F1 B1 sG1 OPT\n");
}

TEST_CASE("zero bubble (ZB-H1), K=2, M=3: stage k defers its first k weight gradients") {
  CHECK(schedule_table(zero_bubble_schedule(2, 1, 3, RecomputeMode::kNever)) ==
        "stage 0: F0 sA0 F1 sA1 rG0 B0 W0 F2 sA2 rG1 B1 W1 rG2 B2 W2 OPT\n"
        "stage 1: rA0 F0 B0 sG0 rA1 F1 B1 sG1 W0 rA2 F2 B2 sG2 W1 W2 OPT\n");
}

TEST_CASE("interleaved 1F1B, K=2, v=2, M=2: stage k holds cells k and k+2, named first") {
  const Schedule s = interleaved_1f1b_schedule(2, 2, 2, RecomputeMode::kNever);
  CHECK(s.cells == std::vector<std::vector<int>>{{0, 2}, {1, 3}});
  CHECK(schedule_table(s) ==
        "stage 0: 0F0 0sA0 0F1 0sA1 2rA0 2F0 2sA0 2rA1 2F1 2sA1 2rG0 2B0 2sG0 2rG1 2B1 2sG1 0rG0 0B0 0rG1 0B1 OPT\n"
        "stage 1: 1rA0 1F0 1sA0 1rA1 1F1 1sA1 3rA0 3F0 3B0 3sG0 3rA1 3F1 3B1 3sG1 1rG0 1B0 1sG0 1rG1 1B1 1sG1 OPT\n");
  CHECK(s.stage_of_cell(3) == 1);
  CHECK(s.chunk_of_cell(2) == 1);
}

TEST_CASE("the chart of GPipe's schedule is the picture in schedule.h") {
  CHECK(schedule_chart(gpipe_schedule(3, 4, RecomputeMode::kNever)) ==
        "stage 0: F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0\n"
        "stage 1: .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 . \n"
        "stage 2: .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  . \n");
}

TEST_CASE("a rendezvous transport gets steps of one forward and one backward, one group between them") {
  // As Megatron-LM's send_forward_backward_recv_forward_backward: the sends of a step
  // and the receives of the next travel in one group.
  const Schedule s = one_f_one_b_schedule(2, 3, RecomputeMode::kNever, CommModel::kRendezvous);
  CHECK(schedule_table(s) ==
        "stage 0: F0 sA0 rG0 F1 B0 sA1 rG1 F2 B1 sA2 rG2 B2 OPT\n"
        "stage 1: rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 OPT\n");
  CHECK_NOTHROW(check_schedule(s, CommModel::kRendezvous));
}

TEST_CASE("recompute modes") {
  // The micro-batches each stage recomputes ([stage] = micro-batches with an R).
  auto recomputed = [](const Schedule& s) {
    std::vector<std::vector<int>> out(s.stages.size());
    for (size_t k = 0; k < s.stages.size(); ++k) {
      for (const Instruction& ins : s.stages[k]) {
        if (ins.op == Op::kRecompute) out[k].push_back(ins.micro_batch);
      }
      std::sort(out[k].begin(), out[k].end());
    }
    return out;
  };
  using V = std::vector<std::vector<int>>;
  // GPipe: all but the last micro-batch, on every stage.
  CHECK(recomputed(gpipe_schedule(3, 4, RecomputeMode::kExceptLast)) == V{{0, 1, 2}, {0, 1, 2}, {0, 1, 2}});
  CHECK(recomputed(gpipe_schedule(3, 4, RecomputeMode::kAlways)) == V{{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}});
  CHECK(recomputed(gpipe_schedule(3, 4, RecomputeMode::kNever)) == V{{}, {}, {}});
  // 1F1B: the last stage runs each backward right after its forward (nothing to save);
  // the others hold K - k forwards at once, and recompute every one, the last included
  // (kept whole, it would overlap the recompute of the one before: never's peak).
  CHECK(recomputed(one_f_one_b_schedule(3, 4, RecomputeMode::kExceptLast)) == V{{0, 1, 2, 3}, {0, 1, 2, 3}, {}});
  CHECK(recomputed(one_f_one_b_schedule(3, 4, RecomputeMode::kAlways)) == V{{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}});
  CHECK(parse_recompute_mode("except_last") == RecomputeMode::kExceptLast);
  CHECK_THROWS_WITH_AS(parse_recompute_mode("sometimes"), doctest::Contains("always, except_last or never"),
                       UserError);
}

TEST_CASE("make_schedule names what it cannot do") {
  CHECK_THROWS_WITH_AS(make_schedule("looped", 2, 2, RecomputeMode::kNever),
                       doctest::Contains("valid schedules: gpipe, 1f1b, interleaved_1f1b, zero_bubble"), UserError);
  ScheduleRequest r;
  r.name = "1f1b";
  r.num_stages = 2;
  r.num_chunks = 2;
  r.num_micro_batches = 4;
  CHECK_THROWS_WITH_AS(make_schedule(r), doctest::Contains("use interleaved_1f1b or zero_bubble"), UserError);
  r.name = "interleaved_1f1b";
  r.num_micro_batches = 5;  // two rounds of about K = 2 do not divide 5
  CHECK_THROWS_WITH_AS(make_schedule(r), doctest::Contains("multiple of pipeline.partitions"), UserError);
  r.num_micro_batches = 0;
  CHECK_THROWS_WITH_AS(make_schedule(r), doctest::Contains("pipeline.micro_batches must be at least 1"), UserError);
}

// Every generated schedule, over a grid of sizes, passes the checker on both kinds of
// transport, or is refused with the reason; the refusals are exactly the documented ones.
TEST_CASE("every generated schedule passes the checker, or is refused for a stated reason") {
  int built = 0;
  for (const std::string& name : schedule_names()) {
    for (int v = 1; v <= 3; ++v) {
      for (int K = 1; K <= 4; ++K) {
        for (int M = 1; M <= 8; ++M) {
          for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever}) {
            for (auto comm : {CommModel::kBuffered, CommModel::kRendezvous}) {
              ScheduleRequest r{name, K, v, M, mode, "", comm};
              INFO(name << " v=" << v << " K=" << K << " M=" << M << " rendezvous=" << (comm == CommModel::kRendezvous));
              try {
                const Schedule s = make_schedule(r);
                CHECK_NOTHROW(check_schedule(s, comm));
                ++built;
              } catch (const UserError& e) {
                const std::string why = e.what();
                const bool one_cell = (name == "gpipe" || name == "1f1b") && v > 1;
                const bool rounds = v > 1 && M % std::max(1, M / K) != 0;
                // Interleaved schedules on NCCL: some sizes would deadlock; the checker refuses them.
                const bool rendezvous = v > 1 && comm == CommModel::kRendezvous && why.find("deadlocks") != std::string::npos;
                CHECK((one_cell || rounds || rendezvous));
              }
            }
          }
        }
      }
    }
  }
  CHECK(built > 1000);
}

// Evaluation's program: the schedule's forwards and their activation messages, no
// recompute, backward or optimizer step, for any number of micro-batches up to M.
TEST_CASE("a forward-only program keeps the schedule's forwards in order and passes the checker") {
  CHECK(schedule_table(forward_only_program(one_f_one_b_schedule(2, 3, RecomputeMode::kAlways), 3)) ==
        "stage 0: F0 sA0 F1 sA1 F2 sA2\n"
        "stage 1: rA0 F0 rA1 F1 rA2 F2\n");
  CHECK(schedule_table(forward_only_program(one_f_one_b_schedule(2, 3, RecomputeMode::kNever), 2)) ==
        "stage 0: F0 sA0 F1 sA1\n"
        "stage 1: rA0 F0 rA1 F1\n");
  // Interleaved, K=2, v=2: cells 0 and 2 on stage 0, 1 and 3 on stage 1, in the
  // schedule's rounds.
  CHECK(schedule_table(forward_only_program(interleaved_1f1b_schedule(2, 2, 2, RecomputeMode::kNever), 2)) ==
        "stage 0: 0F0 0sA0 0F1 0sA1 2rA0 2F0 2sA0 2rA1 2F1 2sA1\n"
        "stage 1: 1rA0 1F0 1sA0 1rA1 1F1 1sA1 3rA0 3F0 3rA1 3F1\n");
  int built = 0;
  for (const std::string& name : schedule_names()) {
    for (int v = 1; v <= 3; ++v) {
      for (int K = 1; K <= 4; ++K) {
        for (int M = 1; M <= 6; ++M) {
          for (auto comm : {CommModel::kBuffered, CommModel::kRendezvous}) {
            Schedule s;
            try {
              s = make_schedule({name, K, v, M, RecomputeMode::kExceptLast, "", comm});
            } catch (const UserError&) {
              continue;  // sizes the schedule refuses (the test above says which)
            }
            for (int n = 1; n <= M; ++n) {
              INFO(name << " v=" << v << " K=" << K << " M=" << M << " n=" << n
                        << " rendezvous=" << (comm == CommModel::kRendezvous));
              const Schedule f = forward_only_program(s, n, comm);
              CHECK(f.forward_only);
              CHECK(f.num_micro_batches == n);
              CHECK(f.cells == s.cells);
              size_t forwards = 0;
              for (const auto& prog : f.stages) {
                for (const Instruction& ins : prog) {
                  CHECK((ins.op == Op::kForward || ins.op == Op::kSendActivation || ins.op == Op::kRecvActivation));
                  forwards += ins.op == Op::kForward;
                }
              }
              CHECK(forwards == static_cast<size_t>(n * s.num_cells()));
              CHECK_NOTHROW(check_schedule(f, comm));
              ++built;
            }
          }
        }
      }
    }
  }
  CHECK(built > 500);
  CHECK_THROWS_AS(forward_only_program(gpipe_schedule(2, 2, RecomputeMode::kNever), 3), Error);
}

TEST_CASE("the checker holds a forward-only program to forwards and activations") {
  Schedule f = forward_only_program(gpipe_schedule(2, 2, RecomputeMode::kNever), 2);
  SUBCASE("no backward") {
    f.stages[1].push_back({Op::kBackward, 1});
    CHECK_THROWS_WITH_AS(check_schedule(f), doctest::Contains("a forward-only program runs forwards only"), UserError);
  }
  SUBCASE("no optimizer step") {
    f.stages[0].push_back({Op::kOptimizerStep, -1});
    CHECK_THROWS_WITH_AS(check_schedule(f), doctest::Contains("a forward-only program runs forwards only"), UserError);
  }
  SUBCASE("no gradient message") {
    f.stages[1].push_back({Op::kSendGradient, 0});
    CHECK_THROWS_WITH_AS(check_schedule(f), doctest::Contains("activations only"), UserError);
  }
  SUBCASE("every forward still runs") {
    f.stages[1].pop_back();  // F1
    CHECK_THROWS_WITH_AS(check_schedule(f), doctest::Contains("never runs the forward of micro-batch 1"), UserError);
  }
  SUBCASE("a training schedule still needs its backwards and optimizer step") {
    f.forward_only = false;
    CHECK_THROWS_WITH_AS(check_schedule(f), doctest::Contains("never runs the backward"), UserError);
  }
}

TEST_CASE("the checker finds broken schedules") {
  Schedule s = gpipe_schedule(2, 2, RecomputeMode::kNever);
  SUBCASE("a receive without a send deadlocks") {
    auto& st = s.stages[0];
    st.erase(st.begin() + 1);  // drop sA0
    CHECK_THROWS_WITH(check_schedule(s), doctest::Contains("deadlocks"));
  }
  SUBCASE("backward before forward") {
    std::swap(s.stages[0][0], s.stages[0][5]);
    CHECK_THROWS_AS(check_schedule(s), UserError);
  }
  SUBCASE("receives in the wrong order across stages deadlock") {
    s.stages[1].insert(s.stages[1].begin(), Instruction{Op::kRecvActivation, 1});
    CHECK_THROWS_AS(check_schedule(s), UserError);
  }
  SUBCASE("a missing optimizer step") {
    s.stages[1].pop_back();
    CHECK_THROWS_WITH(check_schedule(s), doctest::Contains("no optimizer step"));
  }
  SUBCASE("a weight gradient before its backward, or twice") {
    Schedule z = zero_bubble_schedule(2, 1, 2, RecomputeMode::kNever);
    auto& st = z.stages[0];
    auto w = std::find(st.begin(), st.end(), Instruction{Op::kBackwardWeight, 0});
    auto b = std::find(st.begin(), st.end(), Instruction{Op::kBackward, 0});
    std::iter_swap(w, b);
    CHECK_THROWS_WITH(check_schedule(z), doctest::Contains("weight gradient before the backward"));
    std::iter_swap(w, b);
    st.insert(st.end() - 1, Instruction{Op::kBackwardWeight, 0});
    CHECK_THROWS_WITH(check_schedule(z), doctest::Contains("weight gradient twice"));
  }
  SUBCASE("the error shows the program with the instruction marked") {
    std::swap(s.stages[0][0], s.stages[0][5]);  // B1 first
    CHECK_THROWS_WITH(check_schedule(s), doctest::Contains("stage 0: B1 <-- HERE sA0 F1"));
    // The whole table, every stage's whole program, with only the failing instruction marked.
    try {
      check_schedule(s);
      FAIL("no error");
    } catch (const UserError& e) {
      const std::string what = e.what();
      CHECK(what.rfind("schedule 'gpipe' stage 0: B1: backward before forward\n", 0) == 0);
      CHECK(what.find("\n  stage 0: B1 <-- HERE sA0 F1 sA1 rG1 F0 rG0 B0 OPT") != std::string::npos);
      CHECK(what.find("\n  stage 1: rA0 F0 rA1 F1 B1 sG1 B0 sG0 OPT") != std::string::npos);
      CHECK(what.find("<-- HERE") == what.rfind("<-- HERE"));
    }
  }
  SUBCASE("a deadlock marks where every stage waits") {
    auto& st = s.stages[0];
    st.erase(st.begin() + 1);  // drop sA0: stage 1 waits at rA0, stage 0 at rG1
    try {
      check_schedule(s);
      FAIL("no error");
    } catch (const UserError& e) {
      const std::string what = e.what();
      CHECK(what.find("\n  stage 0: F0 F1 sA1 rG1 <-- HERE B1") != std::string::npos);
      CHECK(what.find("\n  stage 1: rA0 <-- HERE F0") != std::string::npos);
    }
  }
  SUBCASE("a missing instruction shows the table without a mark") {
    s.stages[1].pop_back();
    try {
      check_schedule(s);
      FAIL("no error");
    } catch (const UserError& e) {
      const std::string what = e.what();
      CHECK(what.find("stage 1 has no optimizer step") != std::string::npos);
      CHECK(what.find("\n  stage 1: rA0 F0 rA1 F1 B1 sG1 B0 sG0") != std::string::npos);
      CHECK(what.find("HERE") == std::string::npos);
    }
  }
}

TEST_CASE("a schedule that is safe with buffered sends deadlocks when sends wait for their receiver") {
  // Stage 0 sends A1 and then waits for G1 in one group; stage 1 sends G0 and then
  // waits for A1: with blocking sends each group waits for the other's next one.
  Schedule s;
  s.name = "crossed";
  s.num_stages = 2;
  s.num_micro_batches = 2;
  s.cells = interleaved_cells(2, 1);
  using I = Instruction;
  s.stages = {
      {I{Op::kForward, 0}, I{Op::kSendActivation, 0}, I{Op::kForward, 1}, I{Op::kSendActivation, 1},
       I{Op::kRecvGradient, 1}, I{Op::kBackward, 1}, I{Op::kRecvGradient, 0}, I{Op::kBackward, 0},
       I{Op::kOptimizerStep}},
      {I{Op::kRecvActivation, 0}, I{Op::kForward, 0}, I{Op::kBackward, 0}, I{Op::kSendGradient, 0},
       I{Op::kRecvActivation, 1}, I{Op::kForward, 1}, I{Op::kBackward, 1}, I{Op::kSendGradient, 1},
       I{Op::kOptimizerStep}},
  };
  CHECK_NOTHROW(check_schedule(s, CommModel::kBuffered));
  CHECK_THROWS_WITH_AS(check_schedule(s, CommModel::kRendezvous), doctest::Contains("deadlocks on a transport"),
                       UserError);
}

TEST_CASE("schedule files: CSV lines and PyTorch's action notation, errors with the line") {
  const std::string one_f_one_b =
      "# 1F1B for two stages and two micro-batches\n"
      "0,F,0\n"
      "0,F,1\n"
      "1,F,0\n"
      "1,B,0\n"
      "0,B,0\n"
      "1F1\n"  // cell 1 = stage 1
      "1B1\n"
      "0B1   # stage 0's last backward\n";
  const Schedule s = parse_schedule_text(one_f_one_b, "mine.csv", 2, 1, 2, RecomputeMode::kNever);
  CHECK(schedule_table(s) == schedule_table(one_f_one_b_schedule(2, 2, RecomputeMode::kNever)));
  CHECK_NOTHROW(check_schedule(s));
  // The recompute mode applies when the file has no R lines.
  const Schedule r = parse_schedule_text(one_f_one_b, "mine.csv", 2, 1, 2, RecomputeMode::kAlways);
  CHECK(schedule_table(r) == schedule_table(one_f_one_b_schedule(2, 2, RecomputeMode::kAlways)));

  auto error_of = [](const std::string& text) {
    try {
      check_schedule(parse_schedule_text(text, "mine.csv", 2, 1, 2, RecomputeMode::kNever));
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error_of("0,F,0\n0,X,1\n").find("mine.csv:2: op 'X' is not F, B, W or R") != std::string::npos);
  CHECK(error_of("0,F,7\n").find("mine.csv:1: micro-batch 7 does not exist") != std::string::npos);
  CHECK(error_of("2,F,0\n").find("mine.csv:1: stage 2 does not exist") != std::string::npos);
  CHECK(error_of("0,F\n").find("mine.csv:1: expected 3 or 4") != std::string::npos);
  CHECK(error_of("0,F,0\n").find("gives stage 1 no instructions") != std::string::npos);
  // The log form (schedule_table, instruction_str) is refused with what to write instead.
  CHECK(error_of("0,F,0\n0,sA,0\n").find("mine.csv:2: op 'sA' is not F, B, W or R: 'sA' (send_activation) is an "
                                        "instruction gpipe inserts itself") != std::string::npos);
  CHECK(error_of("0F0\nrA0\n").find("mine.csv:2: 'rA' (recv_activation) is an instruction gpipe inserts itself") !=
        std::string::npos);
  CHECK(error_of("0F0\nOPT\n").find("mine.csv:2: 'OPT' (optimizer_step)") != std::string::npos);
  CHECK(error_of("0F0\n0?1\n").find("mine.csv:2: cannot read '0?1'") != std::string::npos);
  CHECK(error_of("F3\n").find("mine.csv:1: 'F3' has no cell (the log form leaves it out); an action names it first, "
                              "e.g. 0F3") != std::string::npos);
  CHECK(error_of("stage 0: F0 sA0 F1\n").find("mine.csv:1: 'stage 0: F0 sA0 ...' is a line of the log form") !=
        std::string::npos);
  CHECK(error_of("stage 0: F0 sA0 F1\n").find("--schedule-file-out") != std::string::npos);
  // A backward before its forward names the file line.
  const std::string backwards = "0,B,0\n0,F,0\n0,F,1\n0,B,1\n1,F,0\n1,B,0\n1,F,1\n1,B,1\n";
  // Stage 0 waits for the gradient of a backward placed before its forward.
  const std::string e = error_of(backwards);
  CHECK(e.find("deadlocks") != std::string::npos);
  CHECK(e.find("stage 0 waits at rG0 at mine.csv:1") != std::string::npos);
  // On one stage, the same mistake is a backward before its forward.
  try {
    check_schedule(parse_schedule_text("0,B,0\n0,F,0\n", "one.csv", 1, 1, 1, RecomputeMode::kNever));
    FAIL("no error");
  } catch (const UserError& err) {
    CHECK(std::string(err.what()).find("B0 at one.csv:1: backward before forward") != std::string::npos);
  }
  // A backward missing: the optimizer step cannot run.
  CHECK(error_of("0,F,0\n0,F,1\n0,B,0\n1,F,0\n1,B,0\n1,F,1\n1,B,1\n")
            .find("optimizer step before the backward of micro-batch 1") != std::string::npos);
}

TEST_CASE("the simulated bubble equals each schedule's formula with balanced cells") {
  for (int K = 1; K <= 4; ++K) {
    for (int M : {1, 2, 4, 8, 16}) {
      OpCosts c;  // forward 1, backward 2, no recompute
      const Simulation g = simulate(gpipe_schedule(K, M, RecomputeMode::kNever), c);
      CHECK(g.makespan == doctest::Approx(3.0 * (M + K - 1)));
      CHECK(g.bubble == doctest::Approx(ideal_bubble(K, M)));
      const Simulation f = simulate(one_f_one_b_schedule(K, M, RecomputeMode::kNever), c);
      CHECK(f.bubble == doctest::Approx(ideal_bubble(K, M)));
    }
  }
  for (int v : {2, 3}) {
    for (int K : {2, 3, 4}) {
      for (int M : {4, 8, 12}) {
        OpCosts c;
        c.forward = 1.0 / v;  // a cell is 1/v of the stage's work
        c.backward = 2.0 / v;
        const Schedule s = interleaved_1f1b_schedule(K, v, M, RecomputeMode::kNever);
        CHECK(simulate(s, c).bubble == doctest::Approx(formula_bubble(s)));
        CHECK(formula_bubble(s) == doctest::Approx(static_cast<double>(K - 1) / (v * M + K - 1)));
      }
    }
  }
}

TEST_CASE("zero bubble fills 1F1B's bubble with weight gradients") {
  OpCosts split;  // the same work as forward 1, backward 2, with the backward in halves
  split.backward = 1.0;
  split.weight = 1.0;
  for (int K : {2, 3, 4}) {
    for (int M : {4, 8}) {
      const Simulation one = simulate(one_f_one_b_schedule(K, M, RecomputeMode::kNever), OpCosts{});
      const Simulation zb = simulate(zero_bubble_schedule(K, 1, M, RecomputeMode::kNever), split);
      CHECK(zb.makespan < one.makespan);
      CHECK(zb.bubble < one.bubble / 2);
    }
  }
}

TEST_CASE("1F1B keeps at most K - k micro-batches in flight on stage k; GPipe keeps M") {
  auto in_flight = [](const Schedule& s, int k) {
    int live = 0, peak = 0;
    for (const Instruction& ins : s.stages[k]) {
      if (ins.op == Op::kForward) peak = std::max(peak, ++live);
      if (ins.op == Op::kBackward) --live;
    }
    return peak;
  };
  for (int K = 1; K <= 4; ++K) {
    const Schedule g = gpipe_schedule(K, 16, RecomputeMode::kNever);
    const Schedule f = one_f_one_b_schedule(K, 16, RecomputeMode::kNever);
    for (int k = 0; k < K; ++k) {
      CHECK(in_flight(g, k) == 16);
      CHECK(in_flight(f, k) == K - k);
    }
  }
}

// ---- Collectives as instructions (RG, TIE, NORM).

namespace {
Schedule::Collectives collectives(bool replicas, std::vector<std::pair<int, int>> ties, bool norm) {
  Schedule::Collectives c;
  c.replicas = replicas;
  c.ties = std::move(ties);
  c.gradient_norm = norm;
  return c;
}
}  // namespace

TEST_CASE("collectives are lowered before each stage's optimizer step, in one order on every stage") {
  Schedule s = gpipe_schedule(3, 2, RecomputeMode::kNever);
  // Tie 0 joins cells 0 and 2 (stages 0 and 2), tie 1 lies within cell 1.
  lower_collectives(s, collectives(true, {{0, 2}, {1, 1}}, true));
  CHECK(schedule_table(s) ==
        "stage 0: F0 sA0 F1 sA1 rG1 B1 rG0 B0 RG TIE0 NORM OPT\n"
        "stage 1: rA0 F0 sA0 rA1 F1 sA1 rG1 B1 sG1 rG0 B0 sG0 RG NORM OPT\n"
        "stage 2: rA0 F0 rA1 F1 B1 sG1 B0 sG0 RG TIE0 NORM OPT\n");
  check_schedule(s);
  check_schedule(s, CommModel::kRendezvous);
  CHECK(collective_stages(s, 0, {Op::kTiedGradients, 0, 0}) == std::vector<int>{0, 2});
  CHECK(collective_stages(s, 1, {Op::kGradientNorm, -1, 0}) == std::vector<int>{0, 1, 2});
  CHECK(collective_stages(s, 1, {Op::kReduceGradients, -1, 0}) == std::vector<int>{1});
  // The same facts again change nothing; other facts are refused.
  const Schedule before = s;
  lower_collectives(s, collectives(true, {{0, 2}, {1, 1}}, true));
  CHECK(s.stages == before.stages);
  CHECK_THROWS_AS(lower_collectives(s, collectives(false, {}, true)), Error);
}

TEST_CASE("the checker proves collectives: order, placement, and that every stage takes part") {
  Schedule base = one_f_one_b_schedule(2, 2, RecomputeMode::kNever);
  lower_collectives(base, collectives(false, {{0, 1}, {1, 0}}, true));
  check_schedule(base);
  check_schedule(base, CommModel::kRendezvous);
  auto fails = [](const Schedule& s, CommModel comm, const std::string& what) {
    try {
      check_schedule(s, comm);
      FAIL("no error for " << what);
    } catch (const UserError& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  // The two ties in opposite orders on the two stages: each waits for the other.
  Schedule swapped = base;
  auto& prog = swapped.stages[1];
  auto tie0 = std::find(prog.begin(), prog.end(), Instruction{Op::kTiedGradients, 0, 0});
  std::iter_swap(tie0, tie0 + 1);
  fails(swapped, CommModel::kBuffered, "deadlocks");
  fails(swapped, CommModel::kRendezvous, "deadlocks");
  // A stage that skips the gradient norm: the others wait for it forever.
  Schedule missing = base;
  missing.stages[0].erase(std::find(missing.stages[0].begin(), missing.stages[0].end(),
                                    Instruction{Op::kGradientNorm, -1, 0}));
  fails(missing, CommModel::kBuffered, "NORM");
  // A collective before the last backward reads gradients that are not final.
  Schedule early = base;
  auto& p0 = early.stages[0];
  auto norm = std::find(p0.begin(), p0.end(), Instruction{Op::kGradientNorm, -1, 0});
  const Instruction n = *norm;
  p0.erase(norm);
  p0.insert(p0.begin() + 2, n);
  fails(early, CommModel::kBuffered, "collective before the backward");
  // The optimizer step before the stage's collectives.
  Schedule late = base;
  auto& p1 = late.stages[1];
  std::rotate(p1.end() - 4, p1.end() - 1, p1.end());  // OPT moved before TIE0 TIE1 NORM
  fails(late, CommModel::kBuffered, "optimizer step before the stage's collectives");
  // A collective the run does not have.
  Schedule stray = one_f_one_b_schedule(2, 2, RecomputeMode::kNever);
  lower_collectives(stray, collectives(false, {}, false));
  stray.stages[0].insert(stray.stages[0].end() - 1, Instruction{Op::kGradientNorm, -1, 0});
  fails(stray, CommModel::kBuffered, "does not need the gradient norm");
}

TEST_CASE("the simulator prices a collective after the last stage arrives") {
  Schedule s = gpipe_schedule(2, 1, RecomputeMode::kNever);
  lower_collectives(s, collectives(false, {}, true));
  OpCosts c;
  c.forward = 1;
  c.backward = 2;
  c.collective = 0.5;
  const Simulation sim = simulate(s, c);
  // Stage 1's backward ends at 4 (F0 on 0 at 0-1, F0 on 1 at 1-2, B0 2-4); stage 0's at 6.
  // NORM starts on each at its own arrival and ends 0.5 after the later one, at 6.5.
  auto norm_of = [&](int k) {
    for (const TimedInstruction& t : sim.timeline[k]) {
      if (t.ins.op == Op::kGradientNorm) return t;
    }
    FAIL("no NORM on stage " << k);
    return TimedInstruction{};
  };
  CHECK(norm_of(1).start == doctest::Approx(4.0));
  CHECK(norm_of(1).end == doctest::Approx(6.5));
  CHECK(norm_of(0).start == doctest::Approx(6.0));
  CHECK(norm_of(0).end == doctest::Approx(6.5));
  CHECK(sim.makespan == doctest::Approx(6.5));
}

TEST_CASE("stages taking turns on one device: their work never overlaps, and the device idles only when nothing is ready") {
  // GPipe, K=2, M=2, F 1, B 2, both stages on one device: stage 0's F0 0-1 and F1 1-2;
  // stage 1's F0 waits for the device until 2 (2-3), F1 3-4, B1 4-6; stage 0's B1 asks
  // at 6 as stage 1's B0 does and is first (the lower stage on a tie) at 6-8; stage 1's
  // B0 8-10; stage 0's B0 10-12. The device is never idle: the makespan is all the work.
  const CostFn f1b2 = [](int, const Instruction& i) {
    return i.op == Op::kForward ? 1.0 : i.op == Op::kBackward ? 2.0 : 0.0;
  };
  const Simulation two = simulate(gpipe_schedule(2, 2, RecomputeMode::kNever), f1b2, CommModel::kBuffered, {0, 0});
  auto spans = [](const Simulation& sim, int k) {
    std::string out;
    for (const TimedInstruction& t : sim.timeline[k]) {
      if (!is_compute(t.ins.op)) continue;
      out += (out.empty() ? "" : " ") + std::string(t.ins.op == Op::kForward ? "F" : "B") +
             std::to_string(t.ins.micro_batch) + "@" + std::to_string(static_cast<int>(t.start)) + "-" +
             std::to_string(static_cast<int>(t.end));
    }
    return out;
  };
  CHECK(spans(two, 0) == "F0@0-1 F1@1-2 B1@6-8 B0@10-12");
  CHECK(spans(two, 1) == "F0@2-3 F1@3-4 B1@4-6 B0@8-10");
  CHECK(two.makespan == doctest::Approx(12.0));

  // Every schedule, all its stages on one device, or on two devices of two stages each.
  OpCosts c;  // F 1, B 1 and W 1 where split (zero bubble), R 1, no messages
  c.backward = 1;
  c.weight = 1;
  const CostFn cost = [&c](int, const Instruction& i) {
    switch (i.op) {
      case Op::kForward: case Op::kRecompute: return c.forward;
      case Op::kBackward: return c.backward;
      case Op::kBackwardWeight: return c.weight * i.count;
      default: return 0.0;
    }
  };
  for (int K : {2, 3, 4}) {
    for (int M : {1, 4, 8}) {
      std::vector<Schedule> all = {gpipe_schedule(K, M, RecomputeMode::kExceptLast),
                                   one_f_one_b_schedule(K, M, RecomputeMode::kNever),
                                   zero_bubble_schedule(K, 1, M, RecomputeMode::kNever)};
      if (M % K == 0) all.push_back(interleaved_1f1b_schedule(K, 2, M, RecomputeMode::kNever));
      for (const Schedule& s : all) {
        CAPTURE(s.name);
        CAPTURE(K);
        CAPTURE(M);
        std::vector<int> own(K), one(K, 0), pairs(K);
        for (int k = 0; k < K; ++k) {
          own[k] = k;
          pairs[k] = k - k % 2;
        }
        const Simulation alone = simulate(s, cost);
        const Simulation apart = simulate(s, cost, CommModel::kBuffered, own);  // no stage shares: as without
        CHECK(apart.makespan == alone.makespan);
        for (int k = 0; k < K; ++k) CHECK(spans(apart, k) == spans(alone, k));

        const Simulation shared = simulate(s, cost, CommModel::kBuffered, one);
        double work = 0;
        for (double b : shared.busy) work += b;
        CHECK(shared.makespan == doctest::Approx(work));
        for (const std::vector<int>& turns : {one, pairs}) {
          const Simulation sim = simulate(s, cost, CommModel::kBuffered, turns);
          std::map<int, std::vector<std::pair<double, double>>> by_device;
          std::map<int, double> device_work;
          for (int k = 0; k < K; ++k) {
            CHECK(sim.busy[k] == doctest::Approx(alone.busy[k]));
            device_work[turns[k]] += sim.busy[k];
            for (const TimedInstruction& t : sim.timeline[k]) {
              if (is_compute(t.ins.op)) by_device[turns[k]].push_back({t.start, t.end});  // a receive's span is its wait
            }
          }
          for (auto& [device, spans_on] : by_device) {
            std::sort(spans_on.begin(), spans_on.end());
            for (size_t i = 1; i < spans_on.size(); ++i) CHECK(spans_on[i].first >= spans_on[i - 1].second - 1e-12);
            CHECK(sim.makespan >= device_work[device] - 1e-9);
          }
          CHECK(sim.makespan >= alone.makespan - 1e-9);
        }
      }
    }
  }
  CHECK_THROWS_AS(simulate(gpipe_schedule(2, 2, RecomputeMode::kNever), cost, CommModel::kBuffered, {0}), Error);
}

TEST_CASE("the file form: both notations, compute instructions only, a header saying what wrote it") {
  const Schedule z = zero_bubble_schedule(2, 1, 2, RecomputeMode::kExceptLast);
  const std::string csv = schedule_file_text(z, ScheduleNotation::kCsv, "from test.yaml");
  CHECK(csv.rfind("# schedule 'zero_bubble' for 2 stages, 1 cell per stage, 2 micro-batches, written by gpipe", 0) == 0);
  CHECK(csv.find("\n# from test.yaml\n") != std::string::npos);
  CHECK(csv.find("# The R lines place the recomputes") != std::string::npos);
  // Each stage's F, R, B, W in program order; no sends, receives or optimizer step.
  CHECK(csv.find("\n# stage 0\n0,F,0\n0,F,1\n0,R,0\n0,B,0\n0,W,0\n0,R,1\n0,B,1\n0,W,1\n"
                 "\n# stage 1\n1,F,0\n1,B,0\n1,F,1\n1,B,1\n1,W,0\n1,W,1\n") != std::string::npos);
  CHECK(csv.find("sA") == std::string::npos);
  CHECK(csv.find("OPT") == std::string::npos);
  // PyTorch's notation writes a backward whose weight gradient is a W as I (BACKWARD_INPUT).
  const std::string actions = schedule_file_text(z, ScheduleNotation::kActions);
  CHECK(actions.find("\n# stage 0\n0F0\n0F1\n0R0\n0I0\n0W0\n0R1\n0I1\n0W1\n") != std::string::npos);
  CHECK(schedule_file_text(gpipe_schedule(2, 1, RecomputeMode::kNever), ScheduleNotation::kActions)
            .find("\n# stage 0\n0F0\n0B0\n") != std::string::npos);
  // With interleaving, the chunk in CSV and the cell in actions.
  const Schedule i = interleaved_1f1b_schedule(2, 2, 2, RecomputeMode::kNever);
  CHECK(schedule_file_text(i, ScheduleNotation::kCsv).find("\n# stage 1: cells 1 3\n1,F,0,0\n1,F,1,0\n1,F,0,1\n") !=
        std::string::npos);
  CHECK(schedule_file_text(i, ScheduleNotation::kActions).find("\n# stage 1: cells 1 3\n1F0\n1F1\n3F0\n") !=
        std::string::npos);
  // Without R lines the header says the recompute mode decides on load.
  CHECK(schedule_file_text(gpipe_schedule(2, 1, RecomputeMode::kNever), ScheduleNotation::kCsv)
            .find("# No R lines: pipeline.recompute decides") != std::string::npos);
  // Cells placed otherwise than interleaved_cells have no file form.
  Schedule odd = gpipe_schedule(2, 1, RecomputeMode::kNever);
  odd.cells = {{1}, {0}};
  CHECK_THROWS_WITH(schedule_file_text(odd, ScheduleNotation::kCsv), doctest::Contains("has no file form"));
}

// parse(print(s)) == s: every built-in schedule, printed in either notation and read
// back with the same sizes, recompute mode and transport, is the same lowered schedule.
TEST_CASE("every built-in schedule survives its file form, in both notations") {
  int round_trips = 0;
  for (const std::string& name : schedule_names()) {
    for (int v = 1; v <= 3; ++v) {
      for (int K = 1; K <= 4; ++K) {
        for (int M : {1, 2, 3, 4, 6, 8}) {
          for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever}) {
            for (auto comm : {CommModel::kBuffered, CommModel::kRendezvous}) {
              ScheduleRequest r{name, K, v, M, mode, "", comm};
              Schedule s;
              try {
                s = make_schedule(r);
              } catch (const UserError&) {
                continue;  // sizes the schedule refuses (the test above says which and why)
              }
              for (auto notation : {ScheduleNotation::kCsv, ScheduleNotation::kActions}) {
                const std::string text = schedule_file_text(s, notation);
                INFO(name << " v=" << v << " K=" << K << " M=" << M << " mode=" << recompute_mode_name(mode)
                          << " rendezvous=" << (comm == CommModel::kRendezvous) << "\n" << text);
                const Schedule back = parse_schedule_text(text, "printed.csv", K, v, M, mode, comm);
                CHECK(back.cells == s.cells);
                CHECK(back.stages == s.stages);
                CHECK(schedule_table(back) == schedule_table(s));
                CHECK_NOTHROW(check_schedule(back, comm));
                // And printing it again gives the same instructions.
                const std::string again = schedule_file_text(back, notation);
                CHECK(again.substr(again.find("\n# stage 0")) == text.substr(text.find("\n# stage 0")));
                ++round_trips;
              }
            }
          }
        }
      }
    }
  }
  CHECK(round_trips > 1000);
}

TEST_CASE("micro_batch_roles reads which micro-batches recompute and which split B and W") {
  // GPipe with except_last: every micro-batch but the last recomputes, on every stage;
  // nothing splits.
  const Schedule g = gpipe_schedule(2, 3, RecomputeMode::kExceptLast);
  for (int k = 0; k < 2; ++k) {
    const MicroBatchRoles r = micro_batch_roles(g, k);
    CHECK(r.recomputed == std::vector<std::vector<char>>{{1, 1, 0}});
    CHECK(r.split == std::vector<std::vector<char>>{{0, 0, 0}});
  }
  // Interleaved, v = 2, always: both chunks of every micro-batch recompute.
  const Schedule il = interleaved_1f1b_schedule(2, 2, 2, RecomputeMode::kAlways);
  CHECK(micro_batch_roles(il, 1).recomputed == std::vector<std::vector<char>>{{1, 1}, {1, 1}});
  // Zero bubble, no recompute: every backward splits into B and W.
  const Schedule zb = zero_bubble_schedule(2, 1, 3, RecomputeMode::kNever);
  for (int k = 0; k < 2; ++k) {
    const MicroBatchRoles r = micro_batch_roles(zb, k);
    CHECK(r.recomputed == std::vector<std::vector<char>>{{0, 0, 0}});
    CHECK(r.split == std::vector<std::vector<char>>{{1, 1, 1}});
  }
  CHECK_THROWS(micro_batch_roles(zb, 2));
}

TEST_CASE("batched weight gradients: the drain's and each run of W's become one W over their micro-batches") {
  auto batched = [](const std::string& name, int K, int v, int M, RecomputeMode mode) {
    ScheduleRequest r{name, K, v, M, mode};
    r.batch_weights = true;
    return make_schedule(r);
  };
  // GPipe: every backward is the drain's; one W over all of them, after the last and its send.
  CHECK(schedule_table(batched("gpipe", 2, 1, 3, RecomputeMode::kNever)) ==
        "stage 0: F0 sA0 F1 sA1 F2 sA2 rG2 B2 rG1 B1 rG0 B0 W0-2 OPT\n"
        "stage 1: rA0 F0 rA1 F1 rA2 F2 B2 sG2 B1 sG1 B0 sG0 W0-2 OPT\n");
  CHECK(schedule_table(batched("gpipe", 2, 1, 2, RecomputeMode::kExceptLast)) ==
        "stage 0: F0 sA0 F1 sA1 rG1 B1 R0 rG0 B0 W0-1 OPT\n"
        "stage 1: rA0 F0 rA1 F1 B1 sG1 R0 B0 sG0 W0-1 OPT\n");
  // 1F1B: the cool-down's backwards only (stage 1 has one, which stays whole).
  CHECK(schedule_table(batched("1f1b", 2, 1, 3, RecomputeMode::kNever)) ==
        "stage 0: F0 sA0 F1 sA1 rG0 B0 F2 sA2 rG1 B1 rG2 B2 W1-2 OPT\n"
        "stage 1: rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 OPT\n");
  // Zero bubble: stage 1's deferred W1 W2 run back to back; stage 0's W's are apart.
  CHECK(schedule_table(batched("zero_bubble", 2, 1, 3, RecomputeMode::kNever)) ==
        "stage 0: F0 sA0 F1 sA1 rG0 B0 W0 F2 sA2 rG1 B1 W1 rG2 B2 W2 OPT\n"
        "stage 1: rA0 F0 B0 sG0 rA1 F1 B1 sG1 W0 rA2 F2 B2 sG2 W1-2 OPT\n");
  // Interleaved: each chunk's drain on its own (stage 1's last cell has one backward
  // after its last forward); a W goes before the next receive, to fill its wait.
  CHECK(schedule_table(batched("interleaved_1f1b", 2, 2, 2, RecomputeMode::kNever)) ==
        "stage 0: 0F0 0sA0 0F1 0sA1 2rA0 2F0 2sA0 2rA1 2F1 2sA1 2rG0 2B0 2sG0 2rG1 2B1 2sG1 2W0-1 0rG0 0B0 0rG1 0B1 "
        "0W0-1 OPT\n"
        "stage 1: 1rA0 1F0 1sA0 1rA1 1F1 1sA1 3rA0 3F0 3B0 3sG0 3rA1 3F1 3B1 3sG1 1rG0 1B0 1sG0 1rG1 1B1 1sG1 "
        "1W0-1 OPT\n");
  // A rendezvous transport: the W waits until the last backward's group of messages is posted.
  ScheduleRequest rz{"gpipe", 2, 1, 2, RecomputeMode::kNever};
  rz.comm = CommModel::kRendezvous;
  rz.batch_weights = true;
  CHECK_NOTHROW(make_schedule(rz));

  // What each batched W covers: every micro-batch's backward splits.
  const Schedule g = batched("gpipe", 2, 1, 3, RecomputeMode::kNever);
  CHECK(micro_batch_roles(g, 0).split == std::vector<std::vector<char>>{{1, 1, 1}});
  const Instruction w = g.stages[1][12];
  CHECK(w.op == Op::kBackwardWeight);
  CHECK(w.micro_batches() == std::vector<int>{0, 1, 2});
  // The simulator charges a batched W as its micro-batches' W's.
  OpCosts unit;
  unit.forward = unit.backward = 1;
  unit.weight = 0.5;
  CHECK(simulate(g, unit).busy[1] == doctest::Approx(3 + 3 + 1.5));

  // The file form lists the W's one by one; loaded and batched again, the same program.
  for (ScheduleNotation notation : {ScheduleNotation::kCsv, ScheduleNotation::kActions}) {
    const std::string text = schedule_file_text(g, notation);
    CHECK(text.find(notation == ScheduleNotation::kCsv ? "\n1,W,0\n1,W,1\n1,W,2\n" : "\n1W0\n1W1\n1W2\n") !=
          std::string::npos);
    Schedule back = parse_schedule_text(text, "batched.txt", 2, 1, 3, RecomputeMode::kNever);
    batch_weight_gradients(back);
    CHECK(back.stages == g.stages);
  }
}

TEST_CASE("the checker refuses a batched W before the last backward it covers") {
  ScheduleRequest r{"gpipe", 2, 1, 3, RecomputeMode::kNever};
  r.batch_weights = true;
  Schedule s = make_schedule(r);
  auto& st = s.stages[0];  // ... rG0 B0 W0-2 OPT
  auto w = std::find_if(st.begin(), st.end(), [](const Instruction& i) { return i.op == Op::kBackwardWeight; });
  REQUIRE(w != st.end());
  SUBCASE("before B0") {
    std::iter_swap(w, w - 1);
    CHECK_THROWS_WITH_AS(check_schedule(s), doctest::Contains("weight gradient before the backward of micro-batch 0"),
                         UserError);
  }
  SUBCASE("past the last micro-batch") {
    w->count = 4;
    CHECK_THROWS_WITH_AS(check_schedule(s), doctest::Contains("no such micro-batch"), UserError);
  }
  SUBCASE("twice over one micro-batch") {
    st.insert(w + 1, Instruction{Op::kBackwardWeight, 2});
    CHECK_THROWS_WITH_AS(check_schedule(s), doctest::Contains("weight gradient twice"), UserError);
  }
  SUBCASE("only a W covers several") {
    Instruction b = *(w - 1);
    REQUIRE(b.op == Op::kBackward);
    (w - 1)->count = 2;
    CHECK_THROWS_WITH_AS(check_schedule(s), doctest::Contains("only a weight gradient covers several"), UserError);
  }
}
