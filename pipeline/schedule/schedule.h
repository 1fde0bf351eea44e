// Schedules are data: for each stage (a worker on one device), the list of
// instructions it executes for one mini-batch. A generator emits the compute
// instructions only (forward, backward, weight gradient, recompute, optimizer step);
// lower_communication() then inserts every send and receive, each receive just before
// the instruction that consumes it and each send just after the one that produces it.
// The executor interprets the result, check_schedule() proves that every send meets its
// receive and nothing can deadlock on the transport, and simulate() predicts the timing
// from per-instruction costs. Implemented in schedule.cc (types, text, lowering),
// schedules.cc (the generators and schedule files) and schedule_check.cc (the checker
// and simulator, one abstract interpreter).
//
// Text. A schedule has two written forms. The file form, printed by
// schedule_file_text() and read by parse_schedule_text(), holds each stage's compute
// instructions (F, B, W, R) in CSV (`1,F,3`) or PyTorch's action notation (`1F3`);
// everything else (sends, receives, the optimizer step and any other op that
// is_compute() excludes) is derived again on load, so parse(print(s)) == s for every
// generated schedule (schedule_test.cc checks them all). The log form,
// instruction_str() and schedule_table() (`stage 0: F0 sA0 ... OPT`), shows the
// lowered program, messages included, for logs, traces and checker errors; it is not
// a file form, and the parser says so when given it.
//
// The model is cut into C contiguous cells, run in order 0..C-1. Stage k holds v
// cells (its chunks); with v = 1 cell k is stage k. GPipe's fill-drain schedule for
// K = 3 stages and M = 4 micro-batches (F = forward, B = backward):
//
//   stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
//   stage 1: .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
//   stage 2: .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .  .
//
// 1F1B (PipeDream-Flush) runs the same work with at most K - k micro-batches in flight
// on stage k; interleaved 1F1B gives each stage v cells (stage k holds cells k, k + K,
// ...); zero-bubble (ZB-H1) splits the backward into B (the input gradient, on the
// critical path) and W (the weight gradient), and moves W into the bubbles.
#pragma once

