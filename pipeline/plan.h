// One plan of a run, computed once from the config and the model and read by the
// trainer, `gpipe plan` and the report: how many stages, cells, micro-batches and
// replicas, how big each micro-batch is, which schedule, where the model is cut and
// which device runs each stage, and what each stage will hold in memory.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/sequential.h"
#include "pipeline/config.h"
#include "pipeline/executor.h"
#include "pipeline/schedule.h"

namespace gpipe {
namespace pipeline {

struct Plan {
  int stages = 1;          // K
  int virtual_stages = 1;  // v: cells per stage
  int micro_batches = 1;   // M
  int replicas = 1;        // D
  int64_t batch_size = 0;     // the whole mini-batch, over every replica
  int64_t replica_batch = 0;  // the rows one pipeline runs per step
  std::vector<int64_t> micro_batch_sizes;  // split_sizes(replica_batch, M)
  CheckpointMode recompute = CheckpointMode::kExceptLast;
  Schedule schedule;
  std::vector<int> balance;     // layers per cell, v K of them
  std::vector<Device> devices;  // per stage
  std::vector<StageSpec> cells;  // per cell, on its stage's device
  int num_cells() const { return static_cast<int>(balance.size()); }
  int64_t largest_micro_batch() const { return micro_batch_sizes.empty() ? 0 : micro_batch_sizes.front(); }
};

struct PlanOptions {
  int local_stage = -1;  // a multi-process run's own stage: only its device must exist here
  CommModel comm = CommModel::kBuffered;  // the transport's, for the schedule's lowering and check
};

// Validates the config against the model (sizes, balance, devices, schedule) and plans
// the run. Throws UserError naming the key and the fix.
Plan make_plan(const Config& config, const layers::Sequential& model, const PlanOptions& options = {});

// The layers per cell the config asks for: its balance, or the balancer's split of the
// layer cost estimates at the plan's micro-batch size into the plan's cells.
std::vector<int> plan_balance(const Config& config, const layers::Sequential& model, int cells,
                              int64_t micro_batch_size);

// What a stage holds at its peak: parameters with their gradients and optimizer state,
// and the activations the schedule keeps alive (walked instruction by instruction: a
// forward keeps its cell's saved activations, or only its input when checkpointed; a
// recompute rebuilds them; a backward frees them, or keeps them for a later W; sends
// free the messages they carried).
struct StageMemory {
  int64_t parameter_bytes = 0;  // parameters, gradients and optimizer state
  int64_t activation_bytes = 0;  // the peak of the activations held
  int64_t total() const { return parameter_bytes + activation_bytes; }
};
std::vector<StageMemory> estimate_memory(const Plan& plan, const layers::Sequential& model,
                                         const layers::OptimizerConfig& optimizer);

// Bytes of a checkpoint of the model and its optimizer state (parameters once, tied
// copies and buffers included).
int64_t checkpoint_bytes(layers::Sequential& model, const layers::OptimizerConfig& optimizer);

// Optimizer state per parameter element, in parameter-sized slots: SGD with momentum
// keeps one buffer, Adam and AdamW two.
int optimizer_slots(const layers::OptimizerConfig& optimizer);

}  // namespace pipeline
}  // namespace gpipe
