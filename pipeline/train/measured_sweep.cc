#include "pipeline/train/measured_sweep.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <ostream>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "pipeline/config/run_model.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
#include "pipeline/planning/profile.h"
#include "pipeline/train/datasets.h"
#include "pipeline/train/trainer.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/inprocess_transport.h"

namespace gpipe {
namespace pipeline {

Config candidate_config(const Config& base, const Candidate& k) {
  Config c = base;
  c.pipeline.partitions = k.stages;
  c.pipeline.virtual_stages = k.virtual_stages;
  c.pipeline.micro_batches = k.micro_batches;
  c.pipeline.schedule = k.schedule;
  c.pipeline.recompute = k.recompute;
  c.pipeline.shard_optimizer = k.shard_optimizer ? "optimizer" : "none";
  c.pipeline.balance = k.balance;
  c.train.blas_threads = k.blas_threads;
  c.pipeline.tensor_parallel = k.tensor_parallel;
  c.pipeline.sequence_parallel = k.sequence_parallel;
  if (!k.precision.empty()) c.model.dtype = parse_dtype(k.precision);
  if (static_cast<int>(c.pipeline.devices.size()) > k.stages) c.pipeline.devices.resize(k.stages);
  // pipeline.capture captures one stage's step, or the steps of stages on one device: a
  // candidate that it cannot take (more devices, replicas, a tensor group) runs without it,
  // as the config would be refused with it.
  c.pipeline.capture = base.pipeline.capture && capture_refusal(c.pipeline).empty();
  c.autos = AutoKeys{};
  return c;
}

namespace {

// A tensor-parallel plan (T > 1) timed as threads of this process: each (stage, member)
// an executor of its own, with its member's model (its stage's blocks with their
// weights, the rest on shapes), the member's pipeline (an in-process transport) and the
// stage's tensor group (an in-process group), as the executor's tests place them. A
// step's time is its slowest thread's; the figure, the median over the timed steps.
double measure_tensor_parallel_step_ms(const Config& config, int warmup, int steps) {
  const int T = config.pipeline.tensor_parallel;
  RunModel shapes = build_member_on_shapes(config, 0);
  const Config& c = shapes.config;
  set_cpu_blas_threads(c.train.blas_threads);
  const Plan plan = make_plan(c, *shapes.model);
  const int K = plan.stages;
  const std::unique_ptr<Dataset> data = make_dataset(c);
  // Not a structured binding: C++17 lambdas cannot capture one.
  const std::pair<Tensor, Tensor> batch = data->batch(batch_key(c.train.seed, 0), c.train.batch_size);
  const Tensor& x = batch.first;
  const Tensor& y = batch.second;
  std::vector<std::vector<double>> ms(static_cast<size_t>(K * T));
  try {
    run_ranks_as_threads(RankLayout{K, T, 1}, c.pipeline.timeout_s, [&](const Launch& launch) {
      const int k = launch.rank;
      const size_t at = static_cast<size_t>(launch.world_rank());
      Config member = c;
      member.model.member = tensor_member(c, launch.member);
      std::vector<bool> mine(static_cast<size_t>(shapes.model->size()), false);
      for (int cell : plan.schedule.cells[k]) {
        const CellSpec& s = plan.cells[cell];
        for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) mine[static_cast<size_t>(i)] = true;
      }
      auto model = layers::build_model(member.model, [&](int i) { return mine[static_cast<size_t>(i)]; });
      ExecutorOptions opts = executor_options(c, launch, plan, 0);
      opts.pin_threads = false;  // K x T threads: stage k's core is not one member's
      Executor ex(*model, plan.cells, plan.schedule, *launch.transport, opts);
      ex.set_lr(c.optimizer.optimizer.lr);
      for (int i = 0; i < warmup + steps; ++i) {
        if (at == 0) heartbeat();
        const auto t0 = std::chrono::steady_clock::now();
        ex.step(x, y);
        const auto t1 = std::chrono::steady_clock::now();
        if (i >= warmup) ms[at].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
    });
  } catch (const std::exception& e) {
    set_cpu_blas_threads(config.train.blas_threads);
    throw UserError("timing the plan at pipeline.tensor_parallel = " + std::to_string(T) + ": " + e.what());
  }
  set_cpu_blas_threads(config.train.blas_threads);
  std::vector<double> slowest(static_cast<size_t>(steps), 0.0);
  for (const std::vector<double>& m : ms) {
    for (size_t i = 0; i < m.size() && i < slowest.size(); ++i) slowest[i] = std::max(slowest[i], m[i]);
  }
  std::sort(slowest.begin(), slowest.end());
  return slowest.empty() ? 0.0 : slowest[slowest.size() / 2];
}

}  // namespace

double measure_step_ms(const Config& config, int warmup, int steps) {
  if (config.pipeline.replicas > 1) {
    throw UserError("timing a plan with pipeline.replicas > 1 takes one process per replica; time it with gpipe run");
  }
  if (config.pipeline.tensor_parallel > 1) return measure_tensor_parallel_step_ms(config, warmup, steps);
  RunModel run = build_run_model(config);  // a model of its own: the run's weights are not touched
  const Config& c = run.config;
  set_cpu_blas_threads(c.train.blas_threads);
  const Plan plan = make_plan(c, *run.model);
  const std::unique_ptr<Dataset> data = make_dataset(c);
  InProcessTransport transport(plan.stages, c.pipeline.timeout_s);
  Executor ex(*run.model, plan.cells, plan.schedule, transport, executor_options(c, Launch{}, plan, 0));
  ex.set_lr(c.optimizer.optimizer.lr);
  auto [x, y] = data->batch(batch_key(c.train.seed, 0), c.train.batch_size);
  std::vector<double> ms;
  for (int i = 0; i < warmup + steps; ++i) {
    heartbeat();  // timing is progress, for gpipe run (runtime/heartbeat.h)
    transport.set_step(i);
    const auto t0 = std::chrono::steady_clock::now();
    ex.step(x, y);
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  set_cpu_blas_threads(config.train.blas_threads);
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0.0 : ms[ms.size() / 2];
}

std::string why_not_measured(const Config& config, const SweepResult& r, bool device_spec) {
  if (device_spec) return "the sweep plans for the devices of a device spec, not this machine's";
  if (config.pipeline.replicas > 1) return "its plans have replicas (several processes each); time them with gpipe run";
  const bool cpu = config.pipeline.devices.empty() || parse_device(config.pipeline.devices[0]).is_cpu();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (cpu && r.devices > cores) {
    return "it plans for " + std::to_string(r.devices) + " CPU devices and this machine has " + std::to_string(cores) +
           " cores";
  }
  if (!cpu && r.devices > cuda_device_count()) {
    return "it plans for " + std::to_string(r.devices) + " GPUs and " + std::to_string(cuda_device_count()) +
           " are visible here";
  }
  return "";
}

namespace {

// Does the config run candidate k's plan? Its balance too where the config gives one; one
// the planner makes may split the layers a little otherwise than the sweep's cost table
// (the config's own is what is timed), and one row per plan keeps the table readable.
bool is_own(const Config& c, const Candidate& k, const std::vector<int>& own_balance) {
  const std::string schedule = c.pipeline.schedule == "fill_drain" ? "gpipe" : c.pipeline.schedule;
  return k.stages == c.pipeline.partitions && k.virtual_stages == c.pipeline.virtual_stages &&
         k.micro_batches == c.pipeline.micro_batches && k.schedule == schedule && k.recompute == c.pipeline.recompute &&
         k.blas_threads == c.train.blas_threads && k.shard_optimizer == (c.pipeline.shard_optimizer != "none") &&
         k.tensor_parallel == c.pipeline.tensor_parallel &&
         k.sequence_parallel == (c.pipeline.sequence_parallel && c.pipeline.tensor_parallel > 1) &&
         (c.pipeline.balance.empty() || k.balance == own_balance) && k.precision.empty();
}

}  // namespace

void measure_candidates(const Config& config, const layers::Sequential& model, SweepResult& r,
                        const MeasureOptions& o, std::ostream& out) {
  // The config's own plan: the candidate that is exactly it, or one of its own (at T > 1,
  // its member 0's, as the sweep plans each T).
  const int T = config.pipeline.tensor_parallel;
  const RunModel member = T > 1 ? build_member_on_shapes(config, 0) : RunModel{};
  const Config& own_config = T > 1 ? member.config : config;
  const layers::Sequential& own_model = T > 1 ? *member.model : model;
  const Plan own_plan = make_plan(own_config, own_model);
  int own = -1;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    if (is_own(config, r.candidates[i], own_plan.balance)) own = static_cast<int>(i);
  }
  if (own < 0) {
    Candidate k;
    k.stages = config.pipeline.partitions;
    k.virtual_stages = config.pipeline.virtual_stages;
    k.micro_batches = config.pipeline.micro_batches;
    k.schedule = config.pipeline.schedule == "fill_drain" ? "gpipe" : config.pipeline.schedule;
    k.recompute = config.pipeline.recompute;
    k.blas_threads = config.train.blas_threads;
    k.replicas = config.pipeline.replicas;
    k.shard_optimizer = config.pipeline.shard_optimizer != "none";
    k.tensor_parallel = T;
    k.sequence_parallel = config.pipeline.sequence_parallel && T > 1;
    k.balance = own_plan.balance;
    k.run = predict_config(own_config, own_model, own_plan);
    for (const StageMemory& m : own_plan.memory) {
      k.peak_device_bytes = std::max(k.peak_device_bytes, m.total());
      k.total_bytes += m.total();
    }
    k.verdict = "the config's own plan";
    // As the sweep weighs its candidates: the fullest device against the limit, and on
    // this machine's CPUs every stage against the memory they share.
    const int64_t host = first_device(config).is_cpu() ? host_available_bytes() : -1;
    k.fits = (r.memory_limit <= 0 || k.peak_device_bytes <= r.memory_limit) && (host <= 0 || k.total_bytes <= host);
    if (!k.fits) k.verdict = "the config's own plan; over the memory limit, not timed";
    r.candidates.push_back(k);
    own = static_cast<int>(r.candidates.size()) - 1;
  }
  r.candidates[own].own = true;
  // The best of each shape: candidates that differ only in recompute mode or sharding
  // run alike, and timing several of them tells little.
  auto shape = [](const Candidate& k) {
    return std::to_string(k.stages) + "/" + std::to_string(k.virtual_stages) + "/" + std::to_string(k.micro_batches) +
           "/" + k.schedule + "/" + std::to_string(k.blas_threads) + "/" + k.precision + "/" +
           std::to_string(k.tensor_parallel) + (k.sequence_parallel ? "s" : "");
  };
  std::vector<int> timed;
  std::vector<std::string> shapes;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const bool cpu = first_device(config).is_cpu();
  for (size_t i = 0; i < r.candidates.size() && static_cast<int>(timed.size()) < o.top; ++i) {
    const Candidate& k = r.candidates[i];
    if (!k.fits || static_cast<int>(i) == own) continue;
    // A tensor group's members are timed as threads of this process on its CPU cores:
    // K x T x BLAS threads within the cores. On GPUs each member would need its own GPU
    // (a plan per member's devices): not timed here, gpipe run times it.
    if (k.tensor_parallel > 1 && (!cpu || k.stages * k.tensor_parallel * k.blas_threads > cores)) continue;
    if (std::find(shapes.begin(), shapes.end(), shape(k)) != shapes.end()) continue;
    shapes.push_back(shape(k));
    timed.push_back(static_cast<int>(i));
  }
  if (r.candidates[own].fits) timed.push_back(own);  // a plan that cannot fit is not run
  double predicted_s = 0;
  for (int i : timed) predicted_s += r.candidates[i].run.step_ms * (o.warmup + o.steps) / 1e3;
  if (predicted_s > o.max_seconds) {
    char line[300];
    std::snprintf(line, sizeof line,
                  "Not timed (the recommendation is the prediction's): %zu plans for %d steps each would take about "
                  "%.0f s by the prediction, more than %.0f s\n",
                  timed.size(), o.warmup + o.steps, predicted_s, o.max_seconds);
    out << line;
    return;
  }
  const bool own_timed = r.candidates[own].fits;
  out << "Timing " << timed.size() << " plans for " << o.warmup << " + " << o.steps << " real steps each (the "
      << "planner's best " << timed.size() - (own_timed ? 1 : 0)
      << (own_timed ? " and the config's own" : "; the config's own does not fit") << "), on models of their own:"
      << std::endl;
  for (int i : timed) {
    Candidate& k = r.candidates[i];
    const Config c = static_cast<int>(i) == own ? config : candidate_config(config, k);
    try {
      k.measured_ms = measure_step_ms(c, o.warmup, o.steps);
    } catch (const UserError& e) {
      k.measured_ms = -1;
      k.verdict = std::string("could not be timed: ") + e.what();
    }
    char line[300];
    std::snprintf(line, sizeof line, "  %-57s predicted %11.3f ms, measured %11.3f ms%s\n", k.label().c_str(),
                  k.run.step_ms, k.measured_ms, static_cast<int>(i) == own ? "  (the config's own)" : "");
    out << line << std::flush;
  }
  // What the timings say of the planner: per way of using the cores (stages at once, BLAS
  // threads), measured over predicted (before any earlier correction), kept in the
  // profile so that later sweeps of this model scale their predictions by it.
  std::map<std::pair<int, int>, std::vector<double>> ratios;
  for (int i : timed) {
    const Candidate& k = r.candidates[i];
    // A tensor-parallel plan's timing (threads standing in for processes) calibrates nothing.
    if (k.measured_ms > 0 && k.run.step_ms > 0 && k.tensor_parallel == 1) {
      ratios[{k.stages, k.blas_threads}].push_back(k.measured_ms / (k.run.step_ms / k.correction));
    }
  }
  if (!ratios.empty() && config.pipeline.replicas == 1) {
    ProfileStore store = load_profile(config.pipeline.profile);
    const Device device = first_device(config);
    for (const auto& [key, values] : ratios) {
      StepCalibration c;
      c.model_hash = model_hash(model);
      c.device = device.is_cpu() ? "cpu" : "cuda";
      c.dtype = dtype_name(model.dtype());
      c.stages = key.first;
      c.blas_threads = key.second;
      double sum = 0;
      for (double v : values) sum += v;
      c.ratio = sum / static_cast<double>(values.size());
      c.plans = static_cast<int>(values.size());
      store.put(c);
    }
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::path(config.pipeline.profile).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);
    save_profile(config.pipeline.profile, store);
    out << "The timings correct the planner from now on: " << ratios.size()
        << " calibration" << (ratios.size() == 1 ? "" : "s") << " (measured / predicted, by stages and BLAS threads) "
        << "saved in " << config.pipeline.profile << std::endl;
  }
  // The measured fastest that fits; the config's own plan when nothing else was timed.
  int best = -1;
  for (int i : timed) {
    const Candidate& k = r.candidates[i];
    if (k.measured_ms <= 0 || !k.fits) continue;
    if (best < 0 || k.measured_ms < r.candidates[best].measured_ms) best = i;
  }
  if (best < 0) return;  // none could be timed: the planner's choice stands
  // A change must pay: a plan that beats the config's own by less than 3% (within the
  // machine's drift from one timing to the next) leaves the config's own recommended.
  const Candidate& mine = r.candidates[own];
  if (best != own && mine.measured_ms > 0 && mine.fits && r.candidates[best].measured_ms > 0.97 * mine.measured_ms) {
    best = own;
  }
  // The sweep's notes on where its choice sits at the edge of the search are about the
  // predicted best; they stand only if it is still the choice.
  if (best != r.recommended) r.edges.clear();
  r.recommended = best;
  const double fastest = r.candidates[best].measured_ms;
  for (int i : timed) {
    Candidate& k = r.candidates[i];
    if (i == best || k.measured_ms <= 0) continue;
    char v[160];
    std::snprintf(v, sizeof v, "measured %+.0f%% against it", 100.0 * (k.measured_ms / fastest - 1.0));
    k.verdict = v;
  }
}

}  // namespace pipeline
}  // namespace gpipe
