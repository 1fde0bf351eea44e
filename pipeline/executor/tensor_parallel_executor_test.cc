// Tensor parallelism placed by the executor (issue 38): each stage of a pipeline run by a
// tensor group of T executors, one per member (its own model built as that member, its
// own pipeline transport, ExecutorOptions::tensor_group joining the stage's members), as
// threads of this process the way mpirun runs them as processes; K stages x T members x D
// replicas, rank ((d K) + k) T + t. The GPT config (a tied head across the stages, dropout)
// and the LLaMA config (grouped-query attention, dropout) in float64 equal the
// unpartitioned model: the first batch's loss and every gradient (each member's block of
// the whole gradient) against Sequential::forward_backward to 1e-12, then three AdamW
// steps with clipping (NORM over the group) and the final parameters joined against the
// same steps at K = T = D = 1; for K in {1, 2}, T in {1, 2, 4}, D in {1, 2}, with the
// optimizer state sharded over the replicas too. A checkpoint saved split is whole by
// name and resumes at another T, K and D.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include "layers/batchnorm2d.h"
#include "layers/flatten.h"
#include "layers/loss.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "layers/tensor_parallel.h"
#include "pipeline/config/config.h"
#include "pipeline/executor/cell.h"
#include "pipeline/executor/executor.h"
#include "runtime/inprocess_replica_group.h"
#include "runtime/inprocess_transport.h"
#include "tests/tensor_group.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::on_threads;
using gpipe::testing::to_doubles;

