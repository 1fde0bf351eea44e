#include "pipeline/report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

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
                             int micro_batches, std::string checkpoint, std::string schedule, int64_t batch_size)
    : layers_(std::move(stage_layers)), devices_(std::move(stage_devices)), micro_batches_(micro_batches),
      checkpoint_(std::move(checkpoint)), schedule_(std::move(schedule)), batch_size_(batch_size),
      acc_(layers_.size()), op_time_(layers_.size()) {
  for (size_t k = 0; k < acc_.size(); ++k) {
    acc_[k].stage = static_cast<int>(k);
    acc_[k].layers = layers_[k];
    acc_[k].device = devices_[k];
  }
}

void ReportBuilder::add_step(int step, double loss, const StepResult& r, bool timed) {
  losses_.emplace_back(step, loss);
  if (!timed) return;
  double span = 0;
  for (const auto& st : r.stages) {
    for (const auto& op : st.ops) {
      if (op.op != Op::kOptimizerStep) span = std::max(span, op.end_ms);
    }
  }
  for (size_t k = 0; k < acc_.size() && k < r.stages.size(); ++k) {
    StageSummary& s = acc_[k];
    const StageTrace& trace = r.stages[k];
    double busy = 0, comm = 0;
    for (const auto& op : trace.ops) {
      const double d = op.end_ms - op.start_ms;
      auto& t = op_time_[k][{static_cast<int>(op.op), op.chunk}];
      t.first += d;
      ++t.second;
      switch (op.op) {
        case Op::kForward: s.forward_ms += d; busy += d; break;
        case Op::kRecompute: s.recompute_ms += d; busy += d; break;
        case Op::kBackward: s.backward_ms += d; busy += d; break;
        case Op::kBackwardWeight: s.weight_ms += d; s.backward_ms += d; busy += d; break;
        case Op::kOptimizerStep:
          s.optimizer_ms += d;
          s.reduce_ms += std::max(0.0, op.reduce_ms);
          break;
        case Op::kSendActivation:
        case Op::kSendGradient: comm += d; break;
        case Op::kRecvActivation:
        case Op::kRecvGradient: break;  // waiting for the neighbour: idle
      }
    }
    s.busy_ms += busy;
    s.comm_ms += comm;
    s.idle_ms += std::max(0.0, span - busy - comm);
    s.peak_activation_bytes = std::max(s.peak_activation_bytes, trace.peak_activation_bytes);
  }
  add_deliveries(r);
  span_total_ += span;
  wall_total_ += r.wall_ms;
  ++timed_;
}

void ReportBuilder::add_deliveries(const StepResult& r) {
  const int K = program_.num_stages;
  if (!has_schedule_ || static_cast<int>(r.stages.size()) != K) return;
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

void ReportBuilder::set_eval(double loss, double accuracy) {
  has_eval_ = true;
  eval_loss_ = loss;
  eval_accuracy_ = accuracy;
}

Simulation ReportBuilder::measured_simulation() const {
  if (!has_schedule_ || timed_ == 0 || static_cast<int>(op_time_.size()) != program_.num_stages) return {};
  const CostFn cost = [&](int stage, const Instruction& ins) {
    if (ins.op == Op::kRecvActivation || ins.op == Op::kRecvGradient) {  // the measured delivery
      return stage < static_cast<int>(delivery_.size()) && delivery_[stage].second > 0
                 ? delivery_[stage].first / delivery_[stage].second
                 : 0.0;
    }
    if (ins.op == Op::kOptimizerStep) return 0.0;
    auto it = op_time_[stage].find({static_cast<int>(ins.op), ins.chunk});
    return it == op_time_[stage].end() ? 0.0 : it->second.first / it->second.second;
  };
  return simulate(program_, cost);
}

RunSummary ReportBuilder::summary() const {
  RunSummary out;
  out.has_plan = has_plan_;
  out.plan = plan_;
  out.partitions = static_cast<int>(acc_.size());
  out.micro_batches = micro_batches_;
  out.checkpoint = checkpoint_;
  out.schedule = schedule_;
  out.batch_size = batch_size_;
  out.timed_steps = timed_;
  out.ideal_bubble = ideal_bubble(out.partitions, micro_batches_);
  out.formula_bubble = has_schedule_ ? formula_bubble(program_) : out.ideal_bubble;
  out.stages = acc_;
  if (timed_ == 0) return out;
  if (has_schedule_ && static_cast<int>(op_time_.size()) == program_.num_stages) {
    const Simulation sim = measured_simulation();
    out.predicted_bubble = sim.bubble;
    out.predicted_span_ms = sim.makespan;
  }
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
    s.reduce_ms /= timed_;
    const size_t k = &s - out.stages.data();
    if (k < delivery_.size() && delivery_[k].second > 0) s.delivery_ms = delivery_[k].first / delivery_[k].second;
    s.comm_ms /= timed_;
    s.idle_ms /= timed_;
    s.busy_ms /= timed_;
    s.utilization = out.span_ms > 0 ? s.busy_ms / out.span_ms : 0;
    busy += s.busy_ms;
  }
  out.measured_bubble = out.span_ms > 0 ? 1.0 - busy / (static_cast<double>(acc_.size()) * out.span_ms) : 0;
  return out;
}

