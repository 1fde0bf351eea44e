// `gpipe plan CONFIG --sweep`: tries the ways to run a config (stages K, micro-batches
// M, recompute mode, schedule, virtual stages, on CPUs one stage with every core's
// BLAS threads, and with pipeline.replicas D > 1 the optimizer state sharded or not;
// each replica gets 1/D of the devices), predicts each with the planner, drops those over the memory limit
// per device, and ranks the rest by predicted samples/s, saying why each lost to the
// one it recommends: memory, the bubble (idle time), slower ops (more recompute,
// thinner micro-batches whose GEMMs run slower), or fewer devices.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/device_spec.h"
#include "pipeline/planning/prediction.h"

namespace gpipe {
namespace pipeline {

struct SweepOptions {
  // Devices to plan for: 0 means this machine's (its cores for CPU configs, its GPUs
  // for CUDA configs). With `spec`, devices of that description instead.
  int devices = 0;
  const DeviceSpec* spec = nullptr;
  // Bytes per device a candidate may hold; 0 takes pipeline.memory_limit, then the
  // spec's memory; on this machine's CPUs the stages also share its available memory.
  int64_t memory_limit = 0;
  int64_t host_available = 0;  // bytes the CPU stages share (0: not checked)
  // Micro-batch counts M to try (those up to train.batch_size). `gpipe plan --sweep
  // --max-micro-batches N` sets them to the powers of two below N, and N.
  std::vector<int> micro_batches = {1, 2, 4, 8, 16, 32};
};

struct Candidate {
  int stages = 1, virtual_stages = 1, micro_batches = 1, blas_threads = 1;
  // The config's pipeline.replicas (D), kept; with D > 1 and an optimizer that has state,
  // each shape is tried with its state sharded over the replicas (ZeRO-1) and not.
  int replicas = 1;
  bool shard_optimizer = false;
  // T: each stage on this many devices, its tensor group (pipeline.tensor_parallel); the
  // plan's figures per stage are one member's. tensor_swept: the sweep tried several T,
  // so the overrides set it.
  int tensor_parallel = 1;
  bool tensor_swept = false;
  // pipeline.sequence_parallel at T > 1 (each member holds 1/T of the positions between
  // the split layers: less activation memory). The sweep tries each T > 1 with and
  // without it where the model allows it; then the overrides set it.
  bool sequence_parallel = false;
  RecomputeMode recompute = RecomputeMode::kNever;
  std::string schedule;
  // model.dtype, when the sweep tried several precisions (empty: the config's alone).
  std::string precision;
  std::vector<int> balance;
  PlannedRun run;
  int64_t peak_device_bytes = 0;  // the largest stage's total
  int64_t total_bytes = 0;        // over all stages
  bool fits = true;
  // A real step's median wall-clock milliseconds where it was timed (measured_sweep.h),
  // else -1; and whether it is the config's own plan.
  double measured_ms = -1;
  bool own = false;
  // The factor its predicted times were scaled by: the profile's StepCalibration for
  // plans that use the cores as it does (1: none).
  double correction = 1;
  std::string verdict;  // "recommended", or why it lost
  std::string label() const;      // "K=2 M=8 1f1b recompute=never"
  std::string overrides() const;  // "--set pipeline.partitions=2 --set ..."
};

struct SweepResult {
  std::vector<Candidate> candidates;  // the fitting ones by predicted samples/s, then the rest
  int recommended = -1;               // index into candidates, -1 if none fits
  int devices = 0;
  int64_t memory_limit = 0;
  std::string costs;  // where the costs came from
  // Where the recommended candidate sits at the edge of what was tried (the most
  // micro-batches, every device, the most virtual stages), each with how to look
  // further; empty when it sits inside.
  std::vector<std::string> edges;
};

// Where r's recommended candidate sits at the edge of what the sweep tried (SweepResult::edges),
// for a recommendation made after the sweep (measured_sweep.h).
std::vector<std::string> recommended_edges(const SweepResult& r, const Config& base, const layers::Sequential& model,
                                           const SweepOptions& o);

// The micro-batch counts the sweep tries up to `most`: the powers of two below it, and it.
std::vector<int> micro_batch_counts(int most);

// Throws UserError when no candidate can even be built (e.g. a one-layer model).
SweepResult sweep(const Config& config, const layers::Sequential& model, const SweepOptions& options);

// One precision the sweep may try (`gpipe plan --sweep --precisions float32,bf16`): the
// config with model.dtype set to it, and its model built in it.
struct SweptPrecision {
  std::string name;  // as model.dtype spells it
  const Config* config = nullptr;
  const layers::Sequential* model = nullptr;
};
// Every candidate of sweep() in each precision, ranked together: each labelled with its
// precision (its overrides set model.dtype), and a candidate that loses to one in another
// precision says so. An entry without a name is the config's precision at another
// pipeline.tensor_parallel (its config's T, its model that T's member 0: each stage on T
// devices of each replica's share); the candidates say their T.
SweepResult sweep(const std::vector<SweptPrecision>& precisions, const SweepOptions& options);

// The tensor-parallel sizes worth sweeping for `base`: T = 1, 2, 4, ... up to each
// replica's devices, and within one node of a device description (a tensor group sums at
// every split layer: Alpa's close devices). The caller builds each T's member and drops
// those the model does not split into.
std::vector<int> tensor_sizes(const Config& base, const SweepOptions& options);

// The config's model as member 0 of each tensor-parallel size worth sweeping
// (tensor_sizes), built on shapes, for sweep(std::vector<SweptPrecision>) with empty
// names; a size the model does not split into (heads, the vocabulary, hidden features
// that T does not divide) is left out and said in `unsplit` ("T=4: <why>"). Each T > 1
// without sequence parallelism and, where the model splits by positions at that T, with
// it (said in `unsplit` only when the config asks for it). Empty when there is only
// T = 1 to try, or the model is not YAML layers (a C++ model is whole).
struct TensorMembers {
  std::vector<RunModel> runs;
  std::vector<std::string> unsplit;
  std::vector<SweptPrecision> swept() const;  // pointers into runs
};
TensorMembers tensor_members(const Config& base, const SweepOptions& options);
// The ranked table, at most max_rows candidates (the recommendation always shown).
std::string sweep_table(const SweepResult& result, int max_rows = 30);

}  // namespace pipeline
}  // namespace gpipe
