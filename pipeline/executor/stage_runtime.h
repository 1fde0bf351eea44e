// The executor's private state per stage (StageRuntime) and per micro-batch
// (MicroBatch), shared by the files that implement the Executor: executor.cc (the
// interpreter), executor_collectives.cc (RG, TIE, NORM) and executor_state.cc (a stage's
// state saved and restored by name). Not part of the executor's interface.
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pipeline/executor/executor.h"
#include "pipeline/executor/shard_partition.h"

namespace gpipe {
namespace pipeline {

// What one stage keeps between instructions, per cell and micro-batch.
struct Executor::MicroBatch {
  Tensor input;                       // cell input; kept while the micro-batch is checkpointed
  Tensor output;                      // cell output awaiting its send
  std::vector<layers::Context> ctx;   // per layer; empty while checkpointed
  layers::Context loss_ctx;           // the model's last cell only
  Tensor targets;                     // likewise
  Tensor loss;                        // likewise
  Tensor grad_output, grad_input;     // received (or handed over) / to be sent
  int64_t held_bytes = 0;             // activations held, for the memory meter
  int64_t correct = 0;                // evaluation, the model's last cell: correct argmax predictions
};

// Evaluation's program and, per stage, which of its instructions open and close a group
// of messages.
struct Executor::EvalProgram {
  Schedule schedule;
  std::vector<std::vector<char>> group_begins, group_ends;
};

// A stage: a worker thread with its cells on one device.
struct Executor::StageRuntime {
  int index = 0;
  bool local = true;  // executed by this process
  Device device;
  std::vector<int> cells;  // global cell index per chunk
  Backend* backend = nullptr;
  std::unique_ptr<layers::Optimizer> optimizer;
  // Shared with the other local stages on the same device, whose backend (its stream,
  // BLAS and cuDNN handles, error checks) they also use: a stage queues work on the
  // device only while it holds it, and never while it waits for a message.
  std::mutex* device_turn = nullptr;
  // When the instruction running now first got its turn (ms of the step's clock; -1: not
  // yet): on a CPU, whose host clock times the work, its wait for the turn before that
  // is waiting, not its compute.
  double turn_at_ms = -1;
  double turn_end_ms = -1;  // when it last gave the turn back
  // The stage's parameters, in layer order (the optimizer's too, unless it is sharded).
  std::vector<layers::Parameter*> params;
  // Sharded optimizer state (ZeRO-1, executor_sharded.cc): this replica's shard of the
  // stage's flattened parameters, which its optimizer updates, and the two buffers of
  // the collectives, kept for the run.
  struct Sharding {
    ShardPartition partition;
    int replica = 0;
    std::vector<std::vector<ShardPiece>> pieces;  // per replica's shard
    // The optimizer's parameters: per piece of this replica's shard, a view of the
    // parameter's elements and of the summed gradient's in `grad_block`.
    std::vector<layers::Parameter> views;
    Tensor flat;                    // (D x block): packed gradients for RS, gathered parameters from AG
    Tensor grad_block, value_block;  // (block): this replica's summed gradients, its updated parameters
  };
  std::unique_ptr<Sharding> sharding;
  std::unique_ptr<GradReducer> reducer;  // with data-parallel replicas, unsharded
  layers::ReplicaSum replica_sum;        // likewise, for BatchNorm's statistics
  // This step so far: the ties within the stage summed (before NORM or OPT reads the
  // gradients), the layers' statistics folded (by RG, over the replicas).
  bool local_ties_summed = false, statistics_folded = false;
  // From the program, once: which (chunk, micro-batch) recompute (checkpointed) and
  // which defer their weight gradients to a W; per instruction, the layers whose
  // gradients are final once it ends (for the replicas' bucketed reduction); and
  // which instructions open and close a group of messages.
  std::vector<std::vector<char>> checkpointed, split;
  std::vector<std::vector<int>> final_layers;
  std::vector<char> group_begins, group_ends;
  // The instruction before which a training step clears the gradients: the first
  // receive, where the stage usually waits anyway, or else the first that adds to or
  // reads the gradients (zero_grads).
  size_t zero_at = 0;
  // The step's scalars (kernels/step_scalars.h) on the stage's device: written once
  // before a training step's first kernel (`written`: the host's values), read by NORM
  // and OPT's ops when they run, and read back once at the step's end, which sets
  // grad_norm (-1 when no norm was taken) and skipped.
  Tensor scalars;
  // Stages capturing their step together (Executor::CaptureGroup): NORM's sum of this
  // stage's squares, a step-scalars tensor whose norm slot every stage of the group adds
  // into its own `scalars`, in stage order.
  Tensor norm_part;
  StepScalarValues written{};
  double grad_norm = -1;
  bool skipped = false;
  std::vector<std::vector<MicroBatch>> mbs;  // [chunk][micro-batch]
  StageTrace trace;
  std::unique_ptr<OpClock> clock;  // device times of compute instructions (GPU stages)
  std::unique_ptr<OpTimer> op_timer;  // each op's time (ExecutorOptions::op_times), else null
  // After the clock: a captured graph records its events, and goes first.
  // pipeline.capture (ExecutorOptions::capture). Per micro-batch, the device buffers its
  // inputs and targets are copied into before a step that uses them (fixed_io), made at
  // the first such step and kept: a captured step reads them at every replay.
  std::vector<Tensor> fixed_inputs, fixed_targets;
  bool fixed_io = false;
  // This step is being captured (run_program); the first training step ran (warm-up);
  // a capture failed (never tried again in the run).
  bool capturing = false, warmed_up = false, capture_failed = false;
  std::string capture_error;  // why the capture in progress failed
  // What a replay needs of the capture: its ops (stage 0's alone when the stages
  // capture together; the micro-batches' shapes it was
  // captured with are the fixed buffers'), its trace (instructions, their ops and held bytes; times replaced at each
  // replay), its clock's spans, the loss tensors it writes, and the backend calls its
  // stage made inside it outside instructions (StageTrace::other_ops).
  struct Captured {
    std::unique_ptr<CapturedOps> ops;
    StageTrace trace;
    OpClock::Spans spans;
    std::vector<Tensor> losses;
    int64_t other_ops_inside = 0;
    int64_t nodes = 0;  // StageTrace::captured_nodes at each replay
  };
  std::unique_ptr<Captured> captured;
  // The CPU's FrozenWeights window (kernels/backend.h) over the stage's instructions but
  // OPT, opened and closed through Backend::host_step, so that a captured step's replay
  // does so in the same places.
  std::unique_ptr<FrozenWeights> frozen;
  // The tensor group's program (Schedule::tensor) while a compute instruction runs: the
  // compute instruction's position (npos outside one) and the next tensor collective's,
  // which the layer's next request must be (Executor::tensor_collective).
  size_t tensor_owner = static_cast<size_t>(-1), tensor_next = 0;
  int64_t live_bytes = 0;
  std::exception_ptr error;
  bool error_is_abort = false;
  std::string error_text;
};

// pipeline.capture with K > 1 stages of this process on one device: their training step
// captured together, as one graph on a GPU (the stages share the device's backend and
// stream, and take turns on it), which stage 0's thread begins, ends and replays; the other
// stages' threads join the capture (Backend::join_capture) and wait for the replay. Every
// stage's thread calls arrive() at the same points of a captured or replayed step
// (executor_capture.cc), so that none waits for one that is not coming.
// What a stage whose part of a capture together failed aborts the transport with, so
// that the others stop too (Transport::recover takes it back).
inline constexpr char kGroupCaptureStopped[] = "another stage's part of the step could not be captured";

struct Executor::CaptureGroup {
  explicit CaptureGroup(int stages) : size(stages) {}
  // Waits until every stage has arrived; `failure` (empty: none) is this round's if it is
  // the first one brought. Returns the round's first failure, which every stage sees.
  std::string arrive(const std::string& failure = std::string()) {
    std::unique_lock<std::mutex> lock(mu);
    if (arrived == 0) round_failure.clear();
    if (round_failure.empty()) round_failure = failure;
    const uint64_t my_round = round;
    if (++arrived == size) {
      arrived = 0;
      ++round;
      last_failure = round_failure;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return round != my_round; });
    }
    return last_failure;
  }
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t round = 0;
  std::string round_failure, last_failure;
  // Stage 0's, between two rounds: the capture ended (to replay) or why it failed (the
  // stages then run the step op by op), and how many ops its graph holds.
  std::unique_ptr<CapturedOps> ops;
  std::string capture_failure;
  int64_t nodes = 0;
};

}  // namespace pipeline
}  // namespace gpipe
