// A failure in any part of a stage's program — its backward, a recompute of a
// checkpointed micro-batch, its optimizer step — stops the whole pipeline with that
// stage's message (stage, layers, device, cause), never a hang, and the executor
// refuses further steps. The failures are real throws from layers defined here, on
// every stage of a three-stage pipeline, with the other stages blocked in a receive or
// in the global norm's all-reduce when it happens.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <string>
#include <vector>

#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/sequential.h"
#include "pipeline/executor/executor.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

layers::LinearOptions linear(int64_t in, int64_t out, uint64_t seed) {
  layers::LinearOptions o(in, out);
  o.dtype = DType::kF64;
  o.seed = seed;
  return o;
}

enum class Where { kBackward, kRecompute, kOptimizer };

// Passes its input through; fails where it is told to.
class Faulty : public layers::Layer {
 public:
  Faulty(Where where, int64_t width) : Layer({width}, {width}, DType::kF64), where_(where) {
    w_.name = "weight";
    w_.value = Tensor::from_vector<double>({1.0, 2.0, 3.0}, {3});
    w_.grad = Tensor::from_vector<double>({0.0, 0.0, 0.0}, {3});
  }
  std::string type() const override { return "faulty"; }
  std::string describe() const override { return "faulty"; }
  layers::LayerCost cost(int64_t) const override { return {}; }
  std::vector<layers::Parameter*> parameters() override { return {&w_}; }

 private:
  Tensor forward_impl(Backend&, const Tensor& x, layers::Context*, const layers::ForwardArgs& args) override {
    if (where_ == Where::kRecompute && args.recompute) throw UserError("recompute went wrong");
    return x;
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const layers::Context&, bool) override {
    if (where_ == Where::kBackward) throw UserError("backward went wrong");
    // A layer bug the optimizer must catch: a gradient that no longer fits its
    // parameter (4 elements for a weight of 3).
    if (where_ == Where::kOptimizer) w_.grad = Tensor::from_vector<double>({1, 1, 1, 1}, {4});
    return dy;
  }
  Where where_;
  layers::Parameter w_;
};

const char* where_name(Where w) {
  return w == Where::kBackward ? "backward" : w == Where::kRecompute ? "recompute" : "optimizer";
}

// Runs f, failing the test (and stopping the binary, since a hung thread cannot be
// joined) if it has not returned after a minute: a deadlock detector, not a timing.
template <typename F>
auto within_a_minute(F f) {
  auto fut = std::async(std::launch::async, f);
  if (fut.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "FAIL: the pipeline hung after a failure\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  return fut.get();
}

}  // namespace

TEST_CASE("a failure in backward, recompute or the optimizer step names its stage and stops every stage") {
  for (Where where : {Where::kBackward, Where::kRecompute, Where::kOptimizer}) {
    for (int bad : {0, 1, 2}) {
      CAPTURE(where_name(where));
      CAPTURE(bad);
      // linear | linear | linear, with the faulty layer after stage `bad`'s linear.
      layers::Sequential model({6}, DType::kF64);
      std::vector<int> balance;
      for (int k = 0; k < 3; ++k) {
        model.emplace<layers::Linear>(linear(6, k == 2 ? 4 : 6, 7 + k));
        if (k == bad) model.emplace<Faulty>(where, k == 2 ? 4 : 6);
        balance.push_back(k == bad ? 2 : 1);
      }
      model.set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(4, DType::kF64));
      InProcessTransport transport(3);
      ExecutorOptions opts;
      opts.clip_grad_norm = 1e9;  // every stage meets the others in the norm's all-reduce
      Executor ex(model, make_stages(balance, {Device::cpu(0), Device::cpu(1), Device::cpu(2)}),
                  gpipe_schedule(3, 4, RecomputeMode::kAlways), transport, opts);
      Tensor x = gpipe::testing::random_tensor({8, 6}, DType::kF64, 1);
      Tensor y = gpipe::testing::random_labels(8, 4, 2);
      const std::string message = within_a_minute([&]() -> std::string {
        try {
          ex.step(x, y);
        } catch (const std::exception& e) {
          return e.what();
        }
        return "no error";
      });
      CAPTURE(message);
      const int first = bad;  // the stages before it hold one layer each
      const std::string stage = "stage " + std::to_string(bad) + " (layers " + std::to_string(first) + ".." +
                                std::to_string(first + 1) + " on cpu:" + std::to_string(bad) + ") failed: ";
      CHECK(message.find(stage) == 0);
      const char* cause = where == Where::kBackward    ? "backward went wrong"
                          : where == Where::kRecompute ? "recompute went wrong"
                                                       : "differ in dtype or shape";
      CHECK(message.find(cause) != std::string::npos);
      CHECK(message.find("stopped") == std::string::npos);  // the cause, not a neighbour's abort
      const std::string again = within_a_minute([&]() -> std::string {
        try {
          ex.step(x, y);
        } catch (const std::exception& e) {
          return e.what();
        }
        return "no error";
      });
      CHECK(again.find("earlier failure") != std::string::npos);
    }
  }
}

TEST_CASE("the recompute failure comes from the recompute: without checkpoints the step succeeds") {
  layers::Sequential model({6}, DType::kF64);
  model.emplace<layers::Linear>(linear(6, 6, 3));
  model.emplace<Faulty>(Where::kRecompute, 6);
  model.emplace<layers::Linear>(linear(6, 4, 4));
  model.set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(4, DType::kF64));
  InProcessTransport transport(2);
  Executor ex(model, make_stages({2, 1}, {Device::cpu(0), Device::cpu(1)}), gpipe_schedule(2, 4, RecomputeMode::kNever),
              transport, {});
  Tensor x = gpipe::testing::random_tensor({8, 6}, DType::kF64, 1);
  Tensor y = gpipe::testing::random_labels(8, 4, 2);
  CHECK_NOTHROW(within_a_minute([&] { return ex.step(x, y); }));
}
