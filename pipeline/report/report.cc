#include "pipeline/report/report.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

std::string describe_layers(const layers::Sequential& model, int first, int count) {
  std::vector<std::pair<std::string, int>> kinds;
  for (int i = first; i < first + count; ++i) {
    const std::string t = model.layer(i).type();
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](auto& kv) { return kv.first == t; });
    if (it == kinds.end()) {
      kinds.emplace_back(t, 1);
    } else {
      ++it->second;
    }
  }
  std::string out = std::to_string(first) + "-" + std::to_string(first + count - 1) + " ";
  for (size_t i = 0; i < kinds.size(); ++i) {
    out += (i ? ", " : "") + kinds[i].first + (kinds[i].second > 1 ? " x" + std::to_string(kinds[i].second) : "");
  }
  return out;
}

ReportBuilder::ReportBuilder(std::vector<std::string> stage_layers, std::vector<std::string> stage_devices,
                             Schedule program, RecomputeMode recompute, int64_t batch_size)
    : layers_(std::move(stage_layers)), devices_(std::move(stage_devices)), program_(std::move(program)),
      recompute_(recompute), batch_size_(batch_size), launch_first_{1}, acc_(layers_.size()),
      op_time_(layers_.size()), tensor_time_(layers_.size()) {
  if (static_cast<int>(layers_.size()) != program_.num_stages || devices_.size() != layers_.size()) {
    throw Error("ReportBuilder: " + std::to_string(layers_.size()) + " stage descriptions and " +
                std::to_string(devices_.size()) + " devices for a program of " + std::to_string(program_.num_stages) +
                " stages");
  }
  for (size_t k = 0; k < acc_.size(); ++k) {
    acc_[k].stage = static_cast<int>(k);
    acc_[k].layers = layers_[k];
    acc_[k].device = devices_[k];
  }
}

void ReportBuilder::add_step(int step, double loss, const StepResult& r, bool timed) {
  if (!first_step_known_) {  // no history carried over: this launch starts at its first step (1 when fresh)
    launch_first_.back() = step;
    first_step_known_ = true;
  }
  losses_.emplace_back(step, loss);
  if (r.loss_scale > 0) {
    last_loss_scale_ = r.loss_scale;
    if (r.skipped) skipped_steps_.push_back(step);
  }
  if (!timed) return;
  std::vector<std::vector<OpSpan>> spans(r.stages.size());
  for (size_t k = 0; k < r.stages.size(); ++k) {
    for (const TimedOp& op : r.stages[k].ops) {
      spans[k].push_back({op.op, op.start_ms, op.end_ms, op.micro_batch, op.group_ms});
    }
  }
  const StepTime time = account_step(spans);
  for (size_t k = 0; k < acc_.size() && k < r.stages.size(); ++k) {
    StageSummary& s = acc_[k];
    const StageTrace& trace = r.stages[k];
    s.add(time.stages[k]);
    for (size_t pc = 0; pc < trace.ops.size(); ++pc) {
      const TimedOp& op = trace.ops[pc];
      if (is_tensor_collective(op.op)) {
        if (trace.ops.size() != program_.stages[k].size()) continue;  // not this schedule's timings
        auto& t = tensor_time_[k][pc];
        t.first += op.end_ms - op.start_ms;
        ++t.second;
        continue;
      }
      auto& t = op_time_[k][{static_cast<int>(op.op), op.chunk}];
      // A compute instruction's own: its tensor collectives, which ran inside it, are
      // instructions of their own in the simulation below.
      t.first += op.end_ms - op.start_ms - (is_compute(op.op) ? op.group_ms : 0.0);
      ++t.second;
    }
    for (const OpTimer::Total& o : trace.op_times) {  // trace.ops: every training step has them
      auto it = std::find_if(s.op_times.begin(), s.op_times.end(),
                             [&](const StageSummary::OpTime& t) { return t.op == o.op; });
      if (it == s.op_times.end()) it = s.op_times.insert(s.op_times.end(), StageSummary::OpTime{o.op, 0, 0});
      it->calls += static_cast<double>(o.calls);
      it->ms += o.ms;
    }
    s.peak_activation_bytes = std::max(s.peak_activation_bytes, trace.peak_activation_bytes);
    s.device_peak_bytes = std::max(s.device_peak_bytes, trace.device_peak_bytes);
    s.optimizer_bytes = std::max(s.optimizer_bytes, trace.optimizer_bytes);
    s.ops_per_step = 0;
    s.all_ops_per_step = trace.other_ops;
    s.captured_nodes = trace.captured_nodes;
    for (const TimedOp& op : trace.ops) {
      if (is_tensor_collective(op.op)) continue;  // counted in the compute instruction it ran in
      s.all_ops_per_step += op.ops;
      if (is_compute(op.op)) s.ops_per_step += op.ops;
    }
  }
  add_deliveries(r);
  span_total_ += time.span_ms;
  wall_total_ += r.wall_ms;
  ++timed_;
}

