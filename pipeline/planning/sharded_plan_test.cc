// The Plan of a run with sharded optimizer state (pipeline.shard_optimizer: optimizer):
// the schedule holds RS and AG, estimate_memory counts one shard's optimizer state per
// device (1/D of the stage's, rounded up to whole elements), and the prediction prices
// RS and AG as (D-1)/D of the stage's bytes over the link, AG after OPT.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
#include "pipeline/planning/profile.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

// Four linear layers 4 -> 4 (20 parameters each, float64), Adam: two slots.
const char* kLinear4 = R"(model:
  input: [4]
  dtype: float64
  layers:
    - repeat: 4
      layers:
        - {type: linear, out: 4}
  loss: softmax_cross_entropy
optimizer: {type: adam}
train: {steps: 1, batch_size: 8}
)";

Plan plan_of(const std::vector<std::string>& sets, RunModel& run) {
  run = build_run_model(parse_config(kLinear4, "t.yaml", sets));
  return make_plan(run.config, *run.model);
}

}  // namespace

TEST_CASE("a sharded plan: RS and AG in the program, one shard's optimizer state per device") {
  struct Case {
    int K, D;
    bool shard;
    int64_t optimizer_bytes;  // per stage
  };
  // Unsharded: 2 slots x 8 bytes x (20 parameters per layer, 4 / K layers per stage).
  // Sharded: 2 x 8 x ceil(N / D) of the stage's N.
  for (const Case& c : {Case{1, 1, true, 1280}, Case{1, 2, false, 1280}, Case{1, 2, true, 640}, Case{1, 3, true, 432},
                        Case{1, 4, true, 320}, Case{2, 2, false, 640}, Case{2, 2, true, 320}}) {
    CAPTURE(c.K);
    CAPTURE(c.D);
    CAPTURE(c.shard);
    RunModel run;
    const Plan plan = plan_of({"pipeline.partitions=" + std::to_string(c.K), "pipeline.replicas=" + std::to_string(c.D),
                               "train.batch_size=" + std::to_string(8 * c.D),
                               std::string("pipeline.shard_optimizer=") + (c.shard ? "optimizer" : "none")},
                              run);
    CHECK(plan.shard_optimizer == (c.shard && c.D > 1));  // one replica has nothing to shard
    const std::string table = schedule_table(plan.schedule);
    CHECK((table.find(" RS ") != std::string::npos) == plan.shard_optimizer);
    CHECK((table.find(" OPT AG") != std::string::npos) == plan.shard_optimizer);
    CHECK((table.find(" RG ") != std::string::npos) == (c.D > 1 && !plan.shard_optimizer));
    const auto mem = estimate_memory(plan, *run.model, run.config.optimizer.optimizer);
    for (const StageMemory& m : mem) {
      CHECK(m.optimizer_bytes == c.optimizer_bytes);
      CHECK(m.weight_bytes == 4 / c.K * 20 * 8);
    }
  }
}

TEST_CASE("the prediction prices RS and AG over the replicas' link, AG after OPT") {
  RunModel run;
  const Plan plan = plan_of({"pipeline.replicas=2", "train.batch_size=16", "pipeline.shard_optimizer=optimizer"}, run);
  const CostSource costs(*run.model, ProfileStore{}, "none", Device::cpu(), 1, partition::CostModel{}, {},
                         run.config.optimizer.optimizer);
  PredictOptions o;
  o.instruction_overhead_ms = 0;
  // 1 ms per message plus 1 ms per 64 bytes: the stage's 640 bytes of parameters, half
  // of them moved by each of RS and AG (D = 2), cost 1 + 320 / 64 = 6 ms each.
  const LinkCost link{"test", 1.0, 64.0};
  const PlannedRun p = predict(plan, *run.model, costs, [&](int, int) { return link; },
                               run.config.optimizer.optimizer, o);
  const auto& t = p.timeline.at(0);
  REQUIRE(t.size() >= 3);
  const TimedInstruction& ag = t.back();
  const TimedInstruction& opt = t[t.size() - 2];
  CHECK(ag.ins.op == Op::kGatherParameters);
  CHECK(opt.ins.op == Op::kOptimizerStep);
  CHECK(ag.start == doctest::Approx(opt.end));
  CHECK(ag.end - ag.start == doctest::Approx(6.0));
  bool rs = false;
  for (const TimedInstruction& x : t) {
    if (x.ins.op == Op::kReduceScatterGradients) {
      rs = true;
      CHECK(x.end - x.start == doctest::Approx(6.0));
      CHECK(x.end <= opt.start);
    }
  }
  CHECK(rs);
}
