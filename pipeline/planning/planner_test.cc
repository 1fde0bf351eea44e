// The planner and what it stands on: its prediction equals a hand-computed makespan on
// a synthetic profile; estimate_memory equals the executor's activation meter, to the
// byte, for every schedule (zero bubble's W contexts included) and recompute mode; the
// sweep never recommends a plan over the memory limit, and says when its choice sits at
// the edge of what it tried; balance by profile follows the measured times and refuses a
// profile of something else; the profile file round-trips; the estimate splits backward
// into B and W as a hand count of their FLOPs does.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "layers/batchnorm2d.h"
#include "layers/layer.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/byte_units.h"
#include "pipeline/planning/device_spec.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
#include "pipeline/planning/profile.h"
#include "pipeline/planning/sweep.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "tests/temp_dir.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

using gpipe::testing::tmp_path;

// Four linear layers of width 4 (each its own cost), 8 samples.
const char* kLinear4 = R"(model:
  input: [4]
  dtype: float64
  layers:
    - repeat: 4
      layers:
        - {type: linear, out: 4}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 8}
)";

// A profile entry for `model` at `micro` in which every layer takes `fwd` ms forward and
// `bwd` backward (B all of it, no W), and nothing else costs anything.
ProfileEntry synthetic(const layers::Sequential& model, int64_t micro, double fwd, double bwd) {
  ProfileEntry e;
  e.key = profile_key(model, micro, Device::cpu(), 1);
  for (int i = 0; i < model.size(); ++i) {
    LayerProfile l;
    l.describe = model.layer(i).describe();
    l.forward_ms = l.forward_nograd_ms = l.recompute_ms = fwd;
    l.backward_ms = l.backward_input_ms = bwd;
    e.layers.push_back(l);
  }
  return e;
}

PlannedRun predict_synthetic(const Config& c, const layers::Sequential& model, const Plan& plan, double fwd,
                             double bwd, double latency_ms) {
  ProfileStore store;
  store.put(synthetic(model, plan.largest_micro_batch(), fwd, bwd));
  const CostSource costs(model, store, "synthetic", Device::cpu(), 1, partition::CostModel{}, {},
                         c.optimizer.optimizer);
  PredictOptions o;
  o.instruction_overhead_ms = 0;
  const LinkCost link{"test", latency_ms, 0};
  return predict(plan, model, costs, [&](int, int) { return link; }, c.optimizer.optimizer, o);
}

}  // namespace

TEST_CASE("the prediction equals a hand-computed makespan on a synthetic profile") {
  SUBCASE("GPipe K=2 M=2, two layers per stage: (M + K - 1)(F + B)") {
    const Config c = parse_config(kLinear4, "t.yaml",
                                  {"pipeline.partitions=2", "pipeline.micro_batches=2", "pipeline.recompute=never",
                                   "pipeline.balance=[2,2]"});
    RunModel run = build_run_model(c);
    const Plan plan = make_plan(run.config, *run.model);
    // A stage's F = 2 x 1 ms, B = 2 x 2 ms: 3 x (2 + 4) = 18 ms.
    const PlannedRun p = predict_synthetic(run.config, *run.model, plan, 1.0, 2.0, 0.0);
    CHECK(p.step_ms == doctest::Approx(18.0));
    CHECK(p.span_ms == doctest::Approx(18.0));
    CHECK(p.stages[0].busy_ms == doctest::Approx(12.0));
    CHECK(p.bubble == doctest::Approx(1.0 - 24.0 / 36.0));
    CHECK(p.samples_per_second == doctest::Approx(8 / 0.018));
    // With 0.5 ms per message, by hand: stage 1 gets F0's input at 2.5 and F1's at 5,
    // runs F1 5-7, B1 7-11, sends 11-11.5, B0 11.5-15.5, sends 15.5-16; stage 0's B1
    // 11.5-15.5 and B0 16-20.
    CHECK(predict_synthetic(run.config, *run.model, plan, 1.0, 2.0, 0.5).step_ms == doctest::Approx(20.0));
  }
  SUBCASE("GPipe K=2 M=2 with both stages on cpu:0: they take turns, and the step adds up their work") {
    const Config c = parse_config(kLinear4, "t.yaml",
                                  {"pipeline.partitions=2", "pipeline.micro_batches=2", "pipeline.recompute=never",
                                   "pipeline.balance=[2,2]", "pipeline.devices=[cpu:0, cpu:0]"});
    RunModel run = build_run_model(c);
    const Plan plan = make_plan(run.config, *run.model);
    CHECK(plan.turns == std::vector<int>{0, 0});
    CHECK(make_plan(run.config, *run.model, PlanOptions{1}).turns == std::vector<int>{0, 1});  // under mpirun
    // F = 2, B = 4 a stage. By hand: s0 F0 0-2, F1 2-4; s1 F0 4-6 (the device busy until
    // 4), F1 6-8, B1 8-12; s0 B1 12-16 (asked at 12, as s1's B0, and first on the tie);
    // s1 B0 16-20; s0 B0 20-24: the device never idles, 2 x 2 x (2 + 4) = 24 ms.
    const PlannedRun p = predict_synthetic(run.config, *run.model, plan, 1.0, 2.0, 0.0);
    CHECK(p.step_ms == doctest::Approx(24.0));
    CHECK(p.stages[0].busy_ms == doctest::Approx(12.0));
    CHECK(p.stages[1].busy_ms == doctest::Approx(12.0));
    CHECK(p.bubble == doctest::Approx(0.5));
  }
  SUBCASE("1F1B K=2 M=3, one layer per stage") {
    const Config c = parse_config(kLinear4, "t.yaml",
                                  {"pipeline.partitions=2", "pipeline.micro_batches=4", "pipeline.recompute=never",
                                   "pipeline.schedule=1f1b", "pipeline.balance=[2,2]"});
    RunModel run = build_run_model(c);
    const Plan plan = make_plan(run.config, *run.model);
    // F = 1, B = 2 per stage (0.5 + 1 per layer). Stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3,
    // stage 1 F0 B0 F1 B1 F2 B2 F3 B3. By hand: s0 F0 0-1, F1 1-2; s1 F0 1-2, B0 2-4;
    // s0 B0 4-6; s1 F1 4-5, B1 5-7; s0 F2 6-7, B1 7-9; s1 F2 7-8, B2 8-10; s0 F3 9-10,
    // B2 10-12; s1 F3 10-11, B3 11-13; s0 B3 13-15.
    const PlannedRun p = predict_synthetic(run.config, *run.model, plan, 0.5, 1.0, 0.0);
    CHECK(p.step_ms == doctest::Approx(15.0));
  }
}

