#include "runtime/heartbeat.h"
#include "pipeline/planning/device_peak.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>
#include <mutex>
#include <thread>

#include "kernels/backend.h"
#include "kernels/cpu_gemm.h"
#include "pipeline/planning/profile.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// Bumped when the probe measures differently, so older entries are not read.
constexpr int kProbeVersion = 2;

std::string host() {
  char name[256] = {0};
  ::gethostname(name, sizeof name - 1);
  return name;
}

// The CPU's matrix library choice (GPIPE_GEMM: auto, openblas, onednn), which changes the rate.
std::string gemm_path() { return cpu_blas::library_name(cpu_blas::library()); }

// The widest vector instructions the CPU has (avx512, avx2 or base), from /proc/cpuinfo's
// flags: a virtual machine may name its processor only "AMD EPYC" whether or not it
// passes AVX-512 through, and the matrix kernels' rate differs by about 2x between them,
// so a rate cached on one must not be read on the other.
std::string cpu_isa() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    bool avx2 = false, avx512 = false;
    for (std::string w; words >> w;) {
      avx512 = avx512 || w == "avx512f";
      avx2 = avx2 || w == "avx2";
    }
    return avx512 ? "avx512" : avx2 ? "avx2" : "base";
  }
  return "base";
}

// The matrix side: large enough that the product runs at the BLAS's full rate, small
// enough that a probe takes a fraction of a second (2 x 1024^3 = 2.1 GFLOP on a CPU).
int64_t probe_side(Device d) { return d.is_cpu() ? 1024 : 4096; }

// The best rate of a few square products on `d`, after one to warm up; `start` holds
// every caller back until all are ready, so they run at once.
double probe(Device d, DType dtype, const std::function<void()>& start) {
  Backend& be = backend_for(d);
  const int64_t n = probe_side(d);
  Tensor a = be.empty({n, n}, dtype), b = be.empty({n, n}, dtype), c = be.empty({n, n}, dtype);
  be.fill(a, 0.5);
  be.fill(b, 0.25);
  // b is used as the layers use a weight: through matmul_weight inside a FrozenWeights
  // window, so a CPU whose oneDNN packs weights is probed at that rate.
  FrozenWeights frozen;
  be.matmul_weight(a, false, b, true, c);  // warm-up: the BLAS's threads, its buffers, the GPU's clocks
  be.synchronize();
  start();
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  double best = 0;
  const auto t_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
  for (int i = 0; i < 12 && (i < 3 || std::chrono::steady_clock::now() < t_end); ++i) {
    heartbeat();  // probing is progress, for gpipe run (runtime/heartbeat.h)
    const auto t0 = std::chrono::steady_clock::now();
    be.matmul_weight(a, false, b, true, c);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, flops / s);
  }
  return best;
}

// A GPU's memory rate for the cost model's byte term: the best of a few device-to-device
// copies of 256 MiB, counting the bytes read and written. Not taken on a CPU, whose cost
// model keeps its fixed rate (partition::CostModel).
double probe_copy(Device d) {
  Backend& be = backend_for(d);
  const int64_t n = int64_t{64} << 20;  // floats: 256 MiB
  Tensor a = be.empty({n}, DType::kF32), c = be.empty({n}, DType::kF32);
  be.fill(a, 0.5);
  copy_tensor(a, c);  // warm-up
  be.synchronize();
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    copy_tensor(a, c);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * static_cast<double>(a.nbytes()) / s);
  }
  return best;
}

// A GPU's cost of a launch: the best of three runs of 1000 launches of the smallest
// kernel (a fill of 256 floats) back to back, over their count: the host's enqueue and
// the device's own time of a kernel, whichever is longer, as a step of many small
// kernels pays it. Not taken on a CPU.
double probe_launch(Device d) {
  Backend& be = backend_for(d);
  Tensor x = be.empty({256}, DType::kF32);
  constexpr int kLaunches = 1000;
  be.fill(x, 0.0);  // warm-up
  be.synchronize();
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kLaunches; ++i) be.fill(x, static_cast<double>(i));
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kLaunches;
    best = best > 0 ? std::min(best, s) : s;
  }
  return best;
}

