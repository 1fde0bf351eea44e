// The defining test for convolutional models: a small ResNet run through the
// executor, for K = 1..3, M in {1, 2, 4} and every recompute mode.
//
// Batch norm normalises each micro-batch with its own statistics, so with BN the
// pipelined outputs depend on the split by design. Hence:
//  (a) without batch norm, the loss and every gradient equal the unpartitioned model's
//      on the whole mini-batch;
//  (b) with batch norm, they equal the unpartitioned model run micro-batch by
//      micro-batch, and after one step every running statistic equals that model's
//      (after its end_step). The first batch norm sees the same inputs however the
//      batch is split, so its running statistics also equal those of the whole batch
//      at once (and with M = 1, everything does).
#include <doctest/doctest.h>

#include "layers/basic_block.h"
#include "layers/batchnorm2d.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

using gpipe::testing::cpu_devices;

Backend& host() { return backend_for(Device::cpu()); }

// conv -> [BN] -> relu -> basic_block -> basic_block(stride 2) -> global average
// pool -> flatten -> linear, on (3, 8, 8) images; float64.
layers::ModelSpec resnet_spec(bool batchnorm) {
  const std::string bn = batchnorm ? "true" : "false";
  layers::ModelSpec spec;
  spec.input = {3, 8, 8};
  spec.dtype = DType::kF64;
  spec.seed = 17;
  spec.layers.push_back({"conv2d", {{"out", "4"}, {"kernel", "3"}, {"bias", batchnorm ? "false" : "true"}}, {}, ""});
  if (batchnorm) spec.layers.push_back({"batchnorm2d", {}, {}, ""});
  spec.layers.push_back({"relu", {}, {}, ""});
  spec.layers.push_back({"basic_block", {{"out", "4"}, {"batchnorm", bn}}, {}, ""});
  spec.layers.push_back({"basic_block", {{"out", "6"}, {"stride", "2"}, {"batchnorm", bn}}, {}, ""});
  spec.layers.push_back({"global_avgpool", {}, {}, ""});
  spec.layers.push_back({"flatten", {}, {}, ""});
  spec.layers.push_back({"linear", {{"out", "5"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// The balancer's split from the layers' own costs, as the trainer would choose it.
std::vector<int> balance_for(const layers::Sequential& model, int64_t n, int k, int m, RecomputeMode mode) {
  return partition::balance_by_cost(partition::layer_costs(model, n / m, recomputes(mode)), k);
}

// Every batch norm's running mean and variance, in layer order.
std::vector<std::vector<double>> running_stats(layers::Sequential& model) {
  std::vector<std::vector<double>> out;
  auto add = [&](layers::BatchNorm2d* bn) {
    out.push_back(gpipe::testing::to_doubles(bn->running_mean()));
    out.push_back(gpipe::testing::to_doubles(bn->running_var()));
  };
  for (int i = 0; i < model.size(); ++i) {
    if (auto* bn = dynamic_cast<layers::BatchNorm2d*>(&model.layer(i))) add(bn);
    if (auto* block = dynamic_cast<layers::BasicBlock*>(&model.layer(i))) {
      for (layers::BatchNorm2d* b : block->batchnorms()) add(b);
    }
  }
  return out;
}

void expect_same_gradients(layers::Sequential& a, layers::Sequential& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO("gradient of ", pa[i].first);
    GPIPE_EXPECT_CLOSE(pa[i].second->grad, pb[i].second->grad, 1e-10, 1e-12);
  }
}

const RecomputeMode kModes[] = {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever};

}  // namespace

TEST_CASE("without batch norm, the pipelined ResNet's loss and gradients equal the whole-batch model's") {
  const int64_t N = 10;  // uneven micro-batches for M = 4
  Tensor x = gpipe::testing::random_tensor({N, 3, 8, 8}, DType::kF64, 31);
  Tensor y = gpipe::testing::random_labels(N, 5, 32);
  auto reference = layers::build_model(resnet_spec(false));
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(host(), x, y, 1.0 / N);

  for (int K = 1; K <= 3; ++K) {
    for (int M : {1, 2, 4}) {
      for (RecomputeMode mode : kModes) {
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        auto model = layers::build_model(resnet_spec(false));
        InProcessTransport transport(K);
        Executor ex(*model, make_stages(balance_for(*model, N, K, M, mode), cpu_devices(K)), gpipe_schedule(K, M, mode),
                    transport, {});
        const StepResult r = ex.step(x, y, /*apply_optimizer=*/false);
        CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
        expect_same_gradients(*model, *reference);
        CHECK(transport.pending() == 0);
      }
    }
  }
}

TEST_CASE("with batch norm, the pipelined ResNet equals the model run micro-batch by micro-batch") {
  const int64_t N = 10;
  Tensor x = gpipe::testing::random_tensor({N, 3, 8, 8}, DType::kF64, 41, -1.0, 2.0);
  Tensor y = gpipe::testing::random_labels(N, 5, 42);

  // The running statistics of one step on the whole batch at once.
  auto whole = layers::build_model(resnet_spec(true));
  whole->zero_grad();
  const double whole_loss = whole->forward_backward(host(), x, y, 1.0 / N);
  whole->end_step(host());
  const auto whole_stats = running_stats(*whole);
  REQUIRE(whole_stats.size() == 2 * (1 + 2 + 3));  // the first BN, then 2 and 3 in the blocks

  for (int M : {1, 2, 4}) {
    // The unpartitioned model, fed the same micro-batches one after another.
    auto reference = layers::build_model(resnet_spec(true));
    reference->zero_grad();
    const std::vector<int64_t> sizes = split_sizes(N, M);
    double ref_loss = 0;
    int64_t offset = 0;
    for (int64_t size : sizes) {
      layers::ForwardArgs args;
      args.sample_offset = offset;
      ref_loss +=
          reference->forward_backward(host(), x.narrow_rows(offset, size), y.narrow_rows(offset, size), 1.0 / N, args);
      offset += size;
    }
    reference->end_step(host());
    const auto ref_stats = running_stats(*reference);

    for (int K = 1; K <= 3; ++K) {
      for (RecomputeMode mode : kModes) {
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        auto model = layers::build_model(resnet_spec(true));
        InProcessTransport transport(K);
        Executor ex(*model, make_stages(balance_for(*model, N, K, M, mode), cpu_devices(K)), gpipe_schedule(K, M, mode),
                    transport, {});
        // A step without the optimizer leaves the gradients to compare (and no
        // end_step: its kept statistics are dropped by the next step).
        const StepResult r = ex.step(x, y, /*apply_optimizer=*/false);
        CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
        expect_same_gradients(*model, *reference);
        if (M == 1) CHECK(r.loss == doctest::Approx(whole_loss).epsilon(1e-12));

        // A full step on the same weights: each stage's end_step folds its batch
        // norms' micro-batch statistics into the running ones.
        ex.step(x, y);
        const auto stats = running_stats(*model);
        REQUIRE(stats.size() == ref_stats.size());
        for (size_t i = 0; i < stats.size(); ++i) {
          INFO("running ", i % 2 ? "var" : "mean", " of batch norm ", i / 2);
          GPIPE_EXPECT_CLOSE(stats[i], ref_stats[i], 1e-12, 1e-14);
          if (i < 2 || M == 1) GPIPE_EXPECT_CLOSE(stats[i], whole_stats[i], 1e-12, 1e-14);
        }
      }
    }
  }
}
