// The executor: runs a schedule with one worker thread per stage in this process.
// Each stage owns one or more cells (contiguous ranges of the model's layers; several
// for interleaved schedules) on its device and interprets its instruction list, the
// same interpreter for every schedule; boundary activations and gradients travel
// through a Transport (or hand over directly between cells of one stage). Gradients of
// all micro-batches accumulate into the parameters' grads and one optimizer step per
// stage ends the mini-batch, so a step equals one step on the whole mini-batch on one
// device.
//
// A worker never throws across threads: it records its error, aborts the transport so
// its neighbours stop waiting, and the driver rethrows the first real failure after
// every worker has stopped.
#pragma once

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/op_log.h"
#include "layers/optimizer.h"
#include "layers/sequential.h"
#include "layers/tensor_parallel.h"
#include "pipeline/executor/cell.h"
#include "pipeline/executor/grad_reducer.h"
#include "pipeline/executor/op_clock.h"
#include "pipeline/schedule/schedule.h"
#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

struct ExecutorOptions {
  layers::OptimizerConfig optimizer;
  // Scale all gradients so that their global norm (over every stage) is at most this;
  // 0 turns clipping off.
  double clip_grad_norm = 0.0;
  // Dynamic loss scaling, for float16 models (model.dtype: fp16), as PyTorch's GradScaler:
  // the loss's gradient is multiplied by the current scale (this, at first), so that
  // small gradients do not flush to zero in float16; a step whose gradients overflow (a
  // global norm that is not finite) is skipped by every stage and the scale halved;
  // after loss_scale_window steps without one it doubles. The gradients are divided by
  // the scale before clipping and the step (exactly, for a power of two, which the config
  // requires). 0 turns it off. A step without the update (apply_optimizer false) leaves
  // the gradients scaled.
  double loss_scale = 0.0;
  int loss_scale_window = 2000;
  // Pin stage k's thread to core k when there are at least as many cores as stages
  // (K = 1 included: a CPU device is one core).
  bool pin_threads = true;
  // Multi-process runs: the one stage this process executes (its rank's), or -1 for all
  // stages as threads of this process. With a local stage, the transport must connect
  // the processes (MpiTransport) and the loss is summed across them through it.
  int local_stage = -1;
  int rank = 0;  // shown in log lines
  // Data parallelism: the other replicas of this process's stage. The stage's
  // gradients are averaged over them (GradReducer: in buckets of bucket_bytes that
  // start during the last backward), BatchNorm statistics summed, the loss averaged;
  // not owned.
  ReplicaGroup* replicas = nullptr;
  int64_t bucket_bytes = int64_t{25} << 20;  // PyTorch DDP's default bucket
  // With replicas: shard the optimizer state over them (ZeRO-1, Plan::shard_optimizer):
  // each replica updates 1/D of the stage's flattened parameters (shard_partition.h);
  // the program reduce-scatters the gradients (RS) and all-gathers the parameters after
  // the step (AG). The replica group must know its rank.
  bool shard_optimizer = false;
  // Index of this process's first row in the whole mini-batch (a replica's share
  // starts at replica x rows per replica): dropout keys its masks on the sample's
  // place in the mini-batch, so every split draws the same masks.
  int64_t sample_offset = 0;
  // The Plan's micro-batch sizes (Plan::micro_batch_sizes, one per micro-batch of the
  // schedule): each step's batch must have their sum of rows and is split by them.
  // Empty: step() splits whatever batch it gets with split_sizes (cell.h).
  std::vector<int64_t> micro_batch_sizes;
  // This process's steady clock minus the job clock (the first stage's process's), in
  // ms (Transport::clock_offset_to_first); StageTrace::start_ms is on the job clock.
  double clock_offset_ms = 0;
  // Tensor parallelism (layers/tensor_parallel.h): this process's stage is member
  // tensor_group->rank() of a group of tensor_group->size() processes (or threads), each
  // holding its block of the stage's split weights (the model built as that member,
  // layers::ModelSpec::member). The executor gives the stage's layers and the loss this
  // group for the sums their splits need, and NORM sums the split parameters' squares
  // over it (the whole ones, equal on every member, counted once). Needs local_stage;
  // not owned. A group that takes the stage's device (ReplicaGroup::takes: NCCL's on a
  // GPU) gets its tensors there; another, a GPU stage's through host copies.
  ReplicaGroup* tensor_group = nullptr;
  // Time compute instructions with device events even on CPU devices (tests of the
  // GPU path's bookkeeping; CUDA devices always use them, see op_clock.h).
  bool device_clock_on_cpu = false;
  // Capture a training step once and replay it (pipeline.capture; Backend::begin_capture):
  // on a GPU a CUDA graph, one launch a step; on the CPU the recorded calls. Needs one
  // stage, or stages all run by this process on one device (their steps captured
  // together, as one graph), without replicas or a tensor group (UserError otherwise).
  // With several stages the gradient norm is summed on the device, in stage order, as the
  // host sums it otherwise (the same bits), and in a captured step a stage sharing the
  // device does not wait for it at its optimizer step: bad data found by a kernel is
  // reported at the step's end, every stage skipping the step alike. Each micro-batch's
  // inputs and targets are copied into buffers kept on the device for the run, which the
  // captured step reads. The first training step runs as before (it makes the
  // optimizer's state, the multi-tensor tables, cuDNN's plans), the second is captured
  // and replayed, and every later one with the same micro-batch sizes is a replay; a
  // step with other sizes, without the optimizer, or evaluation runs as before. A
  // capture that fails (an op that reads the device back or copies from the host) is
  // logged and the run goes on without it. The device clock times every instruction.
  bool capture = false;
  // Time each backend op of a training step (trace.ops; kernels/op_log.h, OpTimer): on a
  // GPU its kernels' device time, on a CPU its call; StageTrace::op_times. Not with capture
  // (a captured step does not run op by op: UserError).
  bool op_times = false;
};

