// The planner: predicts a plan's step time, bubble, throughput and memory per stage
// before anything trains, by simulating its schedule (schedule.h's simulate) with a
// cost per instruction: the layers' measured times from a profile (profile.h) when
// there is one for the model, micro-batch size and device, and the roofline cost
// model (partition/balance.h) otherwise; sends cost the transport's latency plus bytes
// over its bandwidth. Memory is estimate_memory (plan.h), the function the trainer's
// fit check calls too.
//
// Why a profile per micro-batch size: splitting a batch into thinner micro-batches
// makes every GEMM slower per row (on one CPU core, 32-row GEMMs run at ~75% of the
// rate of 256-row ones), which can cost more than the bubble it saves. A cost model
// that is linear in rows cannot see that; measured times at each size can.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "layers/optimizer.h"
#include "layers/sequential.h"
#include "partition/balance.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/prediction.h"
#include "pipeline/planning/profile.h"

namespace gpipe {
namespace pipeline {

// One layer's times at one micro-batch size, in ms.
struct LayerTimes {
  double forward = 0, forward_nograd = 0, recompute = 0;
  double backward = 0, backward_input = 0, backward_weight = 0;
  double optimizer = 0;
  // A tensor-group member's sums over its group: the part of forward (recompute too), of
  // backward_input and of backward_weight that is communication (the report's
  // accounting, OpSpan::group_ms).
  double forward_group = 0, backward_group = 0, weight_group = 0;
  // Once a step, in the instruction where the layer's gradients become final (its
  // stage's last B or W of its cell): its sequence-partial gradients' sum over the group.
  double step_group = 0;
  // A user's cost for the layer (`cost:`): its times hold whatever sums it makes, which
  // are then not priced apart (CostTable::tensor_ms).
  bool group_in_times = false;
};

struct CostTable {
  std::string source;  // "profile", "estimate", "profile at micro-batch 8, scaled"
  int64_t micro_batch = 0;
  std::vector<LayerTimes> layers;
  double loss_forward = 0, loss_backward = 0;  // ms; estimates count the loss in the last layer
  // A tensor-group member's collectives (the program's tAR, tMAX, tAG, tRS), priced one
  // by one as the cost model prices the layers' sums (CostModel::group_time): the group
  // is set in an estimate. A measured table has its layers' sums inside their times and
  // no group parts (LayerTimes::forward_group and the rest 0), and prices them at 0; so
  // does a layer with a user's cost (LayerTimes::group_in_times).
  int tensor_members = 1;
  double group_latency_seconds = 0, group_bytes_per_second = 0;
  // ms of `op` at a micro-batch of `micro_batch` samples.
  double tensor_ms(const TensorOp& op, int64_t micro_batch) const;
};

// From the cost model: forward max(FLOPs / rate, bytes / bandwidth), backward likewise
// (the model's first layer without its input gradient), shared by B and W as the same
// roofline of their own counts (W: weight_grad_flops and weight_grad_bytes; B: the
// rest of backward), the optimizer by the bytes it reads and writes. A layer's
// `cost:` (seconds of forward + backward) is split one third forward.
CostTable estimate_costs(const layers::Sequential& model, int64_t micro_batch, const partition::CostModel& cm,
                         const std::vector<std::optional<double>>& overrides, const layers::OptimizerConfig& optimizer);
CostTable profile_costs(const ProfileEntry& entry);

// The cost tables a plan's micro-batch sizes get: the profile's entry at that size;
// else the nearest profiled size of this model and device, scaled per layer by the
// cost model's ratio between the two sizes; else the cost model alone.
class CostSource {
 public:
  // concurrency: stages computing at once (the profile's entries measured so, else
  // those measured alone). compute_scale multiplies every layer time (the sweep's guess
  // for more BLAS threads than were profiled: 1 / threads, perfect scaling).
  CostSource(const layers::Sequential& model, ProfileStore profile, std::string profile_path, Device device,
             int blas_threads, partition::CostModel cm, std::vector<std::optional<double>> overrides,
             layers::OptimizerConfig optimizer, double compute_scale = 1.0, int concurrency = 1);
  const CostTable& at(int64_t micro_batch) const;
  bool has_profile() const;  // some size of this model and device was measured
  std::string describe() const;  // for the plan's and the report's "costs from" line

