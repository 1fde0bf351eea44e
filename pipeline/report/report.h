// Bubble and utilization reports: where each stage's time went, against the schedule's
// formula (GPipe's (K-1)/(M+K-1)) and against the simulator's prediction from the
// measured per-instruction times. Built from the executor's per-instruction timings.
//
// Per step, the pipeline span is from the step's start to the end of the last
// backward on any stage (the optimizer steps after it are reported on their own).
// Within the span a stage is busy (forward, recompute, backward, weight gradient),
// communicating (sends), or idle (waiting for a neighbour at a receive, or with
// nothing to do: the bubble).
//
// A run may span several launches (a resume, a supervisor restart): the steps' losses and
// the validation scores cover the whole run (history() goes into each checkpoint,
// carry_over() takes it back), while the timings are always this launch's own.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/executor/executor.h"
#include "pipeline/planning/prediction.h"
#include "pipeline/schedule/time_accounting.h"

namespace gpipe {
namespace pipeline {

// A stage's measured time per step, averaged over the timed steps (time_accounting.h,
// the planner's accounting of predicted steps), and what only a measurement has.
struct StageSummary : StageTime {
  int stage = 0;
  std::string layers;  // "0-15 linear x8, relu x8"
  std::string device;
  // Mean time from a send's end to the end of its receive, over the receives of this
  // stage that were waiting for their message (a thread's wake-up, a transfer); -1: none.
  double delivery_ms = -1;
  int64_t peak_activation_bytes = 0;
  // The stage's device's allocator at its most (StageTrace::device_peak_bytes), from the
  // launch's first step to its last timed one (the count never falls within a launch, so
  // the largest reading is the last); stages sharing a device in one process read one count.
  int64_t device_peak_bytes = 0;
  // Backend ops the stage's thread called per step (TimedOp::ops), in the last timed step:
  // in its F, R, B and W (what the plan counts on shapes, PlannedStage::launches, on the
  // CPU), and in all (its other instructions and StageTrace::other_ops too). -1: none timed.
  int64_t ops_per_step = -1, all_ops_per_step = -1;
  // pipeline.capture: the captured step's ops (StageTrace::captured_nodes) when the last
  // timed step was a replay of it (on a GPU one graph launch); 0 when it ran op by op.
  int64_t captured_nodes = 0;
  // The optimizer state the stage's device holds (one replica's; its shard's, when
  // sharded), measured after each step: the most of any timed step.
  int64_t optimizer_bytes = 0;
  // Model FLOPs utilization: the stage's useful FLOPs per step (Plan::stage_flops) per
  // second of step, over its device's peak (device_peak.h); -1 when unknown.
  double useful_flops = 0;      // per step
  double peak_flops_per_second = 0;
  double mfu = -1;
  // trace.ops: each backend op the stage's thread called, with its calls and milliseconds
  // per step (the device's time on a GPU; StageTrace::op_times), the mean over the timed
  // steps, the longest first. Empty when the ops were not timed.
  struct OpTime {
    std::string op;
    double calls = 0, ms = 0;
  };
  std::vector<OpTime> op_times;
};

// One launch of the run as the report shows it: its steps are [first_step, last_step]
// (numbered from 1, as in the terminal; last_step = first_step - 1 and steps = 0 when none
// of its steps is kept).
struct LaunchSummary {
  int launch = 1;
  int first_step = 1;
  int last_step = 0;
  int steps = 0;  // the steps of the report that ran in it
};

// One matrix product of the run timed alone on its stage's device after the last step
// (pipeline/train/gemm_rates.h): c (m, n) = op(a) (m, k) op(b) (k, n), row-major.
struct GemmRate {
  // The backend op: matmul, matmul_weight, linear_bias, linear_weight_grad, linear_residual,
  // linear_input_grad_add; or one made of
  // several products (MetaProduct), with m, n, k 0, its `operands` and its `op_flops`:
  // attention, attention_backward, fused_attention, fused_attention_backward, conv2d,
  // conv2d_backward.
  std::string op;
  std::string operands;  // "qkv 4x128x384, heads 4 -> probs ..., out ..." ("" for a product)
  double op_flops = 0;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  std::string dtype, c_dtype;  // a's and b's; c's
  std::string device;
  std::vector<int> stages;  // the stages whose layers call it
  std::string layers;       // those layers' indices, "0, 2, 4-7"
  std::string phases;       // where they call it: "F", "B", "W", or several ("FB")
  int64_t calls = 0;        // calls per micro-batch over those stages: F, B and W (R repeats F's)
  int timed_calls = 0;
  double ms = 0;            // one call's time (device time on a GPU), the mean of the timed calls
  double flops_per_second = 0;       // 2 m n k / ms
  double peak_flops_per_second = 0;  // the device's probed peak, whole (0: not known)
  double flops() const {
    return operands.empty() ? 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) : op_flops;
  }
};

struct RunSummary {
  int partitions = 0, micro_batches = 0;
  // The job's other axes (set_layout): data-parallel replicas, the tensor group's size and
  // whether it splits the positions between its split layers.
  int replicas = 1, tensor_parallel = 1;
  bool sequence_parallel = false;
  RecomputeMode recompute = RecomputeMode::kExceptLast;  // "checkpoint" in report.json (recompute_mode_name)
  std::string schedule;
  int64_t batch_size = 0;
  int timed_steps = 0;
  double span_ms = 0;  // per step, averaged
  double step_ms = 0;  // wall time per step, averaged
  double samples_per_second = 0;
  // The whole pipeline's MFU: its useful FLOPs per second over the sum of its stages'
  // peaks (-1 when unknown). With replicas, one pipeline's: every replica runs the same.
  double useful_flops = 0;  // per step
  double peak_flops_per_second = 0;
  double mfu = -1;
  double measured_bubble = 0, ideal_bubble = 0;
  double formula_bubble = 0;    // the schedule's own formula (interleaving divides GPipe's by v)
  double predicted_bubble = -1;  // simulate() of the schedule with the measured mean time of each
                                 // instruction kind per stage; -1 without a schedule
  double predicted_span_ms = 0;
  std::vector<StageSummary> stages;
  // Every launch of the run (one for a fresh run); the timings above are timed_launch's only.
  std::vector<LaunchSummary> launches;
  int timed_launch = 1;
  // The planner's prediction made before the run (planner.h), when it was given one.
  bool has_plan = false;
  PlannedRun plan;
  // The run's matrix products, each timed alone (empty: not measured).
  std::vector<GemmRate> gemms;
};

// The job's axes beyond the pipeline, for the table's and the page's heading: ", tensor
// parallel T=2 (sequence parallel), replicas D=2", or "" for one pipeline of whole stages.
std::string layout_text(const RunSummary& s);

class ReportBuilder {
 public:
  // One entry per stage of the pipeline (a multi-process run gathers every stage's
  // timings into its first stage's process, see trainer.cc).
  // The run's facts come from its Plan: the program that runs (its stages, micro-batches
  // and name; the predicted bubble simulates it), the recompute mode and the mini-batch.
  // stage_layers and stage_devices describe the program's stages, one entry each.
  ReportBuilder(std::vector<std::string> stage_layers, std::vector<std::string> stage_devices, Schedule program,
                RecomputeMode recompute, int64_t batch_size);
  // Step number `step` (from 1, as every output numbers steps) and its timings; a step
  // that is not `timed` (the warm-up) only contributes its loss.
  void add_step(int step, double loss, const StepResult& r, bool timed);
  void set_eval(double loss, double accuracy);
  // MFU's inputs, per stage: useful FLOPs per step (Plan::stage_flops) and the device's
  // peak FLOP/s (device_peaks). Without them the report shows no MFU.
  void set_flops(std::vector<double> stage_flops, std::vector<double> stage_peaks);
  // The run's matrix products, each timed alone after the last step (gemm_rates.h).
  void set_gemms(std::vector<GemmRate> gemms) { gemms_ = std::move(gemms); }
  // What the planner predicted for this run, shown beside the measurements.
  void set_prediction(PlannedRun plan) { plan_ = std::move(plan); has_plan_ = true; }
  // The job's replicas and tensor group (1, 1, false: one pipeline of whole stages).
  void set_layout(int replicas, int tensor_parallel, bool sequence_parallel) {
    replicas_ = replicas;
    tensor_parallel_ = tensor_parallel;
    sequence_parallel_ = sequence_parallel;
  }
  // Stages that take turns on one device (Plan::turns): the predicted bubble's simulation
  // has them wait for each other, as they did. None set: each stage its own device.
  void set_turns(std::vector<int> turns) { turns_ = std::move(turns); }
  // A validation score taken after step number `step`.
  void add_validation(int step, double loss, double accuracy);
  RunSummary summary() const;
  // The schedule simulated with the measured mean time of each instruction kind per
  // stage (the predicted bubble's source); an empty Simulation before any timed step.
  Simulation measured_simulation() const;
  const std::vector<std::pair<int, double>>& losses() const { return losses_; }
  struct Validation {
    int step;
    double loss, accuracy;
  };
  const std::vector<Validation>& validations() const { return validations_; }

