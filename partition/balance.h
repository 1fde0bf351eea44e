// The balancer: splits L layers into K contiguous cells so that the slowest cell is
// as fast as possible. Exact (dynamic programming over split points), not a heuristic.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "layers/layer.h"
#include "layers/sequential.h"

namespace gpipe {
namespace partition {

// The ops a layer's phases call, each a kernel launch (or more: cuBLAS, cuDNN's
// attention) on a GPU, where a launch costs time whatever its size. Counted on shapes
// by the planner's probe (pipeline/planning/plan.h: probe_activations; MetaOpCount in
// kernels/meta_backend.h); the model's last layer counts the loss's ops with its own.
struct LayerLaunches {
  int64_t forward = 0;         // F: the training forward (BatchNorm keeps its statistics)
  int64_t recompute = 0;       // R: the same forward again, which keeps nothing
  int64_t backward_input = 0;  // B; a layer that does not split its backward: all of it
  int64_t backward_weight = 0;  // W of one micro-batch (0 for a layer that does not split)
  int64_t backward() const { return backward_input + backward_weight; }
  // A member of a tensor group (layers/tensor_parallel.h): its sums over the group, in F
  // (and R) and in B, and their bytes at a batch of one sample (activations: they grow
  // with the batch); and in W, of weight gradients (replicated key/value heads'), whose
  // bytes do not.
  int64_t group_sums_forward = 0, group_sums_backward = 0, group_sums_weight = 0;
  int64_t group_bytes_forward = 0, group_bytes_backward = 0, group_bytes_weight = 0;
  // Under sequence parallelism: its all-gathers and reduce-scatters of positions in F
  // and in B, each one pass of a ring, and the bytes of their whole tensors at a batch
  // of one sample.
  int64_t group_gathers_forward = 0, group_gathers_backward = 0;
  int64_t group_gather_bytes_forward = 0, group_gather_bytes_backward = 0;
  // Once a step, where its gradients become final (its stage's last B or W of the
  // cell): its sequence-partial gradients (Parameter::sequence_partial: a norm's weight,
  // a position table) summed over the group, one collective a layer, and their bytes.
  int64_t group_sums_step = 0, group_bytes_step = 0;
};

// Turns a layer's counts into seconds: a roofline-style estimate that charges the
// larger of compute time and memory time, forward plus backward (plus a second
// forward when the cell rematerializes), and on a device whose launches cost time, the
// layer's launches times that cost.
struct CostModel {
  double flops_per_second = 5e10;  // one core's matrix-product rate, roughly
  double bytes_per_second = 1e10;  // one core's memory bandwidth, roughly
  bool probed = false;  // flops_per_second is the device's measured peak (pipeline/planning/device_peak.h)
  bool bytes_probed = false;  // bytes_per_second is a GPU's measured copy rate (ditto)
  // What one launch costs beyond its roofline time: 0 on a CPU (an op is a call); a
  // GPU's smallest kernel back to back (device_peak.h's probe, or a device
  // description's launch_overhead_us).
  double launch_seconds = 0;
  bool launch_probed = false;  // launch_seconds was measured on this machine's GPU
  // A GPU's cost of that kernel as a node of a captured step's graph, replayed
  // (DevicePeak::graph_node_seconds, or a device description's graph_node_us; 0: not
  // known), and whether launch_seconds is it: a run whose step is captured
  // (pipeline.capture) pays it for each op instead of a launch (price_captured).
  double graph_node_seconds = 0;
  bool launches_captured = false;
  // With launches_captured: what an op's launch cost before (a profile measured op by op
  // has it in its times, which a captured step does not pay).
  double uncaptured_launch_seconds = 0;
  void price_captured() {
    if (graph_node_seconds <= 0 || launches_captured) return;  // not known: each op stays a launch
    uncaptured_launch_seconds = launch_seconds;
    launch_seconds = graph_node_seconds;
    launches_captured = true;
  }
  // The model's launches per layer (nullptr: not counted, so no launch term).
  std::shared_ptr<const std::vector<LayerLaunches>> launches;
  // A member of a tensor group of this many (1: not split): each of its layers' sums
  // (LayerLaunches::group_*) over a ring of the members, NCCL's all-reduce: 2 (T-1)/T of
  // the bytes each way at group_bytes_per_second, and 2 (T-1) steps of group_latency_seconds;
  // an all-gather or a reduce-scatter half of that: (T-1)/T of its whole tensor's bytes,
  // T-1 steps.
  int tensor_members = 1;
  double group_latency_seconds = 0, group_bytes_per_second = 0;
  // The seconds of `sums` sums of `bytes` in all, and `gathers` all-gathers or
  // reduce-scatters of whole tensors of `gather_bytes` in all, over the group (0 when
  // not split).
  double group_time(int64_t sums, double bytes, int64_t gathers = 0, double gather_bytes = 0) const;
  // Layer `layer`'s sums over the group at a micro-batch of `batch` samples, in seconds:
  // in F (and R), in B (their bytes grow with the batch) and in W (they do not).
  struct GroupSeconds {
    double forward = 0, backward = 0, weight = 0;
    double step = 0;  // once a step: LayerLaunches::group_sums_step
  };
  GroupSeconds group_seconds(int layer, int64_t batch) const;
  // Layer `layer`'s seconds at a micro-batch of `batch` samples (its launch term and its
  // group sums where counted; layer -1: none).
  double seconds(const layers::LayerCost& c, bool recompute, int layer = -1, int64_t batch = 1) const;
  // The seconds of n launches.
  double launch_time(int64_t n) const { return static_cast<double>(n) * launch_seconds; }
  // Layer i's counts, or zeros where none were counted.
  LayerLaunches launches_of(int layer) const;
};

// Cell sizes (layers per cell) minimising the largest cell cost. Among optimal splits
// the earliest cells are largest: the first cell as large as possible, then the second,
// and so on (6 equal layers into 4 cells give [2, 2, 1, 1]). Throws UserError if k < 1, k > costs.size(), or a cost is negative or not
// finite.
std::vector<int> balance_by_cost(const std::vector<double>& costs, int k);

// Checks a user's manual balance against the layer count; throws UserError naming the
// problem and the fix.
void validate_balance(const std::vector<int>& balance, int num_layers, int k);

// The cost of the most expensive cell of a split.
double max_cell_cost(const std::vector<double>& costs, const std::vector<int>& balance);

// Per-layer costs in seconds for a model at a given micro-batch size; a user's
// `cost:` value (overrides[i]) replaces the estimate for layer i. The first layer is
// charged no input gradient, which the executor never computes.
std::vector<double> layer_costs(const layers::Sequential& model, int64_t micro_batch_size, bool recompute,
                                const std::vector<std::optional<double>>& overrides = {},
                                const CostModel& cm = {});

}  // namespace partition
}  // namespace gpipe