TEST_CASE("estimate_memory equals the executor's activation meter") {
  const char* gpt = R"(model:
  input: [6]
  dtype: float64
  layers:
    - {type: embedding, vocab: 16, dim: 8}
    - repeat: 3
      layers:
        - {type: transformer_block, heads: 2, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 16}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 10}
)";
  // The LLaMA layers keep more between B and W (RMSNorm's dy, four projections' dy).
  const char* llama = R"(model:
  input: [6]
  dtype: float64
  layers:
    - {type: embedding, vocab: 16, dim: 8, positions: 0}
    - repeat: 3
      layers:
        - {type: llama_block, heads: 2, kv_heads: 1, hidden: 12}
    - {type: rmsnorm}
    - {type: linear, out: 16}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 10}
)";
  const char* mlp = R"(model:
  input: [12]
  dtype: float64
  layers:
    - {type: linear, out: 24}
    - repeat: 3
      layers:
        - {type: relu}
        - {type: linear, out: 24}
    - {type: dropout, p: 0.2}
    - {type: linear, out: 5}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 10}
)";
  struct Case {
    const char* schedule;
    int v;
  };
  for (const char* text : {mlp, gpt, llama}) {
    for (const Case sc : {Case{"gpipe", 1}, Case{"1f1b", 1}, Case{"interleaved_1f1b", 2}, Case{"zero_bubble", 1},
                          Case{"zero_bubble", 2}}) {
      for (const char* mode : {"never", "except_last", "always"}) {
        for (int K : {1, 2, 3}) {
         for (const char* batched : {"false", "true"}) {  // pipeline.batch_weight_gradients
          // v = 2 at K = 1: two chunks on one stage, handing over without messages.
          const std::string schedule = sc.schedule, recompute = mode, batch_w = batched;
          CAPTURE(schedule);
          CAPTURE(recompute);
          CAPTURE(K);
          CAPTURE(batch_w);
          const Config c = parse_config(
              text, "t.yaml",
              {"pipeline.partitions=" + std::to_string(K), "pipeline.micro_batches=4",
               std::string("pipeline.recompute=") + mode, std::string("pipeline.schedule=") + sc.schedule,
               "pipeline.virtual_stages=" + std::to_string(sc.v),
               std::string("pipeline.batch_weight_gradients=") + batched});
          RunModel run = build_run_model(c);
          const Plan plan = make_plan(run.config, *run.model);
          const auto estimate = estimate_memory(plan, *run.model, run.config.optimizer.optimizer);
          const int64_t n = 10;
          const Shape in = run.model->input_shape();
          Tensor x = run.model->input_dtype() == DType::kI32 ? gpipe::testing::random_labels(n * 6, 16, 3).reshape({n, 6})
                                                             : gpipe::testing::random_tensor({n, in[0]}, DType::kF64, 3);
          Tensor y = run.model->input_dtype() == DType::kI32 ? gpipe::testing::random_labels(n * 6, 16, 4).reshape({n, 6})
                                                             : gpipe::testing::random_labels(n, 5, 4);
          InProcessTransport transport(K);
          ExecutorOptions opts;
          opts.pin_threads = false;
          Executor ex(*run.model, plan.cells, plan.schedule, transport, opts);
          const StepResult r = ex.step(x, y);
          for (int k = 0; k < K; ++k) {
            CAPTURE(k);
            CHECK(estimate[k].activation_bytes == r.stages[k].peak_activation_bytes);
          }
         }
        }
      }
    }
  }
}

TEST_CASE("the sweep never recommends a plan over the memory limit") {
  const Config base = load_config("configs/mlp.yaml", {"pipeline.profile=" + tmp_path("none.json")});
  RunModel run = build_run_model(base);
  SweepOptions o;
  o.devices = 2;
  o.micro_batches = {1, 2, 4, 8, 16};
  const SweepResult free = sweep(run.config, *run.model, o);
  REQUIRE(free.recommended == 0);
  const Candidate& fastest = free.candidates.front();
  // A plan said to lose on its bubble has a larger one than the recommended plan's (one
  // stage with two BLAS threads has no bubble; it loses, if at all, on other time).
  for (const Candidate& c : free.candidates) {
    INFO(c.label(), ": ", c.verdict);
    if (c.verdict.rfind("bubble", 0) == 0) CHECK(c.run.bubble > fastest.run.bubble);
  }
  // A limit just under the fastest plan's fullest device.
  o.memory_limit = fastest.peak_device_bytes - 1;
  const SweepResult tight = sweep(run.config, *run.model, o);
  REQUIRE(tight.recommended >= 0);
  const Candidate& chosen = tight.candidates[tight.recommended];
  CHECK(chosen.fits);
  CHECK(chosen.peak_device_bytes <= o.memory_limit);
  CHECK(chosen.label() != fastest.label());
  int over = 0;
  for (const Candidate& c : tight.candidates) {
    CHECK(c.fits == (c.peak_device_bytes <= o.memory_limit));
    if (!c.fits) {
      ++over;
      CHECK(c.verdict.rfind("memory", 0) == 0);
    } else {
      CHECK(c.run.samples_per_second <= chosen.run.samples_per_second);
    }
  }
  CHECK(over > 0);
  CHECK(sweep_table(tight).find("<< recommended") != std::string::npos);
  // No plan at all fits in a byte.
  o.memory_limit = 1;
  const SweepResult none = sweep(run.config, *run.model, o);
  CHECK(none.recommended == -1);
  CHECK(sweep_table(none).find("No candidate fits") != std::string::npos);
}