  // The run's history so far, for a checkpoint's trainer_state.json: every launch, and every
  // step's loss and validation up to and including step number `up_to_step` (the number of steps
  // done; steps after it are left out).
  //   {"version": 2, "launches": [{"launch": 1, "first_step": 1}, ...],
  //    "steps": [[step, loss], ...], "validations": [[step, loss, accuracy], ...]}
  // A launch that starts after `up_to_step` is left out too (it has no step in the history).
  nlohmann::json history(int up_to_step) const;
  // A resumed launch: the history saved with its checkpoint (steps and validations before
  // `first_step`, the launches before this one); this launch is numbered after them and starts at first_step.
  // Throws gpipe::Error on a malformed history. A run that starts fresh calls nothing and is launch 1 starting at step 1.
  // Reads version 1 too (steps numbered from 0) and renumbers it.
  // Call it before this launch's first add_step or add_validation.
  void carry_over(const nlohmann::json& history, int first_step);
  // This launch's number (1 for a fresh run): the one the timings come from.
  int launch() const { return static_cast<int>(launch_first_.size()); }
  // The launch step `step` ran in: the last one that started at or before it.
  int launch_of(int step) const;
  // Every launch, with the steps of the report that ran in it.
  std::vector<LaunchSummary> launches() const;

  // The table printed at the end of a run.
  std::string table() const;
  nlohmann::json json() const;

