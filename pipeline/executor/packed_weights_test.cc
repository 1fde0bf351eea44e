// The executor's FrozenWeights window (kernels/backend.h) never lets a stage compute
// with a packed copy of a weight older than the weight: a float32 MLP trained through
// the pipeline with oneDNN packing every weight equals the same training on OpenBLAS,
// step after step (the optimizer step writes the weights between steps), and after the
// parameters are overwritten between steps (as a checkpoint load does).
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu_gemm.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "pipeline/executor/executor.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

layers::ModelSpec mlp_spec() {
  layers::ModelSpec spec;
  spec.input = {16};
  spec.dtype = DType::kF32;
  spec.seed = 5;
  spec.layers = {{"linear", {{"out", "32"}}, {}, ""}, {"relu", {}, {}, ""}, {"linear", {{"out", "32"}}, {}, ""},
                 {"relu", {}, {}, ""},              {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

constexpr int kSteps = 5;
constexpr int64_t kBatch = 24;

Tensor inputs(int step) { return gpipe::testing::random_tensor({kBatch, 16}, DType::kF32, 300 + step, -2, 2); }
Tensor labels(int step) { return gpipe::testing::random_labels(kBatch, 4, 400 + step); }

// Per-step losses of K = 2, M = 4 training; after step 2 every parameter is overwritten
// with fixed values, as a checkpoint load would.
std::vector<double> train(cpu_blas::Library lib, bool always_pack) {
  cpu_blas::set_library(lib);
  cpu_blas::set_always_pack(always_pack);
  auto model = layers::build_model(mlp_spec());
  InProcessTransport transport(2);
  ExecutorOptions opts;
  opts.optimizer.type = "sgd";
  opts.optimizer.lr = 0.5;
  Executor ex(*model, make_stages({2, 3}, gpipe::testing::cpu_devices(2)),
              gpipe_schedule(2, 4, RecomputeMode::kNever), transport, opts);
  std::vector<double> losses;
  for (int t = 0; t < kSteps; ++t) {
    if (t == 2) {
      uint64_t seed = 900;
      for (auto& np : model->named_parameters()) {
        Tensor v = gpipe::testing::random_tensor(np.second->value.shape(), DType::kF32, seed++, -0.5, 0.5);
        backend_for(Device::cpu()).copy(v, np.second->value);
      }
    }
    losses.push_back(ex.step(inputs(t), labels(t)).loss);
  }
  cpu_blas::set_always_pack(false);
  cpu_blas::set_library(cpu_blas::Library::kAuto);
  return losses;
}

}  // namespace

TEST_CASE("packed weights through the pipeline equal OpenBLAS, across optimizer steps and a parameter load") {
  const std::vector<double> want = train(cpu_blas::Library::kOpenblas, false);
  for (bool always_pack : {false, true}) {
    CAPTURE(always_pack);
    const std::vector<double> got = train(cpu_blas::Library::kOnednn, always_pack);
    for (int t = 0; t < kSteps; ++t) {
      CAPTURE(t);
      // float32 rounding differences only: a stale weight moves the loss by 1e-2 or more.
      CHECK(got[t] == doctest::Approx(want[t]).epsilon(1e-5));
    }
  }
  // The steps did change the loss (so a stale copy would show).
  CHECK(std::fabs(want[1] - want[0]) > 1e-2);
  CHECK(std::fabs(want[3] - want[2]) > 1e-2);
}