TEST_CASE("timings kept in the profile scale the sweep's predictions of plans that use the cores alike") {
  const std::string path = tmp_path("calibrated.json");
  std::remove(path.c_str());
  const Config base = load_config("configs/mlp.yaml", {"pipeline.profile=" + path});
  RunModel run = build_run_model(base);
  SweepOptions o;
  o.devices = 2;
  o.micro_batches = {1, 2, 4};
  const SweepResult plain = sweep(run.config, *run.model, o);
  // Two stages at once were measured 1.5 times as slow as predicted; nothing else was timed.
  ProfileStore store;
  StepCalibration c;
  c.model_hash = model_hash(*run.model);
  c.device = "cpu";
  c.dtype = dtype_name(run.model->dtype());
  c.stages = 2;
  c.blas_threads = 1;
  c.ratio = 1.5;
  c.plans = 1;
  store.put(c);
  save_profile(path, store);
  REQUIRE(load_profile(path).calibrations.size() == 1);
  const SweepResult scaled = sweep(run.config, *run.model, o);
  CHECK(scaled.costs.find("step times scaled by 1 timing of this model's plans") != std::string::npos);
  REQUIRE(scaled.candidates.size() == plain.candidates.size());
  int twos = 0, ones = 0;
  for (const Candidate& k : plain.candidates) {
    CAPTURE(k.label());
    const auto it = std::find_if(scaled.candidates.begin(), scaled.candidates.end(),
                                 [&](const Candidate& x) { return x.label() == k.label(); });
    REQUIRE(it != scaled.candidates.end());
    const bool two = k.stages == 2 && k.blas_threads == 1;
    CHECK(it->run.step_ms == doctest::Approx(k.run.step_ms * (two ? 1.5 : 1.0)));
    CHECK(it->correction == (two ? 1.5 : 1.0));
    (two ? twos : ones) += 1;
  }
  CHECK(twos > 0);
  CHECK(ones > 0);
  // Another model's timings change nothing.
  store.calibrations[0].model_hash = "another";
  save_profile(path, store);
  const SweepResult other = sweep(run.config, *run.model, o);
  CHECK(other.costs.find("scaled") == std::string::npos);
  CHECK(other.candidates.front().run.step_ms == plain.candidates.front().run.step_ms);
}

TEST_CASE("a sweep over precisions ranks each precision's candidates together, each as its own sweep predicts it") {
  const std::string none = "pipeline.profile=" + tmp_path("none.json");
  RunModel f32 = build_run_model(load_config("configs/mlp.yaml", {none}));
  RunModel bf16 = build_run_model(load_config("configs/mlp.yaml", {none, "model.dtype=bf16"}));
  REQUIRE(bf16.model->dtype() == DType::kBF16);
  SweepOptions o;
  o.devices = 2;
  o.micro_batches = {1, 2, 4};
  const std::vector<SweptPrecision> both = {{"float32", &f32.config, f32.model.get()},
                                            {"bf16", &bf16.config, bf16.model.get()}};
  for (int round : {0, 1}) {  // round 1 under the memory limit that round 0 sets at its end
    const SweepResult alone_f = sweep(f32.config, *f32.model, o);
    const SweepResult alone_b = sweep(bf16.config, *bf16.model, o);
    const SweepResult merged = sweep(both, o);
    CAPTURE(round);
    REQUIRE(merged.candidates.size() == alone_f.candidates.size() + alone_b.candidates.size());
    // Each precision's candidates, in the merged order, are its own sweep's in its order,
    // with its predictions, labelled with the precision.
    for (const auto& [name, alone] : {std::pair{"float32", &alone_f}, std::pair{"bf16", &alone_b}}) {
      size_t i = 0;
      for (const Candidate& c : merged.candidates) {
        if (c.precision != name) continue;
        REQUIRE(i < alone->candidates.size());
        const Candidate& a = alone->candidates[i++];
        CHECK(c.label() == a.label() + " " + name);
        CHECK(c.overrides() == a.overrides() + " --set model.dtype=" + name);
        CHECK(c.run.step_ms == a.run.step_ms);
        CHECK(c.peak_device_bytes == a.peak_device_bytes);
        CHECK(c.fits == a.fits);
      }
      CHECK(i == alone->candidates.size());
    }
    // The recommendation is the better of the two sweeps' own.
    const auto best_of = [](const SweepResult& r) {
      return r.recommended < 0 ? 0.0 : r.candidates[r.recommended].run.samples_per_second;
    };
    REQUIRE(merged.recommended == 0);
    const Candidate& best = merged.candidates[0];
    CHECK(best.run.samples_per_second == std::max(best_of(alone_f), best_of(alone_b)));
    CHECK(best.precision == (best_of(alone_f) >= best_of(alone_b) ? "float32" : "bf16"));
    // A candidate that loses on its ops in the other precision names that precision.
    int named = 0;
    for (const Candidate& c : merged.candidates) {
      if (c.precision != best.precision && c.verdict.rfind("slower ops", 0) == 0) {
        INFO(c.label(), ": ", c.verdict);
        CHECK(c.verdict.find(c.precision) != std::string::npos);
        ++named;
      }
    }
    if (round == 0) CHECK(named > 0);
    if (round == 0) {
      // Under a limit between the two precisions' smallest fullest devices, only the
      // precision with the smaller one fits, and it is recommended.
      auto smallest = [](const SweepResult& r) {
        int64_t m = INT64_MAX;
        for (const Candidate& c : r.candidates) m = std::min(m, c.peak_device_bytes);
        return m;
      };
      const int64_t sf = smallest(alone_f), sb = smallest(alone_b);
      REQUIRE(sf != sb);
      o.memory_limit = std::max(sf, sb) - 1;
      const SweepResult tight = sweep(both, o);
      REQUIRE(tight.recommended == 0);
      CHECK(tight.candidates[0].precision == (sb < sf ? "bf16" : "float32"));
      for (const Candidate& c : tight.candidates) {
        if (c.precision != tight.candidates[0].precision) CHECK(c.verdict.rfind("memory", 0) == 0);
      }
    }
  }
}

TEST_CASE("the sweep says when its choice sits at the edge of what it tried, and how to look further") {
  const Config c = parse_config(kLinear4, "t.yaml", {"pipeline.profile=" + tmp_path("none.json")});
  RunModel run = build_run_model(c);
  SweepOptions o;
  o.devices = 1;           // K = 1 only: the choice uses every device
  o.micro_batches = {1};   // M = 1 only, of a batch of 8: the choice has the most micro-batches tried
  const SweepResult edge = sweep(run.config, *run.model, o);
  REQUIRE(edge.recommended == 0);
  CHECK(edge.candidates[0].micro_batches == 1);
  CHECK(edge.candidates[0].stages == 1);
  REQUIRE(edge.edges.size() == 2);
  const std::string table = sweep_table(edge);
  INFO(table);
  CHECK(table.find("At the edge of the search:\n") != std::string::npos);
  CHECK(table.find("  M=1 is the most micro-batches the sweep tried (train.batch_size 8 allows up to 8); more may be "
                   "faster still: add --max-micro-batches 2 to try up to 2\n") != std::string::npos);
  CHECK(table.find(" uses every device the sweep planned for (--devices 1); more devices may be faster: --devices 2 "
                   "plans for 2") != std::string::npos);
  // M up to the batch itself: no M could be tried beyond it, so none is an edge to widen.
  o.micro_batches = micro_batch_counts(8);
  CHECK(o.micro_batches == std::vector<int>{1, 2, 4, 8});
  o.devices = 4;  // one layer per stage at most
  const SweepResult inside = sweep(run.config, *run.model, o);
  REQUIRE(inside.recommended == 0);
  for (const std::string& e : inside.edges) CHECK(e.find("micro-batches") == std::string::npos);
  CHECK(micro_batch_counts(48) == std::vector<int>{1, 2, 4, 8, 16, 32, 48});
  CHECK(micro_batch_counts(1) == std::vector<int>{1});
}

