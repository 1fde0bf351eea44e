// Where each stage's time went in one step: one accounting for what the executor
// measured (the report, report.h) and what the simulator predicted (the planner,
// planner.h), so that the report's measured and predicted columns mean the same thing.
//
// The step's span runs from its start to the end of the last instruction on any stage
// other than the optimizer step (reported on its own, after the span; with sharded
// optimizer state the parameters' all-gather AG follows it, so the span takes the step
// in, and its time is the optimizer's, not idle). Within the span
// a stage computes (forward, recompute, backward, weight gradient: busy, less the time
// a split layer spends in its tensor group's sums), communicates (sends, the collectives'
// own time, and those sums), or is idle: waiting at a receive for its
// neighbour, at a collective for the other stages taking part, or with nothing to do
// (the bubble). A collective among stages (TIE, NORM) lasts, on each, from its arrival
// until the last one arrived plus the collective's own time, which is the quickest
// stage's duration (the last to arrive waits for no one); RG's partners are replicas,
// whose timings are not in this step's: all of its time counts, as all of RS's and AG's.
#pragma once

#include <vector>

#include "pipeline/schedule/schedule.h"

namespace gpipe {
namespace pipeline {

// Which part of a stage's time an instruction's time is.
enum class TimeCategory {
  kCompute,        // is_compute: F, R, B, W
  kCommunication,  // sends and collectives: the stage moves data
  kWaiting,        // receives: the stage waits for its neighbour (idle time)
  kOptimizer,      // the optimizer step, outside the span
};
TimeCategory time_category(Op op);

// One stage's time, in ms: of one step, or summed or averaged over steps.
struct StageTime {
  double forward_ms = 0, recompute_ms = 0, backward_ms = 0;
  double weight_ms = 0;  // W: deferred weight gradients (zero-bubble schedules); in backward_ms too
  double optimizer_ms = 0;
  double comm_ms = 0;  // communication (sends, collectives' own time)
  double collective_ms = 0;  // the collectives' own time (RG, TIE, NORM); in comm_ms too
  double group_ms = 0;  // the tensor group's sums inside F, R and B (OpSpan::group_ms); in comm_ms too
  double idle_ms = 0;  // span - busy - comm: waiting at receives, and the bubble
  double busy_ms = 0;  // compute
  double utilization = 0;  // busy / span
  // Adds another step's times (utilization, a ratio, is left as it is).
  void add(const StageTime& step);
};

// An instruction's place in a stage's step: start and end in ms since the step began.
struct OpSpan {
  Op op;
  double start_ms = 0, end_ms = 0;
  int micro_batch = -1;  // the instruction's; a TIE's tie index, which names the collective
  // A compute instruction's time in its tensor group's collectives (the tensor
  // collectives it ran, tAR tMAX tAG tRS: a split layer's sums inside F, R, B and W):
  // communication, not compute. Their own spans, if given, are skipped: this holds them.
  double group_ms = 0;
};

struct StepTime {
  double span_ms = 0;  // to the end of the last instruction but the optimizer steps
  std::vector<StageTime> stages;
};

// The accounting of one step from each stage's instructions in program order.
StepTime account_step(const std::vector<std::vector<OpSpan>>& stages);

}  // namespace pipeline
}  // namespace gpipe