void ReportBuilder::add_deliveries(const StepResult& r) {
  const int K = program_.num_stages;
  if (static_cast<int>(r.stages.size()) != K) return;
  for (int k = 0; k < K; ++k) {
    if (r.stages[k].ops.size() != program_.stages[k].size()) return;  // not this schedule's timings
  }
  if (delivery_.empty()) delivery_.assign(K, {0.0, 0});
  // On the job clock: each stage's op times are relative to its own step start.
  std::map<MessageKey, double> sent;
  for (int k = 0; k < K; ++k) {
    for (size_t i = 0; i < program_.stages[k].size(); ++i) {
      const Op op = program_.stages[k][i].op;
      if (op == Op::kSendActivation || op == Op::kSendGradient) {
        sent[message_key(program_, k, program_.stages[k][i])] = r.stages[k].start_ms + r.stages[k].ops[i].end_ms;
      }
    }
  }
  for (int k = 0; k < K; ++k) {
    for (size_t i = 0; i < program_.stages[k].size(); ++i) {
      const Op op = program_.stages[k][i].op;
      if (op != Op::kRecvActivation && op != Op::kRecvGradient) continue;
      auto it = sent.find(message_key(program_, k, program_.stages[k][i]));
      const TimedOp& t = r.stages[k].ops[i];
      if (it == sent.end() || r.stages[k].start_ms + t.start_ms >= it->second) continue;  // it was there already
      delivery_[k].first += std::max(0.0, r.stages[k].start_ms + t.end_ms - it->second);
      ++delivery_[k].second;
    }
  }
}

void ReportBuilder::add_validation(int step, double loss, double accuracy) {
  validations_.push_back({step, loss, accuracy});
}

// ---- The run's history across launches (resumes, restarts).

namespace {

// Version 2 numbers steps from 1, as every output does; version 1 (gpipe before
// 2026-11-26) numbered them from 0 and is read by adding 1.
constexpr int kHistoryVersion = 2;

constexpr double kMiB = 1024.0 * 1024.0;  // memory is shown in MiB everywhere (the planner's tables too)

// "41.3%", or "-" for an unknown share (negative).
std::string percent(double share) {
  if (share < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * share);
  return buf;
}

Error malformed(const std::string& what) {
  return Error("malformed report history (saved with the checkpoint in trainer_state.json): " + what +
               "; the checkpoint's weights do not depend on it: remove the history from trainer_state.json to resume "
               "with a report of this launch only");
}

// A step number: an integer in [first, INT_MAX - 1] (first: 1, or 0 in a version-1 history).
int step_of(const nlohmann::json& v, const std::string& where, int first) {
  if (!v.is_number_integer()) throw malformed(where + " is " + v.dump() + ", not an integer step");
  // JSON's non-negative integers are unsigned: 0 is one, and still below a first step of 1.
  if (v.is_number_unsigned() ? (v.get<uint64_t>() >= static_cast<uint64_t>(INT_MAX) ||
                                v.get<uint64_t>() < static_cast<uint64_t>(first))
                             : (v.get<int64_t>() < first || v.get<int64_t>() >= INT_MAX)) {
    throw malformed(where + " is " + v.dump() + ", not a step from " + std::to_string(first) + " to " +
                    std::to_string(INT_MAX - 1));
  }
  return static_cast<int>(v.get<int64_t>());
}

// A loss or an accuracy. Training losses are finite (the trainer stops at a NaN); a
// validation score may not be, and JSON writes a NaN as null.
double value_of(const nlohmann::json& v, const std::string& where, bool may_be_nan) {
  if (may_be_nan && v.is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!v.is_number()) throw malformed(where + " is " + v.dump() + ", not a number");
  const double d = v.get<double>();
  if (!std::isfinite(d) && !may_be_nan) throw malformed(where + " is " + v.dump() + ", not finite");
  return d;
}

const nlohmann::json& array_at(const nlohmann::json& h, const char* key) {
  if (!h.contains(key)) throw malformed(std::string("no \"") + key + "\"");
  const nlohmann::json& a = h[key];
  if (!a.is_array()) throw malformed(std::string("\"") + key + "\" is " + a.type_name() + ", not an array");
  return a;
}

}  // namespace

nlohmann::json ReportBuilder::history(int up_to_step) const {
  nlohmann::json h = {{"version", kHistoryVersion},
                      {"launches", nlohmann::json::array()},
                      {"steps", nlohmann::json::array()},
                      {"validations", nlohmann::json::array()}};
  for (size_t i = 0; i < launch_first_.size(); ++i) {
    if (launch_first_[i] > up_to_step) break;  // none of its steps is in the history
    h["launches"].push_back({{"launch", static_cast<int>(i) + 1}, {"first_step", launch_first_[i]}});
  }
  for (const auto& [step, loss] : losses_) {
    if (step <= up_to_step) h["steps"].push_back({step, loss});
  }
  for (const auto& v : validations_) {
    if (v.step <= up_to_step) h["validations"].push_back({v.step, v.loss, v.accuracy});
  }
  return h;
}

