// Layers written as forward only (layers/derived.h) inside a pipeline: a GPT whose
// feed-forward blocks are a derived layer registered as a type of one's own (an RMSNorm,
// a SwiGLU with dropout, the residual), under every schedule, K, M and recompute mode:
// loss and every parameter gradient equal the unpartitioned model's (float64), with the
// weight gradients batched too. The derived backward, its B/W split, its dropout keys
// under recompute and its cost (the balancer's input) all take part.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "layers/derived.h"
#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "runtime/random.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::layers::DerivedLayer;

namespace {

using gpipe::testing::cpu_devices;

// x + dropout(down(silu(gate(n)) * up(n))), n = rmsnorm(x): LLaMA's feed-forward half.
class FeedForward : public DerivedLayer {
 public:
  FeedForward(const Shape& shape, int64_t hidden, double p, DType dtype, uint64_t seed)
      : DerivedLayer("test_feed_forward", shape, shape, dtype, seed),
        norm_(add_constant_parameter("norm.weight", {shape.back()}, 1.0)),
        gate_(add_parameter("gate.weight", {hidden, shape.back()}, 0.5, mix_seed(seed, 1))),
        up_(add_parameter("up.weight", {hidden, shape.back()}, 0.5, mix_seed(seed, 2))),
        down_(add_parameter("down.weight", {shape.back(), hidden}, 0.5, mix_seed(seed, 3))),
        p_(p) {}
  Var define(Graph& g, Var x) const override {
    Var n = g.mul(g.mul(x, g.rsqrt(g.add(g.mean(g.square(x)), 1e-6))), g.param(norm_));
    Var h = g.linear(g.mul(g.silu(g.linear(n, gate_)), g.linear(n, up_)), down_);
    return g.add(x, g.dropout(h, p_));
  }

 private:
  Parameter &norm_, &gate_, &up_, &down_;
  double p_;
};

void register_once() {
  static const bool done = [] {
    layers::register_layer("test_feed_forward", [](layers::LayerArgs& args, const Shape& input, DType dtype,
                                                   uint64_t seed) {
      const int64_t hidden = args.get_int("hidden");
      const double p = args.get_double("dropout", 0.0);
      return std::unique_ptr<layers::Layer>(std::make_unique<FeedForward>(input, hidden, p, dtype, seed));
    });
    return true;
  }();
  (void)done;
}

layers::ModelSpec spec_with_derived_layers() {
  register_once();
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.seed = 23;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""}};
  for (int i = 0; i < 3; ++i) {
    spec.layers.push_back({"transformer_block", {{"heads", "2"}}, {}, ""});
    spec.layers.push_back({"test_feed_forward", {{"hidden", "12"}, {"dropout", "0.2"}}, {}, "", "ffn." + std::to_string(i)});
  }
  spec.layers.push_back({"layernorm", {}, {}, ""});
  spec.layers.push_back({"linear", {{"out", "16"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

struct Case {
  std::string name;
  int v;
};

}  // namespace

TEST_CASE("derived layers in every schedule: pipelined loss and gradients equal the unpartitioned model's") {
  const layers::ModelSpec spec = spec_with_derived_layers();
  const int64_t N = 6;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 71).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 72).reshape({N, 6});
  auto reference = layers::build_model(spec);
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 6));
  auto ref_params = reference->named_parameters();
  int derived_params = 0;  // checkpoint names: the layer's name, then the parameter's
  for (const auto& np : ref_params) derived_params += np.first.rfind("ffn.", 0) == 0;
  CHECK(derived_params == 3 * 4);
  int ran = 0, batched_ran = 0;
  for (const Case& sc : {Case{"gpipe", 1}, Case{"1f1b", 1}, Case{"zero_bubble", 1}, Case{"interleaved_1f1b", 2}}) {
    for (int K = 1; K <= 3; ++K) {
      for (int M : {1, 3, 6}) {
        for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kNever}) {
          CAPTURE(sc.name);
          CAPTURE(K);
          CAPTURE(M);
          CAPTURE(recompute_mode_name(mode));
          ScheduleRequest request{sc.name, K, sc.v, M, mode};
          Schedule schedule;
          try {
            schedule = make_schedule(request);
          } catch (const UserError& e) {
            CHECK(std::string(e.what()).find("multiple of pipeline.partitions") != std::string::npos);
            continue;
          }
          auto model = layers::build_model(spec);
          const std::vector<int> balance =
              partition::balance_by_cost(std::vector<double>(model->size(), 1.0), K * sc.v);
          InProcessTransport transport(K);
          Executor ex(*model, make_cells(balance, schedule, cpu_devices(K)), schedule, transport, {});
          const StepResult r = ex.step(x, y, /*apply_optimizer=*/false);
          CHECK(r.loss == doctest::Approx(ref_loss).epsilon(1e-12));
          auto params = model->named_parameters();
          REQUIRE(params.size() == ref_params.size());
          for (size_t i = 0; i < params.size(); ++i) {
            INFO("gradient of ", params[i].first);
            GPIPE_EXPECT_CLOSE(params[i].second->grad, ref_params[i].second->grad, 1e-9, 1e-12);
          }
          ++ran;
          request.batch_weights = true;
          const Schedule batched = make_schedule(request);
          if (batched.stages == schedule.stages) continue;
          auto model_b = layers::build_model(spec);
          InProcessTransport transport_b(K);
          Executor ex_b(*model_b, make_cells(balance, batched, cpu_devices(K)), batched, transport_b, {});
          CHECK(ex_b.step(x, y, /*apply_optimizer=*/false).loss == r.loss);
          auto params_b = model_b->named_parameters();
          for (size_t i = 0; i < params.size(); ++i) {
            INFO("batched W: gradient of ", params[i].first);
            GPIPE_EXPECT_CLOSE(params_b[i].second->grad, params[i].second->grad, 1e-12, 1e-15);
          }
          ++batched_ran;
        }
      }
    }
  }
  CHECK(ran > 40);
  CHECK(batched_ran > 10);
}
