// A training run from a Config (and, for a model built in C++, a factory): builds the
// model, balances it into cells, runs the schedule step by step, logs, evaluates, and
// writes the report.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/plan.h"
#include "pipeline/report/report.h"
#include "pipeline/train/launch.h"
#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

struct TrainResult {
  RunSummary summary;
  std::vector<double> losses;  // per step
  double eval_loss = 0, eval_accuracy = 0;
  std::vector<int> balance;
  std::string report_path;
  int start_step = 0;           // where the run began: a resumed run's checkpoint step
  std::string checkpoint_path;  // the last checkpoint saved, if any
};

// Runs the whole job; progress lines and the final table go to `out`.
TrainResult train(const Config& config, std::ostream& out, const Launch& launch = {});
// The same for a model built in C++ by `make_model` (called once in every process),
// with everything else from `config` (data, pipeline, optimizer, train, output; from
// YAML or filled in C++): config.model is ignored, the data takes the model's input
// shape and dtypes, and there are no per-layer `cost:` overrides.
TrainResult train(const Config& config, const MakeModel& make_model, std::ostream& out,
                  const Launch& launch = {});

// The executor's options for `plan` of `config` run as `launch` (its stage, replicas,
// rows), with the report clock's offset: what train() builds its Executor with, and
// what measured_sweep.h times candidate plans with.
ExecutorOptions executor_options(const Config& config, const Launch& launch, const Plan& plan,
                                 double clock_offset_ms);

// A job's K x T x D ranks as threads of this process, laid out as Plan::ranks lays out
// processes: an in-process transport per (replica, member) (its pipeline of K stages; a
// repeated message key waits in order, as MPI's: a stage may start its next program
// before its neighbour ends this one), an in-process tensor group per (replica, stage)
// (its T members) and replica group per (stage, member) (its D replicas). Calls
// rank(launch) on each rank's thread with its Launch (`threads` set). The first failure
// aborts every transport and group, so the other ranks wake; once all threads have ended
// it is rethrown (the first that was not a wake-up, Aborted, if any). What train() runs
// without mpirun at T > 1 (any D), and what the measured sweep times T > 1 plans on.
void run_ranks_as_threads(const RankLayout& layout, double timeout_s, const std::function<void(const Launch&)>& rank);

// The cells a config asks for: its balance, or the balancer's from layer costs.
std::vector<int> plan_balance(const Config& config, const layers::Sequential& model);

}  // namespace pipeline
}  // namespace gpipe