void ReportBuilder::carry_over(const nlohmann::json& h, int first_step) {
  GPIPE_CHECK(!first_step_known_ && losses_.empty() && validations_.empty(),
              "carry_over() comes before the launch's first step or validation, once");
  GPIPE_CHECK(first_step >= 1, "a launch's first step is step 1 or later");
  if (!h.is_object()) throw malformed("it is " + std::string(h.type_name()) + ", not an object");
  if (!h.contains("version") || !h["version"].is_number_integer()) throw malformed("no integer \"version\"");
  const int64_t version = h["version"].get<int64_t>();
  if (version != kHistoryVersion && version != 1) {
    throw malformed("version " + h["version"].dump() + ", this gpipe reads versions 1 and " +
                    std::to_string(kHistoryVersion) + " (a newer gpipe wrote it?)");
  }
  const int shift = version == 1 ? 1 : 0;  // version 1 counted steps from 0
  auto step_at = [&](const nlohmann::json& v, const std::string& where) { return step_of(v, where, 1 - shift) + shift; };
  // Launches: numbered 1, 2, ... in order, each starting after the one before and before this one.
  std::vector<int> firsts;
  for (const nlohmann::json& l : array_at(h, "launches")) {
    const std::string where = "launch " + std::to_string(firsts.size() + 1);
    if (!l.is_object() || !l.contains("launch") || !l.contains("first_step")) {
      throw malformed(where + " is " + l.dump() + ", not {\"launch\": N, \"first_step\": S}");
    }
    if (!l["launch"].is_number_integer() || l["launch"].get<int64_t>() != static_cast<int64_t>(firsts.size()) + 1) {
      throw malformed(where + " is numbered " + l["launch"].dump());
    }
    const int f = step_at(l["first_step"], where + "'s first_step");
    if (!firsts.empty() && f <= firsts.back()) {
      throw malformed(where + " starts at step " + std::to_string(f) + ", not after launch " +
                      std::to_string(firsts.size()) + "'s " + std::to_string(firsts.back()));
    }
    if (f >= first_step) {
      throw malformed(where + " starts at step " + std::to_string(f) + ", not before this launch's first step " +
                      std::to_string(first_step));
    }
    firsts.push_back(f);
  }
  const nlohmann::json& steps = array_at(h, "steps");
  const nlohmann::json& vals = array_at(h, "validations");
  if (firsts.empty() && (!steps.empty() || !vals.empty())) throw malformed("steps without a launch");
  // Steps and validations: in order, each in a launch and before this one.
  const int lo = firsts.empty() ? 1 : firsts.front();
  auto in_range = [&](int step, const std::string& where) {
    if (step < lo || step >= first_step) {
      throw malformed(where + " is at step " + std::to_string(step) + ", outside the history's steps " +
                      std::to_string(lo) + " to " + std::to_string(first_step - 1));
    }
  };
  std::vector<std::pair<int, double>> losses;
  for (const nlohmann::json& e : steps) {
    const std::string where = "steps[" + std::to_string(losses.size()) + "]";
    if (!e.is_array() || e.size() != 2) throw malformed(where + " is " + e.dump() + ", not [step, loss]");
    const int step = step_at(e[0], where + "'s step");
    in_range(step, where);
    if (!losses.empty() && step <= losses.back().first) {
      throw malformed(where + " is step " + std::to_string(step) + ", not after step " +
                      std::to_string(losses.back().first));
    }
    losses.emplace_back(step, value_of(e[1], where + "'s loss", false));
  }
  std::vector<Validation> validations;
  for (const nlohmann::json& e : vals) {
    const std::string where = "validations[" + std::to_string(validations.size()) + "]";
    if (!e.is_array() || e.size() != 3) throw malformed(where + " is " + e.dump() + ", not [step, loss, accuracy]");
    const int step = step_at(e[0], where + "'s step");
    in_range(step, where);
    if (!validations.empty() && step < validations.back().step) {
      throw malformed(where + " is step " + std::to_string(step) + ", before step " +
                      std::to_string(validations.back().step));
    }
    validations.push_back({step, value_of(e[1], where + "'s loss", true), value_of(e[2], where + "'s accuracy", true)});
  }
  firsts.push_back(first_step);
  launch_first_ = std::move(firsts);
  first_step_known_ = true;
  losses_ = std::move(losses);
  validations_ = std::move(validations);
}

int ReportBuilder::launch_of(int step) const {
  const auto it = std::upper_bound(launch_first_.begin(), launch_first_.end(), step);
  return std::max(1, static_cast<int>(it - launch_first_.begin()));
}

std::vector<LaunchSummary> ReportBuilder::launches() const {
  std::vector<LaunchSummary> out;
  for (size_t i = 0; i < launch_first_.size(); ++i) {
    out.push_back({static_cast<int>(i) + 1, launch_first_[i], launch_first_[i] - 1, 0});
  }
  for (const auto& [step, loss] : losses_) {
    LaunchSummary& l = out[launch_of(step) - 1];
    l.last_step = std::max(l.last_step, step);
    ++l.steps;
  }
  return out;
}

void ReportBuilder::set_eval(double loss, double accuracy) {
  has_eval_ = true;
  eval_loss_ = loss;
  eval_accuracy_ = accuracy;
}

