// Sharded optimizer state (ZeRO-1) in one process: the shard partition on its own, then
// K stages x D replicas as threads (one executor per stage and replica, the replicas
// joined by InProcessReplicaGroup, as under mpirun) with the state sharded equal the
// same run unsharded in float64, with Adam and SGD-momentum, with and without clipping,
// with a tied head, at K=2 x D=2 and at K=1 x D=3 (uneven shards); each replica keeps
// 1/D of the state; and a checkpoint saved sharded resumes at another D, K and mode.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "layers/optimizer.h"
#include "layers/registry.h"
#include "pipeline/executor/executor.h"
#include "pipeline/executor/shard_partition.h"
#include "runtime/inprocess_replica_group.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::to_doubles;

TEST_CASE("the shard partition: balanced, contiguous, a parameter split across shards") {
  // 5 + 2 + 4 = 11 elements over 3 replicas: 4, 4, 3, in blocks of 4.
  const ShardPartition p = shard_partition({5, 2, 4}, 3);
  CHECK(p.total() == 11);
  CHECK(p.size(0) == 4);
  CHECK(p.size(1) == 4);
  CHECK(p.size(2) == 3);
  CHECK(p.block() == 4);
  // Parameter 0 lies in shards 0 and 1, parameter 2 in shards 1 and 2.
  CHECK(p.pieces(0) == std::vector<ShardPiece>{{0, 0, 0, 4}});
  CHECK(p.pieces(1) == std::vector<ShardPiece>{{0, 4, 0, 1}, {1, 0, 1, 2}, {2, 0, 3, 1}});
  CHECK(p.pieces(2) == std::vector<ShardPiece>{{2, 1, 0, 3}});
  CHECK(p.param_begin(2) == 7);
  // Sizes differ by at most one, larger first, whatever N and D; the pieces cover every
  // element once.
  for (int D = 1; D <= 5; ++D) {
    for (const std::vector<int64_t>& numels : std::vector<std::vector<int64_t>>{{1}, {10}, {3, 0, 7}, {6, 1, 20, 3, 12}}) {
      const ShardPartition q = shard_partition(numels, D);
      int64_t n = 0;
      for (int64_t x : numels) n += x;
      std::vector<int> covered(static_cast<size_t>(n), 0);
      for (int d = 0; d < D; ++d) {
        CAPTURE(D);
        CHECK(q.size(d) == n / D + (d < n % D ? 1 : 0));
        CHECK(q.size(d) <= q.block());
        int64_t at = 0;
        for (const ShardPiece& piece : q.pieces(d)) {
          CHECK(piece.shard_offset == at);
          at += piece.length;
          for (int64_t e = 0; e < piece.length; ++e) ++covered[q.param_begin(piece.param) + piece.param_offset + e];
        }
        CHECK(at == q.size(d));
      }
      for (int c : covered) CHECK(c == 1);
    }
  }
  CHECK_THROWS_AS(shard_partition({4}, 0), Error);
}