namespace {

struct Run {
  int K = 1, T = 1, D = 1;
  bool shard = false;
  // Zero bubble with each drain's weight gradients batched (a layer's W over several
  // micro-batches at once) instead of 1F1B.
  bool batched_w = false;
  // Sequence parallelism (TensorShard::sequence): each member holds 1/T of the positions
  // between the split layers.
  bool sequence = false;
};

// A parameter as one member holds it: its block's place, value and gradient.
struct Held {
  int dim = -1, rank = 0, count = 1, groups = 1, replicas = 1;
  Shape whole;
  Tensor value, grad;
};

// Per rank: the losses and norms of its steps; the parameters its stage owns by name,
// after the first call (gradients without a step) and at the end; and the state saved
// (replica 0, member 0 of each stage: whole by name), all stages' in one map.
struct Outcome {
  std::vector<std::vector<double>> loss, norm;
  std::vector<std::map<std::string, Held>> first, last;
  StageState saved;
  // Per rank, each step: the compute instructions' time in the tensor group's sums
  // (TimedOp::group_ms), and whether each lies within its instruction.
  std::vector<std::vector<double>> group_ms;
  std::vector<int> group_within;
};

// What a call of train does besides its steps: the first batch's gradients first, a save
// after `save_after` steps, or a resume from `resume` at step `first_step`.
struct Extra {
  bool first_grads = true;
  int save_after = -1;
  const StageState* resume = nullptr;
  int first_step = 0;
};

const int64_t kRows = 8;  // the mini-batch: 4 rows a replica at D = 2, 2 micro-batches of 2

struct Batch {
  Tensor x, y;
};
// Step `step`'s token ids and targets, for samples of `positions` tokens.
Batch batch(int step, int64_t positions) {
  return {gpipe::testing::random_labels(kRows * positions, 16, 700 + step).reshape({kRows, positions}),
          gpipe::testing::random_labels(kRows * positions, 16, 800 + step).reshape({kRows, positions})};
}

std::map<std::string, Held> held(layers::Sequential& model, int first, int count) {
  std::map<std::string, Held> out;
  std::vector<layers::Parameter*> mine;
  for (int i = first; i < first + count; ++i) {
    for (auto* p : model.layer(i).parameters()) mine.push_back(p);
  }
  for (auto& [name, p] : model.named_parameters()) {
    if (model.is_tied_copy(p) || std::find(mine.begin(), mine.end(), p) == mine.end()) continue;
    // Copies (float64, on the CPU): the executor goes on using the parameter's own.
    Held h{p->shard_dim, p->shard_rank, p->shard_count, p->shard_groups, p->shard_replicas, p->whole,
           Tensor::from_vector(to_doubles(p->value), p->value.shape()),
           Tensor::from_vector(to_doubles(p->grad), p->grad.shape())};
    if (h.dim < 0) h.whole = p->value.shape();
    out[name] = h;
  }
  return out;
}

// `steps` training steps (AdamW, clipping at 0.05, so that it applies), after a first
// call without the optimizer that leaves the first batch's gradients.
Outcome train(const layers::ModelSpec& whole_spec, const Run& run, int steps, const Extra& extra = {}) {
  const int P = run.K * run.T * run.D;
  const std::vector<int> balance = run.K == 1 ? std::vector<int>{5} : std::vector<int>{2, 3};
  Outcome out;
  out.loss.resize(P);
  out.norm.resize(P);
  out.first.resize(P);
  out.last.resize(P);
  out.group_ms.resize(P);
  out.group_within.assign(P, 1);
  // A pipeline per (replica, member); a replica group per (stage, member); a tensor group
  // per (replica, stage).
  std::vector<std::unique_ptr<InProcessTransport>> pipes;
  std::vector<std::unique_ptr<InProcessReplicaHub>> replica_hubs, tensor_hubs;
  for (int i = 0; i < run.D * run.T; ++i) pipes.push_back(std::make_unique<InProcessTransport>(run.K, 30));
  for (int i = 0; i < run.K * run.T; ++i) replica_hubs.push_back(std::make_unique<InProcessReplicaHub>(run.D, 30));
  for (int i = 0; i < run.D * run.K; ++i) tensor_hubs.push_back(std::make_unique<InProcessReplicaHub>(run.T, 30));
  std::mutex saved_mu;
  const std::vector<std::string> errors = on_threads(P, [&](int rank) {
    const int t = rank % run.T, k = (rank / run.T) % run.K, d = rank / (run.T * run.K);
    layers::ModelSpec spec = whole_spec;
    spec.member = layers::TensorShard{t, run.T, run.sequence};
    auto model = layers::build_model(spec);
    // Under sequence parallelism the embedding gives the member its share of the positions.
    const int64_t positions = whole_spec.input.at(0);
    if (model->layer(0).output_shape().at(0) != (run.sequence && run.T > 1 ? positions / run.T : positions)) {
      throw Error("the embedding's output " + shape_str(model->layer(0).output_shape()) + " is not the member's positions");
    }
    InProcessReplicaGroup replicas(*replica_hubs[k * run.T + t], d);
    InProcessReplicaGroup tensor(*tensor_hubs[d * run.K + k], t);
    ExecutorOptions opts;
    opts.optimizer.type = "adamw";
    opts.optimizer.lr = 0.01;
    opts.optimizer.weight_decay = 0.1;
    opts.clip_grad_norm = 0.05;
    opts.local_stage = k;
    opts.rank = rank;
    opts.replicas = run.D > 1 ? &replicas : nullptr;
    opts.shard_optimizer = run.shard;
    opts.tensor_group = run.T > 1 ? &tensor : nullptr;
    opts.bucket_bytes = 300;
    opts.pin_threads = false;
    opts.sample_offset = d * (kRows / run.D);
    std::vector<Device> devices;
    for (int s = 0; s < run.K; ++s) devices.push_back(Device::cpu(s));
    ScheduleRequest request{run.batched_w ? "zero_bubble" : "1f1b", run.K, 1, 2, RecomputeMode::kExceptLast};
    request.batch_weights = run.batched_w;
    Executor ex(*model, make_stages(balance, devices), make_schedule(request), *pipes[d * run.T + t], opts);
    const int64_t rows = kRows / run.D;
    int first = 0;
    for (int s = 0; s < k; ++s) first += balance[s];
    if (extra.resume != nullptr) ex.restore_state(k, extra.resume->model, extra.resume->optimizer);
    if (extra.first_grads) {
      const Batch b = batch(0, whole_spec.input.at(0));
      ex.step(b.x.narrow_rows(d * rows, rows), b.y.narrow_rows(d * rows, rows), false);
      if (!run.shard) out.first[rank] = held(*model, first, balance[k]);
    }
    ex.set_step(static_cast<uint64_t>(extra.first_step));
    for (int step = extra.first_step; step < extra.first_step + steps; ++step) {
      const Batch b = batch(step, whole_spec.input.at(0));
      const StepResult r = ex.step(b.x.narrow_rows(d * rows, rows), b.y.narrow_rows(d * rows, rows));
      out.loss[rank].push_back(r.loss);
      out.norm[rank].push_back(r.grad_norm);
      double group = 0;
      for (const TimedOp& op : r.stages.at(k).ops) {
        group += op.group_ms;
        if (op.group_ms < 0 || op.group_ms > op.end_ms - op.start_ms + 1e-9 || (op.group_ms > 0 && !is_compute(op.op))) {
          out.group_within[rank] = 0;
        }
      }
      out.group_ms[rank].push_back(group);
      if (step + 1 - extra.first_step == extra.save_after) {
        StageState saved = ex.save_state(k);  // every member and replica takes part
        if (d == 0 && t == 0) {
          std::lock_guard<std::mutex> lock(saved_mu);
          out.saved.model.insert(saved.model.begin(), saved.model.end());
          out.saved.optimizer.insert(saved.optimizer.begin(), saved.optimizer.end());
        }
      }
    }
    out.last[rank] = held(*model, first, balance[k]);
  });
  for (const std::string& e : errors) REQUIRE(e == "");
  return out;
}

// The whole parameter `name` from the members of replica d's stage that owns it.
std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> joined(
    const std::vector<std::map<std::string, Held>>& by_rank, const Run& run, int d) {
  std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> out;
  for (int k = 0; k < run.K; ++k) {
    const int base = (d * run.K + k) * run.T;
    for (const auto& [name, h0] : by_rank[static_cast<size_t>(base)]) {
      std::vector<Tensor> values, grads;
      for (int t = 0; t < run.T; ++t) {
        const Held& h = by_rank[static_cast<size_t>(base + t)].at(name);
        // Member t's block, or the block it holds with the R - 1 members beside it.
        CHECK(h.rank == (h.dim < 0 ? 0 : t / h.replicas));
        if (h.dim >= 0 && t % h.replicas != 0) {
          CHECK(to_doubles(h.value) == to_doubles(values.back()));  // alike on its holders
          CHECK(to_doubles(h.grad) == to_doubles(grads.back()));
          continue;
        }
        values.push_back(h.value);
        grads.push_back(h.grad);
      }
      if (h0.dim < 0) {
        // A whole parameter: the same on every member.
        for (int t = 1; t < static_cast<int>(values.size()); ++t) {
          CHECK(to_doubles(values[t]) == to_doubles(values[0]));
          CHECK(to_doubles(grads[t]) == to_doubles(grads[0]));
        }
        out[name] = {to_doubles(values[0]), to_doubles(grads[0])};
      } else {
        CHECK(h0.count * h0.replicas == run.T);
        out[name] = {to_doubles(layers::join_blocks(values, h0.dim, h0.groups, h0.whole)),
                     to_doubles(layers::join_blocks(grads, h0.dim, h0.groups, h0.whole))};
      }
    }
  }
  return out;
}

// Sequence parallelism (sequence true) runs T = 2 and 4 (at T = 1 it changes nothing).
void check_model(const char* text, bool sequence = false) {
  const Config config = parse_config(text, "tp.yaml");
  // The unpartitioned model's loss and gradients on the first batch.
  auto whole = layers::build_model(config.model);
  Backend& be = backend_for(Device::cpu());
  const Batch b0 = batch(0, config.model.input.at(0));
  layers::ForwardArgs args;
  const double scale = 1.0 / static_cast<double>(whole->loss().counted_targets(b0.y));
  whole->forward_backward(be, b0.x, b0.y, scale, args);
  whole->sum_tied_gradients(be);
  std::map<std::string, std::vector<double>> want_grad;
  for (auto& [name, p] : whole->named_parameters()) {
    if (!whole->is_tied_copy(p)) want_grad[name] = to_doubles(p->grad);
  }
  const int steps = 3;
  const Outcome ref = train(config.model, Run{}, steps);
  const auto ref_last = joined(ref.last, Run{}, 0);
  for (int K : {1, 2}) {
    for (int T : {1, 2, 4}) {
      if (sequence && T == 1) continue;
      for (int D : {1, 2}) {
        for (bool shard : {false, true}) {
          if (shard && D == 1) continue;
          Run run{K, T, D, shard};
          run.sequence = sequence;
          CAPTURE(K);
          CAPTURE(T);
          CAPTURE(D);
          CAPTURE(shard);
          const Outcome got = train(config.model, run, steps);
          for (int rank = 0; rank < K * T * D; ++rank) {
            CAPTURE(rank);
            for (int s = 0; s < steps; ++s) {
              CHECK(got.loss[rank][s] == doctest::Approx(ref.loss[0][s]).epsilon(1e-12));
              CHECK(got.norm[rank][s] == doctest::Approx(ref.norm[0][s]).epsilon(1e-12));
            }
          }
          CHECK(ref.norm[0][0] > 0.05);  // the clip applies
          // Each compute instruction's time in the group's sums (every member's stage sums
          // at every step when split; nothing otherwise), within the instruction.
          for (int rank = 0; rank < K * T * D; ++rank) {
            CHECK(got.group_within[rank] == 1);
            for (double g : got.group_ms[rank]) CHECK((T > 1 ? g > 0 : g == 0));
          }
          for (int d = 0; d < D; ++d) {
            CAPTURE(d);
            if (!shard) {
              const auto first = joined(got.first, run, d);
              REQUIRE(first.size() == want_grad.size());
              for (const auto& [name, vg] : first) {
                INFO(name);
                GPIPE_EXPECT_CLOSE(vg.second, want_grad.at(name), 1e-12, 1e-13);
              }
            }
            const auto last = joined(got.last, run, d);
            REQUIRE(last.size() == ref_last.size());
            for (const auto& [name, vg] : last) {
              INFO(name);
              // Three Adam steps divide each gradient by its own root mean square: a
              // rounding of a small gradient (the sums run in another order over T
              // and D) moves its parameter by ~1e-13 of lr; the values are ~0.1.
              GPIPE_EXPECT_CLOSE(vg.first, ref_last.at(name).first, 1e-12, 1e-12);
            }
          }
        }
      }
    }
  }
}

// Three steps of zero bubble with each drain's W batched, at K = 2 x T = 4 (with sequence
// parallelism or not), equal K = T = D = 1: losses and the final parameters.
void check_batched_w(const char* text, bool sequence = false) {
  const Config config = parse_config(text, "tp.yaml");
  Extra steps;
  steps.first_grads = false;
  const Outcome ref = train(config.model, Run{}, 3, steps);
  Run batched{2, 4, 1};
  batched.batched_w = true;
  batched.sequence = sequence;
  const Outcome got = train(config.model, batched, 3, steps);
  for (int s = 0; s < 3; ++s) CHECK(got.loss[0][s] == doctest::Approx(ref.loss[0][s]).epsilon(1e-12));
  const auto want = joined(ref.last, Run{}, 0);
  for (const auto& [name, vg] : joined(got.last, batched, 0)) {
    INFO(name);
    GPIPE_EXPECT_CLOSE(vg.first, want.at(name).first, 1e-12, 1e-12);
  }
}

}  // namespace