 private:
  std::string describe_sources() const;
  // The profile's entries of this model, dtype, device, threads and concurrency (or,
  // with none at this concurrency, measured alone).
  std::vector<const ProfileEntry*> family() const;
  const layers::Sequential& model_;
  ProfileStore profile_;
  std::string path_;
  ProfileKey base_key_;
  partition::CostModel cm_;
  std::vector<std::optional<double>> overrides_;
  layers::OptimizerConfig optimizer_;
  double compute_scale_ = 1.0;
  mutable std::map<int64_t, CostTable> cache_;
};

// Cost of a message from stage src to stage dst.
using LinkFn = std::function<LinkCost(int src, int dst)>;

struct PredictOptions {
  // The executor's own cost per instruction (timing, the activation meter, dispatch):
  // 4 to 5 us on the 2-vCPU machine of bench/RESULTS.md (pipeline_bench --direct).
  double instruction_overhead_ms = 0.005;
  // The model's activation layout, probed once for many predictions (nullptr: probe).
  const ActivationLayout* layout = nullptr;
};

// The ops stage k's layers call in one step (PlannedStage::launches): F a training
// forward's, R the forward's again (LayerLaunches::recompute), B its part of the backward (all of it for a micro-batch that does not
// defer W), W the weight gradient's for each micro-batch it covers. The plan's ops must
// have been counted (Plan::launches).
int64_t stage_launches(const Plan& plan, int k);

// Simulates the plan's schedule with these costs. Deterministic: the same inputs give
// the same prediction.
PlannedRun predict(const Plan& plan, const layers::Sequential& model, const CostSource& costs, const LinkFn& link,
                   const layers::OptimizerConfig& optimizer, const PredictOptions& options = {});

// A message between stages on this machine: the in-process hand-over (no bytes move
// between CPU stages), or MPI between processes; the profile's measured figures
// (`gpipe profile`, `mpirun -np 2 gpipe profile`) when it has them.
LinkCost local_link(const ProfileStore& profile, bool across_processes);

// A tensor-parallel plan's group sums (Plan::tensor_parallel members, each a process;
// their sums counted on shapes, Plan::launches) priced over `link`, the link between a
// stage's members: this machine's MPI (local_link across processes) or a device
// description's link within a node.
void price_tensor_group(partition::CostModel& cm, int members, const LinkCost& link);

// How many of a plan's stages compute at once on their own cores: on CPUs one per device
// (stages that take turns on one, Plan::turns, count once), at most the cores; 1 on GPUs
// (each its own device).
int stages_at_once(const Plan& plan);

// The cost model of a plan's devices where nothing was measured of the model: their
// matrix-product peak as a run probes it (device_peaks with all of the plan's devices at
// once, the slowest device's whole rate: stages that take turns on one, Plan::turns, each
// have all of it while they compute, and the simulation has them wait for each other)
// and, on GPUs, their probed copy rate
// (the CPU's fixed 10 GB/s otherwise). `flops_per_second` > 0: that rate and
// `bytes_per_second` (when > 0) instead, probing nothing (a run that probed already:
// under mpirun a rank must not probe the other ranks' devices); < 0: the fixed rates.
// `launch_seconds` with a given rate: a GPU's measured launch cost (DevicePeak), and
// `graph_node_seconds` its cost in a captured graph (CostModel::price_captured). The
// model's counted ops (Plan::launches) go with it.
partition::CostModel probed_cost_model(const Plan& plan, DType dtype, int blas_threads, double flops_per_second = 0,
                                       double bytes_per_second = 0, double launch_seconds = 0,
                                       double graph_node_seconds = 0);

// Whether the config's training step is captured (pipeline.capture, on a pipeline it
// takes, and no layer that does host work in a step): the cost model then prices each op
// at a graph node's cost where it knows one (CostModel::price_captured).
bool captures(const Config& config, const layers::Sequential& model);

// The run's prediction as `train` and `gpipe plan` make it: the config's profile file
// when it has entries for this model, the cost model otherwise (probed_cost_model, at
// `flops_per_second`, `bytes_per_second`, `launch_seconds` and `graph_node_seconds` when
// given; a captured step's ops at the graph node's cost, captures()). Messages
// between stages cross processes when `across_processes`; a tensor group's members are
// processes unless `group_across_processes` is false (threads of one process).
PlannedRun predict_config(const Config& config, const layers::Sequential& model, const Plan& plan,
                          bool across_processes = false, double flops_per_second = 0, double bytes_per_second = 0,
                          double launch_seconds = 0, bool group_across_processes = true,
                          double graph_node_seconds = 0);

}  // namespace pipeline
}  // namespace gpipe
