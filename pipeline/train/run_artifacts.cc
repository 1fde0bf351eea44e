#include "pipeline/train/run_artifacts.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ostream>

#include "pipeline/planning/device_peak.h"
#include "pipeline/planning/planner.h"
#include "pipeline/report/report_html.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

RunArtifacts::RunArtifacts(const Config& c, const layers::Sequential& model, const Plan& plan, const Launch& launch,
                           std::vector<std::string> stage_layers, std::vector<std::string> stage_devices)
    : config_(c), schedule_(plan.schedule), recorder_(c.trace.first_step, c.trace.last_step) {
  const bool multi = launch.size > 1;
  if (multi) clock_offset_ms_ = launch.transport->clock_offset_to_first(launch.rank);
  epoch_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count() -
              clock_offset_ms_;
  probe_peaks(c, model, plan, launch);
  for (int k = 0; k < plan.stages; ++k) {
    const int rank = launch.layout().rank({multi ? k : 0, launch.member, launch.replica});
    processes_.push_back({k, rank, stage_devices.at(k), stage_layers.at(k)});
  }
  try {
    // The planner's device speed where nothing is measured: the slowest stage's peak (this
    // process's own on the others, whose prediction is not shown).
    // Rates this process probed already (a failed probe: the fixed rates, not another probe).
    prediction_ = predict_config(c, model, plan, multi && !launch.threads, planning_peak_ > 0 ? planning_peak_ : -1,
                                 planning_bytes_, planning_launch_, /*group_across_processes=*/!launch.threads,
                                 planning_node_);
    has_prediction_ = true;
  } catch (const UserError& e) {
    spdlog::warn("no prediction for this run: {}", e.what());
  }
}

void RunArtifacts::probe_peaks(const Config& c, const layers::Sequential& model, const Plan& plan,
                               const Launch& launch) {
  const DType dtype = model.output_dtype();
  // A probe that fails (a device out of memory) costs the report its MFU, not the run;
  // under mpirun every rank still takes part in the gather, with 0 for "unknown".
  auto probe = [&](const std::vector<Device>& devices, const std::vector<int>& turns, int processes) {
    try {
      return pipeline::stage_peaks(devices, turns, dtype, c.train.blas_threads, processes);
    } catch (const std::exception& e) {
      spdlog::warn("the devices' peak could not be probed ({}): no MFU in this run's report", e.what());
      return std::vector<DevicePeak>(devices.size());
    }
  };
  std::string how;
  // The job's ranks start probing together: they meet here first (under mpirun the
  // clock's collective met them already when K > 1; threads, and a one-stage job's
  // members and replicas, had not met).
  if (launch.layout().size() > 1) {
    if (launch.size > 1) launch.transport->all_reduce_sum(launch.rank, 0.0);
    if (launch.tensor > 1) launch.tensor_group->all_reduce_sum(0.0);
    if (launch.replica_count() > 1) launch.replicas->all_reduce_sum(0.0);
  }
  // Every process of the job on this machine probes now, at once (or every thread that
  // stands for one): Open MPI says how many there are; the cache keys a peak by it, so a
  // share of the machine is never stored as its whole.
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int processes = local != nullptr ? std::max(1, std::atoi(local)) : launch.layout().size();
  if (launch.size > 1) {
    const DevicePeak mine = probe({plan.devices.at(launch.rank)}, {0}, processes).at(0);
    planning_peak_ = mine.flops_per_second;
    planning_bytes_ = mine.bytes_per_second;
    planning_launch_ = mine.launch_seconds;
    planning_node_ = mine.graph_node_seconds;
    for (const auto& v : launch.transport->gather_to_first(launch.rank, {mine.flops_per_second})) {
      stage_peaks_.push_back(v.at(0));
    }
    how = mine.cached ? "cached" : "probed";
  } else {
    // One stage a process: alone (1), or the members or replicas of a one-stage job, each
    // its own process (or thread) probing beside the others.
    // Stages that take turns on a device have shares of it (stage_peaks); the planner
    // prices each at the whole device, the slowest one's, as it has them take turns.
    const std::vector<DevicePeak> peaks = probe(plan.devices, plan.turns, processes);
    for (size_t k = 0; k < peaks.size(); ++k) {
      const DevicePeak& p = peaks[k];
      stage_peaks_.push_back(p.flops_per_second);
      const auto sharing = static_cast<double>(std::count(plan.turns.begin(), plan.turns.end(), plan.turns[k]));
      const double whole = p.flops_per_second * sharing;
      planning_peak_ = planning_peak_ > 0 ? std::min(planning_peak_, whole) : whole;
      if (p.bytes_per_second > 0) {
        const double bytes = p.bytes_per_second * sharing;
        planning_bytes_ = planning_bytes_ > 0 ? std::min(planning_bytes_, bytes) : bytes;
      }
      planning_launch_ = std::max(planning_launch_, p.launch_seconds);  // the slowest GPU's
      planning_node_ = std::max(planning_node_, p.graph_node_seconds);
      how = p.cached ? "cached" : "probed";
    }
  }
  if (std::any_of(stage_peaks_.begin(), stage_peaks_.end(), [](double p) { return !(p > 0); })) {
    stage_peaks_.clear();  // some stage's is unknown: no MFU
    planning_peak_ = 0;
    return;
  }
  if (launch.size > 1 && !stage_peaks_.empty()) {
    planning_peak_ = *std::min_element(stage_peaks_.begin(), stage_peaks_.end());
  }
  for (size_t k = 0; k < stage_peaks_.size(); ++k) {
    const auto sharing = launch.size > 1 ? 1 : std::count(plan.turns.begin(), plan.turns.end(), plan.turns.at(k));
    spdlog::info("stage {} device peak: {:.1f} GFLOP/s ({} matrix products, {}{}{}; {})", k, stage_peaks_[k] / 1e9,
                 dtype_name(dtype), how,
                 sharing > 1 ? ", its 1/" + std::to_string(sharing) + " share of " + plan.devices.at(k).str() +
                                   ", which " + std::to_string(sharing) + " stages take turns on"
                             : std::string(),
                 processes > 1 && plan.devices.at(k).is_cpu()
                     ? ", its share with " + std::to_string(processes) + " ranks on this machine computing at once"
                     : std::string(),
                 peak_cache_path());
  }
}