TEST_CASE("balance by profile follows the measured times and refuses a profile of something else") {
  const std::string path = tmp_path("balance_profile.json");
  std::filesystem::remove(path);
  const std::vector<std::string> set = {"pipeline.partitions=2", "pipeline.micro_batches=2",
                                        "pipeline.balance_by=profile", "pipeline.profile=" + path};
  const Config c = parse_config(kLinear4, "t.yaml", set);
  RunModel run = build_run_model(c);
  auto error = [&](const Config& cfg) -> std::string {
    try {
      make_plan(cfg, *run.model);
    } catch (const UserError& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(error(c).find("does not exist") != std::string::npos);

  // Layer 0 costs as much as the three others together, twice over: it gets a stage alone.
  ProfileEntry e = synthetic(*run.model, 4, 1.0, 2.0);
  e.layers[0].forward_ms = 6;
  e.layers[0].backward_ms = 12;
  ProfileStore store;
  store.put(e);
  save_profile(path, store);
  CHECK(make_plan(c, *run.model).balance == std::vector<int>{1, 3});
  // The same model balanced by the estimates: equal layers split evenly.
  Config est = c;
  est.pipeline.balance_by = "estimate";
  CHECK(make_plan(est, *run.model).balance == std::vector<int>{2, 2});

  // Another micro-batch size, another model.
  Config other_size = parse_config(kLinear4, "t.yaml", set);
  other_size.pipeline.micro_batches = 4;
  CHECK(error(other_size).find("profiled at micro-batch sizes 4") != std::string::npos);
  ProfileEntry foreign = e;
  foreign.key.model_hash = "0123456789abcdef";
  ProfileStore store2;
  store2.put(foreign);
  save_profile(path, store2);
  CHECK(error(c).find("made for another model") != std::string::npos);
}

TEST_CASE("a profile file round-trips and keeps one entry per key") {
  const Config c = parse_config(kLinear4, "t.yaml");
  RunModel run = build_run_model(c);
  const std::string path = tmp_path("roundtrip_profile.json");
  ProfileStore store;
  store.put(synthetic(*run.model, 4, 1.5, 2.5));
  store.put(synthetic(*run.model, 8, 3.0, 5.0));
  store.put(synthetic(*run.model, 4, 1.0, 2.0));  // replaces the first
  store.put(LinkCost{"mpi", 0.003, 8e6});
  save_profile(path, store);
  const ProfileStore back = load_profile(path);
  REQUIRE(back.entries.size() == 2);
  const ProfileEntry* e = back.find(profile_key(*run.model, 4, Device::cpu(), 1));
  REQUIRE(e != nullptr);
  CHECK(e->layers.size() == 4);
  CHECK(e->layers[2].forward_ms == 1.0);
  CHECK(back.link("mpi")->bytes_per_ms == 8e6);
  CHECK(back.find(profile_key(*run.model, 4, Device::cpu(), 2)) == nullptr);  // other BLAS threads
  std::FILE* f = std::fopen(path.c_str(), "w");
  std::fputs("{\"format\": \"gpipe-profile\", \"entries\": [{\"micro_batch\": 3}]}", f);
  std::fclose(f);
  CHECK_THROWS_AS(load_profile(path), UserError);
}

TEST_CASE("a measured profile of a real model has a time for every layer and kind") {
  const Config c = parse_config(kLinear4, "t.yaml");
  RunModel run = build_run_model(c);
  Tensor x = gpipe::testing::random_tensor({4, 4}, DType::kF64, 1);
  Tensor y = gpipe::testing::random_labels(4, 4, 2);
  const ProfileEntry e = measure_layers(*run.model, x, y, Device::cpu(), c.optimizer.optimizer, 1, 3, 1);
  REQUIRE(e.layers.size() == 4);
  CHECK(e.key.micro_batch == 4);
  CHECK(e.key.model_hash == model_hash(*run.model));
  for (const LayerProfile& l : e.layers) {
    CHECK(l.forward_ms > 0);
    CHECK(l.backward_ms > 0);
    CHECK(l.param_bytes == 4 * 5 * 8);
  }
  // The planner takes it as this model's costs at micro-batch 4, and scales it to 2.
  ProfileStore store;
  store.put(e);
  const CostSource costs(*run.model, store, "p", Device::cpu(), 1, partition::CostModel{}, {}, c.optimizer.optimizer);
  CHECK(costs.at(4).source == "profile");
  CHECK(costs.at(2).source == "profile at micro-batch 4, scaled");
  CHECK(costs.has_profile());
}

TEST_CASE("a K-stage plan takes the profile measured with K stages at once, else the one measured alone") {
  const Config c = parse_config(kLinear4, "t.yaml");
  RunModel run = build_run_model(c);
  ProfileStore store;
  store.put(synthetic(*run.model, 4, 1.0, 2.0));
  ProfileEntry busy = synthetic(*run.model, 4, 1.5, 3.0);  // slower with a neighbour at work
  busy.key.concurrency = 2;
  store.put(busy);
  auto forward = [&](int at_once) {
    const CostSource s(*run.model, store, "p", Device::cpu(), 1, partition::CostModel{}, {}, c.optimizer.optimizer,
                       1.0, at_once);
    return s.at(4).layers[0].forward;
  };
  CHECK(forward(1) == 1.0);
  CHECK(forward(2) == 1.5);
  CHECK(forward(3) == 1.0);  // not measured with 3: alone
}

// GPipe's Table 2 (Huang et al. 2019, arXiv:1811.06965v5): the training throughput of
// Transformer-48 under GPipe (with re-materialization) on TPUs, K partitions by M
// micro-batches, each relative to K = 2, M = 1. The planner predicts the same runs on
// the H100 description (configs/gpipe_transformer48.yaml: the paper's layer shape, batch
// 32). The paper adjusted the batch "to fit memory if necessary", which its M = 1 and 4
// rows show (K = 8, M = 4 at 4.8 is more than a bubble of 7/11 allows at a fixed batch),
// so only M = 32 is checked, within 15%: the planner comes out lower everywhere, most at
// K = 8, where 48 blocks, the embedding and a 32k-word head (1.2 blocks' work) leave the
// fullest stage 7 blocks against 6.2 on average (bench/RESULTS.md, issue 20).
TEST_CASE("the planner's GPipe speedups against GPipe's Table 2 (Transformer-48, normalised to K=2, M=1)") {
  const int Ks[3] = {2, 4, 8}, Ms[3] = {1, 4, 32};
  const double paper[3][3] = {{1.0, 1.07, 1.3}, {1.7, 3.2, 4.8}, {1.8, 3.4, 6.3}};  // [M][K]
  const Config base = load_config("configs/gpipe_transformer48.yaml");
  RunModel run = build_run_model_on_shapes(base);  // 2.5 billion parameters: counted, never allocated
  const DeviceSpec spec = load_device_spec("configs/devices/h100_nvlink_ib.yaml");
  SweepOptions o;
  o.devices = 8;
  o.spec = &spec;
  o.micro_batches = {1, 4, 32};
  const SweepResult r = sweep(run.config, *run.model, o);
  auto gpipe_at = [&](int K, int M) -> const Candidate& {
    for (const Candidate& c : r.candidates) {
      if (c.stages == K && c.virtual_stages == 1 && c.micro_batches == M && c.schedule == "gpipe" &&
          c.recompute == RecomputeMode::kAlways) {
        return c;
      }
    }
    FAIL("no GPipe candidate at K=" << K << " M=" << M);
    return r.candidates.front();
  };
  const double one = gpipe_at(2, 1).run.samples_per_second;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      const Candidate& c = gpipe_at(Ks[j], Ms[i]);
      const double planned = c.run.samples_per_second / one;
      std::string balance;
      for (int b : c.balance) balance += " " + std::to_string(b);
      MESSAGE("Table 2, K=" << Ks[j] << " M=" << Ms[i] << ": paper " << paper[i][j] << ", planned " << planned
                            << " (balance" << balance << ", bubble " << c.run.bubble << ")");
      if (Ms[i] == 32) CHECK(planned == doctest::Approx(paper[i][j]).epsilon(0.15));
    }
  }
}