// A checkpoint saved at K = 2, T = 2, D = 2 with the optimizer sharded (or as save_run
// says) holds every parameter and slot whole, by name: it resumes at T = 1, at T = 4
// (K = 1) and at T = 2 (K = 2, D = 1) with the losses and parameters of the run that
// never stopped.
// resume_sequence: the resumed runs split over T > 1 with sequence parallelism.
void check_resume(const char* text, const Run& save_run = Run{2, 2, 2, true}, bool resume_sequence = false) {
  const Config config = parse_config(text, "tp.yaml");
  Extra whole_run;
  whole_run.first_grads = false;
  const Outcome ref = train(config.model, Run{}, 4, whole_run);
  const auto ref_last = joined(ref.last, Run{}, 0);
  Extra save;
  save.first_grads = false;
  save.save_after = 2;
  const Outcome saved = train(config.model, save_run, 2, save);
  // Whole: the unsplit model's shapes, by the unsplit model's names.
  auto whole = layers::build_model(config.model);
  for (auto& [name, p] : whole->named_parameters()) {
    if (whole->is_tied_copy(p)) continue;
    INFO(name);
    REQUIRE(saved.saved.model.count(name) == 1);
    CHECK(saved.saved.model.at(name).shape() == p->value.shape());
    CHECK(saved.saved.optimizer.at(name + ".exp_avg").shape() == p->value.shape());
  }
  for (Run run : {Run{1, 1, 1}, Run{1, 4, 1}, Run{2, 2, 1}, Run{2, 1, 2, true}}) {
    run.sequence = resume_sequence && run.T > 1;
    CAPTURE(run.K);
    CAPTURE(run.T);
    CAPTURE(run.D);
    CAPTURE(run.sequence);
    Extra resume;
    resume.first_grads = false;
    resume.resume = &saved.saved;
    resume.first_step = 2;
    const Outcome got = train(config.model, run, 2, resume);
    for (int s = 0; s < 2; ++s) CHECK(got.loss[0][s] == doctest::Approx(ref.loss[0][2 + s]).epsilon(1e-12));
    const auto last = joined(got.last, run, 0);
    REQUIRE(last.size() == ref_last.size());
    for (const auto& [name, vg] : last) {
      INFO(name);
      GPIPE_EXPECT_CLOSE(vg.first, ref_last.at(name).first, 1e-12, 1e-12);
    }
  }
}

