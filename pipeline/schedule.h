// Schedules are data: for each stage, the list of instructions it executes for one
// mini-batch. The executor interprets them, check_schedule() proves that every send
// meets its receive and that the schedule cannot deadlock, and simulate() predicts
// their timing from per-instruction costs.
//
// GPipe's fill-drain schedule for K = 3 stages and M = 4 micro-batches (F = forward,
// B = backward; every stage runs all forwards, then all backwards in reverse order):
//
//   stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
//   stage 1: .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
//   stage 2: .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .  .
//
// The idle slots are the bubble: (K-1)/(M+K-1) of each stage's time.
#pragma once

#include <string>
#include <vector>

namespace gpipe {
namespace pipeline {

enum class Op {
  kRecvActivation,  // receive the stage input of micro-batch m from stage k-1
  kForward,         // forward of the cell (and the loss on the last stage)
  kSendActivation,  // send the cell output of m to stage k+1
  kRecompute,       // rerun the forward of a checkpointed m, keeping what backward needs
  kRecvGradient,    // receive the gradient of the cell output of m from stage k+1
  kBackward,        // backward of the cell, accumulating parameter gradients
  kSendGradient,    // send the gradient of the cell input of m to stage k-1
  kOptimizerStep,   // one optimizer step on the stage's parameters (m = -1)
};

const char* op_name(Op op);        // "forward", ...
const char* op_short_name(Op op);  // "F", "B", "R", "sA", "rA", "sG", "rG", "OPT"

struct Instruction {
  Op op;
  int micro_batch;
  bool operator==(const Instruction& o) const { return op == o.op && micro_batch == o.micro_batch; }
};

enum class CheckpointMode { kAlways, kExceptLast, kNever };
CheckpointMode parse_checkpoint_mode(const std::string& name);  // "always", "except_last", "never"
const char* checkpoint_mode_name(CheckpointMode mode);
// Whether micro-batch m of M keeps only its stage input and recomputes during backward.
bool is_checkpointed(CheckpointMode mode, int micro_batch, int num_micro_batches);

struct Schedule {
  std::string name;
  int num_stages = 0;
  int num_micro_batches = 0;
  std::vector<std::vector<Instruction>> stages;  // per stage, in execution order
};

// GPipe: all forwards, then all backwards in reverse micro-batch order; recompute is
// issued before the gradient is received, so it can overlap the wait.
Schedule gpipe_schedule(int num_stages, int num_micro_batches, CheckpointMode mode);
// Builds the schedule named in a config ("gpipe"); an unknown name lists the valid ones.
Schedule make_schedule(const std::string& name, int num_stages, int num_micro_batches, CheckpointMode mode);

// Proves the schedule is well formed before anything runs: every stage forwards and
// backwards each micro-batch once, in dependency order, each send has exactly one
// matching receive on the neighbour, and executing it with blocking receives cannot
// deadlock. Throws gpipe::Error describing the first problem.
void check_schedule(const Schedule& s);

// Predicted timing with unit costs per instruction kind (receives cost nothing of
// their own; they wait for the matching send).
struct OpCosts {
  double forward = 1.0, backward = 2.0, recompute = 1.0, send = 0.0, optimizer = 0.0;
};
struct Simulation {
  double makespan = 0;
  std::vector<double> busy;  // per stage: forward + recompute + backward
  double bubble = 0;         // 1 - sum(busy) / (K * makespan)
};
Simulation simulate(const Schedule& s, const OpCosts& costs);

// One line per stage: "stage 0: rA0 F0 sA0 ...", for tests and logs.
std::string schedule_table(const Schedule& s);

// GPipe's ideal bubble fraction (K-1)/(M+K-1).
double ideal_bubble(int num_stages, int num_micro_batches);

}  // namespace pipeline
}  // namespace gpipe