Simulation ReportBuilder::measured_simulation() const {
  if (timed_ == 0) return {};
  const CostFn cost = [&](int stage, const Instruction& ins) {
    if (ins.op == Op::kRecvActivation || ins.op == Op::kRecvGradient) {  // the measured delivery
      return stage < static_cast<int>(delivery_.size()) && delivery_[stage].second > 0
                 ? delivery_[stage].first / delivery_[stage].second
                 : 0.0;
    }
    if (ins.op == Op::kOptimizerStep) return 0.0;
    if (ins.op == Op::kTiedGradients || ins.op == Op::kGradientNorm) {
      // Its own time, without the wait for the others (which the simulation adds): the
      // quickest stage's mean, that of the one that arrived last.
      double quickest = -1;
      for (const auto& times : op_time_) {
        auto it = times.find({static_cast<int>(ins.op), ins.chunk});
        if (it != times.end()) {
          const double mean = it->second.first / it->second.second;
          quickest = quickest < 0 ? mean : std::min(quickest, mean);
        }
      }
      return std::max(0.0, quickest);
    }
    if (is_tensor_collective(ins.op)) {  // its own mean, found by its place in the program
      const auto& times = tensor_time_[static_cast<size_t>(stage)];
      auto it = times.find(program_position(program_, stage, ins));
      return it == times.end() ? 0.0 : it->second.first / it->second.second;
    }
    auto it = op_time_[stage].find({static_cast<int>(ins.op), ins.chunk});
    return it == op_time_[stage].end() ? 0.0 : it->second.first / it->second.second;
  };
  return simulate(program_, cost, CommModel::kBuffered, turns_);
}

RunSummary ReportBuilder::summary() const {
  RunSummary out;
  out.has_plan = has_plan_;
  out.plan = plan_;
  out.gemms = gemms_;
  out.partitions = static_cast<int>(acc_.size());
  out.micro_batches = program_.num_micro_batches;
  out.recompute = recompute_;
  out.schedule = program_.name;
  out.replicas = replicas_;
  out.tensor_parallel = tensor_parallel_;
  out.sequence_parallel = sequence_parallel_;
  out.batch_size = batch_size_;
  out.timed_steps = timed_;
  out.ideal_bubble = ideal_bubble(out.partitions, out.micro_batches);
  out.formula_bubble = formula_bubble(program_);
  out.stages = acc_;
  out.launches = launches();
  out.timed_launch = launch();
  if (timed_ == 0) return out;
  const Simulation sim = measured_simulation();
  out.predicted_bubble = sim.bubble;
  out.predicted_span_ms = sim.makespan;
  out.span_ms = span_total_ / timed_;
  out.step_ms = wall_total_ / timed_;
  out.samples_per_second = wall_total_ > 0 ? batch_size_ * timed_ / (wall_total_ / 1000.0) : 0;
  double busy = 0;
  for (auto& s : out.stages) {
    s.forward_ms /= timed_;
    s.recompute_ms /= timed_;
    s.backward_ms /= timed_;
    s.weight_ms /= timed_;
    s.optimizer_ms /= timed_;
    s.collective_ms /= timed_;
    s.group_ms /= timed_;
    const size_t k = &s - out.stages.data();
    if (k < delivery_.size() && delivery_[k].second > 0) s.delivery_ms = delivery_[k].first / delivery_[k].second;
    s.comm_ms /= timed_;
    s.idle_ms /= timed_;
    s.busy_ms /= timed_;
    s.utilization = out.span_ms > 0 ? s.busy_ms / out.span_ms : 0;
    busy += s.busy_ms;
    for (StageSummary::OpTime& o : s.op_times) {
      o.calls /= timed_;
      o.ms /= timed_;
    }
    std::stable_sort(s.op_times.begin(), s.op_times.end(),
                     [](const StageSummary::OpTime& a, const StageSummary::OpTime& b) { return a.ms > b.ms; });
  }
  out.measured_bubble = out.span_ms > 0 ? 1.0 - busy / (static_cast<double>(acc_.size()) * out.span_ms) : 0;
  if (stage_flops_.size() == out.stages.size() && stage_peaks_.size() == out.stages.size() && out.step_ms > 0) {
    const double seconds = out.step_ms / 1e3;
    out.mfu = 0;
    for (size_t k = 0; k < out.stages.size(); ++k) {
      StageSummary& st = out.stages[k];
      st.useful_flops = stage_flops_[k];
      st.peak_flops_per_second = stage_peaks_[k];
      st.mfu = st.peak_flops_per_second > 0 ? st.useful_flops / seconds / st.peak_flops_per_second : -1;
      out.useful_flops += st.useful_flops;
      out.peak_flops_per_second += st.peak_flops_per_second;
    }
    out.mfu = out.peak_flops_per_second > 0 ? out.useful_flops / seconds / out.peak_flops_per_second : -1;
  }
  return out;
}

void ReportBuilder::set_flops(std::vector<double> stage_flops, std::vector<double> stage_peaks) {
  stage_flops_ = std::move(stage_flops);
  stage_peaks_ = std::move(stage_peaks);
}