TEST_CASE("the estimate splits a transformer block's backward into B and W as their FLOPs do") {
  // gpt.yaml's shape, smaller: micro-batches of 4 samples, T = 32, C = 64, 4 heads.
  const char* gpt = R"(model:
  input: [32]
  dtype: float32
  layers:
    - {type: embedding, vocab: 64, dim: 64}
    - repeat: 2
      layers:
        - {type: transformer_block, heads: 4, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 64}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 8}
)";
  const Config c = parse_config(gpt, "t.yaml");
  RunModel run = build_run_model(c);
  const double Bs = 4, T = 32, C = 64, H = 4, D = 16, R = Bs * T, n = R * C;
  // W: the dW products and bias sums of qkv, proj, fc1 and fc2. B: their dx, the
  // attention core, the layer norms, GELU, the dropouts and the residual adds.
  auto dw = [&](double in, double out) { return 2 * R * in * out + in * out + R * out; };
  const double w = dw(C, 3 * C) + dw(C, C) + dw(C, 4 * C) + dw(4 * C, C);
  const double b = 2 * R * 12 * C * C + Bs * H * (8 * T * T * D + 4 * T * (T + 1) / 2) +
                   2 * (R * (16 * C + 2) + 2 * C) + 78 * R * 4 * C + 4 * n;
  const double hand_share = w / (w + b);  // 0.4197
  CHECK(hand_share == doctest::Approx(0.4197).epsilon(1e-3));
  SUBCASE("on a device of FLOPs only, W's share is the hand count's") {
    partition::CostModel flops_only;
    flops_only.bytes_per_second = 1e30;
    const CostTable t = estimate_costs(*run.model, 4, flops_only, {}, c.optimizer.optimizer);
    for (int i : {1, 2}) {
      const LayerTimes& l = t.layers[i];
      CHECK(l.backward == doctest::Approx((w + b) / flops_only.flops_per_second * 1e3));
      CHECK(l.backward_weight / l.backward == doctest::Approx(hand_share));
      CHECK(l.backward_input + l.backward_weight == doctest::Approx(l.backward));
    }
  }
  SUBCASE("with the default rates W stays near the hand count's share, well under all of backward") {
    const CostTable t = estimate_costs(*run.model, 4, partition::CostModel{}, {}, c.optimizer.optimizer);
    for (int i : {1, 2}) {
      const LayerTimes& l = t.layers[i];
      CHECK(l.backward_weight / l.backward == doctest::Approx(hand_share).epsilon(0.05));
      CHECK(l.backward_input + l.backward_weight == doctest::Approx(l.backward));
    }
    // Layers that do not split do everything in B; the head's W is its dW and db.
    for (int i : {0, 3}) CHECK(t.layers[i].backward_weight == 0);
    CHECK(t.layers[4].backward_weight > 0);
    CHECK(t.layers[4].backward_input > 0);  // its dx and the loss's backward
  }
}

// Without a profile, B and W share a layer's backward time as the sums of their
// kernels' own rooflines do (LayerCost::backward_parts), while the backward's time is
// the roofline of the layer's totals. gpt.yaml's block (C = 256, 4 heads, T = 128,
// micro-batches of 4), counted here from the layers' formulas, not from cost().
TEST_CASE("the estimate splits a gpt.yaml block's backward by its kernels' rooflines") {
  const char* gpt = R"(model:
  input: [128]
  dtype: float32
  layers:
    - {type: embedding, vocab: 256, dim: 256}
    - {type: transformer_block, heads: 4, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 256}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 4}
)";
  const Config c = parse_config(gpt, "t.yaml");
  RunModel run = build_run_model(c);
  const double Bs = 4, T = 128, C = 256, H = 4, D = 64, R = Bs * T, n = R * C, es = 4;
  const double bh = Bs * H, kept = T * (T + 1) / 2;
  const double flop_rate = 5e10, byte_rate = 1e10;  // partition::CostModel's defaults
  struct Kernel {
    bool w;
    double flops, bytes;
  };
  std::vector<Kernel> k;
  for (auto [in, out] : {std::pair<double, double>{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}}) {
    k.push_back({false, 2 * R * in * out, es * (R * out + in * out + R * in)});                    // dx = dy W
    k.push_back({true, 2 * R * in * out + in * out + R * out, es * (R * out + R * in + 2 * in * out)});  // dW, db
  }
  for (int i = 0; i < 2; ++i) {
    k.push_back({false, R * (16 * C + 2) + 2 * C, es * (3 * R * C + 2 * R + 5 * C)});  // layer norm
    k.push_back({false, n, es * 2 * n});                                                // dropout
    k.push_back({false, n, es * 3 * n});                                                // residual axpy
  }
  k.push_back({false, 78 * 4 * n, es * 3 * 4 * n});                                    // GELU
  k.push_back({false, bh * 8 * T * T * D, es * bh * (8 * T * D + 4 * T * T)});         // attention's products
  k.push_back({false, bh * 4 * kept, es * bh * (2 * kept + T * T)});                   // softmax Jacobian
  auto ms = [&](double f, double b) { return std::max(f / flop_rate, b / byte_rate) * 1e3; };
  double b_ms = 0, w_ms = 0, b_flops = 0, b_bytes = 0, w_flops = 0, w_bytes = 0;
  for (const Kernel& x : k) {
    (x.w ? w_ms : b_ms) += ms(x.flops, x.bytes);
    (x.w ? w_flops : b_flops) += x.flops;
    (x.w ? w_bytes : b_bytes) += x.bytes;
  }
  const double share = w_ms / (b_ms + w_ms);
  const double total_ms = ms(b_flops + w_flops, b_bytes + w_bytes);
  // The roofline of B's and W's sums, as before: it charges B's bytes-bound kernels
  // (GELU, the layer norms, dropout, the adds, the Jacobian) at the products' rate.
  const double sums_share = ms(w_flops, w_bytes) / (ms(b_flops, b_bytes) + ms(w_flops, w_bytes));
  CHECK(share == doctest::Approx(0.4387).epsilon(1e-3));
  CHECK(sums_share == doctest::Approx(0.4503).epsilon(1e-3));
  const CostTable t = estimate_costs(*run.model, 4, partition::CostModel{}, {}, c.optimizer.optimizer);
  const LayerTimes& l = t.layers[1];
  CHECK(l.backward == doctest::Approx(total_ms).epsilon(1e-9));
  CHECK(l.backward_weight / l.backward == doctest::Approx(share).epsilon(1e-9));
  CHECK(l.backward_input + l.backward_weight == doctest::Approx(l.backward).epsilon(1e-9));
  CHECK(sums_share - share > 0.005);  // the old split gave W more: this test tells them apart
}

