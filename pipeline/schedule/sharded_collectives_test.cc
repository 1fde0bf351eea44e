// The sharded optimizer's collectives as instructions (issue 22): lowered in their
// place (the ties' TIE, RS, NORM before OPT; AG right after it), proved by the checker
// (AG before OPT, or RS and AG in a run that does not shard, are refused), simulated
// after OPT, and accounted as communication inside the step's span.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/time_accounting.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {
Schedule::Collectives sharded(bool ties) {
  Schedule::Collectives c;
  c.replicas = true;
  c.gradient_norm = true;
  c.shard_optimizer = true;
  if (ties) c.ties = {{0, 1}};
  return c;
}
std::vector<std::string> tail(const Schedule& s, int k, size_t n) {
  std::vector<std::string> out;
  for (size_t i = s.stages[k].size() - n; i < s.stages[k].size(); ++i) out.push_back(op_short_name(s.stages[k][i].op));
  return out;
}
}  // namespace

TEST_CASE("sharded collectives are lowered around OPT: TIE, RS, NORM before it, AG after it") {
  Schedule s = gpipe_schedule(2, 2, RecomputeMode::kNever);
  lower_collectives(s, sharded(true));
  CHECK(tail(s, 0, 5) == std::vector<std::string>{"TIE", "RS", "NORM", "OPT", "AG"});
  CHECK(tail(s, 1, 5) == std::vector<std::string>{"TIE", "RS", "NORM", "OPT", "AG"});
  CHECK(schedule_table(s).find("RG") == std::string::npos);
  lower_collectives(s, sharded(true));  // idempotent
  CHECK(tail(s, 0, 5) == std::vector<std::string>{"TIE", "RS", "NORM", "OPT", "AG"});
  check_schedule(s);
  check_schedule(s, CommModel::kRendezvous);
  // Unsharded replicas keep RG, and nothing after OPT.
  Schedule u = gpipe_schedule(2, 2, RecomputeMode::kNever);
  Schedule::Collectives c = sharded(false);
  c.shard_optimizer = false;
  lower_collectives(u, c);
  CHECK(tail(u, 0, 3) == std::vector<std::string>{"RG", "NORM", "OPT"});
  CHECK(op_short_name(Op::kReduceScatterGradients) == std::string("RS"));
  CHECK(op_short_name(Op::kGatherParameters) == std::string("AG"));
  CHECK(is_collective(Op::kGatherParameters));
  CHECK(after_optimizer(Op::kGatherParameters));
  CHECK_FALSE(after_optimizer(Op::kReduceScatterGradients));
}

TEST_CASE("the checker refuses AG before OPT, and RS or AG in a run that does not shard") {
  Schedule s = gpipe_schedule(1, 2, RecomputeMode::kNever);
  lower_collectives(s, sharded(false));
  auto& prog = s.stages[0];
  REQUIRE(prog.back().op == Op::kGatherParameters);
  Schedule early = s;
  std::swap(early.stages[0][early.stages[0].size() - 1], early.stages[0][early.stages[0].size() - 2]);  // AG, OPT
  CHECK_THROWS_WITH_AS(check_schedule(early), doctest::Contains("the parameters' all-gather before the optimizer step"),
                       UserError);
  Schedule unsharded = s;
  unsharded.collectives.shard_optimizer = false;
  CHECK_THROWS_WITH_AS(check_schedule(unsharded), doctest::Contains("does not shard its optimizer state"), UserError);
  Schedule missing = s;
  missing.stages[0].pop_back();  // no AG
  CHECK_THROWS_WITH_AS(check_schedule(missing), doctest::Contains("runs 2 collectives (RG, TIE, NORM, RS, AG) where the run needs 3"),
                       UserError);
}

TEST_CASE("the simulator runs AG after OPT; the accounting keeps OPT out of the idle time") {
  Schedule s = gpipe_schedule(1, 1, RecomputeMode::kNever);
  lower_collectives(s, sharded(false));
  OpCosts c;
  c.forward = 1;
  c.backward = 2;
  c.optimizer = 3;
  c.collective = 0.5;
  const Simulation sim = simulate(s, c);
  // F 1, B 2, RS 0.5, NORM 0.5, OPT 3, AG 0.5.
  CHECK(sim.makespan == doctest::Approx(7.5));
  const auto& t = sim.timeline[0];
  REQUIRE(t.back().ins.op == Op::kGatherParameters);
  CHECK(t.back().start == doctest::Approx(7.0));
  std::vector<std::vector<OpSpan>> ops(1);
  for (const TimedInstruction& x : t) ops[0].push_back({x.ins.op, x.start, x.end, x.ins.micro_batch});
  const StepTime st = account_step(ops);
  CHECK(st.span_ms == doctest::Approx(7.5));
  CHECK(st.stages[0].optimizer_ms == doctest::Approx(3));
  CHECK(st.stages[0].collective_ms == doctest::Approx(1.5));
  CHECK(st.stages[0].idle_ms == doctest::Approx(0));
}