std::string layout_text(const RunSummary& s) {
  std::string out;
  if (s.tensor_parallel > 1) {
    out += ", tensor parallel T=" + std::to_string(s.tensor_parallel) + (s.sequence_parallel ? " (sequence parallel)" : "");
  }
  if (s.replicas > 1) out += ", replicas D=" + std::to_string(s.replicas);
  return out;
}

std::string ReportBuilder::table() const {
  const RunSummary s = summary();
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "Pipeline: K=%d stages, M=%d micro-batches, recompute=%s, schedule=%s, batch=%lld%s\n",
                s.partitions, s.micro_batches, recompute_mode_name(s.recompute), s.schedule.c_str(),
                static_cast<long long>(s.batch_size), layout_text(s).c_str());
  os << line;
  if (s.launches.size() > 1 && !losses_.empty()) {
    const LaunchSummary& now = s.launches.back();
    std::snprintf(line, sizeof line, "Run: steps %d-%d in %zu launches; timings are from launch %d (steps %d-%d)\n",
                  losses_.front().first, losses_.back().first, s.launches.size(), s.timed_launch, now.first_step,
                  now.last_step);
    os << line;
  }
  std::snprintf(line, sizeof line, "Per step, averaged over %d timed steps (span %.2f ms, wall %.2f ms):\n",
                s.timed_steps, s.span_ms, s.step_ms);
  os << line;
  std::snprintf(line, sizeof line, "%-5s %-28s %-7s %9s %9s %9s %8s %8s %8s %6s %6s %10s\n", "stage", "layers",
                "device", "fwd ms", "recomp ms", "bwd ms", "comm ms", "idle ms", "opt ms", "util", "MFU", "peak act");
  os << line;
  bool cut = false;  // a stage's layers longer than their column: listed in full under the table
  for (const auto& st : s.stages) {
    const bool fits = st.layers.size() <= 28;
    cut = cut || !fits;
    std::snprintf(line, sizeof line, "%-5d %-28s %-7s %9.2f %9.2f %9.2f %8.2f %8.2f %8.2f %5.1f%% %6s %6.2f MiB\n",
                  st.stage, fits ? st.layers.c_str() : (st.layers.substr(0, 25) + "...").c_str(), st.device.c_str(),
                  st.forward_ms, st.recompute_ms, st.backward_ms, st.comm_ms, st.idle_ms, st.optimizer_ms,
                  100 * st.utilization, percent(st.mfu).c_str(), st.peak_activation_bytes / kMiB);
    os << line;
  }
  if (cut) {
    for (const auto& st : s.stages) os << "  stage " << st.stage << " layers: " << st.layers << "\n";
  }
  if (std::any_of(s.stages.begin(), s.stages.end(), [](const StageSummary& st) { return st.device_peak_bytes > 0; })) {
    os << "Device memory, measured (the most the stage's device's allocator had handed out at once from this launch's "
          "first step: "
          "every tensor of its process there, the temporaries too; stages sharing a device in one process read one "
          "count):";
    for (const auto& st : s.stages) {
      std::snprintf(line, sizeof line, "%s stage %d %s %.2f MiB", st.stage == s.stages.front().stage ? "" : ",",
                    st.stage, st.device.c_str(), st.device_peak_bytes / kMiB);
      os << line;
    }
    os << "\n";
  }
  std::string group;  // a tensor-parallel run's sums over each stage's group, inside F, R, B and W
  for (const auto& st : s.stages) {
    if (st.group_ms <= 0) continue;
    std::snprintf(line, sizeof line, "%sstage %d %.2f ms (%.0f%% of its comm)", group.empty() ? "" : ", ", st.stage,
                  st.group_ms, st.comm_ms > 0 ? 100 * st.group_ms / st.comm_ms : 0.0);
    group += line;
  }
  if (!group.empty()) os << "Tensor group's collectives, waits for the other members included (in comm ms, not in fwd, recomp or bwd): "
                           << group << "\n";
  if (!s.stages.empty() && s.stages.front().ops_per_step >= 0) {
    const bool captured = std::any_of(s.stages.begin(), s.stages.end(), [](const StageSummary& st) { return st.captured_nodes > 0; });
    os << (captured ? "Ops per step, measured (backend calls, captured once and replayed: on a GPU one graph launch a step):"
                    : "Ops per step, measured (backend calls: on a GPU most launch one kernel or more, none captured in a graph):");
    for (const auto& st : s.stages) {
      os << (st.stage == 0 ? " " : ", ") << "stage " << st.stage << " " << st.ops_per_step << " in F, R, B and W of "
         << st.all_ops_per_step << " in all";
      if (st.captured_nodes > 0) os << ", " << st.captured_nodes << " of them replayed";
    }
    os << "\n";
  }
  if (s.predicted_bubble >= 0) {
    std::snprintf(line, sizeof line,
                  "Bubble: measured %.3f, predicted %.3f (the schedule simulated with the measured op and delivery times), "
                  "formula %.3f\n",
                  s.measured_bubble, s.predicted_bubble, s.formula_bubble);
  } else {
    std::snprintf(line, sizeof line, "Bubble: measured %.3f, ideal (K-1)/(M+K-1) = %.3f\n", s.measured_bubble,
                  s.ideal_bubble);
  }
  os << line;
  std::snprintf(line, sizeof line, "Throughput: %.1f samples/s\n", s.samples_per_second);
  os << line;
  if (s.mfu >= 0) {
    std::snprintf(line, sizeof line,
                  "MFU: %.1f%% (%.2f GFLOP of forward and backward per step in %.2f ms: %.1f GFLOP/s of the "
                  "devices' %.1f GFLOP/s peak)\n",
                  100 * s.mfu, s.useful_flops / 1e9, s.step_ms, s.useful_flops / (s.step_ms / 1e3) / 1e9,
                  s.peak_flops_per_second / 1e9);
    os << line;
  }
  if (!s.gemms.empty()) {
    os << "Matrix products, and attention and convolutions (their products together), each timed alone on its "
          "device after the run (a call's time, the mean of up to 20; against the device's probed peak), the longest "
          "per micro-batch first:\n";
    constexpr size_t kShown = 8;
    for (size_t i = 0; i < s.gemms.size() && i < kShown; ++i) {
      const GemmRate& g = s.gemms[i];
      std::string stages;
      for (int k : g.stages) stages += (stages.empty() ? "" : ", ") + std::to_string(k);
      std::string peak;
      if (g.peak_flops_per_second > 0) {
        std::snprintf(line, sizeof line, ", %.1f%% of %.1f", 100 * g.flops_per_second / g.peak_flops_per_second,
                      g.peak_flops_per_second / 1e9);
        peak = line;
      }
      // Each operand as stored, ^T where the product reads it transposed.
      auto operand = [](int64_t rows, int64_t cols, bool t) {
        const std::string s = std::to_string(t ? cols : rows) + "x" + std::to_string(t ? rows : cols);
        return t ? "(" + s + ")^T" : s;
      };
      const std::string what =
          g.operands.empty() ? operand(g.m, g.k, g.trans_a) + " @ " + operand(g.k, g.n, g.trans_b) + " -> " +
                                   std::to_string(g.m) + "x" + std::to_string(g.n)
                             : g.operands;
      // The texts of any length; the figures through a buffer.
      std::snprintf(line, sizeof line, ", %lld a micro-batch: %.4g ms, %.1f GFLOP/s", static_cast<long long>(g.calls),
                    g.ms, g.flops_per_second / 1e9);
      os << "  " << g.op << " " << what << ", " << g.dtype << " in, " << g.c_dtype << " out: stage " << stages
         << ", layers " << g.layers << ", " << g.phases << line << peak << "\n";
    }
    if (s.gemms.size() > kShown) os << "  and " << s.gemms.size() - kShown << " more in report.json\n";
  }
  if (std::any_of(s.stages.begin(), s.stages.end(), [](const StageSummary& st) { return !st.op_times.empty(); })) {
    os << "Time by op (trace.ops: each backend op's time per step, the device's on a GPU; the longest first):\n";
    constexpr size_t kShownOps = 6;
    for (const StageSummary& st : s.stages) {
      if (st.op_times.empty()) continue;
      double calls = 0, ms = 0;
      for (const StageSummary::OpTime& o : st.op_times) {
        calls += o.calls;
        ms += o.ms;
      }
      std::snprintf(line, sizeof line, "  stage %d: %.3f ms in %.0f calls:", st.stage, ms, calls);
      os << line;
      double rest_calls = 0, rest_ms = 0;
      for (size_t i = 0; i < st.op_times.size(); ++i) {
        const StageSummary::OpTime& o = st.op_times[i];
        if (i >= kShownOps) {
          rest_calls += o.calls;
          rest_ms += o.ms;
          continue;
        }
        std::snprintf(line, sizeof line, " %.3f ms (%.0f calls, %.0f%%)", o.ms, o.calls, ms > 0 ? 100 * o.ms / ms : 0.0);
        os << (i ? "," : "") << " " << o.op << line;
      }
      if (st.op_times.size() > kShownOps) {
        std::snprintf(line, sizeof line, " %.3f ms (%.0f calls)", rest_ms, rest_calls);
        os << ", and " << st.op_times.size() - kShownOps << " more ops" << line;
      }
      os << "\n";
    }
  }
  if (s.has_plan && s.plan.stages.size() == s.stages.size()) {
    const PlannedRun& p = s.plan;
    os << "Planned vs measured (the plan's costs: " << p.source << "):\n";
    std::snprintf(line, sizeof line, "%-5s %21s %21s %21s %23s %23s\n", "stage", "busy ms plan/meas",
                  "idle ms plan/meas", "util plan/meas", "peak act MiB plan/meas", "opt state MiB plan/meas");
    os << line;
    for (size_t k = 0; k < s.stages.size(); ++k) {
      const StageSummary& m = s.stages[k];
      const PlannedStage& q = p.stages[k];
      std::snprintf(line, sizeof line,
                    "%-5zu %10.2f / %8.2f %10.2f / %8.2f %9.1f%% / %7.1f%% %12.2f / %8.2f %12.2f / %8.2f\n", k,
                    q.busy_ms, m.busy_ms, q.idle_ms, m.idle_ms, 100 * q.utilization, 100 * m.utilization,
                    q.activation_bytes / kMiB, m.peak_activation_bytes / kMiB, q.optimizer_bytes / kMiB,
                    m.optimizer_bytes / kMiB);
      os << line;
    }
    std::snprintf(line, sizeof line,
                  "Step: planned %.2f ms, measured %.2f ms (%+.1f%%); bubble planned %.3f, measured %.3f; "
                  "%.1f samples/s planned\n",
                  p.step_ms, s.step_ms, s.step_ms > 0 ? 100 * (p.step_ms - s.step_ms) / s.step_ms : 0.0, p.bubble,
                  s.measured_bubble, p.samples_per_second);
    os << line;
    if (p.stages.front().launches >= 0) {
      const bool captured = std::any_of(s.stages.begin(), s.stages.end(), [](const StageSummary& st) { return st.captured_nodes > 0; });
      os << (p.launches_captured ? "Ops per step, planned (the layers' F, R, B and W counted on shapes; the plan prices "
                                   "each as a node of the captured step's graph):"
             : captured ? "Ops per step, planned (the layers' F, R, B and W counted on shapes; the plan prices each as a "
                          "kernel launch of its own, as if the step were not captured):"
                        : "Ops per step, planned (the layers' F, R, B and W counted on shapes; on a GPU each one kernel "
                          "launch or more, not captured in a graph):");
      for (size_t k = 0; k < p.stages.size(); ++k) os << (k == 0 ? " " : ", ") << "stage " << k << " " << p.stages[k].launches;
      os << "\n";
    }
  }
  if (has_eval_) {
    std::snprintf(line, sizeof line, "Validation: loss %.4f, accuracy %.2f%%\n", eval_loss_, 100 * eval_accuracy_);
    os << line;
  }
  if (last_loss_scale_ > 0) {
    std::string which;
    for (size_t i = 0; i < skipped_steps_.size() && i < 10; ++i) which += (i ? ", " : "") + std::to_string(skipped_steps_[i]);
    if (skipped_steps_.size() > 10) which += ", ...";
    std::snprintf(line, sizeof line, "Loss scaling (fp16): %zu of %zu steps skipped on overflow%s%s%s; the last step's scale %.0f\n",
                  skipped_steps_.size(), losses_.size(), which.empty() ? "" : " (steps ", which.c_str(),
                  which.empty() ? "" : ")", last_loss_scale_);
    os << line;
  }
  return os.str();
}