struct TimedOp {
  Op op;
  int micro_batch;
  double start_ms, end_ms;  // since the step began
  int chunk = 0;
  // Sends and receives: the message's size; collectives: the bytes this stage
  // contributed (RG: its gradients, TIE: the weight's gradient, NORM: one double); a
  // tensor collective: the bytes its group moved (a narrow tensor as float32).
  int64_t bytes = 0;
  int peer = -1;           // sends, receives and TIE: the other stage
  int64_t live_bytes = 0;  // activations the stage holds after the instruction
  // A compute instruction of a stage split over a tensor group: the part of its time its
  // layers spent in the group's collectives, the tensor collectives after it in the
  // program (which ran inside it and are in the trace too, each with its own times: the
  // device's on a GPU); communication, not compute.
  double group_ms = 0;
  // The backend ops the stage's thread called during it (kernels/op_log.h, a call counted
  // once whatever it calls inside): its layers' and its loss's (what the plan counts on
  // shapes, Plan::launches; on a GPU also the copies of a first cell's inputs and a last
  // cell's targets, and a tensor group's sums), and for the others what they compute
  // (OPT's update and clip, NORM's sum); the gradients' zeroing is the stage's other_ops.
  int64_t ops = 0;
};

struct StageTrace {
  std::vector<TimedOp> ops;
  // Backend ops the stage's thread called in the step outside its instructions' own
  // (TimedOp::ops): the gradients' zeroing, the step's scalars written and read, the
  // final wait.
  int64_t other_ops = 0;
  int64_t peak_activation_bytes = 0;  // largest sum of activations held at once
  // The most bytes the stage's device's allocator (runtime/allocator.h) had handed out at
  // once, from the executor's first training step (a launch's) to the end of this one,
  // evaluations and checkpoint saves between them included: every tensor this process
  // holds there (weights, gradients, optimizer state, activations, the ops' temporaries),
  // as PyTorch's max_memory_allocated counts. Stages sharing a device read the same count.
  // CPU devices hand tensors between stages without a copy, so there a message counts on
  // the device that made it, and cpu:0 also holds the host's batches.
  int64_t device_peak_bytes = 0;
  // The optimizer state this stage's replica holds after its step (its shard's, when
  // sharded): the bytes of every slot, measured; 0 in a step without an update.
  int64_t optimizer_bytes = 0;
  // When the step started, on the job clock: ms of std::chrono::steady_clock since its
  // epoch, minus ExecutorOptions::clock_offset_ms. Op times are relative to it.
  double start_ms = 0;
  // A captured step (ExecutorOptions::capture): the captured ops' count (the graph's
  // nodes on a GPU, the backend calls on the CPU) when this step was one replay of them;
  // 0 when it ran op by op. The instructions' ops are the capture's. Stages captured
  // together (one graph) each count the backend calls their thread captured.
  int64_t captured_nodes = 0;
  // ExecutorOptions::op_times: each backend op the stage's thread called in the training
  // step, in the order first called, with its calls and milliseconds. Empty otherwise.
  std::vector<OpTimer::Total> op_times;
};
// A stage's timings as numbers, and back, for gathering them across processes.
std::vector<double> encode_trace(const StageTrace& t);
StageTrace decode_trace(const std::vector<double>& v, int stage);

