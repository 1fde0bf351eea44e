// The devices' peaks (MFU's denominator): a real probe of this machine's CPU gives a
// finite positive rate and stores it in the cache file under its key; the next call reads
// it back instead of probing; an entry put there by hand is what is returned for its key
// (the cache is read, not only written); a damaged file is probed over and rewritten.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "kernels/backend.h"
#include "pipeline/planning/device_peak.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

using gpipe::testing::tmp_path;

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

}  // namespace

TEST_CASE("a probed peak is cached under its key, read back, and a damaged cache is probed over") {
  const std::string path = tmp_path("peaks.json");
  std::filesystem::remove(path);
  ::setenv("GPIPE_PEAK_CACHE", path.c_str(), 1);
  CHECK(peak_cache_path() == path);
  set_cpu_blas_threads(1);
  const std::vector<Device> two = {Device::cpu(), Device::cpu()};

  const std::vector<DevicePeak> probed = device_peaks(two, DType::kF32, 1);
  REQUIRE(probed.size() == 2);
  CHECK(!probed[0].cached);
  CHECK(std::isfinite(probed[0].flops_per_second));
  CHECK(probed[0].flops_per_second > 1e8);  // any CPU of this decade multiplies faster than 0.1 GFLOP/s
  CHECK(probed[1].flops_per_second == probed[0].flops_per_second);  // each of two at once gets their mean
  const std::string key = peak_key(Device::cpu(), DType::kF32, 1, 2);
  CHECK(key.find("|float32|threads=1|concurrent=2|") != std::string::npos);
  // The processor's widest vector instructions, read here independently from the flags.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string text((std::istreambuf_iterator<char>(cpuinfo)), std::istreambuf_iterator<char>());
  const std::string isa = text.find(" avx512f") != std::string::npos ? "|avx512|"
                          : text.find(" avx2") != std::string::npos  ? "|avx2|"
                                                                     : "|base|";
  CHECK(key.find(isa) != std::string::npos);
  nlohmann::json file = read_json(path);
  CHECK(file["peaks"][key].get<double>() == probed[0].flops_per_second);

  const std::vector<DevicePeak> again = device_peaks(two, DType::kF32, 1);
  CHECK(again[0].cached);
  CHECK(again[0].flops_per_second == probed[0].flops_per_second);

  // An entry of its own for one stage alone: read as it is.
  file["peaks"][peak_key(Device::cpu(), DType::kF32, 1, 1)] = 123e9;
  std::ofstream(path) << file.dump();
  const DevicePeak alone = device_peaks({Device::cpu()}, DType::kF32, 1).at(0);
  CHECK(alone.cached);
  CHECK(alone.flops_per_second == 123e9);

  std::ofstream(path) << "{\"version\": 1, \"peaks\": {";  // torn
  const DevicePeak reprobed = device_peaks({Device::cpu()}, DType::kF32, 1).at(0);
  CHECK(!reprobed.cached);
  CHECK(reprobed.flops_per_second > 1e8);
  CHECK(read_json(path)["peaks"].size() == 1);  // rewritten whole, with this probe only
}

TEST_CASE("stages sharing a GPU share its rates, so MFU's denominator counts the GPU once") {
  // The cache's entries stand for a probe of each GPU alone (no GPU is needed to read them).
  const std::string path = tmp_path("gpu_peaks.json");
  ::setenv("GPIPE_PEAK_CACHE", path.c_str(), 1);
  nlohmann::json peaks;
  for (int g : {0, 1}) {
    const std::string key = peak_key(Device::cuda(g), DType::kF32, 1, 1);
    peaks[key] = 40e12 + g * 1e12;
    peaks[key + "|copy"] = 3e12;
    peaks[key + "|launch"] = 3e-6 + g * 1e-6;
    peaks[key + "|graph_node"] = 1e-6 + g * 0.5e-6;  // a launch's cost in a captured graph
  }
  std::ofstream(path) << nlohmann::json{{"version", 2}, {"peaks", peaks}}.dump();
  const std::vector<DevicePeak> p =
      device_peaks({Device::cuda(0), Device::cuda(0), Device::cuda(1), Device::cuda(0)}, DType::kF32, 1);
  REQUIRE(p.size() == 4);
  for (int i : {0, 1, 3}) {
    CHECK(p[i].cached);
    CHECK(p[i].flops_per_second == doctest::Approx(40e12 / 3));
    CHECK(p[i].bytes_per_second == doctest::Approx(1e12));
    CHECK(p[i].launch_seconds == 3e-6);  // a launch costs each stage on the GPU the same
    CHECK(p[i].graph_node_seconds == 1e-6);  // and so does a captured one
  }
  CHECK(p[2].flops_per_second == 41e12);  // alone on cuda:1: all of it
  CHECK(p[2].bytes_per_second == 3e12);
  CHECK(p[2].launch_seconds == 4e-6);
  CHECK(p[2].graph_node_seconds == 1.5e-6);
  // The planner's cost model takes the slowest GPU's launch (a run that probed passes it in).
  Plan both;
  both.devices = {Device::cuda(0), Device::cuda(1)};
  const partition::CostModel cm = probed_cost_model(both, DType::kF32, 1);
  CHECK(cm.launch_seconds == 4e-6);
  CHECK(cm.launch_probed);
  CHECK(cm.graph_node_seconds == 1.5e-6);  // what a captured step would pay instead (price_captured)
  CHECK_FALSE(cm.launches_captured);
  const DevicePeak cpu = device_peaks({Device::cpu()}, DType::kF32, 1).at(0);
  CHECK(cpu.bytes_per_second == 0);  // a CPU's byte rate is the cost model's fixed one
  CHECK(cpu.launch_seconds == 0);    // and its ops are calls
}