// A GPU's cost of a captured launch: the same 1000 launches captured as one graph
// (Backend::begin_capture, as pipeline.capture captures a step), the best of three
// replays over their count. 0 where the device cannot capture (kept in the cache), -1
// where capturing failed otherwise (not kept: the next run measures again); the planner
// then keeps the launch's cost. Not taken on a CPU.
double probe_graph_node(Device d) {
  Backend& be = backend_for(d);
  Tensor x = be.empty({256}, DType::kF32);
  constexpr int kLaunches = 1000;
  be.synchronize();
  std::unique_ptr<CapturedOps> graph;
  try {
    be.begin_capture();
    for (int i = 0; i < kLaunches; ++i) be.fill(x, static_cast<double>(i));
    graph = be.end_capture();
  } catch (const std::exception& e) {
    be.abort_capture();  // the stream left as it was, for the run
    const bool cannot = dynamic_cast<const CaptureError*>(&e) != nullptr;
    spdlog::warn("{}: a captured launch's cost could not be measured ({}); the planner prices a captured step's "
                 "ops as launches", d.str(), e.what());
    return cannot ? 0.0 : -1.0;
  }
  graph->replay();  // warm-up: the graph's first launch uploads it
  be.synchronize();
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    graph->replay();
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kLaunches;
    best = best > 0 ? std::min(best, s) : s;
  }
  return best;
}

nlohmann::json read_cache(const std::string& path) {
  std::ifstream f(path);
  if (!f) return nlohmann::json::object();
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    if (j.is_object() && j.value("version", 0) == kProbeVersion && j.contains("peaks") && j["peaks"].is_object()) {
      return j["peaks"];
    }
    spdlog::warn("{}: not a peak cache of this gpipe (version {}); probing again and rewriting it", path,
                 kProbeVersion);
  } catch (const std::exception& e) {
    spdlog::warn("{}: damaged ({}); probing again and rewriting it", path, e.what());
  }
  return nlohmann::json::object();
}

}  // namespace

std::string peak_key(Device device, DType dtype, int blas_threads, int concurrent) {
  std::string k = host() + "|" + (device.is_cpu() ? processor_name() + "|" + cpu_isa() : device.str()) + "|" +
                  dtype_name(dtype);
  if (device.is_cpu()) k += "|threads=" + std::to_string(blas_threads);
  return k + "|concurrent=" + std::to_string(concurrent) + "|gemm=" + gemm_path();
}

std::string peak_cache_path() {
  if (const char* p = std::getenv("GPIPE_PEAK_CACHE"); p != nullptr && *p != '\0') return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return (std::filesystem::path(x) / "gpipe" / "peaks.json").string();
  }
  const char* home = std::getenv("HOME");
  return (std::filesystem::path(home != nullptr ? home : "/tmp") / ".cache" / "gpipe" / "peaks.json").string();
}

std::vector<DevicePeak> stage_peaks(const std::vector<Device>& devices, const std::vector<int>& turns, DType dtype,
                                    int blas_threads, int processes) {
  GPIPE_CHECK(turns.size() == devices.size(), "stage_peaks: a turn per stage");
  std::vector<Device> probed;  // one per device the stages take turns on
  std::vector<size_t> at(devices.size());
  std::vector<int> sharing(devices.size(), 0);
  for (size_t k = 0; k < devices.size(); ++k) {
    const auto first = static_cast<size_t>(turns[k]);
    GPIPE_CHECK(first <= k && turns[first] == static_cast<int>(first), "stage_peaks: not device_turns");
    if (first == k) {
      at[k] = probed.size();
      probed.push_back(devices[k]);
    }
    ++sharing[first];
  }
  const std::vector<DevicePeak> whole = device_peaks(probed, dtype, blas_threads, processes);
  std::vector<DevicePeak> out(devices.size());
  for (size_t k = 0; k < devices.size(); ++k) {
    const auto first = static_cast<size_t>(turns[k]);
    out[k] = whole[at[first]];
    out[k].flops_per_second /= sharing[first];
    out[k].bytes_per_second /= sharing[first];
  }
  return out;
}

