// The Plan of a tensor-parallel run (pipeline.tensor_parallel: T): the rank layout every
// part of a K x T x D job reads (Plan::ranks), against a table written out by hand; and
// a member's plan, made on shapes with its place in the group (layers::ShapeCollectives),
// holding the member's weights: its blocks of the split layers and the whole ones,
// counted here from the member built with its weights; and a member's sums over its
// group, counted on shapes and priced over the group's link as the planner prices them.
#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "partition/balance.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
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

// An MLP split Megatron's way after a whole layer: the row-parallel layer sums its output
// forward, the column-parallel one its input gradient backward (each 12 float64 a sample).
const char* kSplitMlp = R"(model:
  input: [12]
  dtype: float64
  layers:
    - {type: linear, out: 12}
    - {type: linear, out: 32, parallel: column}
    - {type: gelu}
    - {type: linear, out: 12, parallel: row}
  loss: softmax_cross_entropy
data: {classes: 12}
train: {steps: 1, batch_size: 8}
)";

TEST_CASE("a member's sums over its group, counted on shapes and priced over the group's link") {
  Config c = parse_config(kSplitMlp, "t.yaml", {"pipeline.tensor_parallel=2"});
  c.model.member = layers::TensorShard{1, 2};
  RunModel run = build_run_model_on_shapes(c);
  const std::vector<partition::LayerLaunches> n = count_launches(*run.model);
  REQUIRE(n.size() == 4);
  const int64_t row = 12 * 8;  // bytes of one sample's 12 float64 features
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(n[i].group_sums_forward == (i == 3 ? 1 : 0));
    CHECK(n[i].group_bytes_forward == (i == 3 ? row : 0));
    CHECK(n[i].group_sums_backward == (i == 1 ? 1 : 0));
    CHECK(n[i].group_bytes_backward == (i == 1 ? row : 0));
  }
  // The same model whole sums nothing.
  Config whole_config = parse_config(kSplitMlp, "t.yaml");
  RunModel whole = build_run_model_on_shapes(whole_config);
  for (const partition::LayerLaunches& w : count_launches(*whole.model)) {
    CHECK(w.group_sums_forward + w.group_sums_backward == 0);
  }
  // Priced: a ring of T = 2 over a link of 10 us and 1 GB/s; 4 samples a micro-batch.
  partition::CostModel plain;
  plain.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(n);
  partition::CostModel priced = plain;
  price_tensor_group(priced, 2, LinkCost{"test", 0.01, 1e6});
  CHECK(priced.group_latency_seconds == doctest::Approx(1e-5));
  CHECK(priced.group_bytes_per_second == doctest::Approx(1e9));
  const layers::OptimizerConfig sgd;
  const CostTable a = estimate_costs(*run.model, 4, plain, {}, sgd);
  const CostTable b = estimate_costs(*run.model, 4, priced, {}, sgd);
  // One sum: 2 (T - 1) = 2 latencies, and 2 (T - 1) / T of 4 samples' bytes at 1 GB/s.
  const double one_sum_ms = (2 * 1e-5 + 4.0 * row * 2 * 1 / 2 / 1e9) * 1e3;
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(b.layers[i].forward - a.layers[i].forward == doctest::Approx(i == 3 ? one_sum_ms : 0.0));
    CHECK(b.layers[i].recompute - a.layers[i].recompute == doctest::Approx(i == 3 ? one_sum_ms : 0.0));
    CHECK(b.layers[i].backward_input - a.layers[i].backward_input == doctest::Approx(i == 1 ? one_sum_ms : 0.0));
    CHECK(b.layers[i].backward_weight == doctest::Approx(a.layers[i].backward_weight));
  }
  // The balancer's seconds carry the same terms (layer 3: forward; layer 1: backward).
  const std::vector<double> ca = partition::layer_costs(*run.model, 4, false, {}, plain);
  const std::vector<double> cb = partition::layer_costs(*run.model, 4, false, {}, priced);
  CHECK(cb[3] - ca[3] == doctest::Approx(one_sum_ms / 1e3));
  CHECK(cb[1] - ca[1] == doctest::Approx(one_sum_ms / 1e3));
  CHECK(cb[0] == doctest::Approx(ca[0]));
}

