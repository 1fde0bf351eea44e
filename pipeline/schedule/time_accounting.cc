#include "pipeline/schedule/time_accounting.h"

#include <algorithm>
#include <map>
#include <utility>

namespace gpipe {
namespace pipeline {

TimeCategory time_category(Op op) {
  if (is_compute(op)) return TimeCategory::kCompute;
  if (op == Op::kOptimizerStep) return TimeCategory::kOptimizer;
  if (op == Op::kRecvActivation || op == Op::kRecvGradient) return TimeCategory::kWaiting;
  return TimeCategory::kCommunication;
}

void StageTime::add(const StageTime& s) {
  forward_ms += s.forward_ms;
  recompute_ms += s.recompute_ms;
  backward_ms += s.backward_ms;
  weight_ms += s.weight_ms;
  optimizer_ms += s.optimizer_ms;
  comm_ms += s.comm_ms;
  collective_ms += s.collective_ms;
  group_ms += s.group_ms;
  idle_ms += s.idle_ms;
  busy_ms += s.busy_ms;
}

StepTime account_step(const std::vector<std::vector<OpSpan>>& stages) {
  StepTime out;
  for (const auto& ops : stages) {
    for (const OpSpan& op : ops) {
      if (time_category(op.op) != TimeCategory::kOptimizer) out.span_ms = std::max(out.span_ms, op.end_ms);
    }
  }
  std::map<std::pair<int, int>, double> quickest;  // (TIE or NORM, tie) -> its shortest duration
  for (const auto& ops : stages) {
    for (const OpSpan& op : ops) {
      if (op.op != Op::kTiedGradients && op.op != Op::kGradientNorm) continue;
      auto [it, fresh] = quickest.emplace(std::make_pair(static_cast<int>(op.op), op.micro_batch), op.end_ms - op.start_ms);
      if (!fresh) it->second = std::min(it->second, op.end_ms - op.start_ms);
    }
  }
  out.stages.assign(stages.size(), {});
  for (size_t k = 0; k < stages.size(); ++k) {
    StageTime& s = out.stages[k];
    double opt_in_span = 0;  // counted only where a collective follows OPT
    bool gathers = false;
    for (const OpSpan& op : stages[k]) gathers = gathers || after_optimizer(op.op);
    for (const OpSpan& op : stages[k]) {
      if (is_tensor_collective(op.op)) continue;  // inside its compute instruction's span, as its group_ms
      double d = op.end_ms - op.start_ms;
      switch (time_category(op.op)) {
        case TimeCategory::kCompute: {
          // A split layer's sums over its tensor group: communication.
          const double group = std::min(std::max(0.0, op.group_ms), d);
          s.comm_ms += group;
          s.group_ms += group;
          d -= group;
          switch (op.op) {
            case Op::kForward: s.forward_ms += d; break;
            case Op::kRecompute: s.recompute_ms += d; break;
            case Op::kBackwardWeight: s.weight_ms += d; s.backward_ms += d; break;
            default: s.backward_ms += d; break;  // B
          }
          s.busy_ms += d;
          break;
        }
        case TimeCategory::kCommunication: {
          double own = d;  // a send's, or RG's
          if (op.op == Op::kTiedGradients || op.op == Op::kGradientNorm) {
            own = std::min(d, quickest.at({static_cast<int>(op.op), op.micro_batch}));
          }
          s.comm_ms += own;
          if (is_collective(op.op)) s.collective_ms += own;
          break;
        }
        case TimeCategory::kOptimizer:
          s.optimizer_ms += d;
          // Where a collective follows it (AG, sharded optimizer state) it is inside
          // the span, and not idle time. (An OPT that merely ends before another
          // stage's last instruction stays idle time, as the bubble's tail.)
          opt_in_span += d;
          break;
        case TimeCategory::kWaiting: break;  // idle: counted as what the span leaves
      }
    }
    s.idle_ms = std::max(0.0, out.span_ms - s.busy_ms - s.comm_ms - (gathers ? opt_in_span : 0.0));
    s.utilization = out.span_ms > 0 ? s.busy_ms / out.span_ms : 0;
  }
  return out;
}

}  // namespace pipeline
}  // namespace gpipe
