// The defining equality in the corners the older tests left out: float32 models, and a
// language model whose head is tied to its embedding, each in every recompute mode
// (always, except_last, never) at several K and M, over a few training steps.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "layers/optimizer.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::to_doubles;

namespace {

using gpipe::testing::cpu_devices;

constexpr RecomputeMode kModes[] = {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever};

std::vector<int> even_balance(int layers, int k) {
  return partition::balance_by_cost(std::vector<double>(layers, 1.0), k);
}

std::vector<layers::Parameter*> all_params(layers::Sequential& m) {
  std::vector<layers::Parameter*> out;
  for (auto& np : m.named_parameters()) out.push_back(np.second);
  return out;
}

layers::ModelSpec mlp_spec() {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.dtype = DType::kF32;
  spec.seed = 23;
  spec.layers = {{"linear", {{"out", "16"}}, {}, ""}, {"gelu", {}, {}, ""},  {"linear", {{"out", "16"}}, {}, ""},
                 {"relu", {}, {}, ""},               {"linear", {{"out", "8"}}, {}, ""}, {"gelu", {}, {}, ""},
                 {"linear", {{"out", "5"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// A byte-level language model in miniature: embedding, two blocks with dropout (so
// recomputation must reproduce the masks), the head tied to the embedding's table.
layers::ModelSpec tied_lm_spec(DType dtype) {
  layers::ModelSpec spec;
  spec.input = {5};
  spec.input_dtype = DType::kI32;
  spec.dtype = dtype;
  spec.seed = 29;
  spec.layers = {{"embedding", {{"vocab", "12"}, {"dim", "8"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}, {"dropout", "0.1"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}, {"dropout", "0.1"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", "12"}, {"bias", "false"}, {"tied", "true"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// The unpartitioned reference trained as the pipeline promises: whole-batch gradients,
// the tied pair given the sum of both, the global norm counting the shared weight
// once, clipping as torch.nn.utils.clip_grad_norm_, one optimizer step.
struct Reference {
  std::unique_ptr<layers::Sequential> model;
  std::unique_ptr<layers::Optimizer> opt;
  double clip = 0;
  double step(const Tensor& x, const Tensor& y, int64_t count, double* norm) {
    Backend& be = backend_for(Device::cpu());
    model->zero_grad();
    const double loss = model->forward_backward(be, x, y, 1.0 / count);
    model->sum_tied_gradients(be);
    double sq = 0;
    for (auto* p : all_params(*model)) {
      if (!model->is_tied_copy(p)) {
        for (double g : to_doubles(p->grad)) sq += g * g;
      }
    }
    *norm = std::sqrt(sq);
    const double coef = clip / (*norm + 1e-6);
    if (clip > 0 && coef < 1) {
      for (auto* p : all_params(*model)) be.scale(p->grad, coef);
    }
    opt->step();
    return loss;
  }
};

}  // namespace

TEST_CASE("float32: every recompute mode, K = 2 and 3, M = 2 and 4, equals the reference") {
  const int64_t N = 11;
  const Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF32, 51, -2, 2);
  const Tensor y = gpipe::testing::random_labels(N, 5, 52);
  auto reference = layers::build_model(mlp_spec());
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / N);
  auto ref_params = reference->named_parameters();
  for (int K : {2, 3}) {
    for (int M : {2, 4}) {
      for (RecomputeMode mode : kModes) {
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        auto model = layers::build_model(mlp_spec());
        InProcessTransport transport(K);
        Executor ex(*model, make_stages(even_balance(model->size(), K), cpu_devices(K)), gpipe_schedule(K, M, mode),
                    transport, {});
        const StepResult r = ex.step(x, y, /*apply_optimizer=*/false);
        CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-5));
        auto params = model->named_parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          INFO("gradient of ", params[i].first);
          CHECK(params[i].second->grad.dtype() == DType::kF32);
          GPIPE_EXPECT_CLOSE(params[i].second->grad, ref_params[i].second->grad, 1e-4, 1e-6);
        }
      }
    }
  }
}

TEST_CASE("float32 training steps stay with the reference in every recompute mode") {
  const int64_t N = 12;
  layers::OptimizerConfig oc;
  oc.type = "sgd";
  oc.lr = 0.1;
  oc.momentum = 0.9;
  for (RecomputeMode mode : kModes) {
    for (int K : {2, 3}) {
      const int M = K == 2 ? 3 : 4;
      CAPTURE(recompute_mode_name(mode));
      CAPTURE(K);
      Reference ref{layers::build_model(mlp_spec()), nullptr};
      ref.opt = layers::make_optimizer(all_params(*ref.model), oc);
      auto model = layers::build_model(mlp_spec());
      InProcessTransport transport(K);
      ExecutorOptions opts;
      opts.optimizer = oc;
      Executor ex(*model, make_stages(even_balance(model->size(), K), cpu_devices(K)), gpipe_schedule(K, M, mode),
                  transport, opts);
      for (int t = 0; t < 4; ++t) {
        CAPTURE(t);
        const Tensor x = gpipe::testing::random_tensor({N, 6}, DType::kF32, 60 + t, -2, 2);
        const Tensor y = gpipe::testing::random_labels(N, 5, 70 + t);
        double norm = 0;
        const double want = ref.step(x, y, N, &norm);
        CHECK(ex.step(x, y).loss == doctest::Approx(want).epsilon(1e-5));
      }
      auto a = model->named_parameters(), b = ref.model->named_parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        INFO("parameter ", a[i].first);
        GPIPE_EXPECT_CLOSE(a[i].second->value, b[i].second->value, 1e-4, 1e-6);
      }
    }
  }
}

TEST_CASE("a tied head in every recompute mode, K = 2 and 3, M = 2 and 3, over training steps") {
  // float64, AdamW with clipping that bites: each step the tied pair must get the
  // summed gradient (or the two copies drift apart and the loss leaves the
  // reference's), the norm must count it once (or every clip is off), and a recompute
  // must see the same dropout masks.
  const int64_t N = 7;
  layers::OptimizerConfig oc;
  oc.type = "adamw";
  oc.lr = 0.01;
  oc.weight_decay = 0.01;
  const double clip = 0.5;
  for (int K : {2, 3}) {
    for (int M : {2, 3}) {
      for (RecomputeMode mode : kModes) {
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(recompute_mode_name(mode));
        Reference ref{layers::build_model(tied_lm_spec(DType::kF64)), nullptr, clip};
        REQUIRE(ref.model->ties().size() == 1);
        ref.opt = layers::make_optimizer(all_params(*ref.model), oc);
        auto model = layers::build_model(tied_lm_spec(DType::kF64));
        InProcessTransport transport(K);
        ExecutorOptions opts;
        opts.optimizer = oc;
        opts.clip_grad_norm = clip;
        const auto balance = even_balance(model->size(), K);
        Executor ex(*model, make_stages(balance, cpu_devices(K)), gpipe_schedule(K, M, mode), transport, opts);
        // With K >= 2 the embedding (layer 0, first stage) and the head (layer 4, last
        // stage) are on different stages: the tied exchange crosses the transport.
        bool clipped = false;
        for (int t = 0; t < 3; ++t) {
          CAPTURE(t);
          const Tensor x = gpipe::testing::random_labels(N * 5, 12, 80 + t).reshape({N, 5});
          const Tensor y = gpipe::testing::random_labels(N * 5, 12, 90 + t).reshape({N, 5});
          // Dropout masks are keyed by the step: the reference's forward gets the same one.
          double norm = 0;
          ref.model->zero_grad();
          layers::ForwardArgs args;
          args.step = static_cast<uint64_t>(t);
          Backend& be = backend_for(Device::cpu());
          const double want = ref.model->forward_backward(be, x, y, 1.0 / (N * 5), args);
          ref.model->sum_tied_gradients(be);
          double sq = 0;
          for (auto* p : all_params(*ref.model)) {
            if (!ref.model->is_tied_copy(p)) {
              for (double g : to_doubles(p->grad)) sq += g * g;
            }
          }
          norm = std::sqrt(sq);
          const double coef = clip / (norm + 1e-6);
          if (coef < 1) {
            clipped = true;
            for (auto* p : all_params(*ref.model)) be.scale(p->grad, coef);
          }
          ref.opt->step();
          const StepResult r = ex.step(x, y);
          CHECK(r.loss == doctest::Approx(want).epsilon(1e-12));
          CHECK(r.grad_norm == doctest::Approx(norm).epsilon(1e-10));
        }
        CHECK(clipped);
        const auto& tie = model->ties().at(0);
        CHECK(to_doubles(tie.copy->value) == to_doubles(tie.owner->value));
        auto a = model->named_parameters(), b = ref.model->named_parameters();
        for (size_t i = 0; i < a.size(); ++i) {
          INFO("parameter ", a[i].first);
          GPIPE_EXPECT_CLOSE(a[i].second->value, b[i].second->value, 1e-10, 1e-12);
        }
      }
    }
  }
}

TEST_CASE("a float32 tied head in every recompute mode") {
  const int64_t N = 6;
  const Tensor x = gpipe::testing::random_labels(N * 5, 12, 101).reshape({N, 5});
  const Tensor y = gpipe::testing::random_labels(N * 5, 12, 102).reshape({N, 5});
  auto reference = layers::build_model(tied_lm_spec(DType::kF32));
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 5));
  reference->sum_tied_gradients(backend_for(Device::cpu()));
  auto ref_params = reference->named_parameters();
  for (RecomputeMode mode : kModes) {
    for (int K : {2, 3}) {
      CAPTURE(recompute_mode_name(mode));
      CAPTURE(K);
      auto model = layers::build_model(tied_lm_spec(DType::kF32));
      InProcessTransport transport(K);
      Executor ex(*model, make_stages(even_balance(model->size(), K), cpu_devices(K)), gpipe_schedule(K, 3, mode),
                  transport, {});
      const StepResult r = ex.step(x, y, false);
      CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-5));
      auto params = model->named_parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        INFO("gradient of ", params[i].first);
        GPIPE_EXPECT_CLOSE(params[i].second->grad, ref_params[i].second->grad, 1e-3, 1e-5);
      }
      const auto& tie = model->ties().at(0);
      CHECK(to_doubles(tie.copy->grad) == to_doubles(tie.owner->grad));
    }
  }
}
