// The planning commands behind `gpipe plan` (the prediction and the sweep) and
// `gpipe profile` (measuring layers and transports into the profile file), as
// functions of a config, so that the command line stays a table of subcommands.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/planning/plan.h"
#include "pipeline/train/launch.h"

namespace gpipe {
namespace pipeline {

struct PlanCommandOptions {
  bool sweep = false;
  int devices = 0;          // --devices N: plan for N devices (0: the config's K, or this machine)
  std::string device_spec;  // --device-spec FILE: devices this machine does not have
  int rows = 30;            // sweep rows shown
  int max_micro_batches = 32;  // the sweep tries M = 1, 2, 4, ... up to this
};

// How `plan` partitions and schedules the model, as `gpipe plan` prints it first: the
// model, each stage's memory, cells and layer costs, and the schedule's chart and table.
void print_plan(const Config& config, layers::Sequential& model, const Plan& plan, std::ostream& out);

// The prediction of `plan` (step time, bubble, samples/s; per stage time and memory)
// as `gpipe plan` prints it.
void print_prediction(const Config& config, const layers::Sequential& model, const Plan& plan, std::ostream& out);

// `gpipe plan` with --sweep, --devices or --device-spec; returns the exit status.
int plan_other_runs(const Config& config, layers::Sequential& model, const PlanCommandOptions& options, std::ostream& out);

struct ProfileOptions {
  std::vector<int64_t> micro_batches;  // sizes to measure; empty: the config's
  bool sweep = false;                  // every size the sweep tries (batch / M for M = 1, 2, 4, ...)
  int warmup = 3, repeats = 10;
  double min_seconds = 3;  // per size and concurrency: repetitions go on at least this long
  // Stages computing at once while measuring (each a copy of the model on its own core);
  // empty: 1 and, on CPUs, every core.
  std::vector<int> concurrency;
};

// `gpipe profile`: measures every layer at each size on the config's first device (on
// CPUs alone and with every core running a copy, as K stages do), and the in-process
// transport, and stores them in pipeline.profile. Under mpirun
// (`launch.size` > 1, CPU stages) it measures the MPI transport between ranks 0 and 1
// instead. Returns the exit status.
int profile_command(const Config& config, const ProfileOptions& options, const Launch& launch, std::ostream& out);

}  // namespace pipeline
}  // namespace gpipe
