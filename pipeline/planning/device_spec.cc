#include "pipeline/planning/device_spec.h"

#include <yaml-cpp/yaml.h>

#include <cmath>

#include "pipeline/config/config.h"
#include "runtime/dtype.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

partition::CostModel DeviceSpec::cost_model(const std::string& dtype) const {
  auto it = peak_flops.find(dtype);
  if (it == peak_flops.end()) {
    throw UserError("the device description " + source + " gives no peak_flops for " + dtype +
                    "; add device.peak_flops." + dtype);
  }
  partition::CostModel cm;
  cm.flops_per_second = it->second * efficiency;
  cm.bytes_per_second = memory_bandwidth * efficiency;
  cm.launch_seconds = launch_seconds;
  cm.graph_node_seconds = graph_node_seconds;
  return cm;
}

partition::CostModel DeviceSpec::cost_model_for(DType t) const {
  const std::string own = dtype_name(t);
  return cost_model(peak_flops.count(own) ? own : dtype_name(master_dtype(t)));
}

const LinkCost& DeviceSpec::link(int a, int b) const {
  return a / devices_per_node == b / devices_per_node ? intra_node : inter_node;
}

namespace {

[[noreturn]] void bad(const std::string& path, const YAML::Node& n, const std::string& key, const std::string& why) {
  const YAML::Mark m = n.Mark();
  const std::string at = m.is_null() ? path : path + ":" + std::to_string(m.line + 1);
  throw UserError("device description error at " + at + ": " + key + ": " + why);
}

YAML::Node need(const std::string& path, const YAML::Node& map, const std::string& key, const std::string& full) {
  const YAML::Node n = map[key];
  if (!n) bad(path, map, full, "missing; see configs/devices/h100_nvlink_ib.yaml for every field");
  return n;
}

double positive(const std::string& path, const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) bad(path, n, key, "expected a number");
  char* end = nullptr;
  const double v = std::strtod(n.Scalar().c_str(), &end);
  if (*end != '\0' || !std::isfinite(v) || v <= 0) bad(path, n, key, "expected a positive number, got '" + n.Scalar() + "'");
  return v;
}

LinkCost read_link(const std::string& path, const YAML::Node& links, const std::string& which) {
  const YAML::Node l = need(path, links, which, "links." + which);
  LinkCost out;
  out.kind = l["name"] ? l["name"].as<std::string>() : which;
  out.latency_ms = positive(path, need(path, l, "latency_us", "links." + which + ".latency_us"),
                            "links." + which + ".latency_us") / 1e3;
  out.bytes_per_ms = positive(path, need(path, l, "bandwidth_gb_per_s", "links." + which + ".bandwidth_gb_per_s"),
                              "links." + which + ".bandwidth_gb_per_s") * 1e9 / 1e3;
  return out;
}

}  // namespace

DeviceSpec load_device_spec(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw UserError("cannot read the device description '" + path + "'; check --device-spec (configs/devices/ has one)");
  } catch (const YAML::ParserException& e) {
    throw UserError("device description error at " + path + ":" + std::to_string(e.mark.line + 1) + ": invalid YAML: " + e.msg);
  }
  DeviceSpec s;
  s.source = path;
  if (!root.IsMap()) bad(path, root, "(top level)", "expected a mapping with name, device and links");
  s.name = root["name"] ? root["name"].as<std::string>() : path;
  const YAML::Node d = need(path, root, "device", "device");
  const YAML::Node peak = need(path, d, "peak_flops", "device.peak_flops");
  if (!peak.IsMap()) bad(path, peak, "device.peak_flops", "expected {float32: 67e12, ...}");
  for (auto it = peak.begin(); it != peak.end(); ++it) {
    const std::string written = it->first.as<std::string>();
    std::string dtype;  // the element type's one name: bf16 is bfloat16
    try {
      dtype = dtype_name(parse_dtype(written));
    } catch (const UserError&) {
      bad(path, it->first, "device.peak_flops." + written, "not an element type; use float32, float64, bfloat16 or float16");
    }
    s.peak_flops[dtype] = positive(path, it->second, "device.peak_flops." + written);
  }
  s.memory_bandwidth = positive(path, need(path, d, "memory_bandwidth_gb_per_s", "device.memory_bandwidth_gb_per_s"),
                                "device.memory_bandwidth_gb_per_s") * 1e9;
  const YAML::Node mem = need(path, d, "memory", "device.memory");
  try {
    s.memory_bytes = parse_byte_size(mem.as<std::string>(), "device.memory");
  } catch (const UserError& e) {
    bad(path, mem, "device.memory", e.what());
  }
  if (d["efficiency"]) {
    s.efficiency = positive(path, d["efficiency"], "device.efficiency");
    if (s.efficiency > 1) bad(path, d["efficiency"], "device.efficiency", "a fraction of the peak: at most 1");
  }
  if (d["launch_overhead_us"]) {
    s.launch_seconds = positive(path, d["launch_overhead_us"], "device.launch_overhead_us") / 1e6;
  }
  if (d["graph_node_us"]) {
    s.graph_node_seconds = positive(path, d["graph_node_us"], "device.graph_node_us") / 1e6;
  }
  s.devices_per_node = static_cast<int>(positive(path, need(path, root, "devices_per_node", "devices_per_node"),
                                                 "devices_per_node"));
  const YAML::Node links = need(path, root, "links", "links");
  s.intra_node = read_link(path, links, "intra_node");
  s.inter_node = read_link(path, links, "inter_node");
  return s;
}

}  // namespace pipeline
}  // namespace gpipe