#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace gpipe {
namespace pipeline {

enum class Op {
  kRecvActivation,  // receive the input of the chunk's cell for micro-batch m
  kForward,         // forward of the cell (and the loss after the model's last cell)
  kSendActivation,  // send the cell's output of m to the stage of the next cell
  kRecompute,       // rerun the forward of a checkpointed m, keeping what backward needs
  kRecvGradient,    // receive the gradient of the cell's output of m
  kBackward,        // the input gradient; also the weight gradients unless a W follows
  kBackwardWeight,  // W: the cell's deferred weight gradients of m (of m .. m + count - 1
                    // when batched: one product over those micro-batches' rows)
  kSendGradient,    // send the gradient of the cell's input of m to the previous cell's stage
  kOptimizerStep,   // one optimizer step on the stage's parameters (m = -1); local
  // Collectives (m = -1 unless said), after the stage's last backward and before its
  // optimizer step; lower_collectives() inserts them from the run's facts (Collectives).
  kReduceGradients,  // RG: the stage's gradients summed over the data-parallel replicas
                     // (buckets start during backward; this waits for the rest), and the
                     // layers' statistics folded over them (Layer::end_step)
  kTiedGradients,    // TIE: a weight tied across two stages gets the sum of both copies'
                     // gradients; micro_batch holds the tie's index in Collectives::ties
  kGradientNorm,     // NORM: the global gradient norm, its square summed over every stage
  // Sharded optimizer state (pipeline.shard_optimizer, ZeRO-1): RS replaces RG and AG
  // follows OPT, the one collective after it.
  kReduceScatterGradients,  // RS: the stage's flattened gradients reduce-scattered over
                            // the replicas: each keeps the sum of its own shard
                            // (shard_partition.h), and the statistics folded as RG does
  kGatherParameters,        // AG: after OPT, each replica's updated shard all-gathered
                            // so that every replica holds the whole stage's parameters
  // The tensor group's collectives (issue 38; layers/tensor_parallel.h): what a split
  // layer (or the executor, for sequence-partial gradients) asks of the T members of its
  // stage while a compute instruction runs. lower_tensor_collectives() puts each right
  // after the compute instruction that asks for it (F, R, B or W), in the order asked,
  // with that instruction's micro-batch and chunk: `F3 tAR3 tAR3 sA3`. The executor runs
  // them when the layer asks, each checked against the program; the checker holds every
  // compute instruction to the ones its cell asks (Schedule::tensor); the simulator and
  // the planner price each. The members of a stage run the same program, so the i-th
  // tensor collective of each is the same one.
  kTensorSum,      // tAR: an all-reduce sum over the tensor group (a row-parallel output,
                   // a column-parallel input gradient, a loss's sums, partial gradients)
  kTensorMax,      // tMAX: an all-reduce maximum (a vocabulary-parallel loss's row maxima)
  kTensorGather,   // tAG: sequence parallelism's all-gather of positions
  kTensorScatter,  // tRS: sequence parallelism's reduce-scatter to positions
};
constexpr int kNumOps = static_cast<int>(Op::kTensorScatter) + 1;  // keep with the last Op

const char* op_name(Op op);        // "forward", ...
const char* op_short_name(Op op);  // "F", "B", "W", "R", "sA", "rA", "sG", "rG", "OPT"
bool is_communication(Op op);      // point-to-point sends and receives
bool is_collective(Op op);         // RG, TIE, NORM, RS, AG: stages (or replicas) wait for each other
bool after_optimizer(Op op);       // AG: the one collective that runs after OPT
bool is_compute(Op op);            // F, R, B, W
bool has_cell(Op op);              // runs on one of the stage's cells (compute and point-to-point)
bool is_tensor_collective(Op op);  // tAR, tMAX, tAG, tRS: inside the compute instruction before them

struct Instruction {
  Op op;
  int micro_batch = -1;
  int chunk = 0;  // which of the stage's cells (0 .. v-1); cells[stage][chunk] is its index
  // A batched weight gradient (W only; batch_weight_gradients): it covers micro-batches
  // micro_batch .. micro_batch + count - 1, in one product over their rows. 1 otherwise.
  int count = 1;
  bool operator==(const Instruction& o) const {
    return op == o.op && micro_batch == o.micro_batch && chunk == o.chunk && count == o.count;
  }
  // The micro-batches the instruction is about: {micro_batch} (none for m = -1), or a
  // batched W's range.
  std::vector<int> micro_batches() const;
};

// Rematerialization: which micro-batches keep only their cell input during forward
// and recompute the rest before backward (torchgpipe's `checkpoint`).
enum class RecomputeMode { kAlways, kExceptLast, kNever };
RecomputeMode parse_recompute_mode(const std::string& name);  // "always", "except_last", "never"
const char* recompute_mode_name(RecomputeMode mode);
// Whether the backward at program[backward] (a stage's compute instructions) is of a
// micro-batch that keeps only its cell input in forward and recomputes the rest first.
// always: every one; never: none; except_last: every one but those whose forward is the
// compute instruction right before their backward, whose context nothing else computed
// overlaps, so that recomputing would save no memory: GPipe's last micro-batch (on
// every stage), and every micro-batch of 1F1B's last stage. (A rule by micro-batch
// number, "all but the last", would keep 1F1B's last micro-batch whole on an early stage
// while the one before it is recomputed: two whole contexts at once, never's peak.)
bool is_recomputed(RecomputeMode mode, const std::vector<Instruction>& program, size_t backward);
// Whether a recompute mode rematerializes any micro-batch (the balancer then counts
// each layer's recompute time too).
inline bool recomputes(RecomputeMode mode) { return mode != RecomputeMode::kNever; }
using CheckpointMode [[deprecated("RecomputeMode: checkpoint now means saved state only")]] = RecomputeMode;

// What a stage's tensor group is asked inside each compute instruction, on shapes
// (run_tensor_program in pipeline/executor/cell.h finds it from a member's model): per
// cell, the collectives of its F, R and an evaluation's F, and per layer those of its
// backward. The program of each instruction follows from these and the stage's program
// (stage_tensor_ops).
struct TensorOp {
  Op op = Op::kTensorSum;  // a tensor collective (is_tensor_collective)
  // Its tensor's bytes as the group moves them (narrow types in float32) at a
  // micro-batch of n samples: bytes + bytes_per_sample x n (an activation's grow with
  // the batch; a parameter's gradient's do not).
  int64_t bytes = 0, bytes_per_sample = 0;
  int layer = -1;  // the model layer that asks it (the loss's: the model's last layer)
  int64_t bytes_at(int64_t micro_batch) const { return bytes + bytes_per_sample * micro_batch; }
  bool operator==(const TensorOp& o) const {
    return op == o.op && bytes == o.bytes && bytes_per_sample == o.bytes_per_sample && layer == o.layer;
  }
};
struct CellTensorOps {
  // F (the loss's after the model's last cell), R (the same forward again, and the
  // loss's), and an evaluation's F (the loss's and its count of correct predictions).
  std::vector<TensorOp> forward, recompute, evaluate;
  std::vector<TensorOp> loss_backward;  // the model's last cell: first in its B
  struct Layer {
    bool splits = false;  // Layer::splits_backward: its weight gradients in W
    // Its whole backward, B (backward_input) and W; `step`: once a step, where its
    // gradients become final, its sequence-partial gradients summed (one tAR or none).
    std::vector<TensorOp> backward, backward_input, weight, step;
    bool operator==(const Layer& o) const {
      return splits == o.splits && backward == o.backward && backward_input == o.backward_input &&
             weight == o.weight && step == o.step;
    }
  };
  std::vector<Layer> layers;  // the cell's layers, in model order
  bool operator==(const CellTensorOps& o) const {
    return forward == o.forward && recompute == o.recompute && evaluate == o.evaluate &&
           loss_backward == o.loss_backward && layers == o.layers;
  }
};
struct TensorProgram {
  int members = 1;                   // T; 1: no tensor group, nothing lowered
  std::vector<CellTensorOps> cells;  // per cell of the schedule
  bool operator==(const TensorProgram& o) const { return members == o.members && cells == o.cells; }
};

struct Schedule {
  std::string name;
  int num_stages = 0;
  int num_micro_batches = 0;
  // cells[k][j]: the model cell that chunk j of stage k runs; every cell 0..C-1
  // appears once. One cell per stage (cells[k] = {k}) unless the schedule interleaves.
  std::vector<std::vector<int>> cells;
  std::vector<std::vector<Instruction>> stages;  // per stage, in execution order
  // The collectives lowered into the program (lower_collectives), for the checker.
  struct Collectives {
    bool replicas = false;  // gradients are summed over data-parallel replicas (RG)
    // Per tied weight: the cells holding its owner and its copy. A tie within one
    // stage is summed locally in the optimizer step; one across stages is a TIE on both.
    std::vector<std::pair<int, int>> ties;
    bool gradient_norm = false;  // the global gradient norm is needed (clipping): NORM
    // With replicas, the optimizer state sharded over them (ZeRO-1): RS instead of RG,
    // the ties' TIE before RS (a sum is linear: the copies' unsummed gradients add up
    // the same), and AG after OPT.
    bool shard_optimizer = false;
    bool operator==(const Collectives& o) const {
      return replicas == o.replicas && ties == o.ties && gradient_norm == o.gradient_norm &&
             shard_optimizer == o.shard_optimizer;
    }
  } collectives;
  bool collectives_lowered = false;
  // The tensor group's collectives lowered into the program (lower_tensor_collectives).
  TensorProgram tensor;
  bool tensor_lowered = false;
  // Schedule files: the file line of each instruction (0 for lowered communication),
  // so that errors name it; empty for generated schedules.
  std::vector<std::vector<int>> lines;
  std::string source;  // the file, for messages
  // A forward-only program (forward_only_program): forwards and their activation
  // messages only, no optimizer step; the checker holds it to that.
  bool forward_only = false;

