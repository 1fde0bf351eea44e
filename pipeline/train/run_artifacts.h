// What a training run leaves besides report.json, and what it needs for them: the
// planner's prediction of the run (shown beside the measurements in the table,
// report.json and report.html), the recorded steps (trace.steps), the clock offset of
// this process to the first stage's (so that a multi-process trace has one clock),
// and at the end trace.json (output.trace) and report.html, written atomically.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <iosfwd>
#include <string>
#include <vector>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/prediction.h"
#include "pipeline/report/report.h"
#include "pipeline/report/trace.h"
#include "pipeline/train/launch.h"

namespace gpipe {
namespace pipeline {

class RunArtifacts {
 public:
  // In a multi-process run every rank of the pipeline constructs it at the same point,
  // before its executor: it measures the rank's clock offset and its device's peak (two
  // collectives).
  RunArtifacts(const Config& config, const layers::Sequential& model, const Plan& plan, const Launch& launch,
               std::vector<std::string> stage_layers, std::vector<std::string> stage_devices);

  // ExecutorOptions::clock_offset_ms.
  double clock_offset_ms() const { return clock_offset_ms_; }
  // The planner's prediction; has_prediction() is false when it could not be made
  // (a profile file that cannot be read: the run goes on, with a warning).
  bool has_prediction() const { return has_prediction_; }
  const PlannedRun& prediction() const { return prediction_; }
  // Every stage's device peak in FLOP/s (device_peak.h), probed with all of the job's
  // stages at once; on the reporting process (stage 0) only, empty elsewhere.
  const std::vector<double>& stage_peaks() const { return stage_peaks_; }

  // A resumed run starts at `step`: the default trace window (trace.steps not given)
  // moves to the steps after it; a given window that ended before it records nothing.
  void starts_at(int step);

  // On the reporting process, with every stage's timings.
  void add_step(int step, double loss, const StepResult& r) { recorder_.add(step, loss, r); }

  // Writes trace.json (when output.trace is on) and report.html into `dir` and names
  // them in `report_json`.
  void write(const std::filesystem::path& dir, const ReportBuilder& report, nlohmann::json& report_json,
             std::ostream& out) const;

 private:
  void probe_peaks(const Config& c, const layers::Sequential& model, const Plan& plan, const Launch& launch);

  const Config& config_;
  Schedule schedule_;
  std::vector<TraceProcess> processes_;
  StepRecorder recorder_;
  double clock_offset_ms_ = 0;
  double epoch_ms_ = 0;  // the job's time zero on the job clock: when this object was made
  bool has_prediction_ = false;
  PlannedRun prediction_;
  std::vector<double> stage_peaks_;
  double planning_peak_ = 0;   // the planner's FLOP/s without a profile
  double planning_bytes_ = 0;  // and its bytes/s (GPUs; 0: the CPU's fixed rate)
  double planning_launch_ = 0;  // and a launch's seconds (GPUs; 0 on a CPU)
  double planning_node_ = 0;    // and a captured graph node's (GPUs; 0 on a CPU or unknown)
};

}  // namespace pipeline
}  // namespace gpipe