TEST_CASE("a tensor collective is priced on its own: over the group's ring, 0 for a layer with a user's cost; more BLAS threads speed up compute, not sums") {
  Config c = parse_config(kSplitMlp, "t.yaml", {"pipeline.tensor_parallel=2"});
  c.model.member = layers::TensorShard{1, 2};
  RunModel run = build_run_model_on_shapes(c);
  partition::CostModel cm;
  cm.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(count_launches(*run.model));
  price_tensor_group(cm, 2, LinkCost{"test", 0.01, 1e6});
  const layers::OptimizerConfig sgd;
  // Layer 1 has a user's cost (seconds of its forward and backward): its sums are in it.
  std::vector<std::optional<double>> overrides(4);
  overrides[1] = 0.003;
  const CostTable table = estimate_costs(*run.model, 4, cm, overrides, sgd);
  const int64_t row = 12 * 8;
  const TensorOp sum3{Op::kTensorSum, 0, row, 3}, sum1{Op::kTensorSum, 0, row, 1};
  const TensorOp gather3{Op::kTensorGather, 0, row, 3};
  // A sum: 2 (T - 1) latencies and 2 (T - 1) / T of 4 samples' bytes; an all-gather half.
  CHECK(table.tensor_ms(sum3, 4) == doctest::Approx((2 * 1e-5 + 4.0 * row * 2 * 1 / 2 / 1e9) * 1e3));
  CHECK(table.tensor_ms(gather3, 4) == doctest::Approx((1e-5 + 4.0 * row * 1 / 2 / 1e9) * 1e3));
  CHECK(table.tensor_ms(sum1, 4) == 0.0);
  CHECK(table.layers[1].group_in_times);
  // Twice the compute rate (the sweep's guess for two BLAS threads): each layer's time
  // less its sums halves, its sums stay.
  const CostSource one(*run.model, ProfileStore{}, "none", Device::cpu(), 1, cm, {}, sgd);
  const CostSource two(*run.model, ProfileStore{}, "none", Device::cpu(), 1, cm, {}, sgd, 0.5);
  const CostTable &a = one.at(4), &b = two.at(4);
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    const LayerTimes &x = a.layers[i], &y = b.layers[i];
    CHECK(y.forward - y.forward_group == doctest::Approx(0.5 * (x.forward - x.forward_group)));
    CHECK(y.recompute - y.forward_group == doctest::Approx(0.5 * (x.recompute - x.forward_group)));
    CHECK(y.backward_input - y.backward_group == doctest::Approx(0.5 * (x.backward_input - x.backward_group)));
    CHECK(y.backward_weight - y.weight_group == doctest::Approx(0.5 * (x.backward_weight - x.weight_group)));
    CHECK(y.backward - y.backward_group - y.weight_group ==
          doctest::Approx(0.5 * (x.backward - x.backward_group - x.weight_group)));
    CHECK(y.forward_group == x.forward_group);
    CHECK(y.backward_group == x.backward_group);
  }
  CHECK(a.layers[3].forward_group > 0);
}

TEST_CASE("replicated key/value heads: their weight gradients' sums counted in W, priced whatever the batch") {
  // 2 key/value heads of width 2 over 4 members: k's and v's weight gradients, each all
  // KV heads' rows (2 x 2) of 16 float64 columns, summed over the group in each W.
  Config c = parse_config(gpipe::testing::kTensorParallelLlamaFewKv, "t.yaml", {"pipeline.tensor_parallel=4"});
  c.model.member = layers::TensorShard{2, 4};
  RunModel run = build_run_model_on_shapes(c);
  const std::vector<partition::LayerLaunches> n = count_launches(*run.model);
  const int64_t kv_grad = 2 * 2 * 16 * 8;
  for (int i : {1, 2}) {  // the llama blocks
    CAPTURE(i);
    CHECK(n[i].group_sums_weight == 2);
    CHECK(n[i].group_bytes_weight == 2 * kv_grad);
  }
  CHECK(n[0].group_sums_weight == 0);
  partition::CostModel cm;
  cm.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(n);
  price_tensor_group(cm, 4, LinkCost{"test", 0.01, 1e6});
  // 2 sums: 2 x 2 (T - 1) latencies, and 2 (T - 1) / T of their bytes at 1 GB/s.
  const double w_ms = (2 * 6 * 1e-5 + 2.0 * kv_grad * 6 / 4 / 1e9) * 1e3;
  for (int64_t micro : {int64_t{1}, int64_t{3}}) {
    CAPTURE(micro);
    const CostTable t = estimate_costs(*run.model, micro, cm, {}, layers::OptimizerConfig{});
    CHECK(t.layers[1].weight_group == doctest::Approx(w_ms));
  }
}