  int num_chunks() const { return cells.empty() ? 1 : static_cast<int>(cells[0].size()); }
  int num_cells() const;
  int cell(int stage, int chunk) const { return cells.at(stage).at(chunk); }
  int stage_of_cell(int cell) const;
  int chunk_of_cell(int cell) const;
};

// One cell per stage (v = 1) or Megatron's interleaving: chunk j of stage k is cell
// j K + k.
std::vector<std::vector<int>> interleaved_cells(int num_stages, int num_chunks);

// How a transport completes a send. Buffered: a send returns at once and its message
// waits for the receiver (in-process hand-over, MPI_Isend). Rendezvous: a send
// completes only when its receiver reaches it, as NCCL's do; a run of consecutive
// sends and receives of one stage is posted as one group (ncclGroupStart/End), whose
// operations progress together.
enum class CommModel { kBuffered, kRendezvous };

// What one stage's program says about each (chunk, micro-batch): whether it is recomputed
// (the program has an R for it) and whether its backward splits into B and W (it has a
// W). Read from the instructions once, here, by the executor, the planner, the memory
// estimate and the bench's direct runner.
struct MicroBatchRoles {
  std::vector<std::vector<char>> recomputed;  // [chunk][micro-batch]
  std::vector<std::vector<char>> split;       // [chunk][micro-batch]
};
MicroBatchRoles micro_batch_roles(const Schedule& s, int stage);

// Where a stage's gradients become final, per chunk (program positions, -1: none): after
// its last B for a layer that does all its backward in B, after its last W or whole
// backward (a B without a W) for one that splits (Layer::splits_backward). Read by the
// executor (when to sum and bucket a layer's gradients) and stage_tensor_ops.
struct ChunkFinals {
  std::vector<long> last_backward, last_weights;  // [chunk]
  long at(int chunk, bool splits) const { return (splits ? last_weights : last_backward)[static_cast<size_t>(chunk)]; }
};
ChunkFinals chunk_finals(const Schedule& s, int stage, const MicroBatchRoles& roles);

// The tensor collectives each compute instruction of stage `stage` asks, in order, by
// program position (empty for the rest), as the executor runs the cell: F's layers in
// order (and the loss after the last cell; an evaluation's program, forward_only, its
// `evaluate` ones), R likewise, B from the loss's backward down the layers (each layer's
// whole backward, or with a W to come its B), W down the layers; a layer whose gradients
// become final there (chunk_finals) adds its `step` after its own.
std::vector<std::vector<TensorOp>> stage_tensor_ops(const Schedule& s, const TensorProgram& t, int stage);
// The position of `ins` in stage `stage`'s program, `ins` being an element of it (as
// simulate() hands a CostFn its instructions): what tells apart two tensor collectives of
// the same kind, micro-batch and chunk. An Error for an instruction of another program.
size_t program_position(const Schedule& s, int stage, const Instruction& ins);
// Inserts them after their compute instructions (members > 1; nothing otherwise), after
// every other pass. Idempotent: the same facts again change nothing; others throw Error.
void lower_tensor_collectives(Schedule& s, const TensorProgram& t);

// ---- Generators. Each returns a lowered schedule, ready to check and run.

// GPipe: all forwards, then all backwards in reverse micro-batch order; recompute is
// issued before the gradient is received, so it can overlap the wait.
Schedule gpipe_schedule(int num_stages, int num_micro_batches, RecomputeMode mode,
                        CommModel comm = CommModel::kBuffered);
// 1F1B (PipeDream-Flush): min(K-1-k, M) forwards of warm-up on stage k, then one
// forward and one backward in turn, then the remaining backwards.
Schedule one_f_one_b_schedule(int num_stages, int num_micro_batches, RecomputeMode mode,
                              CommModel comm = CommModel::kBuffered);
// Interleaved 1F1B (Megatron-LM; PyTorch's flexible variant): stage k holds cells k,
// k + K, ..., micro-batches go round in rounds of M / max(1, M / K), which must divide M.
Schedule interleaved_1f1b_schedule(int num_stages, int num_chunks, int num_micro_batches, RecomputeMode mode,
                                   CommModel comm = CommModel::kBuffered);
// Zero bubble (ZB-H1, and ZB-1P for num_chunks > 1; Qi et al. 2024): 1F1B's order with
// the backward split into B and W; stage k defers its first k weight gradients into
// the cool-down bubble.
Schedule zero_bubble_schedule(int num_stages, int num_chunks, int num_micro_batches, RecomputeMode mode,
                              CommModel comm = CommModel::kBuffered);

// What a config asks for.
struct ScheduleRequest {
  std::string name = "gpipe";  // gpipe (fill_drain), 1f1b, interleaved_1f1b, zero_bubble, file
  int num_stages = 1, num_chunks = 1, num_micro_batches = 1;
  RecomputeMode mode = RecomputeMode::kExceptLast;
  std::string file;  // pipeline.schedule_file
  CommModel comm = CommModel::kBuffered;  // the transport's, so the checker models it
  bool batch_weights = false;  // pipeline.batch_weight_gradients: batch_weight_gradients()
};
// Builds and checks the named schedule; an unknown name lists the valid ones, a
// schedule that cannot take these K, v, M says what it needs and why.
Schedule make_schedule(const ScheduleRequest& request);
Schedule make_schedule(const std::string& name, int num_stages, int num_micro_batches, RecomputeMode mode);
std::vector<std::string> schedule_names();

// A schedule of the user's own, one compute instruction per line:
//   stage,op,micro_batch[,chunk]     e.g.  1,F,3   0,B,2   0,W,2,1
// or one action in PyTorch's notation, `<cell><op><micro-batch>` (1F3, 0B2, 0W2),
// the cell placed as in interleaved_cells(). op is F, B, W or R (I is taken for B,
// PyTorch's input-gradient action). Blank lines and `#` comments are skipped; each
// stage runs its lines in file order. Without any R line, `mode` decides which
// micro-batches recompute. Communication is inserted by lower_communication(). Errors
// name the file, the line and the broken rule; a line in the log form (`F3`, `rA0`,
// `OPT`, `stage 0: ...`) is refused with what to write instead. schedule_file_text()
// prints a schedule in this form.
Schedule parse_schedule_text(const std::string& text, const std::string& source, int num_stages, int num_chunks,
                             int num_micro_batches, RecomputeMode mode, CommModel comm = CommModel::kBuffered);
Schedule load_schedule_file(const std::string& path, int num_stages, int num_chunks, int num_micro_batches,
                            RecomputeMode mode, CommModel comm = CommModel::kBuffered);

// Evaluation's program, derived from a training schedule: each stage's forwards in the
// schedule's order (which the checker already proved pipelines without deadlock) for
// micro-batches 0 .. num_micro_batches - 1 (at most the schedule's M), with their
// activation sends and receives lowered for `comm`; no recompute, no backward, no
// optimizer step. Same stages and cells as `s`; forward_only is set.
Schedule forward_only_program(const Schedule& s, int num_micro_batches, CommModel comm = CommModel::kBuffered);

// ---- Building blocks of the generators.

// Puts R(j, m) right before B(j, m) for every checkpointed micro-batch.
void insert_recompute(Schedule& s, RecomputeMode mode);
// Weight gradients batched across micro-batches (pipeline.batch_weight_gradients), on a
// lowered program, stage by stage and chunk by chunk:
//  1. The drain: the backwards after the chunk's last forward that do all their work in
//     B (GPipe's, 1F1B's cool-down) split into B and W, their W's placed after the last
//     of them and its sends, when there are two or more and their micro-batches are
//     consecutive numbers (the drain holds their inputs anyway; their weight gradients
//     wait for the last one instead of being taken one by one). The W follows the last
//     backward's sends (for `comm` rendezvous, its whole group of messages).
//  2. Every run of a chunk's W's with nothing but messages between them (zero bubble's
//     cool-down, and step 1's) whose micro-batches are consecutive numbers becomes one W
//     with that count, where the run's last W was.
// Nothing moves earlier, so what the checker proved of the program still holds;
// check_schedule proves the result again.
void batch_weight_gradients(Schedule& s, CommModel comm = CommModel::kBuffered);
// Inserts every send and receive between stages (cells on the same stage hand over
// directly), then an optimizer step at the end of each stage if it has none (unless the
// program is forward_only). For a
// rendezvous transport a receive is moved up past recomputes and weight gradients to
// join the sends before it in one group.
void lower_communication(Schedule& s, CommModel comm = CommModel::kBuffered);

// Inserts the step's collectives before each stage's optimizer step, in the same order
// on every stage: RG (with replicas), one TIE per tie across stages on its two stages
// (in tie order), NORM on every stage (clipping). With sharded optimizer state: the
// TIEs, RS, NORM before OPT, and AG right after it. Idempotent: lowering the same facts
// again changes nothing; different facts throw Error.
void lower_collectives(Schedule& s, const Schedule::Collectives& collectives);
// The collectives stage `stage` runs for these facts, in their order (what
// lower_collectives inserts there, and what the checker expects).
std::vector<Instruction> stage_collectives(const Schedule& s, const Schedule::Collectives& collectives, int stage);
// The stages taking part in a collective instruction of stage `stage`: itself for RG
// (and RS, AG; its partners are the replicas, running the same program), the tie's two stages for
// TIE, every stage for NORM.
std::vector<int> collective_stages(const Schedule& s, int stage, const Instruction& ins);

// ---- The checker and simulator (schedule_check.cc).


// Proves the schedule is well formed before anything runs: every cell's forward,
// backward and (where present) weight gradient runs exactly once per micro-batch, in
// dependency order; each send has exactly one matching receive on the right stage;
// and executing it with blocking receives (and, for rendezvous transports, blocking
// sends) cannot deadlock. Throws UserError describing the first problem, naming the
// file line for schedule files, then showing every stage's program (schedule_table)
// with the failing instruction, or each stage's waiting one, marked `<-- HERE`.
void check_schedule(const Schedule& s, CommModel comm = CommModel::kBuffered);

// A message's identity, the same for its send and its receive: (receiving stage,
// 0 activation / 1 gradient, micro-batch, receiving cell). `peer`, if given, is set
// to the other stage (-1 where the cell has no neighbour that way).
using MessageKey = std::tuple<int, int, int, int>;
MessageKey message_key(const Schedule& s, int stage, const Instruction& ins, int* peer = nullptr);

// Predicted timing. The cost of an instruction in any unit (seconds, ms, slots). A
// receive's cost is the message's delivery: a message whose send ends at t can be taken
// at t + that cost, and a receive that finds it there already costs nothing.
using CostFn = std::function<double(int stage, const Instruction& ins)>;
struct TimedInstruction {
  Instruction ins;
  double start = 0, end = 0;
};
struct Simulation {
  double makespan = 0;
  std::vector<double> busy;  // per stage: forward + recompute + backward + weight gradient
  double bubble = 0;         // 1 - sum(busy) / (K * makespan)
  std::vector<std::vector<TimedInstruction>> timeline;  // per stage, in program order
};
// `turns`: per stage, the first stage on its device (device_turns, Plan::turns), where
// stages of one process share a device and take turns on it: each one's F, R, B, W and
// OPT (and tensor collectives) then wait for the device to be free, in the order the
// stages ask for it; a collective's small device part holds no turn. Empty: every stage
// has its own device. The buffered model's only (stages that take turns are threads of
// one process, which hand over in memory): an Error with kRendezvous.
Simulation simulate(const Schedule& s, const CostFn& cost, CommModel comm = CommModel::kBuffered,
                    const std::vector<int>& turns = {});
// Unit costs per instruction kind, the same for every stage and cell.
struct OpCosts {
  double forward = 1.0, backward = 2.0, weight = 0.0, recompute = 1.0, send = 0.0, optimizer = 0.0,
         collective = 0.0;
};
Simulation simulate(const Schedule& s, const OpCosts& costs);

// ---- Text.

// The file form's two notations (see parse_schedule_text).
enum class ScheduleNotation {
  kCsv,      // stage,op,micro_batch[,chunk]: 1,F,3 (the chunk only where v > 1)
  kActions,  // PyTorch's <cell><op><micro-batch>: 1F3; a backward whose weight
             // gradient follows as a W is written I, as PyTorch's BACKWARD_INPUT
};
// The schedule as a schedule file that parse_schedule_text() reads back to the same
// lowered schedule, given the same K, v, M, recompute mode and transport: a header
// of `#` comments saying what wrote it (with `comment`, if given, as more comment
// lines), then each stage's compute instructions (is_compute) in program order, stage
// after stage. The schedule's cells must be interleaved_cells(K, v), the only
// placement a file can express.
std::string schedule_file_text(const Schedule& s, ScheduleNotation notation, const std::string& comment = "");

// The log form, not a file form (schedule_file_text is that): "F3", "rA0", "OPT";
// with several chunks per stage the cell comes first ("2F3"), as in PyTorch's action
// notation. Compute instructions of one-cell stages leave the cell out, since the
// stage names it.
std::string instruction_str(const Schedule& s, int stage, const Instruction& ins);
// One line per stage: "stage 0: rA0 F0 sA0 ...", the lowered program in the log form,
// for tests, logs and checker errors.
std::string schedule_table(const Schedule& s);
// The same, with a run of one tensor collective repeated n times written once as `tAR0*n`
// (`F0 tAR0*9 sA0`): what gpipe plan prints, where a split stage's F asks a sum per block.
std::string compact_schedule_table(const Schedule& s);
// The stages' compute instructions as a time chart, one row per stage and one column
// per time slot ('.' where the stage waits), simulated with a unit cost per compute
// instruction: the picture at the top of this file, for any schedule.
std::string schedule_chart(const Schedule& s);

// GPipe's ideal bubble fraction (K-1)/(M+K-1).
double ideal_bubble(int num_stages, int num_micro_batches);
// The bubble the schedule's formula gives: GPipe, 1F1B and zero-bubble's (K-1)/(M+K-1)
// with equal F and B (ZB-H1 lowers it further when W fills the cool-down), and
// interleaving's (K-1)/(v M + K - 1).
double formula_bubble(const Schedule& s);

}  // namespace pipeline
}  // namespace gpipe
