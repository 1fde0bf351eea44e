// Measured per-layer costs (`gpipe profile`): each layer's forward, backward (and its
// B and W halves where the layer splits its backward), recompute and optimizer time at
// one micro-batch size on one device, after warm-up, the median of timed repetitions;
// with the layer's parameter, output and saved-activation bytes. A profile file holds
// entries for several models, sizes and devices, each keyed by a hash of the model's
// layer descriptions, the micro-batch size, the dtype, the device kind and the BLAS
// threads; and the measured latency and bandwidth of the transports. The planner
// (planner.h) predicts from it and the balancer can balance by it
// (pipeline.balance_by: profile, torchgpipe's balance by time).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "layers/optimizer.h"
#include "layers/sequential.h"
#include "runtime/tensor.h"
#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

struct LayerProfile {
  std::string describe;
  double forward_ms = 0;         // forward keeping what backward needs
  double forward_nograd_ms = 0;  // forward of a checkpointed micro-batch (keeps nothing)
  double recompute_ms = 0;       // the forward again before backward
  double backward_ms = 0;        // the whole backward (no input gradient for the model's first layer)
  double backward_input_ms = 0;  // B: its input-gradient half (= backward_ms if it does not split)
  double backward_weight_ms = 0;  // W: its weight-gradient half (0 if it does not split)
  double optimizer_ms = 0;       // one optimizer step on its parameters
  int64_t param_bytes = 0, output_bytes = 0, saved_bytes = 0;
};

// What a profile is keyed by.
struct ProfileKey {
  std::string model_hash;
  int64_t micro_batch = 0;
  std::string dtype;   // "float32"
  std::string device;  // "cpu", "cuda"
  int blas_threads = 1;
  // How many stages computed at once, each on its own core, while it was measured: on
  // CPUs, stages that run together slow each other down (shared caches and memory
  // bandwidth, and on some VMs shared physical cores), so a K-stage plan is predicted
  // from the entry measured with K at once.
  int concurrency = 1;
  std::string str() const;  // "model 3f2a..., micro-batch 8, float32 on cpu, 1 BLAS thread"
};

struct ProfileEntry {
  ProfileKey key;
  std::string host;       // the CPU (or GPU) it was measured on, for messages
  std::string optimizer;  // the optimizer type its optimizer_ms timed
  std::string created;    // UTC time
  int warmup = 0, repeats = 0;
  std::vector<LayerProfile> layers;
  double loss_forward_ms = 0, loss_backward_ms = 0;  // counted with the last layer
};

// A transport's point-to-point cost: latency + bytes / bandwidth (bandwidth 0: none
// per byte, a hand-over of a pointer).
struct LinkCost {
  std::string kind;  // "inprocess", "mpi", "nvlink", ...
  double latency_ms = 0;
  double bytes_per_ms = 0;
  double ms(int64_t bytes) const { return latency_ms + (bytes_per_ms > 0 ? bytes / bytes_per_ms : 0.0); }
};

// Real steps of a plan timed against the planner's prediction (measured_sweep.h), per
// model, device, dtype and the way the plan uses the cores: how many stages compute at
// once and with how many BLAS threads each (the planner's models of several stages
// sharing a CPU and of BLAS threading are the least sure). A later sweep scales its
// predictions of plans that use the cores alike by `ratio`.
struct StepCalibration {
  std::string model_hash, device, dtype;
  int stages = 1, blas_threads = 1;
  double ratio = 1;  // measured / predicted step time, the prediction before any calibration
  int plans = 0;     // how many timed plans the ratio is the mean of
  std::string created;  // UTC time
};

struct ProfileStore {
  std::vector<ProfileEntry> entries;
  std::vector<LinkCost> links;
  std::vector<StepCalibration> calibrations;
  const ProfileEntry* find(const ProfileKey& key) const;
  const LinkCost* link(const std::string& kind) const;
  const StepCalibration* calibration(const std::string& model_hash, const std::string& device, const std::string& dtype,
                                     int stages, int blas_threads) const;
  // Adds or replaces the entry with the same key (the link with the same kind, the
  // calibration of the same model, device, dtype, stages and threads).
  void put(ProfileEntry entry);
  void put(LinkCost link);
  void put(StepCalibration calibration);
};

// The entry for `key` in the profile file at `path`, or a UserError that says what is
// missing (the file, this model, this micro-batch size, this device) and the command
// that makes it.
ProfileEntry require_profile(const std::string& path, const ProfileKey& key);

// Per-layer seconds for the balancer: forward + backward (+ recompute when the cells
// rematerialize), the loss counted with the last layer, as partition::layer_costs does
// for estimates.
std::vector<double> profile_layer_costs(const ProfileEntry& entry, bool recompute);

// The model part of a key: a hash of its input, dtypes, layer descriptions and loss.
std::string model_hash(const layers::Sequential& model);
// The CPU's model name (/proc/cpuinfo), "unknown CPU" where it has none.
std::string processor_name();
ProfileKey profile_key(const layers::Sequential& model, int64_t micro_batch, Device device, int blas_threads,
                       int concurrency = 1);

// Reads a profile file; a missing file gives an empty store, a malformed one a
// UserError naming the file.
ProfileStore load_profile(const std::string& path);
void save_profile(const std::string& path, const ProfileStore& store);  // atomically

// Measures every layer of `model` on `inputs` (a micro-batch: (n, *input shape)) and
// `targets`, on `device`, on the calling thread. The model's parameters move to the
// device; their gradients are left dirty. `concurrency` only labels the entry: the
// caller runs that many measurements at once (profile_command). Times at least
// `repeats` repetitions after `warmup`, and more until `min_seconds` have passed.
ProfileEntry measure_layers(layers::Sequential& model, const Tensor& inputs, const Tensor& targets, Device device,
                            const layers::OptimizerConfig& optimizer, int warmup, int repeats, int blas_threads,
                            int concurrency = 1, double min_seconds = 0);

// Ping-pong between stages 0 and 1 of `transport` (both in this process, or this
// process's stage `me` against the other rank), small and large messages: latency is
// half the small round trip, bandwidth from the large one. Collective for both stages.
LinkCost measure_link(Transport& transport, const std::string& kind, int me, int repeats);

}  // namespace pipeline
}  // namespace gpipe