// A GPU computes a bf16 model's products in bf16 (cublasGemmEx), so a device
// description plans it at its BF16 peak, where the description gives one (the H100's
// datasheet: 989 TFLOP/s dense), and at float32's where it does not.
TEST_CASE("a device description's roofline for a 16-bit model is its 16-bit peak where it gives one") {
  const DeviceSpec h100 = load_device_spec("configs/devices/h100_nvlink_ib.yaml");
  CHECK(h100.cost_model_for(DType::kBF16).flops_per_second == doctest::Approx(989e12 * 0.6));
  CHECK(h100.cost_model_for(DType::kF16).flops_per_second == doctest::Approx(989e12 * 0.6));
  CHECK(h100.cost_model_for(DType::kF32).flops_per_second == doctest::Approx(67e12 * 0.6));
  CHECK(h100.cost_model_for(DType::kBF16).bytes_per_second == doctest::Approx(3350e9 * 0.6));
  DeviceSpec no_bf16 = h100;
  no_bf16.peak_flops.erase("bfloat16");
  CHECK(no_bf16.cost_model_for(DType::kBF16).flops_per_second == doctest::Approx(67e12 * 0.6));
  // A key in another of the type's spellings counts; a key that names no type is refused.
  const gpipe::testing::TempDir dir;
  std::string text;
  {
    std::ifstream in("configs/devices/h100_nvlink_ib.yaml");
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto with_peaks = [&](const std::string& peaks) {
    std::string t = text;
    const size_t at = t.find("peak_flops: {");
    REQUIRE(at != std::string::npos);
    t.replace(at, t.find('}', at) + 1 - at, "peak_flops: {" + peaks + "}");
    std::ofstream(dir / "spec.yaml") << t;
    return dir / "spec.yaml";
  };
  CHECK(load_device_spec(with_peaks("float32: 67e12, bf16: 500e12")).cost_model_for(DType::kBF16).flops_per_second ==
        doctest::Approx(500e12 * 0.6));
  CHECK_THROWS_WITH_AS(load_device_spec(with_peaks("float32: 67e12, tf32: 495e12")),
                       doctest::Contains("not an element type"), UserError);
}

// Bytes in prose (a limit, a stage's parts): a limit of a KiB is not "0.0 MiB".
TEST_CASE("bytes in prose take the unit that shows them") {
  CHECK(bytes_str(100) == "100 bytes");
  CHECK(bytes_str(1536) == "1.5 KiB");
  CHECK(bytes_str(int64_t{3} << 20) == "3.0 MiB");
  CHECK(bytes_str(int64_t{5} << 29) == "2.50 GiB");
}

// The planner's per-launch term (issue 37, item 6): each layer's ops counted on shapes,
// against a hand count of the layers' code (layers/linear.cc, activation.cc, loss.cc);
// the ops per step of a plan, against the same hand count over its program; and the
// estimate's times, against the roofline plus the ops times a launch's cost.
namespace {
// A convolution, BatchNorm (whose F copies its statistics, and which does host work in a
// step), and a linear head.
const char* kConvBatchNorm = R"(model:
  input: [2, 4, 4]
  dtype: float64
  layers:
    - {type: conv2d, out: 3, kernel: 3, bias: false}
    - {type: batchnorm2d}
    - {type: relu}
    - {type: flatten}
    - {type: linear, out: 3}
  loss: softmax_cross_entropy
data: {classes: 3}
train: {steps: 1, batch_size: 4}
)";
const char* kSmall = R"(model:
  input: [4]
  dtype: float64
  layers:
    - {type: linear, out: 5}
    - {type: relu}
    - {type: linear, out: 3}
  loss: softmax_cross_entropy
data: {classes: 3}
train: {steps: 1, batch_size: 4}
)";
}  // namespace