// ---- report.json

namespace {

// The times of one stage's step, measured or planned (one accounting, StageTime).
nlohmann::json stage_time_json(const StageTime& t) {
  return {{"forward_ms", t.forward_ms}, {"recompute_ms", t.recompute_ms}, {"backward_ms", t.backward_ms},
          {"weight_ms", t.weight_ms},   {"optimizer_ms", t.optimizer_ms}, {"comm_ms", t.comm_ms},
          {"idle_ms", t.idle_ms},       {"busy_ms", t.busy_ms},           {"utilization", t.utilization},
          {"tensor_group_ms", t.group_ms}};
}

// A stage's measured times (per step) and peak activations, as report.json's "stages" show them.
nlohmann::json stage_json(const StageSummary& st) {
  nlohmann::json j = stage_time_json(st);
  j.update({{"stage", st.stage},
            {"layers", st.layers},
            {"device", st.device},
            {"collective_ms", st.collective_ms},
            {"optimizer_reduce_ms", st.collective_ms},  // the old name, for one release
            {"delivery_ms", st.delivery_ms},
            {"peak_activation_bytes", st.peak_activation_bytes},
            {"device_peak_bytes", st.device_peak_bytes},
            {"optimizer_bytes", st.optimizer_bytes}});
  if (st.ops_per_step >= 0) {
    j.update({{"ops_per_step", st.ops_per_step}, {"ops_per_step_all", st.all_ops_per_step},
              {"captured_ops", st.captured_nodes}});
  }
  if (st.mfu >= 0) {
    j.update({{"mfu", st.mfu}, {"useful_flops", st.useful_flops}, {"peak_flops_per_second", st.peak_flops_per_second}});
  }
  if (!st.op_times.empty()) {  // trace.ops, per step, the longest first
    nlohmann::json ops = nlohmann::json::array();
    for (const StageSummary::OpTime& o : st.op_times) {
      ops.push_back({{"op", o.op}, {"calls_per_step", o.calls}, {"ms_per_step", o.ms}});
    }
    j["op_times"] = std::move(ops);
  }
  return j;
}

// A stage's predicted times and memory, as report.json's "prediction" shows them.
nlohmann::json planned_stage_json(const PlannedStage& q) {
  nlohmann::json j = stage_time_json(q);
  j.update({{"weight_bytes", q.weight_bytes},
            {"gradient_bytes", q.gradient_bytes},
            {"optimizer_bytes", q.optimizer_bytes},
            {"activation_bytes", q.activation_bytes}});
  if (q.launches >= 0) j["ops_per_step"] = q.launches;
  return j;
}

// The planner's prediction of the run: its step, span, bubble and throughput, and its stages.
nlohmann::json prediction_json(const PlannedRun& plan) {
  nlohmann::json stages = nlohmann::json::array();  // in stage order
  for (const PlannedStage& q : plan.stages) stages.push_back(planned_stage_json(q));
  return {{"source", plan.source},
          {"step_ms", plan.step_ms},
          {"span_ms", plan.span_ms},
          {"bubble", plan.bubble},
          {"samples_per_second", plan.samples_per_second},
          {"stages", stages}};
}

}  // namespace