std::string ReportBuilder::table() const {
  const RunSummary s = summary();
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "Pipeline: K=%d stages, M=%d micro-batches, checkpoint=%s, schedule=%s, batch=%lld\n",
                s.partitions, s.micro_batches, s.checkpoint.c_str(), s.schedule.c_str(),
                static_cast<long long>(s.batch_size));
  os << line;
  std::snprintf(line, sizeof line, "Per step, averaged over %d timed steps (span %.2f ms, wall %.2f ms):\n",
                s.timed_steps, s.span_ms, s.step_ms);
  os << line;
  std::snprintf(line, sizeof line, "%-5s %-28s %-7s %9s %9s %9s %8s %8s %8s %6s %10s\n", "stage", "layers", "device",
                "fwd ms", "recomp ms", "bwd ms", "comm ms", "idle ms", "opt ms", "util", "peak act");
  os << line;
  for (const auto& st : s.stages) {
    std::snprintf(line, sizeof line, "%-5d %-28s %-7s %9.2f %9.2f %9.2f %8.2f %8.2f %8.2f %5.1f%% %7.2f MB\n",
                  st.stage, st.layers.substr(0, 28).c_str(), st.device.c_str(), st.forward_ms, st.recompute_ms,
                  st.backward_ms, st.comm_ms, st.idle_ms, st.optimizer_ms, 100 * st.utilization,
                  st.peak_activation_bytes / 1e6);
    os << line;
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
  if (s.has_plan && s.plan.stages.size() == s.stages.size()) {
    const PlannedRun& p = s.plan;
    os << "Planned vs measured (the plan's costs: " << p.source << "):\n";
    std::snprintf(line, sizeof line, "%-5s %21s %21s %21s %21s\n", "stage", "busy ms plan/meas", "idle ms plan/meas",
                  "util plan/meas", "peak act MB plan/meas");
    os << line;
    for (size_t k = 0; k < s.stages.size(); ++k) {
      const StageSummary& m = s.stages[k];
      const PlannedStage& q = p.stages[k];
      std::snprintf(line, sizeof line, "%-5zu %10.2f / %8.2f %10.2f / %8.2f %9.1f%% / %7.1f%% %10.2f / %8.2f\n", k,
                    q.busy_ms, m.busy_ms, q.idle_ms, m.idle_ms, 100 * q.utilization, 100 * m.utilization,
                    q.activation_bytes / 1e6, m.peak_activation_bytes / 1e6);
      os << line;
    }
    std::snprintf(line, sizeof line,
                  "Step: planned %.2f ms, measured %.2f ms (%+.1f%%); bubble planned %.3f, measured %.3f; "
                  "%.1f samples/s planned\n",
                  p.step_ms, s.step_ms, s.step_ms > 0 ? 100 * (p.step_ms - s.step_ms) / s.step_ms : 0.0, p.bubble,
                  s.measured_bubble, p.samples_per_second);
    os << line;
  }
  if (has_eval_) {
    std::snprintf(line, sizeof line, "Validation: loss %.4f, accuracy %.2f%%\n", eval_loss_, 100 * eval_accuracy_);
    os << line;
  }
  return os.str();
}

