// Data parallelism in one process. The GradReducer's bucketing on its own (every
// gradient reduced exactly once, in buckets as the size asks, the same on every
// replica, summed), and the executor with replicas equal to the unpartitioned model.
// The collaborator is a real ReplicaGroup over threads (ThreadReplicaGroup below): D
// members, each in its own thread, whose i-th reductions are summed together once all
// D have started them, as MPI_Iallreduce would. It also keeps a log of every reduction
// and notices replicas that start different reductions in the same turn.
#include <doctest/doctest.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "layers/optimizer.h"
#include "layers/registry.h"
#include "pipeline/executor/executor.h"
#include "pipeline/executor/grad_reducer.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::to_doubles;

namespace {

// The state the D members of one group share.
class Hub {
 public:
  explicit Hub(int members) : members_(members), next_(members, 0) {}
  struct Round {
    std::vector<Tensor> parts;
    int arrived = 0;
    bool done = false;
    DType dtype = DType::kF64;
    int64_t numel = 0;
  };
  int members() const { return members_; }

  // Member `me`'s next reduction; the last member to arrive sums into every part.
  int contribute(int me, Tensor t) {
    std::lock_guard<std::mutex> lock(mu_);
    const int r = next_[me]++;
    if (static_cast<int>(rounds_.size()) <= r) rounds_.emplace_back();
    Round& round = rounds_[r];
    if (round.arrived == 0) {
      round.parts.resize(members_);
      round.dtype = t.dtype();
      round.numel = t.numel();
    } else if (round.dtype != t.dtype() || round.numel != t.numel()) {
      errors_.push_back("reduction " + std::to_string(r) + ": member " + std::to_string(me) + " gave " + t.str() +
                        ", another " + std::to_string(round.numel) + " elements of " + dtype_name(round.dtype));
    }
    round.parts[me] = t;
    if (++round.arrived == members_) {
      if (errors_.empty()) {
        std::vector<double> sum(round.numel, 0.0);
        for (const Tensor& p : round.parts) {
          const auto v = to_doubles(p);
          for (int64_t i = 0; i < round.numel; ++i) sum[i] += v[i];
        }
        for (Tensor& p : round.parts) {
          for (int64_t i = 0; i < round.numel; ++i) {
            if (p.dtype() == DType::kF64) {
              p.data<double>()[i] = sum[i];
            } else {
              p.data<float>()[i] = static_cast<float>(sum[i]);
            }
          }
        }
      }
      round.done = true;
      round.parts.clear();  // the members own their buffers again
      cv_.notify_all();
    }
    return r;
  }
  void wait(int r) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return rounds_[r].done; });
  }
  // The log: every reduction's element count and type, in order.
  std::vector<std::pair<int64_t, DType>> log() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<int64_t, DType>> out;
    for (const Round& r : rounds_) out.emplace_back(r.numel, r.dtype);
    return out;
  }
  std::vector<std::string> errors() const {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_;
  }

 private:
  const int members_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> next_;
  std::deque<Round> rounds_;
  std::vector<std::string> errors_;
};

class ThreadReplicaGroup : public ReplicaGroup {
 public:
  ThreadReplicaGroup(Hub& hub, int me) : hub_(hub), me_(me) {}
  int size() const override { return hub_.members(); }
  void all_reduce_sum(Tensor& t) override { hub_.wait(hub_.contribute(me_, t)); }
  double all_reduce_sum(double value) override {
    Tensor t = Tensor::from_vector<double>({value}, {1});
    all_reduce_sum(t);
    return t.data<double>()[0];
  }
  void start_all_reduce_sum(Tensor& t) override { pending_.push_back(hub_.contribute(me_, t)); }
  void wait_all() override {
    for (int r : pending_) hub_.wait(r);
    pending_.clear();
  }

 private:
  Hub& hub_;
  int me_;
  std::vector<int> pending_;
};

// Runs f(d) for every replica d in its own thread.
void on_replicas(int D, const std::function<void(int)>& f) {
  const std::vector<std::string> errors = gpipe::testing::on_threads(D, f);
  for (int d = 0; d < D; ++d) {
    INFO("replica ", d, ": ", errors[d]);
    CHECK(errors[d].empty());
  }
}