nlohmann::json ReportBuilder::json() const {
  const RunSummary s = summary();
  nlohmann::json j;
  j["num_stages"] = s.partitions;  // K, pipeline.partitions
  j["micro_batches"] = s.micro_batches;
  j["recompute"] = recompute_mode_name(s.recompute);
  // The old names of these two, for one release: "checkpoint" now means saved state only.
  j["partitions"] = s.partitions;
  j["checkpoint"] = recompute_mode_name(s.recompute);
  j["schedule"] = s.schedule;
  j["batch_size"] = s.batch_size;
  j["timed_steps"] = s.timed_steps;
  j["timed_launch"] = s.timed_launch;  // every timing figure is this launch's; steps and validation span all
  j["span_ms"] = s.span_ms;
  j["step_ms"] = s.step_ms;
  j["samples_per_second"] = s.samples_per_second;
  if (s.mfu >= 0) {
    // Model FLOPs utilization: useful_flops (forward and backward of the model per step, no
    // recompute) per second of step_ms, over the stages' summed peak_flops_per_second.
    j["mfu"] = s.mfu;
    j["useful_flops"] = s.useful_flops;
    j["peak_flops_per_second"] = s.peak_flops_per_second;
  }
  j["bubble"] = {{"measured", s.measured_bubble},
                 {"theoretical", s.ideal_bubble},
                 {"formula", s.formula_bubble},
                 {"predicted", s.predicted_bubble}};
  j["predicted_span_ms"] = s.predicted_span_ms;
  j["steps"] = nlohmann::json::array();
  for (const auto& [step, loss] : losses_) {
    j["steps"].push_back({{"step", step}, {"loss", loss}, {"launch", launch_of(step)}});
  }
  j["launches"] = nlohmann::json::array();
  for (const LaunchSummary& l : s.launches) {
    j["launches"].push_back(
        {{"launch", l.launch}, {"first_step", l.first_step}, {"last_step", l.last_step}, {"steps", l.steps}});
  }
  j["stages"] = nlohmann::json::array();
  for (const auto& st : s.stages) j["stages"].push_back(stage_json(st));
  if (has_eval_) j["eval"] = {{"loss", eval_loss_}, {"accuracy", eval_accuracy_}};
  if (last_loss_scale_ > 0) j["loss_scaling"] = {{"skipped_steps", skipped_steps_}, {"last_scale", last_loss_scale_}};
  if (s.has_plan) j["prediction"] = prediction_json(s.plan);
  if (!s.gemms.empty()) {
    // Each matrix product timed alone: c (m, n) = op(a) (m, k) op(b) (k, n); flops 2 m n k
    // a call; flops_per_second = flops / (ms / 1000); peak_fraction over the device's
    // whole probed peak. Attention and convolutions: m, n, k 0, their `operands`, and the
    // flops of their products (kernels/meta_backend.h, MetaProduct).
    j["gemms"] = nlohmann::json::array();
    for (const GemmRate& g : s.gemms) {
      nlohmann::json e = {{"op", g.op},
                          {"m", g.m},
                          {"n", g.n},
                          {"k", g.k},
                          {"trans_a", g.trans_a},
                          {"trans_b", g.trans_b},
                          {"dtype", g.dtype},
                          {"c_dtype", g.c_dtype},
                          {"device", g.device},
                          {"stages", g.stages},
                          {"layers", g.layers},
                          {"phases", g.phases},
                          {"calls_per_micro_batch", g.calls},
                          {"timed_calls", g.timed_calls},
                          {"ms", g.ms},
                          {"flops", g.flops()},
                          {"flops_per_second", g.flops_per_second}};
      if (!g.operands.empty()) e["operands"] = g.operands;
      if (g.peak_flops_per_second > 0) {
        e["peak_flops_per_second"] = g.peak_flops_per_second;
        e["peak_fraction"] = g.flops_per_second / g.peak_flops_per_second;
      }
      j["gemms"].push_back(std::move(e));
    }
  }
  j["validation"] = nlohmann::json::array();
  for (const auto& v : validations_) {
    j["validation"].push_back(
        {{"step", v.step}, {"loss", v.loss}, {"accuracy", v.accuracy}, {"launch", launch_of(v.step)}});
  }
  return j;
}

}  // namespace pipeline
}  // namespace gpipe