// The bytes of an optimizer's state: every slot of every parameter it updates.
int64_t state_bytes(layers::Optimizer& optimizer);

struct StepResult {
  double loss = 0;  // mean over the mini-batch (sum of the micro-batches' scaled losses)
  double grad_norm = -1;  // global gradient norm before clipping; -1 when not computed
  // Dynamic loss scaling (ExecutorOptions::loss_scale): the scale this step's backward
  // used (0 when off), and whether its gradients overflowed, so that no stage stepped.
  double loss_scale = 0;
  bool skipped = false;
  double wall_ms = 0;
  std::vector<StageTrace> stages;
};

// What evaluation scores: the loss summed over the counted targets (the loss at scale
// 1), correct argmax predictions (ignore_index left out), and the targets the loss
// counts. Means divide the first two by the third.
struct EvalResult {
  double loss_sum = 0, correct = 0, counted = 0;
};

// A stage's share of a checkpoint (pipeline/checkpoint/checkpoint.h), as host tensors by stable
// names that do not depend on the partition: the parameters and buffers of its layers as
// "<layer name>.<name>" ("layers.3.attn.qkv.weight", "layers.2.running_mean", or with
// a named layer "h.0.attn.qkv.weight"), and its
// optimizer's state as "<parameter name><suffix>" (".exp_avg", ".momentum_buffer") and
// "<parameter name>.step". A tied copy is its owner's weight: only the owner's stage saves
// it, and the copy's stage restores it from the owner's name.
struct StageState {
  std::map<std::string, Tensor> model, optimizer;
};
struct StageStateNames {
  std::vector<std::string> model, optimizer;  // what the stage saves
  std::vector<std::string> model_needed, optimizer_needed;  // what it restores (its tied copies' owners too)
};
// "layers.3.weight", or with the layer named "h.0.attn.qkv.weight" (Sequential::layer_name).
std::string state_name(const layers::Sequential& model, int layer, const std::string& name);

class Executor {
 public:
  // Moves each cell's parameters to its stage's device. The model must outlive the
  // executor; the transport too.
  Executor(layers::Sequential& model, std::vector<CellSpec> stages, Schedule schedule, Transport& transport,
           ExecutorOptions options);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // One mini-batch: inputs (N, *input_shape) and int32 targets (N) on the host.
  // Gradients start from zero (each stage clears them at its first receive); with
  // apply_optimizer = false the optimizer steps are skipped, leaving the accumulated
  // gradients in Parameter::grad for inspection. After a step that applied the
  // optimizer they hold the gradients it applied (clipped, where clipping applies).
  StepResult step(const Tensor& inputs, const Tensor& targets, bool apply_optimizer = true);

  // Evaluation: the schedule's forward-only program (forward_only_program) on the same
  // workers and transport, in evaluation mode, keeping no contexts; parameters,
  // gradients and the step count stay as they are. inputs (N, *input_shape) and int32
  // targets (N) on the host are cut into micro-batches of micro_batch_rows rows, the
  // last taking the rest, at most the schedule's M of them. Each micro-batch's scores
  // are added to `sum` in micro-batch order (a pass over many calls sums as one long
  // one would), which is returned. Only the process of the model's last cell scores:
  // after a pass, all_reduce_scores gives every process the totals.
  EvalResult evaluate(const Tensor& inputs, const Tensor& targets, int64_t micro_batch_rows, EvalResult sum = {});
  // A pass's scores summed over this pipeline's processes and the data-parallel
  // replicas (collective: every process of the job calls it); as given in one process
  // without replicas.
  EvalResult all_reduce_scores(EvalResult local);

  const Schedule& schedule() const { return schedule_; }
  // The cells, in model order (one per stage unless the schedule interleaves).
  const std::vector<CellSpec>& cells() const { return cells_; }
  void set_lr(double lr);
  // The optimizer step the next step() is (dropout keys its masks on it); a resumed
  // run continues the count. Starts at 0 and counts up with every step().
  void set_step(uint64_t step) { steps_done_ = step; }
  // The loss scale the next step uses, and the steps since the last overflow (0 for
  // both when loss scaling is off); set them back when resuming (a saved scale of 0, from
  // a run without loss scaling, keeps this run's initial scale).
  double loss_scale() const { return loss_scale_; }
  int clean_steps() const { return clean_steps_; }
  void set_loss_scale(double scale, int clean_steps);
  uint64_t next_step() const { return steps_done_; }

