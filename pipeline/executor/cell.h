// A cell is a stage's piece of the model: a contiguous range of layers and the device of
// the stage that runs it. The plan derives the cells and the micro-batch sizes once
// (plan.h); the executor runs what it is given. Kept apart from both so that the plan
// does not depend on the executor.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/sequential.h"
#include "pipeline/schedule/schedule.h"
#include "runtime/device.h"

namespace gpipe {
namespace pipeline {

// A cell: a contiguous range of the model's layers, and the device of the stage that
// runs it. With one cell per stage (every schedule but the interleaved ones) cell k
// is stage k.
struct CellSpec {
  int first_layer = 0;
  int num_layers = 0;
  Device device;
};

using StageSpec [[deprecated("CellSpec: a stage is a device's worker, a cell its piece of the model")]] = CellSpec;

// Cell specs from per-cell layer counts, with cell k on devices[k] (one cell per stage).
std::vector<CellSpec> make_stages(const std::vector<int>& balance, const std::vector<Device>& devices);
// The same for a schedule that may place several cells on a stage: balance has one
// entry per cell, devices one per stage, and each cell goes to its stage's device.
std::vector<CellSpec> make_cells(const std::vector<int>& balance, const Schedule& schedule,
                                  const std::vector<Device>& devices);

// The cell holding a layer (Error if none does).
int cell_of_layer(const std::vector<CellSpec>& cells, int layer);

// The collectives a run of this model on these cells needs (Schedule::Collectives):
// the replicas' gradient sum, the ties' cells, the global gradient norm for clipping.
// The plan lowers them into its schedule; the executor into one made by hand.
// shard_optimizer: with replicas, the optimizer state sharded over them (RS, AG).
Schedule::Collectives run_collectives(const layers::Sequential& model, const std::vector<CellSpec>& cells,
                                      bool replicas, bool gradient_norm, bool shard_optimizer = false);

// What the T members of each stage's tensor group are asked inside each compute
// instruction (Schedule::tensor), found by running member `rank`'s model (its layers
// split for `members`) on shapes, at a micro-batch of one sample: each layer's forward
// (as F, as R, and as an evaluation's), whole backward, B and W, the loss's forward,
// backward and count of correct predictions, and each layer's sequence-partial
// gradients, summed once a step (Executor::gradients_final). Microseconds a layer; the
// model's own group is set back after. members 1: an empty program (nothing to lower).
// The plan lowers it into its schedule (lower_tensor_collectives); the executor into
// one made by hand.
TensorProgram run_tensor_program(layers::Sequential& model, const std::vector<CellSpec>& cells, int rank, int members);

// Sizes of M micro-batches of an N-sample batch: as even as possible, larger first
// (10 into 4 -> 3 3 2 2). Throws UserError when N < M.
std::vector<int64_t> split_sizes(int64_t n, int m);

}  // namespace pipeline
}  // namespace gpipe