std::vector<DevicePeak> device_peaks(const std::vector<Device>& devices, DType dtype, int blas_threads, int processes) {
  // CPU stages share the machine, so they are probed together and keyed by how many
  // ran at once. A GPU is probed once, alone, whatever the number of stages on it; each
  // of those stages then gets its share, so that the shares add up to the GPU's rate.
  const int cpus = static_cast<int>(std::count_if(devices.begin(), devices.end(), [](Device d) { return d.is_cpu(); }));
  std::vector<size_t> first(devices.size());  // the first stage on the same GPU (itself for a CPU)
  std::vector<int> sharing(devices.size(), 1);
  for (size_t i = 0; i < devices.size(); ++i) {
    first[i] = i;
    if (devices[i].is_cpu()) continue;
    first[i] = static_cast<size_t>(std::find(devices.begin(), devices.end(), devices[i]) - devices.begin());
    sharing[i] = static_cast<int>(std::count(devices.begin(), devices.end(), devices[i]));
  }
  std::vector<std::string> keys;
  for (Device d : devices) keys.push_back(peak_key(d, dtype, blas_threads, d.is_cpu() ? cpus * processes : 1));
  auto copy_key = [&](size_t i) { return keys[i] + "|copy"; };
  auto launch_key = [&](size_t i) { return keys[i] + "|launch"; };
  auto node_key = [&](size_t i) { return keys[i] + "|graph_node"; };

  const std::string path = peak_cache_path();
  nlohmann::json cache = read_cache(path);
  std::vector<DevicePeak> out(devices.size());
  // Every stage's share of its device once `out` holds the devices' whole rates.
  auto shares = [&] {
    std::vector<DevicePeak> each(devices.size());
    for (size_t i = 0; i < devices.size(); ++i) {
      each[i] = out[first[i]];
      each[i].flops_per_second /= sharing[i];
      each[i].bytes_per_second /= sharing[i];
      // launch_seconds (and graph_node_seconds) stay whole: a launch costs each stage on
      // the GPU the same.
    }
    return each;
  };
  auto cached = [&](const std::string& key) {
    const auto it = cache.find(key);
    return it != cache.end() && it->is_number() && it->get<double>() > 0 ? it->get<double>() : 0.0;
  };
  // A graph node's cost is stored as 0 where the device could not capture: known, not missing.
  auto cached_node = [&](const std::string& key) {
    const auto it = cache.find(key);
    return it != cache.end() && it->is_number() && it->get<double>() >= 0 ? it->get<double>() : -1.0;
  };
  std::vector<size_t> to_probe;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (first[i] != i) continue;
    const double flops = cached(keys[i]);
    const double bytes = devices[i].is_cpu() ? 0.0 : cached(copy_key(i));
    const double launch = devices[i].is_cpu() ? 0.0 : cached(launch_key(i));
    const double node = devices[i].is_cpu() ? 0.0 : cached_node(node_key(i));
    if (flops > 0 && (devices[i].is_cpu() || (bytes > 0 && launch > 0 && node >= 0))) {
      out[i] = {flops, bytes, launch, node, true};
    } else {
      to_probe.push_back(i);
    }
  }
  if (to_probe.empty()) return shares();
  // The BLAS's threads per call as the key says (a command that probes before its run
  // sets them, such as `gpipe plan`, would otherwise probe at the library's default).
  set_cpu_blas_threads(blas_threads);

  // All callers start their timed products together (a countdown of those still warming up).
  std::mutex m;
  std::condition_variable cv;
  size_t waiting = to_probe.size();
  auto start = [&] {
    std::unique_lock<std::mutex> lock(m);
    if (--waiting == 0) cv.notify_all();
    cv.wait(lock, [&] { return waiting == 0; });
  };
  std::vector<double> rate(to_probe.size(), 0), copy_rate(to_probe.size(), 0), launch(to_probe.size(), 0),
      node(to_probe.size(), 0);
  std::vector<std::exception_ptr> error(to_probe.size());
  std::vector<std::thread> threads;
  for (size_t j = 0; j < to_probe.size(); ++j) {
    threads.emplace_back([&, j] {
      bool started = false;  // start() counts each caller once
      try {
        rate[j] = probe(devices[to_probe[j]], dtype, [&] {
          started = true;
          start();
        });
        if (!devices[to_probe[j]].is_cpu()) {
          copy_rate[j] = probe_copy(devices[to_probe[j]]);
          launch[j] = probe_launch(devices[to_probe[j]]);
          node[j] = probe_graph_node(devices[to_probe[j]]);
        }
      } catch (...) {
        error[j] = std::current_exception();
        if (!started) start();  // the others do not wait for it
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : error) {
    if (e) std::rethrow_exception(e);
  }
  // CPU callers that ran together each get their mean: one stage's share of the machine.
  double cpu_sum = 0;
  int cpu_n = 0;
  for (size_t j = 0; j < to_probe.size(); ++j) {
    if (devices[to_probe[j]].is_cpu()) cpu_sum += rate[j], ++cpu_n;
  }
  for (size_t j = 0; j < to_probe.size(); ++j) {
    const size_t i = to_probe[j];
    out[i] = {devices[i].is_cpu() ? cpu_sum / cpu_n : rate[j], copy_rate[j], launch[j], std::max(0.0, node[j]), false};
    cache[keys[i]] = out[i].flops_per_second;
    if (!devices[i].is_cpu()) {
      cache[copy_key(i)] = out[i].bytes_per_second;
      cache[launch_key(i)] = out[i].launch_seconds;
      if (node[j] >= 0) cache[node_key(i)] = node[j];  // a failure that may pass is measured again
    }
  }
  try {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    write_file_atomically(path, nlohmann::json{{"version", kProbeVersion}, {"peaks", cache}}.dump(2) + "\n");
  } catch (const std::exception& e) {
    spdlog::debug("peak cache not written ({}): the next run probes again", e.what());
  }
  return shares();
}

}  // namespace pipeline
}  // namespace gpipe
