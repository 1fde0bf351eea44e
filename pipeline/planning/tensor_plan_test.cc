// The Plan of a tensor-parallel run (pipeline.tensor_parallel: T): the rank layout every
// part of a K x T x D job reads (Plan::ranks), against a table written out by hand; and
// a member's plan, made on shapes with its place in the group (layers::ShapeCollectives),
// holding the member's weights: its blocks of the split layers and the whole ones,
// counted here from the member built with its weights.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "layers/registry.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/plan.h"
#include "tests/tensor_group.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

TEST_CASE("the rank layout: a stage's tensor group on adjacent ranks, then the stages, then the replicas") {
  const RankLayout l{2, 3, 2};  // K = 2, T = 3, D = 2
  CHECK(l.size() == 12);
  // rank: stage, member, replica.
  const int want[12][3] = {{0, 0, 0}, {0, 1, 0}, {0, 2, 0}, {1, 0, 0}, {1, 1, 0}, {1, 2, 0},
                           {0, 0, 1}, {0, 1, 1}, {0, 2, 1}, {1, 0, 1}, {1, 1, 1}, {1, 2, 1}};
  for (int r = 0; r < 12; ++r) {
    CAPTURE(r);
    const RankPlace p = l.place(r);
    CHECK(p.stage == want[r][0]);
    CHECK(p.member == want[r][1]);
    CHECK(p.replica == want[r][2]);
    CHECK(l.rank(p) == r);
  }
  // T = 1: the layout without tensor parallelism, rank = replica K + stage.
  const RankLayout plain{3, 1, 2};
  for (int r = 0; r < 6; ++r) {
    CHECK(plain.place(r).stage == r % 3);
    CHECK(plain.place(r).replica == r / 3);
    CHECK(plain.place(r).member == 0);
  }
}

TEST_CASE("pipeline.tensor_parallel: read into the plan, at least 1") {
  const char* text = gpipe::testing::kTensorParallelGpt;
  const Config c = parse_config(text, "t.yaml", {"pipeline.tensor_parallel=4", "pipeline.partitions=2"});
  const Plan p = plan_sizes(c);
  CHECK(p.tensor_parallel == 4);
  CHECK(p.ranks().size() == 8);
  CHECK_THROWS_WITH_AS(parse_config(text, "t.yaml", {"pipeline.tensor_parallel=0"}),
                       doctest::Contains("pipeline.tensor_parallel: must be at least 1"), UserError);
}

TEST_CASE("a member's plan, made on shapes, holds the member's weights") {
  for (const char* text : {gpipe::testing::kTensorParallelGpt, gpipe::testing::kTensorParallelLlama}) {
    int64_t whole_weights = 0;
    for (int T : {1, 2, 4}) {
      CAPTURE(T);
      Config c = parse_config(text, "t.yaml", {"pipeline.tensor_parallel=" + std::to_string(T)});
      c.model.member = layers::TensorShard{T - 1, T};
      RunModel run = build_run_model_on_shapes(c);
      REQUIRE(run.on_shapes);
      const Plan plan = make_plan(run.config, *run.model);  // the split layers sum on shapes
      // The member with its weights: what it holds, parameter by parameter.
      auto member = layers::build_model(c.model);
      int64_t held = 0, split = 0;
      for (int i = 0; i < member->size(); ++i) {
        for (const layers::Parameter* p : member->layer(i).parameters()) {
          held += p->value.numel() * 8;  // float64; a tied copy is held by its own layer too
          if (p->shard_count > 1) ++split;
        }
      }
      CHECK(plan.memory.at(0).weight_bytes == held);
      if (T == 1) {
        whole_weights = held;
        CHECK(split == 0);
      } else {
        CHECK(split > 0);
        CHECK(held < whole_weights);
      }
    }
  }
}
