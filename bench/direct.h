// The yardstick for the runtime's own cost: the executor's computation done directly
// on one thread. It interprets the same schedule with the same layer, loss and
// optimizer calls in the same order per stage, but with no worker threads, no
// transport (a send is a store into a local map) and no per-instruction bookkeeping,
// and it times each compute instruction so that an ideal pipelined makespan can be
// predicted from what the work itself costs.
#pragma once

#include <vector>

#include "layers/optimizer.h"
#include "layers/sequential.h"
#include "pipeline/executor/executor.h"
#include "pipeline/schedule/schedule.h"

namespace gpipe {
namespace bench {

struct DirectStep {
  double total_ms = 0;  // the whole step, timed from outside
  double loss = 0;
  // zero_grad_ms[k]: clearing stage k's gradients, which each executor stage does
  // itself before its first instruction.
  std::vector<double> zero_grad_ms;
  // cost_ms[k][i]: the time of instruction i of stage k's program (0 for sends,
  // receives, and an optimizer step that was skipped).
  std::vector<std::vector<double>> cost_ms;
};

class DirectRunner {
 public:
  // The model must hold the same layers as the executor's (a separate instance);
  // `stages` and `schedule` are the executor's.
  // With pin_stages (and K > 1), the calling thread moves to core k while it runs
  // stage k's instructions, so each stage's costs are measured on the core the
  // executor pins that stage to; its original affinity is restored afterwards.
  DirectRunner(layers::Sequential& model, std::vector<pipeline::CellSpec> stages, pipeline::Schedule schedule,
               const SgdParams& sgd, bool pin_stages = false);
  DirectStep step(const Tensor& inputs, const Tensor& targets, bool apply_optimizer = true);

 private:
  layers::Sequential& model_;
  std::vector<pipeline::CellSpec> stages_;
  pipeline::Schedule schedule_;
  std::vector<std::unique_ptr<layers::Sgd>> optimizers_;  // one per stage, like the executor's
  bool pin_stages_;
};

// Pins the calling thread to one core; false if that failed (e.g. fewer cores).
bool pin_this_thread(int core);

// Makespan of the schedule when stage k starts at start_ms[k], each instruction costs
// what a direct run measured (stage k's instruction i costs cost_ms[k][i]) and a
// receive completes as soon as its matching send has: the fastest a pipeline could
// run this work with a free runtime.
double ideal_makespan_ms(const pipeline::Schedule& s, const std::vector<double>& start_ms,
                         const std::vector<std::vector<double>>& cost_ms);

}  // namespace bench
}  // namespace gpipe
