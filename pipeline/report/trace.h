// The run's timeline as Chrome trace events (the JSON that Perfetto, ui.perfetto.dev,
// and chrome://tracing open): one process per stage, named with its stage, rank and
// device; in each, a "compute" track with a slice per forward, recompute, backward,
// weight gradient and optimizer step, and a "communication" track with a slice per
// send and receive (micro-batch, cell, bytes and peer in its args); a flow arrow from
// every send to its receive; and a counter of the stage's activation memory. A last
// process, "steps", has one slice per recorded step (loss, wall time).
//
// Times are microseconds from one job epoch: every stage's step start is on the job
// clock (StageTrace::start_ms: in a multi-process run each rank's clock offset to
// rank 0 was measured at start and subtracted), each instruction's time is relative
// to its stage's step start.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "pipeline/executor/executor.h"
#include "pipeline/schedule/schedule.h"

namespace gpipe {
namespace pipeline {

// One stage as the trace names it: "stage 1 · rank 1 · cpu:1", with its layers.
struct TraceProcess {
  int stage = 0;
  int rank = 0;
  std::string device;
  std::string layers;
};

// One step's timings of every stage (gathered to the first stage's process).
struct RecordedStep {
  int step = 0;
  double loss = 0;
  double wall_ms = 0;
  std::vector<StageTrace> stages;
};

// Keeps the steps [first, last] of a run (trace.steps).
class StepRecorder {
 public:
  StepRecorder(int first_step, int last_step) : first_(first_step), last_(last_step) {}
  bool records(int step) const { return step >= first_ && step <= last_; }
  // r must hold every stage's timings; steps outside the window are ignored.
  void add(int step, double loss, const StepResult& r);
  const std::vector<RecordedStep>& steps() const { return steps_; }
  // The recorded step whose wall time is the median (the lower one of an even count);
  // nullptr when none was recorded.
  const RecordedStep* median_step() const;

 private:
  int first_, last_;
  std::vector<RecordedStep> steps_;
};

// The Chrome trace of `steps` run with `schedule`, times from `epoch_ms` (on the job
// clock). Throws Error if a step's timings do not match the schedule.
nlohmann::json chrome_trace(const Schedule& schedule, const std::vector<TraceProcess>& processes,
                            const std::vector<RecordedStep>& steps, double epoch_ms);

}  // namespace pipeline
}  // namespace gpipe