  // Checkpoints, between steps. state_names works for any stage (the names follow from
  // the model, the cells and the optimizer's config); save and restore for this
  // process's stages. restore checks every name, shape and dtype (UserError).
  StageStateNames state_names(int stage) const;
  // Bytes of optimizer state this process keeps for a local stage (its slots: SGD's
  // momentum, Adam's moments): the whole stage's, or with a sharded optimizer its shard's.
  int64_t optimizer_state_bytes(int stage);
  StageState save_state(int stage);
  void restore_state(int stage, const std::map<std::string, Tensor>& model,
                     const std::map<std::string, Tensor>& optimizer);

 private:
  struct StageRuntime;
  struct MicroBatch;
  struct EvalProgram;
  // The constructor's steps.
  void check_cells() const;
  std::unique_ptr<StageRuntime> make_stage(int k);
  void read_program(StageRuntime& rt);
  void share_devices();
  void start_workers();
  void worker_main(int k);
  // Wakes the workers on cur_, waits for them, and rethrows the first real failure.
  void run_workers();
  // The instructions stage k runs this time: the schedule's, or the forward-only
  // program's when evaluating.
  const std::vector<Instruction>& program(int k) const;
  void run_stage(int k);
  // The stage's program op by op, as run_stage's body: eagerly, or captured
  // (ExecutorOptions::capture; StageRuntime::capturing) and then replayed once.
  void run_program(int k);
  // pipeline.capture: whether this training step of stage `rt` reads its inputs from the
  // fixed buffers, and a replay of the captured step.
  bool capture_eligible(const StageRuntime& rt) const;
  bool fixed_buffers_fit(const StageRuntime& rt) const;
  void fill_fixed_buffers(StageRuntime& rt);
  void replay_stage(StageRuntime& rt);
  int64_t begin_replay(StageRuntime& rt);
  void load_replay(StageRuntime& rt);
  void end_replay(StageRuntime& rt, int64_t calls0, int64_t replayed);
  void set_frozen(StageRuntime& rt, bool frozen);
  // pipeline.capture with K > 1 stages on one device (CaptureGroup; executor_capture.cc):
  // the capture begun by stage 0 and joined by the others once all have written their
  // step's scalars and buffers (`failed`: this stage could not, and the step fails on
  // every stage); ended together (`failure`: why this stage's part could not
  // be captured), stage 0 ending it and replaying it once, false if it failed anywhere
  // (the step then runs op by op); a later step replayed by stage 0 for all.
  void group_begin(StageRuntime& rt, const std::exception_ptr& failed);
  bool group_end(StageRuntime& rt, const std::string& failure, int64_t capture_calls0, int64_t* replayed);
  void replay_group(StageRuntime& rt);
  void sum_group_norm(StageRuntime& rt, const std::vector<Tensor>& grads);
  void keep_capture(StageRuntime& rt, int64_t captured_calls);
  static void place_device_times(StageTrace& trace, const std::vector<OpClock::Span>& spans, bool replayed_together);
  std::string blame_replay(const CapturedOps& ops, const std::exception& e);
  // One handler per instruction kind; run_stage times, meters and dispatches. Returns
  // the bytes a send or receive moved.
  int64_t run_instruction(StageRuntime& rt, size_t pc);
  void forward(StageRuntime& rt, const Instruction& ins, bool recompute);
  void backward(StageRuntime& rt, const Instruction& ins, size_t pc);
  void weight_gradient(StageRuntime& rt, const Instruction& ins, size_t pc);
  void optimizer_step(StageRuntime& rt);
  // The step's scalars (kernels/step_scalars.h): written before a training step, read
  // back after it; NORM leaves the norm on the device where nothing is summed across.
  void write_step_scalars(StageRuntime& rt);
  void read_step_scalars(StageRuntime& rt);
  bool norm_on_device() const;
  int64_t reduce_gradients(StageRuntime& rt);
  int64_t exchange_tied_gradient(StageRuntime& rt, int tie);
  int64_t reduce_gradient_norm(StageRuntime& rt);
  // Sharded optimizer state (executor_sharded.cc).
  void make_sharding(StageRuntime& rt);
  int64_t reduce_scatter_gradients(StageRuntime& rt);
  int64_t gather_parameters(StageRuntime& rt);
  // A stage's squared gradients: of its parameters split over a tensor group (this
  // member's blocks) and of its whole ones.
  struct SumSquares {
    double split = 0, whole = 0;
  };
  SumSquares shard_sum_squares(StageRuntime& rt);
  void save_sharded_optimizer(StageRuntime& rt, const std::vector<std::string>& names, StageState& out);
  void restore_sharded_optimizer(StageRuntime& rt, const std::vector<std::string>& names,
                                 const std::map<std::string, Tensor>& optimizer);
  // Tensor parallelism's whole-by-name checkpoints (executor_state.cc).
  void join_split_state(StageRuntime& rt, StageState& out);
  void cut_split_state(StageRuntime& rt, std::map<std::string, Tensor>& model, std::map<std::string, Tensor>& optimizer);
  // After the instruction that makes `layer`'s gradients final (StageRuntime::final_layers):
  // its sequence-partial ones summed over the tensor group, then its replicas' bucket.
  void gradients_final(StageRuntime& rt, layers::Layer& layer);
  void sum_over_tensor_group(Backend& be, const std::vector<layers::Parameter*>& params);
  // The tensor group's collectives as the program's instructions (Schedule::tensor): a
  // layer's request, made while a compute instruction runs, is run as the program's next
  // instruction after it, which must be a tensor collective of that kind (an Error
  // otherwise: the program and the model disagree), timed and traced as its own.
  class ProgramCollectives;
  void tensor_collective(Op op, int64_t bytes, const std::function<void()>& run);
  double now_ms() const;
  // holding_turn: the caller holds the stage's device turn already.
  void sum_local_ties(StageRuntime& rt, bool holding_turn = false);
  void fold_statistics(StageRuntime& rt);
  void zero_grads(StageRuntime& rt);
  // Stage k's turn on its device's backend (no-op unless it shares the device), held
  // until the Turn goes; it notes when it was first taken and when last given back
  // (StageRuntime::turn_at_ms, turn_end_ms), which time a CPU stage's work.
  class Turn {
   public:
    Turn() = default;
    Turn(std::mutex& m, const Executor* ex, double* end_ms) : lock_(m), ex_(ex), end_ms_(end_ms) {}
    Turn(Turn&&) = default;
    Turn& operator=(Turn&&) = delete;  // would give back the turn it holds without noting when
    ~Turn() {
      if (end_ms_ != nullptr && lock_.owns_lock()) *end_ms_ = ex_->now_ms();  // still held
    }

