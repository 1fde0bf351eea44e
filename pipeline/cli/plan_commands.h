// The planning commands behind `gpipe plan` (the prediction and the sweep), as functions
// of a config, so that the command line stays a table of subcommands (`gpipe profile` is
// pipeline/train/profiling.h).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/sweep.h"
#include "pipeline/train/launch.h"

namespace gpipe {
namespace pipeline {

struct PlanCommandOptions {
  bool sweep = false;
  int devices = 0;          // --devices N: plan for N devices (0: the config's K, or this machine)
  std::string device_spec;  // --device-spec FILE: devices this machine does not have
  int rows = 30;            // sweep rows shown
  int max_micro_batches = 32;  // the sweep tries M = 1, 2, 4, ... up to this
  int measure = 3;  // --time-best N: the sweep's best N plans and the config's own timed before one is recommended
  // --precisions: the sweep tries each (the config and its model in each model.dtype);
  // empty: the config's precision alone.
  std::vector<SweptPrecision> precisions;
};

// How `plan` partitions and schedules the model, as `gpipe plan` prints it first: the
// model, each stage's memory, cells and layer costs, and the schedule's chart and table.
// `whole`: the unsplit model (on shapes) of a tensor-parallel plan, whose parameters and
// checkpoint the model line counts beside the member's; nullptr: `model` itself.
void print_plan(const Config& config, layers::Sequential& model, const Plan& plan, std::ostream& out,
                layers::Sequential* whole = nullptr);

// The prediction of `plan` (step time, bubble, samples/s; per stage time and memory)
// as `gpipe plan` prints it.
void print_prediction(const Config& config, const layers::Sequential& model, const Plan& plan, std::ostream& out);

// `gpipe plan` with --sweep, --devices or --device-spec; returns the exit status.
int plan_other_runs(const Config& config, layers::Sequential& model, const PlanCommandOptions& options, std::ostream& out);

}  // namespace pipeline
}  // namespace gpipe