TEST_CASE("a GPT config (a tied head across the stages) on K x T x D executors equals the unpartitioned model") {
  check_model(gpipe::testing::kTensorParallelGpt);
}

TEST_CASE("a LLaMA config (grouped-query attention) on K x T x D executors equals the unpartitioned model") {
  check_model(gpipe::testing::kTensorParallelLlama);
}

TEST_CASE("a LLaMA config with 2 key/value heads (replicated over pairs of members at T = 4) equals the unpartitioned model") {
  check_model(gpipe::testing::kTensorParallelLlamaFewKv.c_str());
  // Their weight gradients summed over the pair after a batched W too (zero bubble, K = 2).
  check_batched_w(gpipe::testing::kTensorParallelLlamaFewKv.c_str());
}

TEST_CASE("a LLaMA config with one key/value head (multi-query: whole, held by every member alike) equals the unpartitioned model") {
  check_model(gpipe::testing::kTensorParallelLlamaMqa.c_str());
  check_resume(gpipe::testing::kTensorParallelLlamaMqa.c_str(), Run{1, 4, 2, true});
}

TEST_CASE("a checkpoint saved split (T = 2, sharded over D = 2) is whole by name and resumes at T = 1, 2 and 4") {
  check_resume(gpipe::testing::kTensorParallelGpt);
  check_resume(gpipe::testing::kTensorParallelLlama);
  check_resume(gpipe::testing::kTensorParallelLlamaFewKv.c_str());
  // Saved at T = 4, where each key/value head is held by two members: once in the checkpoint.
  check_resume(gpipe::testing::kTensorParallelLlamaFewKv.c_str(), Run{2, 4, 1});
}

