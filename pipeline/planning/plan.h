// One plan of a run, computed once from the config and the model and read by the
// trainer, `gpipe plan` and the report: how many stages, cells, micro-batches and
// replicas, how big each micro-batch is, which schedule, where the model is cut and
// which device runs each stage, and what each stage will hold in memory.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kernels/meta_backend.h"
#include "layers/sequential.h"
#include "partition/balance.h"
#include "pipeline/config/config.h"
#include "pipeline/executor/cell.h"
#include "pipeline/schedule/schedule.h"

namespace gpipe {
namespace pipeline {

// What each layer's forward keeps for its backward, read once per model by running every
// layer on shapes (kernels/meta_backend.h: tensors without data, ops that compute
// nothing; microseconds a layer, no memory, no device touched) at a batch of one and of
// two samples (in recompute mode, so that no layer's state changes) and counting the
// buffers of its context as the executor's meter does (held_bytes.h): the bytes besides its input and output,
// linear in the batch size, and whether it keeps its input and its output. A layer's
// output is often the next one's saved input; counting each buffer once is what makes
// the estimate agree with the meter.
struct ContextKeeps {
  double own_base = 0, own_per_sample = 0;  // bytes besides the four buffers below
  bool keeps_input = false, keeps_output = false;
  bool keeps_grad_output = false, keeps_grad_input = false;  // dy, and the dx it returned (after B)
  int64_t own(int64_t batch) const;
};
// A layer's context after its forward, and for a layer that splits its backward, after
// B (backward_input, probed on that context with a zero output gradient): what it keeps
// for W (a Linear its input and dy; nothing for a layer that does not split).
struct LayerActivation {
  ContextKeeps forward, weight;
};
struct ActivationLayout {
  std::vector<LayerActivation> layers;
  ContextKeeps loss;  // the loss's context (keeps_input: it keeps the logits)
  // Each layer's ops per phase, counted on shapes (count_launches); nullptr where the
  // model cannot run on shapes.
  std::shared_ptr<const std::vector<partition::LayerLaunches>> launches;
};
// What a stage holds at its peak: parameters with their gradients and optimizer state,
// and the activations the schedule keeps alive, after each instruction as the executor
// meters them (walked instruction by instruction: a forward keeps its cell's contexts,
// or only its input when checkpointed, and the output until it is sent; a recompute
// rebuilds the contexts and keeps the input; a backward frees them, or keeps what the
// splitting layers' W needs, as probed, and holds the input gradient until it is sent).
// make_plan computes it once (Plan::memory); the fit check, the report's prediction,
// the sweep, auto and `gpipe plan` read it there.
// With a sharded optimizer (Plan::shard_optimizer) the optimizer state is one replica's
// shard. Not counted, sharded or not: the replicas' reduction buffers (the buckets, or
// the flat buffer of RS and AG: one gradient's worth).
struct StageMemory {
  int64_t parameter_bytes = 0;  // parameters, gradients and optimizer state: the three below
  int64_t weight_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  int64_t activation_bytes = 0;  // the peak of the activations held
  int64_t total() const { return parameter_bytes + activation_bytes; }
};

// Where a process sits in a job of K stages x T tensor-group members x D replicas.
struct RankPlace {
  int stage = 0, member = 0, replica = 0;
};
// The job's processes, numbered rank = (replica K + stage) T + member: a stage's tensor
// group on adjacent ranks (mpirun fills a node's slots in rank order, so the group that
// talks at every split layer shares a host, Alpa's close devices), then the stages of a
// pipeline, then the replicas. T = 1 is the layout without tensor parallelism.
struct RankLayout {
  int stages = 1, tensor = 1, replicas = 1;
  int size() const { return stages * tensor * replicas; }
  RankPlace place(int rank) const { return {(rank / tensor) % stages, rank % tensor, rank / (tensor * stages)}; }
  int rank(const RankPlace& p) const { return (p.replica * stages + p.stage) * tensor + p.member; }
};

struct Plan {
  int stages = 1;          // K
  int virtual_stages = 1;  // v: cells per stage
  int replicas = 1;        // D
  // T: each stage's split layers (layers/tensor_parallel.h) over this many processes,
  // each building its member of the model (layers::ModelSpec::member).
  int tensor_parallel = 1;
  // pipeline.sequence_parallel at T > 1: between the split layers each member holds 1/T
  // of each sample's positions (the member's model, layers::TensorShard::sequence).
  bool sequence_parallel = false;
  RankLayout ranks() const { return {stages, tensor_parallel, replicas}; }
  // pipeline.shard_optimizer: optimizer with D > 1 (ZeRO-1): each replica keeps 1/D of
  // its stage's optimizer state (shard_partition.h); the schedule holds RS and AG.
  bool shard_optimizer = false;
  int64_t batch_size = 0;     // the whole mini-batch, over every replica
  int64_t replica_batch = 0;  // the rows one pipeline runs per step
  std::vector<int64_t> micro_batch_sizes;  // split_sizes(replica_batch, M): M of them
  RecomputeMode recompute = RecomputeMode::kExceptLast;
  Schedule schedule;
  std::vector<int> balance;     // layers per cell, v K of them
  std::vector<Device> devices;  // per stage
  // Per stage, the first stage on its device in this process (device_turns): stages that
  // one process runs on one device take turns on it. The planner's simulation has them
  // wait for each other, and their device's peak is counted once (stage_peaks).
  std::vector<int> turns;
  std::vector<CellSpec> cells;  // per cell, on its stage's device
  // Useful FLOPs of one step of one pipeline, per stage: the forward and backward of its
  // layers over the M micro-batches (exact counts, LayerCost; the loss's with the last
  // layer, as Sequential::costs counts it). Not counted: recompute, and the model input's
  // gradient, which nothing computes. MFU's numerator.
  std::vector<double> stage_flops;
  // What each stage holds at its peak (estimate_memory, from the model's activation
  // layout probed on shapes): computed once, here, and read by everything that shows
  // or checks memory.
  std::vector<StageMemory> memory;
  // Each layer's ops per phase (ActivationLayout::launches, from the same probe):
  // the cost model's launch term and the planned launches per step read them here.
  std::shared_ptr<const std::vector<partition::LayerLaunches>> launches;
  int micro_batches() const { return static_cast<int>(micro_batch_sizes.size()); }  // M
  int num_cells() const { return static_cast<int>(balance.size()); }
  int64_t largest_micro_batch() const { return micro_batch_sizes.empty() ? 0 : micro_batch_sizes.front(); }
};

// The device of the pipeline's first stage: pipeline.devices[0], or the CPU when the
// config names none. Costs are measured and looked up on it (profile, planner, sweep).
Device first_device(const Config& config);

// The per-layer `cost:` overrides of a config's YAML layers (none for a C++ model).
std::vector<std::optional<double>> cost_overrides(const Config& config);

// A plan's sizes only (stages, cells per stage, micro-batches, replicas, batch and
// micro-batch sizes, recompute mode): no schedule, balance or devices. Validates them
// (UserError naming the key and the fix). make_plan starts from it; `gpipe profile`
// and the sweep, which need the micro-batch sizes without a whole plan, call it alone.
Plan plan_sizes(const Config& config);

struct PlanOptions {
  int local_stage = -1;  // a multi-process run's own stage: only its device must exist here
  CommModel comm = CommModel::kBuffered;  // the transport's, for the schedule's lowering and check
  // The model's activation layout, probed once for many plans (the sweep); nullptr: probe.
  const ActivationLayout* layout = nullptr;
};

// Validates the config against the model (sizes, balance, devices, schedule) and plans
// the run. Throws UserError naming the key and the fix.
Plan make_plan(const Config& config, const layers::Sequential& model, const PlanOptions& options = {});

// Plan::stage_flops of a plan whose sizes, schedule and cells are set.
std::vector<double> useful_flops(const layers::Sequential& model, const Plan& plan);

// The layers per cell the config asks for: its balance, or the balancer's split of the
// layer cost estimates at the plan's micro-batch size into the plan's cells.
std::vector<int> plan_balance(const Config& config, const layers::Sequential& model, int cells,
                              int64_t micro_batch_size);

ActivationLayout probe_activations(const layers::Sequential& model);
// Each layer's ops (kernels/meta_backend.h: MetaOpCount) on shapes at a batch of one,
// as the executor calls them: F in training (BatchNorm's copies of its micro-batch
// statistics included) and R, the forward again without them; B on a zero output gradient (with the input
// gradient on every layer but the first) and W, or the whole backward of a layer that
// does not split; the loss's forward and backward with the last layer. The counts of
// the built-in layers do not depend on the batch size. Throws where a layer cannot run
// on shapes.
// With `products`, the matrix products of each layer's phases are listed there too
// (MetaProducts: F's, the loss's with the last layer's; B's; W's), at a batch of `batch`
// samples, where the products' sizes depend on it.
struct LayerProducts {
  std::vector<MetaProduct> forward, backward, weight;
};
std::vector<partition::LayerLaunches> count_launches(const layers::Sequential& model, int64_t batch = 1,
                                                     std::vector<LayerProducts>* products = nullptr);
// The same probe answering as the first GPU of `devices` would, where there is one
// (MetaAnswersAs: a bf16 attention keeps cuDNN's fused operands there, a float32 one its
// probabilities): the model's layers are on the CPU until the executor moves them, and
// what an attention layer keeps depends on the device. What estimate_memory and the
// sweep read.
ActivationLayout probe_activations(const layers::Sequential& model, const std::vector<Device>& devices);
// The same probe with data, on the layers' own devices (forward and backward computed on
// batches of zeros): the oracle that probe_activations is tested against.
ActivationLayout probe_activations_on_devices(const layers::Sequential& model);

std::vector<StageMemory> estimate_memory(const Plan& plan, const layers::Sequential& model,
                                         const layers::OptimizerConfig& optimizer);
// The same with a layout probed before (the sweep estimates many plans of one model).
std::vector<StageMemory> estimate_memory(const Plan& plan, const layers::Sequential& model,
                                         const layers::OptimizerConfig& optimizer, const ActivationLayout& layout);

// Bytes of host memory available now (MemAvailable), or -1 where unknown: CPU stages
// share it (the trainer's fit check, the sweep).
int64_t host_available_bytes();

// Bytes of a checkpoint of the model and its optimizer state (parameters once, tied
// copies and buffers included).
int64_t checkpoint_bytes(layers::Sequential& model, const layers::OptimizerConfig& optimizer);

// Optimizer state per parameter element, in parameter-sized slots: SGD with momentum
// keeps one buffer, Adam and AdamW two.
int optimizer_slots(const layers::OptimizerConfig& optimizer);

}  // namespace pipeline
}  // namespace gpipe