 private:
  // Folds the step's waiting receives into delivery_ (by the schedule's message keys).
  void add_deliveries(const StepResult& r);

  std::vector<std::string> layers_, devices_;
  std::vector<int> turns_;
  Schedule program_;  // the run's program: K, M and the schedule's name are its
  RecomputeMode recompute_;
  int64_t batch_size_;
  std::vector<std::pair<int, double>> losses_;
  std::vector<Validation> validations_;
  std::vector<int> launch_first_;  // launch i+1's first step; the last is this launch's
  bool first_step_known_ = false;  // carry_over() set it; otherwise this launch's first add_step does
  std::vector<StageSummary> acc_;
  // Per stage: total time and count of each (instruction kind, chunk).
  std::vector<std::map<std::pair<int, int>, std::pair<double, int>>> op_time_;
  // Per stage: total time and count of each tensor collective, by its place in the
  // program (each is its own: a layer's sum, the loss's, a step sum).
  std::vector<std::map<size_t, std::pair<double, int>>> tensor_time_;
  std::vector<std::pair<double, int>> delivery_;  // per stage: sum and count of waiting receives' delivery times
  PlannedRun plan_;
  bool has_plan_ = false;
  int replicas_ = 1, tensor_parallel_ = 1;
  bool sequence_parallel_ = false;
  int timed_ = 0;
  double span_total_ = 0, wall_total_ = 0;
  std::vector<double> stage_flops_, stage_peaks_;
  std::vector<GemmRate> gemms_;
  bool has_eval_ = false;
  double eval_loss_ = 0, eval_accuracy_ = 0;
  // fp16's loss scaling (this launch's steps): the steps skipped on overflow, and the
  // scale the last step used (0: no loss scaling).
  std::vector<int> skipped_steps_;
  double last_loss_scale_ = 0;
};

// "linear x8, relu x8" for a cell.
std::string describe_layers(const layers::Sequential& model, int first, int count);

// Between the cells of one stage's layer text (its chunks, with virtual stages):
// "0-1 embedding, transformer_block | 4-5 transformer_block x2". The page splits on it.
constexpr const char* kChunkSeparator = " | ";

}  // namespace pipeline
}  // namespace gpipe