// Sequence parallelism: the samples' 8 positions split over the members between the split
// layers (the norms, the dropouts with their share of the unsplit mask, the residual
// stream), gathered and scattered around them.
TEST_CASE("sequence parallelism: a GPT config (learned positions, a tied head) on K x T x D executors equals the unpartitioned model") {
  check_model(gpipe::testing::with_positions(gpipe::testing::kTensorParallelGpt, 8).c_str(), /*sequence=*/true);
}

TEST_CASE("sequence parallelism: a LLaMA config (grouped-query attention, key/value heads replicated at T = 4) equals the unpartitioned model") {
  check_model(gpipe::testing::with_positions(gpipe::testing::kTensorParallelLlama, 8).c_str(), /*sequence=*/true);
  const std::string few_kv = gpipe::testing::with_positions(gpipe::testing::kTensorParallelLlamaFewKv.c_str(), 8);
  check_model(few_kv.c_str(), /*sequence=*/true);
  // Zero bubble with batched W (K = 2, T = 4): the row-parallel layers' gathered output
  // gradients and the norms' partial gradients over several micro-batches at once.
  check_batched_w(few_kv.c_str(), /*sequence=*/true);
}

TEST_CASE("sequence parallelism: a checkpoint saved with it (T = 2, sharded over D = 2) resumes without it, and the reverse") {
  const std::string gpt = gpipe::testing::with_positions(gpipe::testing::kTensorParallelGpt, 8);
  Run saved{2, 2, 2, true};
  saved.sequence = true;
  check_resume(gpt.c_str(), saved);
  check_resume(gpipe::testing::with_positions(gpipe::testing::kTensorParallelLlama, 8).c_str(), Run{2, 2, 2, true},
               /*resume_sequence=*/true);
}