   private:
    std::unique_lock<std::mutex> lock_;
    const Executor* ex_ = nullptr;
    double* end_ms_ = nullptr;
  };
  Turn device_turn(int k);
  int stage_of_layer(int layer) const;
  Tensor to_device(StageRuntime& rt, const Tensor& host);
  // Loss scaling's verdict on a step, from NORM's global norm of the scaled gradients:
  // an overflow anywhere made it infinite or NaN on every stage alike.
  bool overflowed(double grad_norm) const { return options_.loss_scale > 0 && !std::isfinite(grad_norm); }

  layers::Sequential& model_;
  std::unique_ptr<layers::GroupCollectives> tensor_group_;         // over options_.tensor_group
  std::unique_ptr<ProgramCollectives> tensor_collectives_;  // what the layers ask: tensor_group_'s, by the program
  std::vector<CellSpec> cells_;
  Schedule schedule_;
  Transport& transport_;
  ExecutorOptions options_;
  std::vector<std::unique_ptr<StageRuntime>> runtimes_;
  std::vector<std::unique_ptr<std::mutex>> device_turns_;  // one per device shared by local stages
  struct CaptureGroup;
  std::unique_ptr<CaptureGroup> capture_group_;  // pipeline.capture with K > 1 stages on one device

  // The current step, shared with the workers.
  struct StepInputs {
    Tensor inputs, targets;
    std::vector<int64_t> offsets, sizes;
    double scale = 1.0;       // the loss's factor: 1 / targets counted, times the loss scale
    double loss_scale = 1.0;  // this step's loss scale (1 without loss scaling)
    bool apply_optimizer = true;
    uint64_t step = 0;  // how many steps ran before this one
    std::chrono::steady_clock::time_point epoch;
    // Evaluation (evaluate()): this forward-only program instead of the schedule, in
    // evaluation mode; no context is kept (no backward comes), the model's last cell
    // scores its output instead of keeping a loss for backward, gradients are left alone.
    const EvalProgram* eval = nullptr;
  } cur_;
  // Forward-only programs by number of micro-batches, built on first use.
  std::map<int, std::unique_ptr<EvalProgram>> eval_programs_;

  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  uint64_t generation_ = 0;
  uint64_t steps_done_ = 0;
  double loss_scale_ = 0;  // dynamic loss scaling's current scale (0: off)
  int clean_steps_ = 0;    // steps since the scale last changed
  int running_ = 0;
  bool shutdown_ = false;
  bool failed_ = false;
  // Whether the first training step has reset its devices' peaks (device_peak_bytes),
  // so that start-up's work there (the device's peak probed, a checkpoint loaded) is not
  // counted.
  bool peaks_reset_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace pipeline
}  // namespace gpipe