nlohmann::json ReportBuilder::json() const {
  const RunSummary s = summary();
  nlohmann::json j;
  j["partitions"] = s.partitions;
  j["micro_batches"] = s.micro_batches;
  j["checkpoint"] = s.checkpoint;
  j["schedule"] = s.schedule;
  j["batch_size"] = s.batch_size;
  j["timed_steps"] = s.timed_steps;
  j["span_ms"] = s.span_ms;
  j["step_ms"] = s.step_ms;
  j["samples_per_second"] = s.samples_per_second;
  j["bubble"] = {{"measured", s.measured_bubble},
                 {"theoretical", s.ideal_bubble},
                 {"formula", s.formula_bubble},
                 {"predicted", s.predicted_bubble}};
  j["predicted_span_ms"] = s.predicted_span_ms;
  j["steps"] = nlohmann::json::array();
  for (const auto& [step, loss] : losses_) j["steps"].push_back({{"step", step}, {"loss", loss}});
  j["stages"] = nlohmann::json::array();
  for (const auto& st : s.stages) {
    j["stages"].push_back({{"stage", st.stage},
                           {"layers", st.layers},
                           {"device", st.device},
                           {"forward_ms", st.forward_ms},
                           {"recompute_ms", st.recompute_ms},
                           {"backward_ms", st.backward_ms},
                           {"weight_ms", st.weight_ms},
                           {"optimizer_ms", st.optimizer_ms},
                           {"optimizer_reduce_ms", st.reduce_ms},
                           {"delivery_ms", st.delivery_ms},
                           {"comm_ms", st.comm_ms},
                           {"idle_ms", st.idle_ms},
                           {"busy_ms", st.busy_ms},
                           {"utilization", st.utilization},
                           {"peak_activation_bytes", st.peak_activation_bytes}});
  }
  if (has_eval_) j["eval"] = {{"loss", eval_loss_}, {"accuracy", eval_accuracy_}};
  if (s.has_plan) {
    nlohmann::json stages = nlohmann::json::array();  // in stage order
    for (size_t k = 0; k < s.plan.stages.size(); ++k) {
      const PlannedStage& q = s.plan.stages[k];
      stages.push_back({{"forward_ms", q.forward_ms},
                        {"recompute_ms", q.recompute_ms},
                        {"backward_ms", q.backward_ms},
                        {"weight_ms", q.weight_ms},
                        {"optimizer_ms", q.optimizer_ms},
                        {"comm_ms", q.comm_ms},
                        {"idle_ms", q.idle_ms},
                        {"busy_ms", q.busy_ms},
                        {"utilization", q.utilization},
                        {"weight_bytes", q.weight_bytes},
                        {"gradient_bytes", q.gradient_bytes},
                        {"optimizer_bytes", q.optimizer_bytes},
                        {"activation_bytes", q.activation_bytes}});
    }
    j["prediction"] = {{"source", s.plan.source},
                       {"step_ms", s.plan.step_ms},
                       {"span_ms", s.plan.span_ms},
                       {"bubble", s.plan.bubble},
                       {"samples_per_second", s.plan.samples_per_second},
                       {"stages", stages}};
  }
  j["validation"] = nlohmann::json::array();
  for (const auto& v : validations_) {
    j["validation"].push_back({{"step", v.step}, {"loss", v.loss}, {"accuracy", v.accuracy}});
  }
  return j;
}

}  // namespace pipeline
}  // namespace gpipe
