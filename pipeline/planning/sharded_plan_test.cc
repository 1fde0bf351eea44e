// The Plan of a run with sharded optimizer state (pipeline.shard_optimizer: optimizer):
// the schedule holds RS and AG, estimate_memory counts one shard's optimizer state per
// device (1/D of the stage's, rounded up to whole elements), and the prediction prices
// RS and AG as (D-1)/D of the stage's bytes over the link, AG after OPT, and one shard's
// update; the sweep tries each shape with the state sharded and not.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
#include "pipeline/planning/profile.h"
#include "pipeline/planning/sweep.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::tmp_path;

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
  // (One replica with the state sharded is refused when the config loads: config_test.)
  for (const Case& c : {Case{1, 1, false, 1280}, Case{1, 2, false, 1280}, Case{1, 2, true, 640}, Case{1, 3, true, 432},
                        Case{1, 4, true, 320}, Case{2, 2, false, 640}, Case{2, 2, true, 320}}) {
    CAPTURE(c.K);
    CAPTURE(c.D);
    CAPTURE(c.shard);
    RunModel run;
    const Plan plan = plan_of({"pipeline.partitions=" + std::to_string(c.K), "pipeline.replicas=" + std::to_string(c.D),
                               "train.batch_size=" + std::to_string(8 * c.D),
                               std::string("pipeline.shard_optimizer=") + (c.shard ? "optimizer" : "none")},
                              run);
    CHECK(plan.shard_optimizer == c.shard);
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

TEST_CASE("a bfloat16 plan counts float32 masters, gradients and state, and bfloat16 working copies") {
  // 2 layers of 20 parameters per stage at K = 2: masters 4 bytes each and working copies
  // 2 (weights 240), gradients 4 (160), Adam's two slots 4 each (320; sharded over D = 2:
  // 2 x 4 x 20 = 160).
  for (bool shard : {false, true}) {
    CAPTURE(shard);
    RunModel run;
    const Plan plan = plan_of({"model.dtype=bf16", "pipeline.partitions=2", "pipeline.replicas=2", "train.batch_size=16",
                               std::string("pipeline.shard_optimizer=") + (shard ? "optimizer" : "none")},
                              run);
    for (const StageMemory& m : estimate_memory(plan, *run.model, run.config.optimizer.optimizer)) {
      CHECK(m.weight_bytes == 240);
      CHECK(m.gradient_bytes == 160);
      CHECK(m.optimizer_bytes == (shard ? 160 : 320));
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
  // Each replica updates half of the stage: OPT is priced at half the unsharded one.
  RunModel whole;
  const Plan unsharded = plan_of({"pipeline.replicas=2", "train.batch_size=16"}, whole);
  const PlannedRun q = predict(unsharded, *whole.model, costs, [&](int, int) { return link; },
                               whole.config.optimizer.optimizer, o);
  double unsharded_opt = 0;
  for (const TimedInstruction& x : q.timeline.at(0)) {
    if (x.ins.op == Op::kOptimizerStep) unsharded_opt = x.end - x.start;
  }
  CHECK(unsharded_opt > 0);
  CHECK(opt.end - opt.start == doctest::Approx(unsharded_opt / 2));
}

TEST_CASE("the sweep tries each shape with the optimizer state sharded over the replicas and not") {
  RunModel run;
  plan_of({"pipeline.replicas=2", "train.batch_size=16", "pipeline.profile=" + tmp_path("none.json")}, run);
  SweepOptions o;
  o.devices = 4;
  o.micro_batches = {1, 2};
  const SweepResult all = sweep(run.config, *run.model, o);
  int sharded = 0;
  int64_t least_unsharded = -1;
  for (const Candidate& c : all.candidates) {
    INFO(c.label());
    CHECK(c.replicas == 2);
    CHECK(c.stages * c.blas_threads <= 2);  // each replica has 2 of the 4 devices
    CHECK(c.label().find("D=2") != std::string::npos);
    CHECK((c.label().find("sharded") != std::string::npos) == c.shard_optimizer);
    CHECK(c.overrides().find(std::string("--set pipeline.shard_optimizer=") +
                             (c.shard_optimizer ? "optimizer" : "none")) != std::string::npos);
    if (c.shard_optimizer) {
      ++sharded;
      // Its twin without sharding: the same shape, each device holding twice the optimizer state.
      const auto twin = std::find_if(all.candidates.begin(), all.candidates.end(), [&](const Candidate& u) {
        return !u.shard_optimizer && u.stages == c.stages && u.virtual_stages == c.virtual_stages &&
               u.micro_batches == c.micro_batches && u.recompute == c.recompute && u.schedule == c.schedule &&
               u.blas_threads == c.blas_threads;
      });
      REQUIRE(twin != all.candidates.end());
      for (size_t k = 0; k < c.run.stages.size(); ++k) {
        CHECK(2 * c.run.stages[k].optimizer_bytes == twin->run.stages[k].optimizer_bytes);
      }
    } else {
      least_unsharded = least_unsharded < 0 ? c.peak_device_bytes : std::min(least_unsharded, c.peak_device_bytes);
    }
  }
  CHECK(sharded * 2 == static_cast<int>(all.candidates.size()));
  // Under a limit no unsharded plan fits: the recommendation is sharded.
  o.memory_limit = least_unsharded - 1;
  const SweepResult tight = sweep(run.config, *run.model, o);
  REQUIRE(tight.recommended >= 0);
  CHECK(tight.candidates[tight.recommended].shard_optimizer);
  for (const Candidate& c : tight.candidates) {
    if (!c.shard_optimizer) CHECK(c.verdict.rfind("memory", 0) == 0);
  }
  // Plain SGD has no state to shard: nothing sharded is tried.
  RunModel sgd;
  plan_of({"pipeline.replicas=2", "train.batch_size=16", "optimizer.type=sgd",
           "pipeline.profile=" + tmp_path("none.json")}, sgd);
  for (const Candidate& c : sweep(sgd.config, *sgd.model, o).candidates) CHECK(!c.shard_optimizer);
}