// The tensor group's collectives are instructions of the program (Schedule::tensor,
// found on the member's shapes): each runs when a layer asks for it, as the program's
// instruction after its compute instruction, and the stage's trace holds it in program
// order, with the bytes it moved, inside that compute instruction, whose group_ms is
// their time. Checked at K = 2 x T = 2 on GPT, with and without sequence parallelism, and
// at K = 1 x T = 4 on LLaMA with 2 key/value heads (each replicated over 2 members: a whole
// B sums their weight gradients, whose bytes do not grow with the batch), for a training
// step and an evaluation (whose F ask for the loss's count too).
TEST_CASE("the tensor group's collectives run as the program's instructions, traced with the bytes found on shapes") {
  struct Case {
    std::string text;
    int K, T;
    std::vector<int> balance;
    bool sequence;
  };
  const std::string gpt = gpipe::testing::with_positions(gpipe::testing::kTensorParallelGpt, 8);
  const Case cases[] = {
      {gpt, 2, 2, {2, 3}, false},
      {gpt, 2, 2, {2, 3}, true},
      {gpipe::testing::with_positions(gpipe::testing::kTensorParallelLlamaFewKv.c_str(), 8), 1, 4, {5}, false},
  };
  for (const Case& c : cases) {
    const int K = c.K, T = c.T;
    CAPTURE(K);
    CAPTURE(T);
    CAPTURE(c.sequence);
    const Config config = parse_config(c.text, "tp.yaml");
    std::vector<std::unique_ptr<InProcessTransport>> pipes;
    std::vector<std::unique_ptr<InProcessReplicaHub>> hubs;
    for (int t = 0; t < T; ++t) pipes.push_back(std::make_unique<InProcessTransport>(K, 30));
    for (int k = 0; k < K; ++k) hubs.push_back(std::make_unique<InProcessReplicaHub>(T, 30));
    std::vector<Schedule> programs(K * T);
    std::vector<StageTrace> traces(K * T);
    std::vector<double> correct(K * T, -1);
    const std::vector<std::string> errors = on_threads(K * T, [&](int rank) {
      const int t = rank % T, k = rank / T;
      layers::ModelSpec spec = config.model;
      spec.member = layers::TensorShard{t, T, c.sequence};
      auto model = layers::build_model(spec);
      InProcessReplicaGroup tensor(*hubs[k], t);
      ExecutorOptions opts;
      opts.local_stage = k;
      opts.rank = rank;
      opts.tensor_group = &tensor;
      opts.pin_threads = false;
      std::vector<Device> devices;
      for (int s = 0; s < K; ++s) devices.push_back(Device::cpu(s));
      Executor ex(*model, make_stages(c.balance, devices),
                  make_schedule(ScheduleRequest{"1f1b", K, 1, 2, RecomputeMode::kExceptLast}), *pipes[t], opts);
      const Batch b = batch(0, 8);
      const StepResult r = ex.step(b.x, b.y);
      programs[rank] = ex.schedule();
      traces[rank] = r.stages.at(k);
      correct[rank] = ex.evaluate(b.x, b.y, 5).correct;  // micro-batches of 5 and 3 rows
    });
    for (const std::string& e : errors) REQUIRE(e == "");
    int fixed = 0;  // collectives whose bytes do not grow with the batch
    for (int rank = 0; rank < K * T; ++rank) {
      CAPTURE(rank);
      const int k = rank / T;
      const Schedule& s = programs[rank];
      REQUIRE(s.tensor_lowered);
      CHECK(s.tensor.members == T);
      CHECK(schedule_table(s) == schedule_table(programs[k * T]));  // the members of a stage run one program
      CHECK(s.tensor == programs[k * T].tensor);
      const auto& prog = s.stages[k];
      const std::vector<std::vector<TensorOp>> asked = stage_tensor_ops(s, s.tensor, k);
      const StageTrace& trace = traces[rank];
      REQUIRE(trace.ops.size() == prog.size());
      int tensor_ops = 0;
      for (size_t pc = 0, owner = 0, next = 0; pc < prog.size(); ++pc) {
        const TimedOp& op = trace.ops[pc];
        CHECK(op.op == prog[pc].op);
        CHECK(op.micro_batch == prog[pc].micro_batch);
        if (!is_tensor_collective(prog[pc].op)) {
          if (is_compute(prog[pc].op)) {
            // Its group time is the tensor collectives after it, which ran inside it.
            double inside = 0;
            for (size_t j = pc + 1; j < prog.size() && is_tensor_collective(prog[j].op); ++j) {
              inside += trace.ops[j].end_ms - trace.ops[j].start_ms;
            }
            CHECK(op.group_ms == doctest::Approx(inside).epsilon(1e-12));
          }
          owner = pc;
          next = 0;
          continue;
        }
        ++tensor_ops;
        const TimedOp& in = trace.ops[owner];
        CHECK(is_compute(prog[owner].op));
        CHECK(op.start_ms >= in.start_ms);
        CHECK(op.end_ms <= in.end_ms);
        // The bytes the layers' tensors moved are those found on shapes for a micro-batch of 4.
        REQUIRE(next < asked[owner].size());
        CHECK(op.bytes == asked[owner][next].bytes_at(4));
        fixed += asked[owner][next].bytes_per_sample == 0;
        ++next;
      }
      // Every F, R, B and W of both stages asks something: the embedding's and the head's
      // vocabulary-parallel sums, the blocks' row-parallel ones (or gathers and scatters).
      CHECK(tensor_ops > 0);
      for (size_t pc = 0; pc < prog.size(); ++pc) {
        if (prog[pc].op == Op::kForward || prog[pc].op == Op::kBackward) {
          CHECK(pc + 1 < prog.size());
          CHECK(is_tensor_collective(prog[pc + 1].op));
        }
      }
    }
    // Fixed-size ones: the replicated key/value heads' weight gradients in each whole B, and
    // with sequence parallelism the partial gradients' sums once a step.
    CHECK((fixed > 0) == (c.sequence || T == 4));
    // The evaluation's count came back on the last stage's members (their F's tMAX and tAR).
    CHECK(correct[(K - 1) * T] >= 0);
    for (int t = 1; t < T; ++t) CHECK(correct[(K - 1) * T + t] == correct[(K - 1) * T]);
  }
}