TEST_CASE("sequence parallelism: a member's all-gathers and reduce-scatters, counted on shapes, priced as half a sum each") {
  // The GPT config with 8 positions of 8 float64 features: a whole (S, C) sample is 512
  // bytes. Layers: the embedding, two blocks, the final norm, the head (with the loss).
  const std::string text = gpipe::testing::with_positions(gpipe::testing::kTensorParallelGpt, 8);
  Config plain_config = parse_config(text, "t.yaml", {"pipeline.tensor_parallel=2"});
  Config seq_config = parse_config(text, "t.yaml", {"pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true"});
  CHECK(seq_config.pipeline.sequence_parallel);
  CHECK_FALSE(plain_config.pipeline.sequence_parallel);
  plain_config.model.member = layers::TensorShard{1, 2};
  seq_config.model.member = layers::TensorShard{1, 2, true};
  RunModel plain = build_run_model_on_shapes(plain_config);
  RunModel seq = build_run_model_on_shapes(seq_config);
  // The member holds half the positions between the split layers, all of them at the head.
  CHECK(seq.model->layer(0).output_shape() == Shape{4, 8});
  CHECK(seq.model->layer(3).output_shape() == Shape{4, 8});
  CHECK(seq.model->layer(4).output_shape() == Shape{8, 8});  // the head's: its half of the vocabulary
  const std::vector<partition::LayerLaunches> p = count_launches(*plain.model);
  const std::vector<partition::LayerLaunches> s = count_launches(*seq.model);
  REQUIRE(s.size() == 5);
  const int64_t sample = 8 * 8 * 8;
  // Embedding: its sum becomes a reduce-scatter, and B all-gathers the token rows' gradient.
  // A block: qkv and fc1 gather, the projection and fc2 scatter (F); B the reverse.
  // Head: gathers its input (F), scatters its input's gradient (B); the loss's sums stay.
  const int64_t want_f[5] = {1, 4, 4, 0, 1}, want_b[5] = {1, 4, 4, 0, 1};
  for (int i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(s[i].group_gathers_forward == want_f[i]);
    CHECK(s[i].group_gathers_backward == want_b[i]);
    CHECK(s[i].group_gather_bytes_forward == want_f[i] * sample);
    CHECK(s[i].group_gather_bytes_backward == want_b[i] * sample);
    CHECK(p[i].group_gathers_forward + p[i].group_gathers_backward == 0);
    // The all-reduces they replace: the embedding's (F), two a block each way, the head's
    // input gradient's (B); the loss's stay.
    const int64_t replaced_f = i == 0 ? 1 : (i == 1 || i == 2) ? 2 : 0;
    const int64_t replaced_b = (i == 1 || i == 2) ? 2 : i == 4 ? 1 : 0;
    CHECK(s[i].group_sums_forward == p[i].group_sums_forward - replaced_f);
    CHECK(s[i].group_sums_backward == p[i].group_sums_backward - replaced_b);
  }
  // Priced over a ring of T = 2 (10 us, 1 GB/s), 4 samples: one gather is T - 1 = 1
  // latency and (T - 1) / T of its whole tensor's bytes.
  partition::CostModel cm;
  cm.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(s);
  price_tensor_group(cm, 2, LinkCost{"test", 0.01, 1e6});
  const double one_gather = 1e-5 + 4.0 * sample / 2 / 1e9;
  CHECK(cm.group_seconds(1, 4).forward == doctest::Approx(4 * one_gather));
  CHECK(cm.group_seconds(1, 4).backward == doctest::Approx(4 * one_gather));
  CHECK(cm.group_seconds(0, 4).forward == doctest::Approx(one_gather));
  CHECK(cm.group_seconds(3, 4).forward == 0);
  // A block moves the bytes of the two all-reduces it replaces, at the same count of ring steps.
  partition::CostModel cp = cm;
  cp.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(p);
  CHECK(cm.group_seconds(1, 4).forward == doctest::Approx(cp.group_seconds(1, 4).forward));
}

