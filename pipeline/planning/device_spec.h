// A description of devices this machine does not have, for planning a pipeline before
// the GPUs are there (`gpipe plan CONFIG --devices N --device-spec FILE`): the device's
// peak rates and memory, how much of the peak a layer reaches, and the links within a
// node and between nodes. configs/devices/ holds one for an H100 node.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "partition/balance.h"
#include "pipeline/planning/profile.h"
#include "runtime/dtype.h"

namespace gpipe {
namespace pipeline {

struct DeviceSpec {
  std::string name;
  std::string source;                        // the file, for messages
  std::map<std::string, double> peak_flops;  // per dtype ("float32"), dense, per device
  double memory_bandwidth = 0;               // bytes/s
  int64_t memory_bytes = 0;
  double efficiency = 0.5;  // the fraction of peak FLOP/s and bandwidth a layer reaches
  double launch_seconds = 0;  // device.launch_overhead_us: one kernel launch's cost (absent: none charged)
  // device.graph_node_us: that kernel's cost as a node of a captured step's graph, which a
  // run with pipeline.capture pays instead (absent: a captured step is priced as launches).
  double graph_node_seconds = 0;
  int devices_per_node = 1;
  LinkCost intra_node, inter_node;

  // The roofline of one device for `dtype`; throws UserError if the spec has no peak for it.
  partition::CostModel cost_model(const std::string& dtype) const;
  // The roofline a model of element type t runs at: t's peak where the spec gives one (a
  // GPU computes a 16-bit model's products in 16 bits, cublasGemmEx with float32
  // accumulation), else its master type's (float32: what the widening computes in).
  // One rate for the whole model: right where its work is matrix products and fused
  // attention (the LLaMA layers), optimistic for layers a GPU widens to float32
  // (convolutions, the GPT attention's exact core), which a profile measures instead.
  partition::CostModel cost_model_for(DType t) const;
  // The link between devices a and b (0-based, devices_per_node to a node).
  const LinkCost& link(int a, int b) const;
};

// Reads a YAML device description; every error names the file, the key and the fix.
DeviceSpec load_device_spec(const std::string& path);

}  // namespace pipeline
}  // namespace gpipe