// One replica's stage: parameters of 6, 1, 20, 3 and 12 float64 elements (48, 8, 160,
// 24 and 96 bytes), gradients that differ per replica.
std::vector<layers::Parameter> stage_params(int replica, int step) {
  std::vector<layers::Parameter> out;
  int i = 0;
  for (int64_t n : {6, 1, 20, 3, 12}) {
    layers::Parameter p;
    p.name = std::to_string(i) + ".weight";
    p.value = Tensor::from_vector<double>(std::vector<double>(n, 0.0), {n});
    std::vector<double> g(n);
    for (int64_t j = 0; j < n; ++j) g[j] = 1000.0 * i + j + 0.25 * replica + 0.125 * (replica + 1) * step;
    p.grad = Tensor::from_vector<double>(g, {n});
    out.push_back(std::move(p));
    ++i;
  }
  return out;
}

}  // namespace

TEST_CASE("every gradient is summed over the replicas exactly once, in buckets of the size asked") {
  // Backward marks the parameters last to first: 96, 24, 160, 8, 48 bytes. A bucket
  // starts once it holds at least bucket_bytes; finish() starts the rest. So:
  struct Expect {
    int64_t bucket_bytes;
    std::vector<int64_t> numels;  // of the reductions, in order
    int full;                     // started before finish(): the buckets that filled
  };
  const std::vector<Expect> expects = {
      {0, {12, 3, 20, 1, 6}, 5},       // one reduction per parameter
      {48, {12, 3 + 20, 1 + 6}, 3},    // 96 >= 48; 24 + 160; 8 + 48
      {100, {12 + 3, 20, 1 + 6}, 2},   // 96 + 24 >= 100; 160; 8 + 48 (started by finish)
      {120, {12 + 3, 20, 1 + 6}, 2},   // 96 + 24 = 120 is full: "at least", not "more than"
      {160, {12 + 3 + 20, 1 + 6}, 1},  // 96 + 24 + 160; 8 + 48 (finish)
      {int64_t{1} << 30, {42}, 0},     // larger than the stage: one reduction, at finish
  };
  for (int D : {2, 3}) {
    for (const Expect& e : expects) {
      CAPTURE(D);
      CAPTURE(e.bucket_bytes);
      Hub hub(D);
      std::vector<std::vector<layers::Parameter>> params(D);
      std::vector<int> started(D, -1);
      on_replicas(D, [&](int d) {
        ThreadReplicaGroup group(hub, d);
        GradReducer reducer(group, backend_for(Device::cpu()), e.bucket_bytes);
        params[d] = stage_params(d, 0);
        std::vector<layers::Parameter*> all;
        for (auto& p : params[d]) all.push_back(&p);
        for (int i = 4; i >= 0; --i) {
          reducer.ready(all[i]);
          reducer.progress();
        }
        started[d] = reducer.buckets_started();
        reducer.finish(all);
      });
      CHECK(hub.errors().empty());
      std::vector<int64_t> numels;
      for (const auto& r : hub.log()) numels.push_back(r.first);
      CHECK(numels == e.numels);  // 42 elements in all: each gradient once
      // Before finish(), only the full buckets had started.
      for (int d = 0; d < D; ++d) CHECK(started[d] == e.full);
      // Every replica holds the sum of every replica's gradient.
      for (int i = 0; i < 5; ++i) {
        std::vector<double> want(params[0][i].grad.numel(), 0.0);
        for (int d = 0; d < D; ++d) {
          const auto mine = stage_params(d, 0)[i].grad;
          for (size_t j = 0; j < want.size(); ++j) want[j] += to_doubles(mine)[j];
        }
        for (int d = 0; d < D; ++d) {
          INFO("parameter ", i, " on replica ", d);
          CHECK(to_doubles(params[d][i].grad) == want);
        }
      }
    }
  }
}