namespace {

void on_threads(int n, const std::function<void(int)>& f) {
  const std::vector<std::string> errors = gpipe::testing::on_threads(n, f);
  for (int i = 0; i < n; ++i) {
    INFO("thread ", i, ": ", errors[i]);
    CHECK(errors[i].empty());
  }
}

layers::ModelSpec mlp_spec(DType dtype = DType::kF64) {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.dtype = dtype;
  spec.seed = 31;
  spec.layers = {{"linear", {{"out", "8"}}, {}, ""}, {"relu", {}, {}, ""},  {"linear", {{"out", "8"}}, {}, ""},
                 {"gelu", {}, {}, ""},              {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// An embedding and a head tied to it (on two stages at K = 2, on one at K = 1).
layers::ModelSpec tied_spec(DType dtype = DType::kF64) {
  layers::ModelSpec spec;
  spec.input = {4};
  spec.input_dtype = DType::kI32;
  spec.dtype = dtype;
  spec.seed = 13;
  spec.layers = {{"embedding", {{"vocab", "10"}, {"dim", "6"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", "6"}}, {}, ""},
                 {"linear", {{"out", "10"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

struct Batch {
  Tensor x, y;
};
Batch batch(bool tokens, int64_t n, int t) {
  if (tokens) {
    return {gpipe::testing::random_labels(n * 4, 10, 300 + t).reshape({n, 4}),
            gpipe::testing::random_labels(n * 4, 10, 400 + t).reshape({n, 4})};
  }
  return {gpipe::testing::random_tensor({n, 6}, DType::kF64, 300 + t, -2, 2), gpipe::testing::random_labels(n, 4, 400 + t)};
}

struct Run {
  int K = 1, D = 1;
  std::vector<int> balance;
  bool shard = false;
};
// Per rank (d K + k): the losses, grad norms, final parameters of its stage, its
// optimizer state's bytes, and (when save_after >= 0) replica 0's saved states.
struct Outcome {
  std::vector<std::vector<double>> loss, norm;
  std::vector<std::vector<std::vector<double>>> params;
  std::vector<int64_t> state_bytes;
  std::vector<int64_t> traced_bytes;  // what the last step's trace says (the report's figure)
  std::vector<StageState> saved;  // per stage, from replica 0
};

using Restore = std::function<void(Executor&, int stage)>;

Outcome train(const layers::ModelSpec& spec, bool tokens, const Run& run, const layers::OptimizerConfig& oc, double clip,
              int first_step, int steps, int save_after = -1, const Restore& restore = nullptr) {
  const int64_t N = 12;
  Outcome out;
  const int P = run.K * run.D;
  out.loss.resize(P);
  out.norm.resize(P);
  out.params.resize(P);
  out.state_bytes.resize(P);
  out.traced_bytes.resize(P);
  out.saved.resize(run.K);
  std::vector<std::unique_ptr<InProcessReplicaHub>> hubs;  // one group per stage
  for (int k = 0; k < run.K; ++k) hubs.push_back(std::make_unique<InProcessReplicaHub>(run.D, 20));
  std::vector<std::unique_ptr<InProcessTransport>> pipes;  // one transport per replica
  for (int d = 0; d < run.D; ++d) pipes.push_back(std::make_unique<InProcessTransport>(run.K, 20));
  on_threads(P, [&](int rank) {
    const int k = rank % run.K, d = rank / run.K;
    auto model = layers::build_model(spec);
    InProcessReplicaGroup group(*hubs[k], d);
    ExecutorOptions opts;
    opts.optimizer = oc;
    opts.clip_grad_norm = clip;
    opts.local_stage = k;
    opts.rank = rank;
    opts.replicas = run.D > 1 ? &group : nullptr;
    opts.shard_optimizer = run.shard;
    opts.bucket_bytes = 200;
    opts.pin_threads = false;
    std::vector<Device> devices;
    for (int s = 0; s < run.K; ++s) devices.push_back(Device::cpu(s));
    Executor ex(*model, make_stages(run.balance, devices),
                make_schedule(ScheduleRequest{"gpipe", run.K, 1, 2, RecomputeMode::kExceptLast}), *pipes[d], opts);
    if (restore) restore(ex, k);
    ex.set_step(static_cast<uint64_t>(first_step));
    const int64_t rows = N / run.D;
    for (int t = first_step; t < first_step + steps; ++t) {
      const Batch b = batch(tokens, N, t);
      const StepResult r = ex.step(b.x.narrow_rows(d * rows, rows), b.y.narrow_rows(d * rows, rows));
      out.loss[rank].push_back(r.loss);
      out.norm[rank].push_back(r.grad_norm);
      out.traced_bytes[rank] = r.stages.at(k).optimizer_bytes;
      if (t + 1 - first_step == save_after) {
        StageState s = ex.save_state(k);  // every replica takes part when sharded
        if (d == 0) out.saved[k] = std::move(s);
      }
    }
    int first = 0;
    for (int s = 0; s < k; ++s) first += run.balance[s];
    for (int i = first; i < first + run.balance[k]; ++i) {
      for (auto* p : model->layer(i).parameters()) out.params[rank].push_back(to_doubles(p->value));
    }
    out.state_bytes[rank] = ex.optimizer_state_bytes(k);
  });
  return out;
}

void check_same(const Outcome& a, const Outcome& b, int K, int D) {
  for (int rank = 0; rank < K * D; ++rank) {
    CAPTURE(rank);
    REQUIRE(a.loss[rank].size() == b.loss[rank].size());
    for (size_t t = 0; t < a.loss[rank].size(); ++t) {
      CHECK(a.loss[rank][t] == doctest::Approx(b.loss[rank][t]).epsilon(1e-12));
      CHECK(a.norm[rank][t] == doctest::Approx(b.norm[rank][t]).epsilon(1e-12));
    }
    REQUIRE(a.params[rank].size() == b.params[rank].size());
    for (size_t i = 0; i < a.params[rank].size(); ++i) {
      INFO("parameter ", i);
      GPIPE_EXPECT_CLOSE(a.params[rank][i], b.params[rank][i], 1e-12, 1e-13);
    }
  }
}

layers::OptimizerConfig optimizer(const std::string& type) {
  layers::OptimizerConfig oc;
  oc.type = type;
  oc.lr = type == "sgd" ? 0.2 : 0.02;
  oc.momentum = 0.9;
  oc.weight_decay = 0.01;
  return oc;
}

}  // namespace

TEST_CASE("sharded optimizer state equals the unsharded run: K x D, Adam and SGD-momentum, clipping, a tied head") {
  struct Case {
    bool tied;
    Run run;
  };
  const std::vector<Case> cases = {
      {false, {2, 2, {3, 2}}}, {false, {1, 3, {5}}}, {true, {2, 2, {2, 2}}}, {true, {1, 3, {4}}}};
  for (const Case& c : cases) {
    for (const std::string type : {"adam", "sgd"}) {
      for (double clip : {0.0, 0.05}) {
        CAPTURE(c.tied);
        CAPTURE(c.run.K);
        CAPTURE(c.run.D);
        CAPTURE(type);
        CAPTURE(clip);
        const layers::ModelSpec spec = c.tied ? tied_spec() : mlp_spec();
        Run plain = c.run, sharded = c.run;
        sharded.shard = true;
        const Outcome want = train(spec, c.tied, plain, optimizer(type), clip, 0, 3);
        const Outcome got = train(spec, c.tied, sharded, optimizer(type), clip, 0, 3);
        check_same(got, want, c.run.K, c.run.D);
        // Clipping took effect: the norms are above the limit.
        if (clip > 0) CHECK(want.norm[0][0] > clip);
        // Each replica keeps its shard's state: 1/D of the stage's, give or take the
        // one element a balanced partition adds (slots x 8 bytes).
        const int slots = type == "adam" ? 2 : 1;
        for (int rank = 0; rank < c.run.K * c.run.D; ++rank) {
          CHECK(got.traced_bytes[rank] == got.state_bytes[rank]);  // the report's figure is the state held
          CHECK(want.traced_bytes[rank] == want.state_bytes[rank]);
          if (rank < c.run.K) {  // unsharded: every parameter's slots, float64
            int64_t elements = 0;
            for (const auto& p : want.params[rank]) elements += static_cast<int64_t>(p.size());
            CHECK(want.state_bytes[rank] == elements * slots * 8);
          }
        }
        for (int k = 0; k < c.run.K; ++k) {
          int64_t sum = 0;
          for (int d = 0; d < c.run.D; ++d) {
            const int64_t mine = got.state_bytes[d * c.run.K + k];
            CHECK(mine * c.run.D <= want.state_bytes[k] + c.run.D * slots * 8);
            sum += mine;
          }
          CHECK(sum == want.state_bytes[k]);  // every element's state, once
        }
      }
    }
  }
}

TEST_CASE("a bfloat16 model's sharded optimizer steps its float32 masters as the unsharded one does") {
  // Gradients, masters and state are float32: the shards, the reduce-scatter and the
  // all-gather move float32, and the working copies are refreshed after AG. Two
  // replicas sum two gradients in either order alike, so the runs agree to float32's
  // rounding of the updates.
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    const layers::ModelSpec spec = tied ? tied_spec(DType::kBF16) : mlp_spec(DType::kBF16);
    Run plain{2, 2, tied ? std::vector<int>{2, 2} : std::vector<int>{3, 2}}, sharded = plain;
    sharded.shard = true;
    const Outcome want = train(spec, tied, plain, optimizer("adam"), 0.0, 0, 3);
    const Outcome got = train(spec, tied, sharded, optimizer("adam"), 0.0, 0, 3);
    for (int rank = 0; rank < 4; ++rank) {
      CAPTURE(rank);
      for (size_t t = 0; t < want.loss[rank].size(); ++t) {
        CHECK(got.loss[rank][t] == doctest::Approx(want.loss[rank][t]).epsilon(1e-5));
      }
      REQUIRE(got.params[rank].size() == want.params[rank].size());
      int64_t elements = 0;
      for (size_t i = 0; i < want.params[rank].size(); ++i) {
        GPIPE_EXPECT_CLOSE(got.params[rank][i], want.params[rank][i], 1e-5, 1e-6);
        elements += static_cast<int64_t>(want.params[rank][i].size());
      }
      CHECK(want.state_bytes[rank] == elements * 2 * 4);  // Adam's two float32 slots
      CHECK(got.state_bytes[rank] < want.state_bytes[rank]);
    }
  }
}

TEST_CASE("a checkpoint saved sharded at D=2 resumes unsharded at D=1, sharded at D=3 and at K=2") {
  // Uninterrupted: K=1 x D=2 sharded, 4 steps, saving after step 2 (each replica gives
  // its shard of every slot; replica 0's save is whole). The others resume from that
  // save at step 2 and must give steps 3 and 4's losses.
  const layers::OptimizerConfig oc = optimizer("adam");
  const layers::ModelSpec spec = mlp_spec();
  const Outcome full = train(spec, false, {1, 2, {5}, true}, oc, 0.05, 0, 4, 2);
  const StageState saved = full.saved[0];
  REQUIRE(saved.optimizer.count("layers.0.weight.exp_avg") == 1);
  CHECK(saved.optimizer.at("layers.0.weight.exp_avg").shape() == Shape{8, 6});  // whole, not a shard
  const Restore restore = [&](Executor& ex, int k) {
    // A stage restores from the names it needs: one file's worth for any K.
    ex.restore_state(k, saved.model, saved.optimizer);
  };
  for (const Run& run : {Run{1, 1, {5}, false}, Run{1, 3, {5}, true}, Run{2, 2, {3, 2}, true}, Run{2, 2, {3, 2}, false}}) {
    CAPTURE(run.K);
    CAPTURE(run.D);
    CAPTURE(run.shard);
    const Outcome resumed = train(spec, false, run, oc, 0.05, 2, 2, -1, restore);
    for (int rank = 0; rank < run.K * run.D; ++rank) {
      CAPTURE(rank);
      REQUIRE(resumed.loss[rank].size() == 2);
      for (int t = 0; t < 2; ++t) CHECK(resumed.loss[rank][t] == doctest::Approx(full.loss[0][2 + t]).epsilon(1e-12));
    }
  }
}
