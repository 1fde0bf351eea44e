// What the planner predicts for a run, in the report's terms, so that every run's
// report can show it beside what was measured (report.h) and `gpipe plan` can print it
// before anything trains (planner.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/time_accounting.h"

namespace gpipe {
namespace pipeline {

// Where the stage's time goes in the simulated step (time_accounting.h, the report's
// accounting of measured steps), and its memory.
struct PlannedStage : StageTime {
  // Memory at the stage's peak: parameters, their gradients, optimizer state, and the
  // activations the schedule keeps (estimate_memory in plan.h).
  int64_t weight_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  int64_t total_bytes() const { return weight_bytes + gradient_bytes + optimizer_bytes + activation_bytes; }
  // The ops its layers call in one step (F, R, B and W over the program; Plan::launches),
  // each a kernel launch or more on a GPU; not counted: the optimizer step, the
  // collectives and the messages. -1 where the model's ops could not be counted.
  int64_t launches = -1;
};

struct PlannedRun {
  std::string source;  // where the op costs came from: "profile FILE (micro-batch 8)", "estimate (...)"
  double step_ms = 0;  // the simulated makespan, optimizer steps included
  double span_ms = 0;  // to the end of the last backward, as the report's span
  double bubble = 0;   // 1 - sum(busy) / (K span), as the report's measured bubble
  double samples_per_second = 0;
  // Each op priced as a node of the captured step's graph (pipeline.capture, with a
  // measured or described node cost: CostModel::price_captured), not a launch.
  bool launches_captured = false;
  std::vector<PlannedStage> stages;
  // The simulated step, per stage in program order (start and end in ms).
  std::vector<std::vector<TimedInstruction>> timeline;
};

}  // namespace pipeline
}  // namespace gpipe