TEST_CASE("parameters left unmarked are reduced by finish; the next step starts afresh") {
  const int D = 2;
  Hub hub(D);
  std::vector<std::vector<double>> after(D);
  on_replicas(D, [&](int d) {
    ThreadReplicaGroup group(hub, d);
    GradReducer reducer(group, backend_for(Device::cpu()), 100);
    for (int step = 0; step < 2; ++step) {
      auto params = stage_params(d, step);
      std::vector<layers::Parameter*> all;
      for (auto& p : params) all.push_back(&p);
      reducer.ready(all[4]);  // only the last layer's (96 B: not yet a full bucket)
      CHECK(reducer.buckets_started() == 0);
      reducer.finish(all);  // the others in `all` order: 0, 1, 2, 3
      CHECK(reducer.buckets_started() == 0);  // finish ends the step
      if (step == 1) {
        for (auto& p : params) {
          const auto v = to_doubles(p.grad);
          after[d].insert(after[d].end(), v.begin(), v.end());
        }
      }
    }
  });
  CHECK(hub.errors().empty());
  std::vector<int64_t> numels;
  for (const auto& r : hub.log()) numels.push_back(r.first);
  // Per step: 96 + 48 B (parameters 4, 0); 8 + 160 B (1, 2); 24 B (3), started by finish.
  CHECK(numels == std::vector<int64_t>{12 + 6, 1 + 20, 3, 12 + 6, 1 + 20, 3});
  CHECK(after[0] == after[1]);
  CHECK(after[0][0] == doctest::Approx(0 + 0.25 + 0.125 * 1 + 0.125 * 2));  // step 1, element 0 of parameter 0
}

TEST_CASE("a bucket holds one element type") {
  const int D = 2;
  Hub hub(D);
  on_replicas(D, [&](int d) {
    ThreadReplicaGroup group(hub, d);
    GradReducer reducer(group, backend_for(Device::cpu()), int64_t{1} << 30);
    std::vector<layers::Parameter> ps(4);
    const DType types[] = {DType::kF64, DType::kF32, DType::kF32, DType::kF64};
    const int64_t sizes[] = {6, 4, 4, 2};
    for (int i = 0; i < 4; ++i) {
      ps[i].name = std::to_string(i);
      ps[i].value = Tensor::empty({sizes[i]}, types[i], Device::cpu());
      ps[i].grad = Tensor::empty({sizes[i]}, types[i], Device::cpu());
      backend_for(Device::cpu()).fill(ps[i].grad, 1.0 + i + d);
    }
    for (int i = 3; i >= 0; --i) reducer.ready(&ps[i]);
    reducer.finish({&ps[0], &ps[1], &ps[2], &ps[3]});
    for (int i = 0; i < 4; ++i) {
      for (double g : to_doubles(ps[i].grad)) CHECK(g == (1.0 + i) * 2 + 1);
    }
  });
  CHECK(hub.errors().empty());
  const auto log = hub.log();
  REQUIRE(log.size() == 3);  // a change of type closes the open bucket
  CHECK(log[0] == std::make_pair(int64_t{2}, DType::kF64));
  CHECK(log[1] == std::make_pair(int64_t{8}, DType::kF32));
  CHECK(log[2] == std::make_pair(int64_t{6}, DType::kF64));
}

TEST_CASE("a gradient marked twice in one step is an internal error that names it") {
  Hub hub(1);
  ThreadReplicaGroup group(hub, 0);
  GradReducer reducer(group, backend_for(Device::cpu()), 1 << 20);
  auto params = stage_params(0, 0);
  reducer.ready(&params[2]);
  CHECK_THROWS_WITH_AS(reducer.ready(&params[2]), doctest::Contains("gradient of 2.weight marked ready twice"), Error);
}