TEST_CASE("sequence parallelism: the partial gradients' sums, once a step where the gradients become final") {
  // The GPT config with 8 positions of 8 float64 features. Partial under sequence
  // parallelism: the position table (8 x 8), each block's two layer norms (weight and
  // bias, 8 each), the final norm; the head's gradient is whole.
  const std::string text = gpipe::testing::with_positions(gpipe::testing::kTensorParallelGpt, 8);
  Config seq_config = parse_config(text, "t.yaml", {"pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true",
                                                    "pipeline.partitions=1", "pipeline.micro_batches=2"});
  Config plain_config = parse_config(text, "t.yaml", {"pipeline.tensor_parallel=2", "pipeline.partitions=1",
                                                      "pipeline.micro_batches=2"});
  seq_config.model.member = layers::TensorShard{1, 2, true};
  plain_config.model.member = layers::TensorShard{1, 2};
  RunModel seq = build_run_model_on_shapes(seq_config);
  RunModel plain = build_run_model_on_shapes(plain_config);
  const std::vector<partition::LayerLaunches> s = count_launches(*seq.model);
  const std::vector<partition::LayerLaunches> p = count_launches(*plain.model);
  REQUIRE(s.size() == 5);
  const int64_t want_bytes[5] = {8 * 8 * 8, 4 * 8 * 8, 4 * 8 * 8, 2 * 8 * 8, 0};
  for (int i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(s[i].group_sums_step == (want_bytes[i] > 0 ? 1 : 0));
    CHECK(s[i].group_bytes_step == want_bytes[i]);
    CHECK(p[i].group_sums_step + p[i].group_bytes_step == 0);
  }
  // Priced as one all-reduce each over a ring of T = 2 (10 us, 1 GB/s), whatever the batch.
  partition::CostModel cm;
  cm.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(s);
  price_tensor_group(cm, 2, LinkCost{"test", 0.01, 1e6});
  double step_ms = 0;
  for (int i = 0; i < 5; ++i) {
    const double want = want_bytes[i] > 0 ? (2 * 1e-5 + want_bytes[i] * 2.0 * 1 / 2 / 1e9) * 1e3 : 0.0;
    CHECK(cm.group_seconds(i, 3).step * 1e3 == doctest::Approx(want));
    step_ms += want;
  }
  // In the simulated step: the stage's last backward (where the executor sums them) runs
  // one tAR more per layer with partial gradients than the other backward, each a tensor
  // collective of its own after it, longer in all by exactly those sums (two micro-batches
  // of 2 samples: the backwards' other collectives alike).
  Config even = seq.config;
  even.train.batch_size = 4;
  const Plan plan = make_plan(even, *seq.model);
  REQUIRE(plan.micro_batch_sizes == std::vector<int64_t>{2, 2});
  REQUIRE(plan.schedule.tensor_lowered);
  PredictOptions o;
  o.instruction_overhead_ms = 0;
  const LinkCost link{"test", 0.0, 0.0};
  const CostSource costs(*seq.model, ProfileStore{}, "none", Device::cpu(), 1, cm, {}, seq.config.optimizer.optimizer);
  const PlannedRun run =
      predict(plan, *seq.model, costs, [&](int, int) { return link; }, seq.config.optimizer.optimizer, o);
  std::vector<int> count;   // per backward: its tensor collectives
  std::vector<double> ms;   // and their time
  double group = 0;         // every tensor collective's
  Op owner = Op::kForward;
  for (const TimedInstruction& x : run.timeline.at(0)) {
    if (!is_tensor_collective(x.ins.op)) {
      owner = x.ins.op;
      if (owner == Op::kBackward) {
        count.push_back(0);
        ms.push_back(0);
      }
      continue;
    }
    group += x.end - x.start;
    if (owner == Op::kBackward) {
      ++count.back();
      ms.back() += x.end - x.start;
    }
  }
  REQUIRE(count.size() == 2);
  CHECK(count[1] - count[0] == 4);
  CHECK(ms[1] - ms[0] == doctest::Approx(step_ms));
  // The plan's tensor-group time is its tensor collectives' (the accounting folds each
  // into the compute instruction that ran it).
  CHECK(run.stages.at(0).group_ms == doctest::Approx(group));
  CHECK(group > step_ms);
  // Compute and collectives together are what the layers' times give for the program's
  // F, R and B (LayerTimes, their sums counted per layer inside them) and the step sums:
  // the collectives priced one by one from the program add up to the layers' counted sums,
  // and each compute instruction is priced without them.
  const CostTable& table = costs.at(2);
  double layers_ms = 0;
  for (const Instruction& ins : plan.schedule.stages[0]) {
    for (const LayerTimes& l : table.layers) {
      if (ins.op == Op::kForward) layers_ms += l.forward;
      if (ins.op == Op::kRecompute) layers_ms += l.recompute;
      if (ins.op == Op::kBackward) layers_ms += l.backward;
    }
    if (ins.op == Op::kForward || ins.op == Op::kRecompute) layers_ms += table.loss_forward;
    if (ins.op == Op::kBackward) layers_ms += table.loss_backward;
  }
  for (const LayerTimes& l : table.layers) layers_ms += l.step_group;
  CHECK(run.stages.at(0).busy_ms + run.stages.at(0).group_ms == doctest::Approx(layers_ms));
  CHECK(step_ms > 0);
}
