// Pipelining changes nothing but speed, for every optimizer: Adam, AdamW, SGD with
// Nesterov momentum, and a cosine schedule with warm-up and clipping by the global
// norm, each trained for several steps through the pipeline (K = 1, 2, 3; M = 2, 5 on a
// batch of 13, so micro-batches are uneven) equals the unpartitioned model trained by
// the same optimizer on the whole batch, in float64: per-step loss, gradient norm, and
// every parameter after the last step.
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

layers::ModelSpec mlp_spec() {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.dtype = DType::kF64;
  spec.seed = 17;
  spec.layers = {{"linear", {{"out", "8"}}, {}, ""}, {"relu", {}, {}, ""},  {"linear", {{"out", "8"}}, {}, ""},
                 {"gelu", {}, {}, ""},              {"linear", {{"out", "7"}}, {}, ""}, {"relu", {}, {}, ""},
                 {"linear", {{"out", "4"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

struct Case {
  std::string name;
  layers::OptimizerConfig opt;
  layers::LrSchedule lr;  // base_lr is opt.lr
  double clip = 0.0;      // max global norm; 0 = off
};

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](const std::string& name, const std::string& type, double lr, double wd) {
    Case c;
    c.name = name;
    c.opt.type = type;
    c.opt.lr = lr;
    c.opt.weight_decay = wd;
    c.lr.base_lr = lr;
    out.push_back(c);
    return &out.back();
  };
  add("adam", "adam", 0.01, 0.01);
  add("adamw", "adamw", 0.01, 0.1);
  Case* n = add("sgd nesterov", "sgd", 0.2, 0.01);
  n->opt.momentum = 0.9;
  n->opt.nesterov = true;
  // As configs/gpt.yaml: AdamW, linear warm-up, cosine decay, clipping (small enough to
  // clip at every step, so a wrong global norm changes every step).
  Case* g = add("adamw cosine warm-up clip", "adamw", 0.02, 0.01);
  g->opt.beta2 = 0.95;
  g->lr.kind = "cosine";
  g->lr.warmup_steps = 2;
  g->lr.min_lr = 0.002;
  g->clip = 0.05;
  Case* s = add("sgd momentum cosine clip", "sgd", 0.3, 0.001);
  s->opt.momentum = 0.8;
  s->lr.kind = "cosine";
  s->lr.warmup_steps = 1;
  s->clip = 0.05;
  return out;
}

std::vector<layers::Parameter*> all_params(layers::Sequential& m) {
  std::vector<layers::Parameter*> out;
  for (auto& np : m.named_parameters()) out.push_back(np.second);
  return out;
}

constexpr int kSteps = 6;
constexpr int64_t kBatch = 13;

Tensor inputs(int step) { return gpipe::testing::random_tensor({kBatch, 6}, DType::kF64, 100 + step, -2, 2); }
Tensor labels(int step) { return gpipe::testing::random_labels(kBatch, 4, 200 + step); }

}  // namespace

TEST_CASE("every optimizer through the pipeline equals the unpartitioned model, step after step") {
  for (const Case& c : cases()) {
    layers::LrSchedule lr = c.lr;
    lr.total_steps = kSteps;

    // The reference: the whole batch on one model, then the textbook clip
    // (torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6) when that is below 1).
    auto reference = layers::build_model(mlp_spec());
    auto ref_opt = layers::make_optimizer(all_params(*reference), c.opt);
    std::vector<double> ref_loss, ref_norm;
    for (int t = 0; t < kSteps; ++t) {
      reference->zero_grad();
      ref_loss.push_back(reference->forward_backward(backend_for(Device::cpu()), inputs(t), labels(t), 1.0 / kBatch));
      double sq = 0;
      for (auto* p : all_params(*reference)) {
        for (double g : to_doubles(p->grad)) sq += g * g;
      }
      ref_norm.push_back(std::sqrt(sq));
      if (c.clip > 0) {
        const double coef = c.clip / (ref_norm.back() + 1e-6);
        if (coef < 1) {
          for (auto* p : all_params(*reference)) backend_for(Device::cpu()).scale(p->grad, coef);
        }
      }
      ref_opt->set_lr(lr.at(t));
      ref_opt->step();
    }
    if (c.clip > 0) CHECK(ref_norm.front() > c.clip);  // it does clip
    auto ref_params = reference->named_parameters();

    // K = 1 keeps the norm and the clip on its device (kernels/step_scalars.h); K > 1
    // sums the stages' norms on the host.
    for (int K : {1, 2, 3}) {
      for (int M : {2, 5}) {
        CAPTURE(c.name);
        CAPTURE(K);
        CAPTURE(M);
        auto model = layers::build_model(mlp_spec());
        InProcessTransport transport(K);
        ExecutorOptions opts;
        opts.optimizer = c.opt;
        opts.clip_grad_norm = c.clip;
        Executor ex(*model,
                    make_stages(partition::balance_by_cost(std::vector<double>(model->size(), 1.0), K), cpu_devices(K)),
                    gpipe_schedule(K, M, RecomputeMode::kExceptLast), transport, opts);
        for (int t = 0; t < kSteps; ++t) {
          CAPTURE(t);
          ex.set_lr(lr.at(t));
          const StepResult r = ex.step(inputs(t), labels(t));
          CHECK(r.loss == doctest::Approx(ref_loss[t]).epsilon(1e-12));
          if (c.clip > 0) CHECK(r.grad_norm == doctest::Approx(ref_norm[t]).epsilon(1e-10));
        }
        auto params = model->named_parameters();
        REQUIRE(params.size() == ref_params.size());
        for (size_t i = 0; i < params.size(); ++i) {
          INFO("parameter ", params[i].first);
          GPIPE_EXPECT_CLOSE(params[i].second->value, ref_params[i].second->value, 1e-10, 1e-12);
        }
      }
    }
  }
}

TEST_CASE("the reference comparison notices a different optimizer") {
  // The equality above is not vacuous: the same run with plain momentum instead of
  // Nesterov ends elsewhere.
  Case c = cases()[2];
  REQUIRE(c.opt.nesterov);
  auto run = [&](bool nesterov) {
    layers::OptimizerConfig o = c.opt;
    o.nesterov = nesterov;
    auto model = layers::build_model(mlp_spec());
    InProcessTransport transport(2);
    ExecutorOptions opts;
    opts.optimizer = o;
    Executor ex(*model, make_stages({4, 3}, cpu_devices(2)), gpipe_schedule(2, 2, RecomputeMode::kAlways), transport,
                opts);
    for (int t = 0; t < 3; ++t) ex.step(inputs(t), labels(t));
    return to_doubles(model->named_parameters()[0].second->value);
  };
  const auto a = run(true), b = run(false);
  const auto rep = gpipe::testing::compare(a, b, 1e-10, 1e-12);
  CHECK(!rep.ok);
}