TEST_CASE("a layer's ops are counted on shapes as its code calls them, and a plan's per step over its program") {
  const Config base = parse_config(kSmall, "t.yaml", {});
  RunModel run = build_run_model(base);
  const std::vector<partition::LayerLaunches> n = count_launches(*run.model);
  REQUIRE(n.size() == 3);
  // linear, the first layer: F linear_bias; B nothing (no input gradient); W linear_weight_grad.
  CHECK(n[0].forward == 1);
  CHECK(n[0].recompute == 1);
  CHECK(n[0].backward_input == 0);
  CHECK(n[0].backward_weight == 1);
  // relu: F relu; B relu_backward (it does not split: all in B).
  CHECK(n[1].forward == 1);
  CHECK(n[1].recompute == 1);
  CHECK(n[1].backward_input == 1);
  CHECK(n[1].backward_weight == 0);
  // linear, the last layer, with the loss: F linear_bias + softmax_xent; B the loss's
  // softmax_xent_backward + matmul for dx; W linear_weight_grad.
  CHECK(n[2].forward == 2);
  CHECK(n[2].recompute == 2);
  CHECK(n[2].backward_input == 2);
  CHECK(n[2].backward_weight == 1);
  // A micro-batch: F 4 ops, its whole backward 5; a recompute another 4.
  struct Case {
    int k;
    const char* schedule;
    const char* recompute;
    int64_t total;
  };
  for (const Case& cs : {Case{1, "gpipe", "never", 2 * 9}, Case{1, "gpipe", "except_last", 2 * 9 + 4},
                         Case{1, "gpipe", "always", 2 * 9 + 2 * 4}, Case{2, "gpipe", "never", 2 * 9},
                         Case{2, "1f1b", "always", 2 * 9 + 2 * 4}, Case{2, "zero_bubble", "never", 2 * 9}}) {
    CAPTURE(cs.schedule);
    CAPTURE(cs.recompute);
    CAPTURE(cs.k);
    const Config c = parse_config(kSmall, "t.yaml",
                                  {"pipeline.partitions=" + std::to_string(cs.k), "pipeline.micro_batches=2",
                                   std::string("pipeline.schedule=") + cs.schedule,
                                   std::string("pipeline.recompute=") + cs.recompute});
    RunModel r = build_run_model(c);
    const Plan plan = make_plan(r.config, *r.model);
    REQUIRE(plan.launches != nullptr);
    int64_t total = 0;
    for (int k = 0; k < plan.stages; ++k) total += stage_launches(plan, k);
    CHECK(total == cs.total);
    // The prediction shows them, stage by stage.
    const PlannedRun p = predict_config(r.config, *r.model, plan, false, -1);
    for (int k = 0; k < plan.stages; ++k) CHECK(p.stages[k].launches == stage_launches(plan, k));
  }
}

TEST_CASE("BatchNorm's F counts the copies of its statistics, which its R does not make") {
  const Config base = parse_config(kConvBatchNorm, "t.yaml", {});
  RunModel run = build_run_model(base);
  const std::vector<partition::LayerLaunches> n = count_launches(*run.model);
  REQUIRE(n.size() == 5);
  // batchnorm2d (layers/batchnorm2d.cc): F batchnorm_train and the two copies of the
  // micro-batch's mean and variance; R batchnorm_train only.
  CHECK(n[1].forward == 3);
  CHECK(n[1].recompute == 1);
  for (int i : {0, 2, 3, 4}) CHECK(n[i].forward == n[i].recompute);
  // The count keeps nothing: an end of step right after it (a replica that saw no
  // micro-batch still joins the sum) finds no statistics without data, and the running
  // statistics stay as they were.
  auto& norm = dynamic_cast<layers::BatchNorm2d&>(run.model->layer(1));
  const std::vector<double> before = gpipe::testing::to_doubles(norm.running_mean());
  const layers::ReplicaSum none = [](std::vector<double>&) {};
  CHECK_NOTHROW(norm.end_step(backend_for(Device::cpu()), none));
  CHECK(gpipe::testing::to_doubles(norm.running_mean()) == before);
  // Per step at M = 2 with every micro-batch recomputed: R's ops are F's less 2 x 2 copies.
  const Config c = parse_config(kConvBatchNorm, "t.yaml", {"pipeline.micro_batches=2", "pipeline.recompute=always"});
  RunModel r = build_run_model(c);
  const Plan plan = make_plan(r.config, *r.model);
  int64_t f = 0, b = 0;
  for (const partition::LayerLaunches& l : n) {
    f += l.forward;
    b += l.backward();
  }
  CHECK(stage_launches(plan, 0) == 2 * f + 2 * (f - 2) + 2 * b);
}

namespace {
// configs/devices/h100_nvlink_ib.yaml written to dir/name with its line "launch_overhead_us: 4"
// replaced by `lines` (each at that line's indent); returns the path.
std::filesystem::path h100_with(const gpipe::testing::TempDir& dir, const std::string& name, const std::string& lines) {
  std::string text;
  {
    std::ifstream in("configs/devices/h100_nvlink_ib.yaml");
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string line = "launch_overhead_us: 4";
  const size_t at = text.find(line);
  REQUIRE(at != std::string::npos);
  const std::string indent = text.substr(text.rfind('\n', at) + 1, at - text.rfind('\n', at) - 1);
  std::string with;
  for (char c : lines) with += c == '\n' ? "\n" + indent : std::string(1, c);
  text.replace(at, line.size(), with);
  std::ofstream(dir / name) << text;
  return dir / name;
}
}  // namespace

TEST_CASE("the estimate charges each of a layer's ops a launch's cost, and nothing on a CPU") {
  const Config c = parse_config(kSmall, "t.yaml", {});
  RunModel run = build_run_model(c);
  partition::CostModel cpu;
  cpu.launches = std::make_shared<const std::vector<partition::LayerLaunches>>(count_launches(*run.model));
  partition::CostModel gpu = cpu;
  gpu.launch_seconds = 1e-3;  // a millisecond a launch: the term in ms is the count
  const CostTable a = estimate_costs(*run.model, 4, cpu, {}, c.optimizer.optimizer);
  const CostTable b = estimate_costs(*run.model, 4, gpu, {}, c.optimizer.optimizer);
  const std::vector<double> ca = partition::layer_costs(*run.model, 4, true, {}, cpu);
  const std::vector<double> cb = partition::layer_costs(*run.model, 4, true, {}, gpu);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    const partition::LayerLaunches& n = (*cpu.launches)[static_cast<size_t>(i)];
    CHECK(b.layers[i].forward - a.layers[i].forward == doctest::Approx(static_cast<double>(n.forward)));
    CHECK(b.layers[i].recompute - a.layers[i].recompute == doctest::Approx(static_cast<double>(n.recompute)));
    CHECK(b.layers[i].backward_input - a.layers[i].backward_input ==
          doctest::Approx(static_cast<double>(n.backward_input)));
    CHECK(b.layers[i].backward_weight - a.layers[i].backward_weight ==
          doctest::Approx(static_cast<double>(n.backward_weight)));
    CHECK(b.layers[i].backward - a.layers[i].backward == doctest::Approx(static_cast<double>(n.backward())));
    // The balancer's seconds: a recomputing layer pays its forward's launches and its recompute's.
    CHECK((cb[i] - ca[i]) * 1e3 == doctest::Approx(static_cast<double>(n.forward + n.recompute + n.backward())));
  }
  // A device description's launch cost reaches the cost model.
  const DeviceSpec h100 = load_device_spec("configs/devices/h100_nvlink_ib.yaml");
  CHECK(h100.cost_model_for(DType::kBF16).launch_seconds == doctest::Approx(4e-6));
  const gpipe::testing::TempDir dir;
  CHECK_THROWS_WITH_AS(load_device_spec(h100_with(dir, "spec.yaml", "launch_overhead_us: -1")),
                       doctest::Contains("device.launch_overhead_us"), UserError);
}