namespace {

layers::ModelSpec mlp_spec() {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.dtype = DType::kF64;
  spec.seed = 31;
  spec.layers = {{"linear", {{"out", "8"}}, {}, ""}, {"relu", {}, {}, ""},  {"linear", {{"out", "8"}}, {}, ""},
                 {"gelu", {}, {}, ""},              {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

}  // namespace

TEST_CASE("K stages x D replicas in one process equal the unpartitioned model") {
  // The multi-process layout with threads: one executor per (stage, replica), each
  // running only its stage (local_stage), the K stages of a replica joined by an
  // in-process transport, the D replicas of a stage by a ThreadReplicaGroup. Replica d
  // trains on rows [d N/D, (d+1) N/D) of every batch. GPipe, and zero bubble, whose
  // deferred weight gradients (W) come after the stage's last backward: a linear
  // layer's gradients may join a bucket only after its last W.
  const int64_t N = 12;
  const int steps = 3;
  layers::OptimizerConfig oc;
  oc.type = "sgd";
  oc.lr = 0.2;
  oc.momentum = 0.9;
  oc.weight_decay = 0.01;
  auto batch = [&](int t) {
    return std::make_pair(gpipe::testing::random_tensor({N, 6}, DType::kF64, 300 + t, -2, 2),
                          gpipe::testing::random_labels(N, 4, 400 + t));
  };
  auto reference = layers::build_model(mlp_spec());
  std::vector<layers::Parameter*> ref_all;
  for (auto& np : reference->named_parameters()) ref_all.push_back(np.second);
  auto ref_opt = layers::make_optimizer(ref_all, oc);
  std::vector<double> ref_loss;
  for (int t = 0; t < steps; ++t) {
    reference->zero_grad();
    auto [x, y] = batch(t);
    ref_loss.push_back(reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N));
    ref_opt->step();
  }

  struct Layout {
    int K, D;
    std::vector<int> balance;
  };
  for (const Layout& l : {Layout{1, 2, {5}}, Layout{1, 3, {5}}, Layout{2, 2, {3, 2}}, Layout{3, 2, {2, 2, 1}}}) {
    for (const std::string schedule : {"gpipe", "zero_bubble"}) {
      for (int64_t bucket : {int64_t{0}, int64_t{200}, int64_t{1} << 30}) {
        CAPTURE(schedule);
        CAPTURE(l.K);
        CAPTURE(l.D);
        CAPTURE(bucket);
        std::vector<std::unique_ptr<Hub>> hubs;  // one group per stage
        for (int k = 0; k < l.K; ++k) hubs.push_back(std::make_unique<Hub>(l.D));
        std::vector<std::unique_ptr<InProcessTransport>> pipes;  // one transport per replica
        for (int d = 0; d < l.D; ++d) pipes.push_back(std::make_unique<InProcessTransport>(l.K));
        std::vector<std::unique_ptr<layers::Sequential>> models(l.K * l.D);
        std::vector<std::vector<double>> losses(l.K * l.D);
        on_replicas(l.K * l.D, [&](int rank) {
          const int k = rank % l.K, d = rank / l.K;
          models[rank] = layers::build_model(mlp_spec());
          ThreadReplicaGroup group(*hubs[k], d);
          ExecutorOptions opts;
          opts.optimizer = oc;
          opts.local_stage = k;
          opts.rank = rank;
          opts.replicas = &group;
          opts.bucket_bytes = bucket;
          std::vector<Device> devices;
          for (int s = 0; s < l.K; ++s) devices.push_back(Device::cpu(s));
          Executor ex(*models[rank], make_stages(l.balance, devices),
                      make_schedule(ScheduleRequest{schedule, l.K, 1, 2, RecomputeMode::kExceptLast}), *pipes[d], opts);
          const int64_t rows = N / l.D;
          for (int t = 0; t < steps; ++t) {
            auto [x, y] = batch(t);
            losses[rank].push_back(ex.step(x.narrow_rows(d * rows, rows), y.narrow_rows(d * rows, rows)).loss);
          }
        });
        for (int k = 0; k < l.K; ++k) CHECK(hubs[k]->errors().empty());
        for (int rank = 0; rank < l.K * l.D; ++rank) {
          CAPTURE(rank);
          REQUIRE(losses[rank].size() == static_cast<size_t>(steps));
          for (int t = 0; t < steps; ++t) CHECK(losses[rank][t] == doctest::Approx(ref_loss[t]).epsilon(1e-12));
          // This rank's stage's layers, against the reference's.
          const int k = rank % l.K;
          int first = 0;
          for (int s = 0; s < k; ++s) first += l.balance[s];
          for (int i = first; i < first + l.balance[k]; ++i) {
            auto mine = models[rank]->layer(i).parameters();
            auto want = reference->layer(i).parameters();
            for (size_t j = 0; j < mine.size(); ++j) {
              INFO("layer ", i, " parameter ", j);
              GPIPE_EXPECT_CLOSE(mine[j]->value, want[j]->value, 1e-10, 1e-12);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("replicas need each stage on its own device") {
  // Stages sharing a device take turns on it, and a replica's blocking reduction must
  // never hold the turn: refused before anything runs, naming the key to change.
  Hub hub(2);
  ThreadReplicaGroup group(hub, 0);
  auto model = layers::build_model(mlp_spec());
  InProcessTransport transport(2);
  ExecutorOptions opts;
  opts.replicas = &group;
  CHECK_THROWS_WITH_AS(Executor(*model, make_stages({3, 2}, {Device::cpu(0), Device::cpu(0)}),
                                gpipe_schedule(2, 2, RecomputeMode::kNever), transport, opts),
                       doctest::Contains("data-parallel replicas need each stage on its own device; pipeline.devices "
                                         "gives stage 0's device to another stage too"),
                       UserError);
}
