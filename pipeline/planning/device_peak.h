// The matrix-product rate each stage's device reaches: the denominator of model FLOPs
// utilization (MFU) in the report, and the planner's device speed where it has no
// profile and no device description. Measured by a short probe (square matrix products
// through the stage's backend, the call the layers make with a weight) with every stage of the
// process probing at once, as they will run; cached per machine so a second run does
// not probe again.
#pragma once

#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace pipeline {

struct DevicePeak {
  double flops_per_second = 0;
  // A GPU's device-to-device copy rate (bytes read and written per second), the cost
  // model's byte term there; 0 on a CPU, whose cost model keeps its fixed rate.
  double bytes_per_second = 0;
  // A GPU's cost of one launch of its smallest kernel, back to back (the cost model's
  // per-launch term); 0 on a CPU, whose ops are calls.
  double launch_seconds = 0;
  // A GPU's cost of that kernel as a node of a captured step's graph, replayed
  // (pipeline.capture: the cost model's per-launch term then); 0 on a CPU, or where the
  // device could not capture.
  double graph_node_seconds = 0;
  bool cached = false;  // read from the cache file instead of measured now
};

// What identifies a probe's result on this machine: host, processor and its widest
// vector instructions (avx512, avx2; or the GPU), dtype,
// BLAS threads per caller, how many callers probed at once and the CPU's matrix library
// (GPIPE_GEMM, kernels/cpu_gemm.h). Cache entries are keyed by it.
std::string peak_key(Device device, DType dtype, int blas_threads, int concurrent);

// The cache file: $GPIPE_PEAK_CACHE, else $XDG_CACHE_HOME/gpipe/peaks.json, else
// ~/.cache/gpipe/peaks.json. A damaged or unreadable file is probed over (with a
// warning); one that cannot be written only costs the next run a probe.
std::string peak_cache_path();

// The peak of each device in `devices` (one per stage of this process), probed with all
// of them calling at once: CPU stages share the machine's cores, so each one's peak is
// its share (two stages of one thread each on two cores: one core each). A GPU is probed
// alone, once, and each of the stages on it gets its share (two stages on cuda:0: half
// each), so that MFU's denominator counts each device once. A probe sets
// the BLAS's threads per call to `blas_threads` (set_cpu_blas_threads) and leaves them so. Results come from the cache
// where it has this key; otherwise probed (about 0.3 s) and stored. `processes`: how many
// processes of the job on this machine probe at the same time (each with its own
// devices), for the key.
std::vector<DevicePeak> device_peaks(const std::vector<Device>& devices, DType dtype, int blas_threads,
                                     int processes = 1);

// The peak of each stage of one process, where stages that take turns on one device
// (`turns`, device_turns; Plan::turns) hold it together: the device is probed once (a
// CPU's beside the other devices computing at once), and each of its stages gets its
// share, as device_peaks gives stages on one GPU. MFU then counts each device once, and
// the shares of a device add up to its whole rate.
std::vector<DevicePeak> stage_peaks(const std::vector<Device>& devices, const std::vector<int>& turns, DType dtype,
                                    int blas_threads, int processes = 1);

}  // namespace pipeline
}  // namespace gpipe
