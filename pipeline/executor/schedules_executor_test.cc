// The defining test for every schedule: loss and every parameter gradient of the
// pipelined model equal the unpartitioned model's (float64), for K in 1..4, several M
// (some that K does not divide), every recompute mode, with dropout and a head tied to
// the embedding; interleaved with v = 2 and 3; on three models: a GPT, a LLaMA-style
// model and a GPT whose feed-forward layers are written as forward only (layers/derived.h).
// Also: the executor's activation meter shows what 1F1B and zero bubble save over GPipe.
#include <doctest/doctest.h>

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

namespace {

using gpipe::testing::cpu_devices;

// A byte-level GPT of 13 layers, so that 4 stages x 3 cells still get a layer each:
// dropout inside and between the blocks, the head tied to the embedding.
layers::ModelSpec gpt_spec() {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.seed = 17;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""}};
  for (int i = 0; i < 5; ++i) {
    spec.layers.push_back({"transformer_block", {{"heads", "2"}, {"dropout", "0.2"}}, {}, ""});
    // One SwiGLU feed-forward in place of a dropout: a second composite layer whose
    // weight gradients W defers (and batches), with the backend's unary silu inside.
    if (i == 2) {
      spec.layers.push_back({"swiglu", {{"hidden", "12"}}, {}, ""});
    } else {
      spec.layers.push_back({"dropout", {{"p", "0.1"}}, {}, ""});
    }
  }
  spec.layers.push_back({"layernorm", {}, {}, ""});
  spec.layers.push_back({"linear", {{"out", "16"}, {"bias", "false"}, {"tied", "true"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// A LLaMA-style model of 8 layers: token embedding without learned positions (rotary
// embeddings inside the attention instead), blocks with grouped-query attention
// (kv_heads 1 and 2) and SwiGLU, dropout on the branches of two of them, a bare attention
// layer, RMSNorm and the tied head.
layers::ModelSpec llama_spec() {
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.seed = 23;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}, {"positions", "0"}}, {}, ""}};
  for (const char* kv : {"1", "2", "2"}) {
    spec.layers.push_back(
        {"llama_block", {{"heads", "2"}, {"kv_heads", kv}, {"hidden", "12"}, {"dropout", kv[0] == '2' ? "0.2" : "0"}}, {}, ""});
  }
  spec.layers.push_back({"gqa_attention", {{"heads", "4"}, {"kv_heads", "2"}, {"rope_base", "100"}}, {}, ""});
  spec.layers.push_back({"llama_block", {{"heads", "4"}, {"kv_heads", "1"}, {"hidden", "16"}}, {}, ""});
  spec.layers.push_back({"rmsnorm", {}, {}, ""});
  spec.layers.push_back({"linear", {{"out", "16"}, {"bias", "false"}, {"tied", "true"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  return spec;
}

// x + dropout(down(silu(gate(n)) * up(n))), n = rmsnorm(x): LLaMA's feed-forward half
// written as forward only and registered as a type of one's own; its backward, B/W split,
// batched W, dropout keys under recompute and cost (the balancer's input) are derived.
class DerivedFeedForward : public layers::DerivedLayer {
 public:
  DerivedFeedForward(const Shape& shape, int64_t hidden, double p, DType dtype, uint64_t seed)
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

// x + softmax(x) * max(x), written as forward only, with no parameters: all of its
// backward is B's, and W has nothing to do.
class DerivedMix : public layers::DerivedLayer {
 public:
  DerivedMix(const Shape& shape, DType dtype, uint64_t seed) : DerivedLayer("test_mix", shape, shape, dtype, seed) {}
  Var define(Graph& g, Var x) const override { return g.add(x, g.mul(g.softmax(x), g.max(x))); }
};

// A GPT whose feed-forward blocks are DerivedFeedForward, named (their checkpoint names),
// with a DerivedMix after the first.
layers::ModelSpec derived_spec() {
  static const bool registered = [] {
    layers::register_layer("test_feed_forward", [](layers::LayerArgs& args, const Shape& input, DType dtype,
                                                   uint64_t seed) {
      return std::unique_ptr<layers::Layer>(std::make_unique<DerivedFeedForward>(
          input, args.get_int("hidden"), args.get_double("dropout", 0.0), dtype, seed));
    });
    layers::register_layer("test_mix", [](layers::LayerArgs&, const Shape& input, DType dtype, uint64_t seed) {
      return std::unique_ptr<layers::Layer>(std::make_unique<DerivedMix>(input, dtype, seed));
    });
    return true;
  }();
  (void)registered;
  layers::ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.seed = 23;
  spec.layers = {{"embedding", {{"vocab", "16"}, {"dim", "8"}}, {}, ""}};
  for (int i = 0; i < 3; ++i) {
    spec.layers.push_back({"transformer_block", {{"heads", "2"}}, {}, ""});
    spec.layers.push_back({"test_feed_forward", {{"hidden", "12"}, {"dropout", "0.2"}}, {}, "", "ffn." + std::to_string(i)});
    if (i == 0) spec.layers.push_back({"test_mix", {}, {}, ""});
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

// Loss and every parameter gradient of `spec` pipelined under every schedule (gpipe,
// 1F1B, zero bubble, interleaved with v = 2 and 3, zero bubble with v = 2), K = 1..4 where
// the model has K v layers, M in {1, 3, 4, 6} and every recompute mode, against the
// unpartitioned model on the same batch of N samples of 6 tokens; where batching the
// weight gradients changes the program, that too. Returns how many runs of each kind.
std::pair<int, int> check_every_schedule(const layers::ModelSpec& spec, uint64_t seed) {
  const int64_t N = 7;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, seed).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, seed + 1).reshape({N, 6});
  auto reference = layers::build_model(spec);
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 6));
  reference->sum_tied_gradients(backend_for(Device::cpu()));
  auto ref_params = reference->named_parameters();

  int ran = 0, batched_ran = 0;
  for (const Case& sc : {Case{"gpipe", 1}, Case{"1f1b", 1}, Case{"zero_bubble", 1}, Case{"interleaved_1f1b", 2},
                         Case{"interleaved_1f1b", 3}, Case{"zero_bubble", 2}}) {
    for (int K = 1; K * sc.v <= static_cast<int>(spec.layers.size()) && K <= 4; ++K) {
      for (int M : {1, 3, 4, 6}) {
        for (auto mode : {RecomputeMode::kAlways, RecomputeMode::kExceptLast, RecomputeMode::kNever}) {
          CAPTURE(sc.name);
          CAPTURE(sc.v);
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
          CHECK(transport.pending() == 0);
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
  return {ran, batched_ran};
}

}  // namespace

TEST_CASE("every schedule: pipelined loss and gradients equal the unpartitioned model's") {
  const auto [ran, batched_ran] = check_every_schedule(gpt_spec(), 51);
  CHECK(ran > 200);
  CHECK(batched_ran > 100);
}

TEST_CASE("every schedule on a LLaMA-style model: pipelined loss and gradients equal the unpartitioned model's") {
  const auto [ran, batched_ran] = check_every_schedule(llama_spec(), 53);
  CHECK(ran > 150);
  CHECK(batched_ran > 70);
}

TEST_CASE("every schedule on a model of layers written as forward only (layers/derived.h)") {
  const auto [ran, batched_ran] = check_every_schedule(derived_spec(), 55);
  CHECK(ran > 150);
  CHECK(batched_ran > 70);
}

TEST_CASE("every schedule trains: three optimizer steps equal GPipe's") {
 for (const layers::ModelSpec& spec : {gpt_spec(), llama_spec()}) {
  CAPTURE(spec.layers[1].type);
  const int64_t N = 8;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 61).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 62).reshape({N, 6});
  ExecutorOptions opts;
  opts.optimizer.type = "adamw";
  opts.optimizer.lr = 0.01;
  opts.optimizer.weight_decay = 0.1;
  opts.clip_grad_norm = 0.5;
  auto run = [&](const std::string& name, int v) {
    auto model = layers::build_model(spec);
    const Schedule s = make_schedule(ScheduleRequest{name, 2, v, 4, RecomputeMode::kExceptLast});
    InProcessTransport transport(2);
    Executor ex(*model, make_cells(partition::balance_by_cost(std::vector<double>(model->size(), 1.0), 2 * v), s,
                                   cpu_devices(2)),
                s, transport, opts);
    std::vector<double> losses;
    for (int i = 0; i < 3; ++i) losses.push_back(ex.step(x, y).loss);
    std::vector<double> weights;
    for (auto& np : model->named_parameters()) {
      for (double w : gpipe::testing::to_doubles(np.second->value)) weights.push_back(w);
    }
    return std::make_pair(losses, weights);
  };
  const auto gpipe = run("gpipe", 1);
  for (const Case& sc : {Case{"1f1b", 1}, Case{"zero_bubble", 1}, Case{"interleaved_1f1b", 2}}) {
    CAPTURE(sc.name);
    const auto other = run(sc.name, sc.v);
    GPIPE_EXPECT_CLOSE(other.first, gpipe.first, 1e-12, 1e-12);
    GPIPE_EXPECT_CLOSE(other.second, gpipe.second, 1e-10, 1e-12);
  }
 }
}

TEST_CASE("the executor's meter: 1F1B and zero bubble hold K micro-batches on stage 0 whatever M, GPipe M") {
  // An MLP without rematerialization: each forward keeps its cell's activations until
  // its backward.
  layers::ModelSpec spec;
  spec.input = {32};
  spec.dtype = DType::kF64;
  spec.seed = 3;
  for (int i = 0; i < 4; ++i) {
    spec.layers.push_back({"linear", {{"out", "32"}}, {}, ""});
    spec.layers.push_back({"relu", {}, {}, ""});
  }
  spec.layers.push_back({"linear", {{"out", "4"}}, {}, ""});
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  const int K = 2;
  int M = 16;
  auto peak_of = [&](const std::string& name, int64_t* one_micro_batch) {
    const int64_t N = 4 * M;  // micro-batches of 4 rows
    Tensor x = gpipe::testing::random_tensor({N, 32}, DType::kF64, 1);
    Tensor y = gpipe::testing::random_labels(N, 4, 2);
    auto model = layers::build_model(spec);
    const Schedule s = make_schedule(ScheduleRequest{name, K, 1, M, RecomputeMode::kNever});
    InProcessTransport transport(K);
    Executor ex(*model, make_stages({5, 4}, cpu_devices(K)), s, transport, {});
    const StepResult r = ex.step(x, y, false);
    // Stage 0 holds one micro-batch's contexts right after its first send.
    for (const TimedOp& op : r.stages[0].ops) {
      if (op.op == Op::kSendActivation && op.micro_batch == 0) {
        *one_micro_batch = op.live_bytes;
        break;
      }
    }
    return r.stages[0].peak_activation_bytes;
  };
  int64_t one = 0;
  const int64_t gpipe = peak_of("gpipe", &one);
  // Stage 0 (linear, relu, linear, relu, linear) then holds three (4, 32) float64
  // buffers, each once: its input (the first linear's context) and the two ReLU outputs,
  // which the next linear keeps too; the output went with the send.
  CHECK(one == 3 * 4 * 32 * 8);
  CHECK(gpipe >= M * one);
  int64_t one_here = 0;
  // K micro-batches' contexts, plus at most one message (an output or a gradient) in transit.
  const int64_t one_f_one_b = peak_of("1f1b", &one_here);
  CHECK(one_here == one);
  CHECK(one_f_one_b >= K * one);
  CHECK(one_f_one_b <= K * one + one / 2);
  // Zero bubble keeps, between a backward and its weight gradient, each linear layer's
  // input and output gradient: one more micro-batch's worth here (the MLP's contexts
  // are its linear inputs), still independent of M.
  const int64_t zero_bubble = peak_of("zero_bubble", &one_here);
  CHECK(zero_bubble <= (K + 1) * one);
  M = 8;
  CHECK(peak_of("1f1b", &one_here) == one_f_one_b);
  CHECK(peak_of("zero_bubble", &one_here) == zero_bubble);
  const int64_t gpipe_8 = peak_of("gpipe", &one_here);
  CHECK(gpipe_8 >= M * one);
  CHECK(gpipe_8 < gpipe - 7 * one);
}

TEST_CASE("a schedule file runs as its generated twin") {
  // 1F1B for K = 2, M = 2 written by hand, with W split off for zero bubble's order.
  const std::string text = "0F0\n0F1\n1F0\n1B0\n1W0\n0B0\n0W0\n1F1\n1B1\n1W1\n0B1\n0W1\n";
  const Schedule file = parse_schedule_text(text, "zb.csv", 2, 1, 2, RecomputeMode::kExceptLast);
  layers::ModelSpec spec = gpt_spec();
  const int64_t N = 4;
  Tensor x = gpipe::testing::random_labels(N * 6, 16, 71).reshape({N, 6});
  Tensor y = gpipe::testing::random_labels(N * 6, 16, 72).reshape({N, 6});
  auto reference = layers::build_model(spec);
  reference->zero_grad();
  const double ref_loss = reference->forward_backward(backend_for(Device::cpu()), x, y, 1.0 / (N * 6));
  auto model = layers::build_model(spec);
  InProcessTransport transport(2);
  Executor ex(*model, make_stages({6, 7}, cpu_devices(2)), file, transport, {});
  CHECK(ex.step(x, y, false).loss == doctest::Approx(ref_loss).epsilon(1e-12));
}