TEST_CASE("stages that take turns on a device share its peak, probed once; the planner prices the device whole") {
  // Hand entries per key, read from the cache (nothing is probed): cpu:0 and cpu:1
  // computing at once (concurrent=2), cpu:0 alone (concurrent=1), and cuda:0 alone.
  const std::string path = tmp_path("turn_peaks.json");
  ::setenv("GPIPE_PEAK_CACHE", path.c_str(), 1);
  nlohmann::json peaks;
  peaks[peak_key(Device::cpu(0), DType::kF32, 1, 2)] = 90e9;
  peaks[peak_key(Device::cpu(0), DType::kF32, 1, 1)] = 100e9;
  peaks[peak_key(Device::cpu(0), DType::kF32, 1, 3)] = 60e9;  // three at once: what no-turns would probe
  const std::string gpu = peak_key(Device::cuda(0), DType::kF32, 1, 1);
  peaks[gpu] = 40e12;
  peaks[gpu + "|copy"] = 3e12;
  peaks[gpu + "|launch"] = 3e-6;
  peaks[gpu + "|graph_node"] = 1e-6;
  std::ofstream(path) << nlohmann::json{{"version", 2}, {"peaks", peaks}}.dump();

  // Stages 0 and 1 take turns on cpu:0 while stage 2 computes on cpu:1: two devices at once.
  const std::vector<Device> three = {Device::cpu(0), Device::cpu(0), Device::cpu(1)};
  const std::vector<DevicePeak> p = stage_peaks(three, device_turns(three, true), DType::kF32, 1);
  REQUIRE(p.size() == 3);
  CHECK(p[0].flops_per_second == 45e9);  // half of cpu:0's 90 each
  CHECK(p[1].flops_per_second == 45e9);
  CHECK(p[2].flops_per_second == 90e9);  // cpu:1 whole
  // Under mpirun (no turns) the same devices are three processes computing at once.
  const std::vector<DevicePeak> apart = stage_peaks(three, device_turns(three, false), DType::kF32, 1);
  for (const DevicePeak& x : apart) CHECK(x.flops_per_second == 60e9);
  // Four stages taking turns on cuda:0: a quarter of its rates each, the launch whole.
  const std::vector<Device> gpus(4, Device::cuda(0));
  for (const DevicePeak& x : stage_peaks(gpus, device_turns(gpus, true), DType::kF32, 1)) {
    CHECK(x.flops_per_second == 10e12);
    CHECK(x.bytes_per_second == 0.75e12);
    CHECK(x.launch_seconds == 3e-6);
  }

  // The planner simulates stages that take turns one at a time, each at the whole device.
  Plan shared;
  shared.stages = 2;
  shared.devices = {Device::cpu(0), Device::cpu(0)};
  shared.turns = device_turns(shared.devices, true);
  CHECK(probed_cost_model(shared, DType::kF32, 1).flops_per_second == 100e9);  // cpu:0 alone
  CHECK(stages_at_once(shared) == 1);
  Plan own = shared;
  own.devices = {Device::cpu(0), Device::cpu(1)};
  own.turns = device_turns(own.devices, true);
  CHECK(probed_cost_model(own, DType::kF32, 1).flops_per_second == 90e9);  // two at once
  CHECK(stages_at_once(own) == std::min(2, static_cast<int>(std::thread::hardware_concurrency())));
  Plan on_gpu;
  on_gpu.stages = 4;
  on_gpu.devices = gpus;
  on_gpu.turns = device_turns(gpus, true);
  const partition::CostModel cm = probed_cost_model(on_gpu, DType::kF32, 1);
  CHECK(cm.flops_per_second == 40e12);  // whole, not the 10 of each stage's share
  CHECK(cm.bytes_per_second == 3e12);
}
