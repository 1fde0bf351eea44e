// Literal instruction tables for small schedules, the checker and the simulator.
#include <doctest/doctest.h>

#include "pipeline/schedule.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

TEST_CASE("GPipe, K=2, M=2, checkpoint except_last") {
  CHECK(schedule_table(gpipe_schedule(2, 2, CheckpointMode::kExceptLast)) ==
        "stage 0: F0 sA0 F1 sA1 rG1 B1 R0 rG0 B0 OPT\n"
        "stage 1: rA0 F0 rA1 F1 B1 sG1 R0 B0 sG0 OPT\n");
}

TEST_CASE("GPipe, K=3, M=2, checkpoint always") {
  CHECK(schedule_table(gpipe_schedule(3, 2, CheckpointMode::kAlways)) ==
        "stage 0: F0 sA0 F1 sA1 R1 rG1 B1 R0 rG0 B0 OPT\n"
        "stage 1: rA0 F0 sA0 rA1 F1 sA1 R1 rG1 B1 sG1 R0 rG0 B0 sG0 OPT\n"
        "stage 2: rA0 F0 rA1 F1 R1 B1 sG1 R0 B0 sG0 OPT\n");
}

TEST_CASE("GPipe, K=1, M=3, checkpoint never") {
  CHECK(schedule_table(gpipe_schedule(1, 3, CheckpointMode::kNever)) == "stage 0: F0 F1 F2 B2 B1 B0 OPT\n");
}

TEST_CASE("checkpoint modes") {
  CHECK(is_checkpointed(CheckpointMode::kAlways, 3, 4));
  CHECK(!is_checkpointed(CheckpointMode::kExceptLast, 3, 4));
  CHECK(is_checkpointed(CheckpointMode::kExceptLast, 2, 4));
  CHECK(!is_checkpointed(CheckpointMode::kNever, 0, 4));
  CHECK(parse_checkpoint_mode("except_last") == CheckpointMode::kExceptLast);
  CHECK_THROWS_WITH_AS(parse_checkpoint_mode("sometimes"), doctest::Contains("always, except_last or never"),
                       UserError);
  CHECK_THROWS_WITH_AS(make_schedule("1f1b", 2, 2, CheckpointMode::kNever), doctest::Contains("valid schedules: gpipe"),
                       UserError);
}

TEST_CASE("every GPipe schedule passes the checker") {
  for (int k = 1; k <= 6; ++k)
    for (int m = 1; m <= 9; ++m)
      for (auto mode : {CheckpointMode::kAlways, CheckpointMode::kExceptLast, CheckpointMode::kNever})
        CHECK_NOTHROW(check_schedule(gpipe_schedule(k, m, mode)));
}

TEST_CASE("the checker finds broken schedules") {
  Schedule s = gpipe_schedule(2, 2, CheckpointMode::kNever);
  SUBCASE("a receive without a send deadlocks") {
    auto& st = s.stages[0];
    st.erase(st.begin() + 1);  // drop sA0
    CHECK_THROWS_WITH(check_schedule(s), doctest::Contains("deadlocks"));
  }
  SUBCASE("backward before forward") {
    std::swap(s.stages[0][0], s.stages[0][5]);
    CHECK_THROWS_AS(check_schedule(s), Error);
  }
  SUBCASE("receives in the wrong order across stages deadlock") {
    // stage 1 waits for a gradient it must itself cause first.
    s.stages[1].insert(s.stages[1].begin(), Instruction{Op::kRecvActivation, 1});
    CHECK_THROWS_AS(check_schedule(s), Error);
  }
  SUBCASE("a missing optimizer step") {
    s.stages[1].pop_back();
    CHECK_THROWS_WITH(check_schedule(s), doctest::Contains("no optimizer step"));
  }
}

TEST_CASE("the simulated bubble of balanced GPipe equals (K-1)/(M+K-1)") {
  for (int k = 1; k <= 4; ++k) {
    for (int m : {1, 2, 4, 8, 16}) {
      OpCosts c;  // forward 1, backward 2, no recompute
      const Simulation sim = simulate(gpipe_schedule(k, m, CheckpointMode::kNever), c);
      CHECK(sim.makespan == doctest::Approx(3.0 * (m + k - 1)));
      CHECK(sim.bubble == doctest::Approx(ideal_bubble(k, m)));
    }
  }
}