// pipeline.capture: a captured step's ops are priced at a graph node's replay cost
// (DevicePeak::graph_node_seconds, a device description's graph_node_us), not a launch's,
// where that cost is known; nothing changes where it is not, or without capture.
TEST_CASE("a captured step's ops are priced at a graph node's cost where it is known") {
  partition::CostModel cm;
  cm.launch_seconds = 1e-3;
  cm.price_captured();  // no node cost known: each op stays a launch
  CHECK(cm.launch_seconds == 1e-3);
  CHECK_FALSE(cm.launches_captured);
  cm.graph_node_seconds = 2e-4;
  cm.price_captured();
  CHECK(cm.launch_seconds == 2e-4);
  CHECK(cm.launches_captured);

  auto predicted = [](bool capture, double node_seconds) {
    const Config c = parse_config(kSmall, "t.yaml", {"pipeline.micro_batches=2",
                                                     std::string("pipeline.capture=") + (capture ? "true" : "false")});
    RunModel r = build_run_model(c);
    CHECK(captures(r.config, *r.model) == capture);
    const Plan plan = make_plan(r.config, *r.model);
    // The fixed rates (-1: no probe), a millisecond a launch, `node_seconds` a captured op.
    return std::make_pair(predict_config(r.config, *r.model, plan, false, -1, 0, 1e-3, true, node_seconds),
                          stage_launches(plan, 0));
  };
  const auto [plain, launches] = predicted(false, 2e-4);
  const auto [captured, same] = predicted(true, 2e-4);
  const auto [unknown, again] = predicted(true, 0);
  REQUIRE(launches > 0);
  CHECK_FALSE(plain.launches_captured);
  CHECK(captured.launches_captured);
  CHECK_FALSE(unknown.launches_captured);
  // One stage: the step is its ops one after another, each 0.8 ms cheaper captured.
  CHECK(plain.step_ms - captured.step_ms == doctest::Approx(0.8 * static_cast<double>(launches)));
  CHECK(unknown.step_ms == doctest::Approx(plain.step_ms));
  CHECK(captured.source.find("200.0 us probed a captured op") != std::string::npos);
  CHECK(plain.source.find("1000.0 us probed a launch") != std::string::npos);

  // A profile measured op by op has each op's launch in its times: captured, each op is
  // 0.8 ms shorter there too. Every layer 50 ms F and R, 100 ms B.
  const gpipe::testing::TempDir profiled;
  const std::string profile_path = profiled / "profile.json";
  {
    const Config c = parse_config(kSmall, "t.yaml", {"pipeline.micro_batches=2"});
    RunModel r = build_run_model(c);
    ProfileStore store;
    store.put(synthetic(*r.model, 2, 50.0, 100.0));
    save_profile(profile_path, store);
  }
  auto from_profile = [&](bool capture) {
    const Config c = parse_config(kSmall, "t.yaml", {"pipeline.micro_batches=2", "pipeline.profile=" + profile_path,
                                                     std::string("pipeline.capture=") + (capture ? "true" : "false")});
    RunModel r = build_run_model(c);
    const Plan plan = make_plan(r.config, *r.model);
    return predict_config(r.config, *r.model, plan, false, -1, 0, 1e-3, true, 2e-4);
  };
  const PlannedRun measured_plain = from_profile(false), measured_captured = from_profile(true);
  CHECK(measured_plain.source.find("profile " + profile_path) == 0);
  CHECK(measured_captured.source.find("each op 800.0 us less, captured") != std::string::npos);
  CHECK(measured_plain.source.find("captured") == std::string::npos);
  CHECK(measured_plain.step_ms - measured_captured.step_ms == doctest::Approx(0.8 * static_cast<double>(launches)));

  // A layer that does host work in its step is never captured: priced as launches.
  const Config with_bn = parse_config(kConvBatchNorm, "t.yaml", {"pipeline.capture=true"});
  RunModel r = build_run_model(with_bn);
  CHECK_FALSE(captures(r.config, *r.model));

  // A device description's graph node cost reaches the cost model; a bad one is refused.
  const gpipe::testing::TempDir dir;
  h100_with(dir, "good.yaml", "launch_overhead_us: 4\ngraph_node_us: 1.5");
  h100_with(dir, "bad.yaml", "launch_overhead_us: 4\ngraph_node_us: 0");
  CHECK(load_device_spec(dir / "good.yaml").cost_model_for(DType::kBF16).graph_node_seconds == doctest::Approx(1.5e-6));
  CHECK(load_device_spec("configs/devices/h100_nvlink_ib.yaml").cost_model_for(DType::kBF16).graph_node_seconds == 0);
  CHECK_THROWS_WITH_AS(load_device_spec(dir / "bad.yaml"), doctest::Contains("device.graph_node_us"), UserError);

  // The sweep prices a candidate that takes capture (one stage) at the node's cost, 2.5 us
  // less an op; a candidate of several stages on devices of their own runs op by op.
  const DeviceSpec spec = load_device_spec(dir / "good.yaml");
  auto swept = [&](bool capture) {
    const Config c = parse_config(kSmall, "t.yaml", {std::string("pipeline.capture=") + (capture ? "true" : "false")});
    RunModel r = build_run_model(c);
    SweepOptions o;
    o.devices = 2;
    o.spec = &spec;
    std::map<std::string, Candidate> by_shape;
    for (const Candidate& x : sweep(r.config, *r.model, o).candidates) {
      by_shape[std::to_string(x.stages) + " " + std::to_string(x.micro_batches) + " " + x.schedule + " " +
               std::to_string(static_cast<int>(x.recompute))] = x;
    }
    return by_shape;
  };
  const auto op_by_op = swept(false), with_capture = swept(true);
  REQUIRE(op_by_op.size() == with_capture.size());
  int one_stage = 0, several = 0;
  for (const auto& [shape, x] : op_by_op) {
    CAPTURE(shape);
    const Candidate& y = with_capture.at(shape);
    if (x.stages == 1) {
      ++one_stage;
      REQUIRE(x.run.stages[0].launches > 0);
      CHECK(x.run.step_ms - y.run.step_ms == doctest::Approx(2.5e-3 * static_cast<double>(x.run.stages[0].launches)));
    } else {
      ++several;
      CHECK(y.run.step_ms == x.run.step_ms);
    }
  }
  CHECK(one_stage > 0);
  CHECK(several > 0);
}