// Finding the program runs the layers' forwards on shapes, at a training step no run
// takes: what a layer keeps per step (BatchNorm's statistics) is dropped at the run's
// first step, and folds as if the finding had not been.
TEST_CASE("finding what a tensor group is asked leaves a layer's per-step state alone") {
  auto make = [] {
    auto model = std::make_unique<layers::Sequential>(Shape{2, 3, 3}, DType::kF64);
    layers::BatchNorm2dOptions o({2, 3, 3});
    o.dtype = DType::kF64;
    model->emplace<layers::BatchNorm2d>(o);
    model->emplace<layers::Flatten>(Shape{2, 3, 3}, DType::kF64);
    model->set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(18, DType::kF64));
    return model;
  };
  auto found = make(), plain = make();
  const TensorProgram t = run_tensor_program(*found, make_stages({2}, {Device::cpu()}), 0, 2);
  CHECK(t.members == 2);
  REQUIRE(t.cells.size() == 1);
  CHECK(t.cells[0].forward.empty());  // nothing here is split
  Backend& be = backend_for(Device::cpu());
  const Tensor x = gpipe::testing::random_tensor({4, 2, 3, 3}, DType::kF64, 3);
  for (layers::Sequential* m : {found.get(), plain.get()}) {
    layers::ForwardArgs step0;  // a run's first step
    m->layer(0).forward(be, x, nullptr, step0);
    m->layer(0).end_step(be);
  }
  auto& a = static_cast<layers::BatchNorm2d&>(found->layer(0));
  auto& b = static_cast<layers::BatchNorm2d&>(plain->layer(0));
  CHECK(to_doubles(a.running_mean()) == to_doubles(b.running_mean()));
  CHECK(to_doubles(a.running_var()) == to_doubles(b.running_var()));
}

