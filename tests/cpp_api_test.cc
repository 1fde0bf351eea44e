// The C++ example from the README, kept compiling and passing: a model written
// against the layer API, split into two cells and trained with GPipe.
#include <doctest/doctest.h>

#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/sequential.h"
#include "partition/balance.h"
#include "pipeline/executor.h"
#include "pipeline/train/data.h"
#include "runtime/inprocess_transport.h"

TEST_CASE("the README's C++ example trains") {
  using namespace gpipe;
  // --- README example begins
  layers::Sequential model({/*input features*/ 32}, DType::kF32);
  model.emplace<layers::Linear>(layers::LinearOptions(32, 128));
  model.emplace<layers::Relu>(Shape{128});
  model.emplace<layers::Linear>(layers::LinearOptions(128, 128));
  model.emplace<layers::Relu>(Shape{128});
  model.emplace<layers::Linear>(layers::LinearOptions(128, 4));
  model.set_loss(std::make_unique<layers::SoftmaxCrossEntropy>(4));

  const int K = 2, M = 4;
  auto costs = partition::layer_costs(model, /*micro-batch size*/ 16, /*recompute*/ true);
  auto balance = partition::balance_by_cost(costs, K);  // e.g. [3, 2]
  auto stages = pipeline::make_stages(balance, {Device::cpu(0), Device::cpu(1)});

  InProcessTransport transport(K);
  pipeline::ExecutorOptions options;
  options.optimizer.lr = 0.05;
  options.optimizer.momentum = 0.9;
  pipeline::Executor executor(model, stages,
                              pipeline::gpipe_schedule(K, M, pipeline::RecomputeMode::kExceptLast),
                              transport, options);

  pipeline::TeacherData data(/*input*/ 32, /*classes*/ 4, /*hidden*/ 16, /*scale*/ 1.0, /*seed*/ 1, DType::kF32);
  double first = 0, last = 0;
  for (int step = 0; step < 100; ++step) {
    auto [x, y] = data.batch(step, 64);
    pipeline::StepResult r = executor.step(x, y);  // one optimizer step per mini-batch
    if (step == 0) first = r.loss;
    last = r.loss;
  }
  // --- README example ends
  CHECK(balance.size() == 2);
  CHECK(last < 0.8 * first);
}