void RunArtifacts::starts_at(int step) {
  if (step == 1) return;  // a fresh run: the configured window stands
  if (!config_.trace.given) {
    const TraceConfig w = default_trace_window(step, config_.train.steps);
    recorder_ = StepRecorder(w.first_step, w.last_step);
  } else if (config_.trace.last_step < step) {
    spdlog::warn("trace.steps [{}, {}] came before this run's first step, {} (resumed): no steps are recorded; set "
                 "trace.steps to steps from {} on",
                 config_.trace.first_step, config_.trace.last_step, step, step);
  }
}

void RunArtifacts::write(const std::filesystem::path& dir, const ReportBuilder& report, nlohmann::json& j,
                         std::ostream& out) const {
  std::string trace_name;
  if (config_.output.trace && !recorder_.steps().empty()) {
    trace_name = "trace.json";
    nlohmann::json trace = chrome_trace(schedule_, processes_, recorder_.steps(), epoch_ms_);
    trace["otherData"]["launch"] = report.launch();  // its steps are this launch's (report.json "launches")
    write_file_atomically((dir / trace_name).string(), trace.dump() + "\n");
    j["trace"] = {{"file", trace_name},
                  {"steps", {recorder_.steps().front().step, recorder_.steps().back().step}}};
    out << "Trace: " << (dir / trace_name).string() << " (open it in Perfetto, ui.perfetto.dev)" << std::endl;
  }
  HtmlReportInput in;
  in.title = config_.name;
  in.config = config_.source;
  in.summary = report.summary();
  in.schedule = schedule_;
  in.step = recorder_.median_step();
  in.recorded_first = recorder_.steps().empty() ? 0 : recorder_.steps().front().step;
  in.recorded_last = recorder_.steps().empty() ? -1 : recorder_.steps().back().step;
  in.measured_simulation = report.measured_simulation();
  in.losses = report.losses();
  in.validations = report.validations();
  in.trace_file = trace_name;
  write_file_atomically((dir / "report.html").string(), render_report_html(in));
  j["html"] = "report.html";
  out << "Page: " << (dir / "report.html").string() << std::endl;
}

}  // namespace pipeline
}  // namespace gpipe