namespace {
// An identity layer whose tensor-group collectives depend on its data (a layer bug the
// executor catches): on shapes, where the program is found, it asks as `on_shapes` says,
// and with data as `with_data` says (kNone: nothing).
enum class Ask { kNone, kSum, kMax };
class AsksByData : public layers::Layer {
 public:
  AsksByData(int64_t width, Ask on_shapes, Ask with_data)
      : Layer({width}, {width}, DType::kF64), on_shapes_(on_shapes), with_data_(with_data) {}
  std::string type() const override { return "asks_by_data"; }
  std::string describe() const override { return "asks_by_data"; }
  layers::LayerCost cost(int64_t) const override { return {}; }
  void set_collectives(layers::TensorCollectives* group) override { group_ = group; }

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, layers::Context*, const layers::ForwardArgs&) override {
    Tensor y = be.empty(x.shape(), x.dtype());
    be.copy(x, y);
    const Ask ask = x.is_meta() ? on_shapes_ : with_data_;
    if (ask == Ask::kSum) group_->all_reduce_sum(be, y);
    if (ask == Ask::kMax) group_->all_reduce_max(be, y);
    return y;
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const layers::Context&, bool) override { return dy; }
  Ask on_shapes_, with_data_;
  layers::TensorCollectives* group_ = nullptr;
};
}  // namespace

TEST_CASE("a layer that asks its tensor group for what the program does not have stops the run, naming the mismatch") {
  struct Case {
    Ask on_shapes, with_data;
    const char* message;
  };
  const Case cases[] = {
      {Ask::kNone, Ask::kSum, "asked its tensor group for tAR in F0 where the program has no more"},
      {Ask::kSum, Ask::kMax, "asked its tensor group for tMAX in F0 where the program has tAR0"},
      {Ask::kSum, Ask::kNone, "has tAR0 in F0, which its layers did not ask the tensor group for"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.message);
    const int T = 2;
    InProcessReplicaHub hub(T, 30);
    const std::vector<std::string> errors = on_threads(T, [&](int t) {
      layers::Sequential model({4}, DType::kF64);
      model.emplace<AsksByData>(4, c.on_shapes, c.with_data);
      model.set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(4, DType::kF64));
      InProcessReplicaGroup tensor(hub, t);
      InProcessTransport transport(1, 30);
      ExecutorOptions opts;
      opts.local_stage = 0;
      opts.tensor_group = &tensor;
      opts.pin_threads = false;
      Executor ex(model, make_stages({1}, {Device::cpu(0)}), gpipe_schedule(1, 2, RecomputeMode::kNever), transport,
                  opts);
      CHECK(ex.schedule().tensor_lowered);
      ex.step(gpipe::testing::random_tensor({4, 4}, DType::kF64, 1), gpipe::testing::random_labels(4, 4, 2));
    });
    for (const std::string& e : errors) {
      CAPTURE(e);
      CHECK(e.find(c.message) != std::string::npos);
      CHECK(e.find("does not match the model") != std::string::npos);
    }
  }
}
