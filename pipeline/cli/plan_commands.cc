#include "pipeline/cli/plan_commands.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <thread>
#include <filesystem>
#include <ostream>
#include <set>

#include "partition/balance.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/byte_units.h"
#include "pipeline/planning/device_spec.h"
#include "pipeline/planning/planner.h"
#include "pipeline/planning/profile.h"
#include "pipeline/planning/sweep.h"
#include "pipeline/train/datasets.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"

namespace gpipe {
namespace pipeline {

namespace {

void pin_to_core(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort, as the executor's
}

void print_planned(const Plan& plan, const PlannedRun& run, int64_t memory_limit, std::ostream& out) {
  char line[512];
  int64_t peak = 0;
  int peak_stage = 0;
  for (size_t k = 0; k < run.stages.size(); ++k) {
    if (run.stages[k].total_bytes() > peak) {
      peak = run.stages[k].total_bytes();
      peak_stage = static_cast<int>(k);
    }
  }
  const ByteUnit unit = byte_unit_for(peak);  // one unit for the memory columns, named over them
  out << "Prediction (costs: " << run.source << "):\n";
  std::snprintf(line, sizeof line, "%76s| memory per stage, %s\n", "", unit.name);
  out << line;
  std::snprintf(line, sizeof line, "%-5s %8s %9s %8s %7s %8s %8s %7s %6s | %9s %9s %9s %11s %9s\n", "stage", "fwd ms",
                "recomp ms", "bwd ms", "W ms", "comm ms", "idle ms", "opt ms", "util", "weights", "grads", "opt state",
                "activations", "total");
  out << line;
  for (size_t k = 0; k < run.stages.size(); ++k) {
    const PlannedStage& s = run.stages[k];
    std::snprintf(line, sizeof line, "%-5zu %8.2f %9.2f %8.2f %7.2f %8.2f %8.2f %7.2f %5.1f%% | %9s %9s %9s %11s %9s\n",
                  k, s.forward_ms, s.recompute_ms, s.backward_ms, s.weight_ms, s.comm_ms, s.idle_ms, s.optimizer_ms,
                  100 * s.utilization, in_unit(s.weight_bytes, unit).c_str(), in_unit(s.gradient_bytes, unit).c_str(),
                  in_unit(s.optimizer_bytes, unit).c_str(), in_unit(s.activation_bytes, unit).c_str(),
                  in_unit(s.total_bytes(), unit).c_str());
    out << line;
  }
  std::snprintf(line, sizeof line,
                "step %.2f ms (span %.2f ms), bubble %.3f (the schedule's formula %.3f), %.1f samples/s; the fullest "
                "device holds %s (stage %d)",
                run.step_ms, run.span_ms, run.bubble, formula_bubble(plan.schedule), run.samples_per_second,
                bytes_str(peak).c_str(), peak_stage);
  out << line;
  if (memory_limit > 0) {
    out << (peak <= memory_limit ? ", within " : ", OVER ") << "the limit of " << bytes_str(memory_limit)
        << " (pipeline.memory_limit)";
  }
  out << "\n";
}

// printf's formatting into a string of any length.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string s(static_cast<size_t>(std::max(n, 0)) + 1, '\0');
  std::snprintf(s.data(), s.size(), fmt, args...);
  s.pop_back();
  return s;
}

// ---- gpipe profile

// Creates the directory pipeline.profile is saved in, if it has one.
void create_profile_directory(const std::string& profile) {
  const std::filesystem::path path(profile);
  if (!path.has_parent_path()) return;
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) throw UserError("cannot create the directory of pipeline.profile '" + path.string() + "': " + ec.message());
}

// Under mpirun: ranks 0 and 1 measure the MPI transport between them, and rank 0 saves it.
void profile_mpi_link(const Config& c, const ProfileOptions& o, const Launch& launch, std::ostream& out) {
  if (launch.transport == nullptr || launch.rank > 1) return;
  if (!first_device(c).is_cpu()) {
    throw UserError("gpipe profile under mpirun measures the MPI transport of CPU stages only");
  }
  const LinkCost l = measure_link(*launch.transport, "mpi", launch.rank, o.repeats);
  if (launch.rank == 0) {
    ProfileStore store = load_profile(c.pipeline.profile);
    store.put(l);
    save_profile(c.pipeline.profile, store);
    char line[200];
    std::snprintf(line, sizeof line, "mpi: latency %.1f us, bandwidth %.2f GB/s -> %s\n", l.latency_ms * 1e3,
                  l.bytes_per_ms / 1e6, c.pipeline.profile.c_str());
    out << line;
  }
}

// The micro-batch sizes to measure: the options' (the run's own when none are given), and
// with --sweep also every size the sweep tries.
std::set<int64_t> sizes_to_profile(const ProfileOptions& o, const Plan& run_sizes) {
  std::set<int64_t> sizes(o.micro_batches.begin(), o.micro_batches.end());
  if (sizes.empty()) sizes.insert(run_sizes.largest_micro_batch());
  if (o.sweep) {
    for (int m : SweepOptions{}.micro_batches) {
      if (m <= run_sizes.replica_batch) sizes.insert(split_sizes(run_sizes.replica_batch, m).front());
    }
  }
  return sizes;
}

// How many stages compute at once in each measurement: the options', or else 1 and (on a
// CPU of several cores) one per core.
std::vector<int> concurrency_levels(const ProfileOptions& o, const Device& device, int cores) {
  std::vector<int> levels = o.concurrency;
  if (levels.empty()) {
    levels.push_back(1);
    if (device.is_cpu() && cores > 1) levels.push_back(cores);
  }
  return levels;
}

// Refuses a number of stages at once that the device cannot run side by side.
void check_concurrency(int at_once, const Device& device, int cores) {
  if (at_once < 1 || (device.is_cpu() && at_once > cores) || (!device.is_cpu() && at_once != 1)) {
    throw UserError("--concurrency " + std::to_string(at_once) + ": give 1 to " + std::to_string(cores) +
                    " stages at once (one per core) on CPUs, 1 on GPUs");
  }
}

// The layers' times with `at_once` of the copies computing together: every copy on its
// own core, started together (they do the same work, so they stay together); the first
// one's times are kept.
ProfileEntry measure_together(const std::vector<std::unique_ptr<layers::Sequential>>& copies, int at_once,
                              const Tensor& x, const Tensor& y, const Device& device, const Config& c,
                              const ProfileOptions& o) {
  std::vector<ProfileEntry> entries(at_once);
  std::vector<std::exception_ptr> errors(at_once);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < at_once; ++i) {
    threads.emplace_back([&, i] {
      try {
        if (device.is_cpu() && c.pipeline.pin_threads) pin_to_core(i);
        ready.fetch_add(1);
        while (ready.load() < at_once) std::this_thread::yield();
        entries[i] = measure_layers(*copies[i], x, y, device, c.optimizer.optimizer, o.warmup, o.repeats,
                                    c.train.blas_threads, at_once, o.min_seconds);
      } catch (...) {
        errors[i] = std::current_exception();
        ready.fetch_add(at_once);  // release the others
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return std::move(entries[0]);
}

// One measurement's line: the model's forward, backward, recompute, loss and optimizer times.
void print_measurement(const ProfileEntry& e, int64_t n, int at_once, int warmup, std::ostream& out) {
  double f = 0, b = 0, r = 0, opt = 0;
  for (const auto& l : e.layers) {
    f += l.forward_ms;
    b += l.backward_ms;
    r += l.recompute_ms;
    opt += l.optimizer_ms;
  }
  char line[300];
  std::snprintf(line, sizeof line,
                "micro-batch %4lld on %s, %d at once: forward %.3f ms, backward %.3f ms, recompute %.3f ms, loss "
                "%.3f + %.3f ms, optimizer %.3f ms (medians of %d after %d warm-up)\n",
                static_cast<long long>(n), e.key.device.c_str(), at_once, f, b, r, e.loss_forward_ms,
                e.loss_backward_ms, opt, e.repeats, warmup);
  out << line;
}

// One line per layer: its forward, backward (input and weight parts) and optimizer times.
void print_layer_times(const ProfileEntry& e, std::ostream& out) {
  char line[300];
  for (size_t i = 0; i < e.layers.size(); ++i) {
    const LayerProfile& l = e.layers[i];
    std::snprintf(line, sizeof line, "  %3zu %-34s fwd %8.3f  bwd %8.3f (B %8.3f W %8.3f)  opt %7.3f ms\n", i,
                  l.describe.substr(0, 34).c_str(), l.forward_ms, l.backward_ms, l.backward_input_ms,
                  l.backward_weight_ms, l.optimizer_ms);
    out << line;
  }
}

// The hand-over between two stages of this process, measured into `store`.
void profile_in_process_link(ProfileStore& store, int repeats, std::ostream& out) {
  InProcessTransport pair(2);
  const LinkCost l = measure_link(pair, "inprocess", -1, repeats);
  store.put(l);
  char line[300];
  std::snprintf(line, sizeof line, "in-process hand-over: %.1f us\n", l.latency_ms * 1e3);
  out << line;
}

}  // namespace

void print_plan(const Config& c, layers::Sequential& model, const Plan& p, std::ostream& out) {
  const int64_t micro = p.largest_micro_batch();
  const auto costs = partition::layer_costs(model, micro, recomputes(p.recompute), cost_overrides(c));
  // Each layer's backward and its B and W halves as the planner estimates them.
  const CostTable times = estimate_costs(model, micro, probed_cost_model(p, model.output_dtype(), c.train.blas_threads),
                                         cost_overrides(c), c.optimizer.optimizer);
  out << format("model: %d layers, %lld parameters, input %s; a checkpoint takes %s\n", model.size(),
                static_cast<long long>(model.parameter_count()), shape_str(model.input_shape()).c_str(),
                bytes_str(checkpoint_bytes(model, c.optimizer.optimizer)).c_str());
  const auto memory = estimate_memory(p, model, c.optimizer.optimizer);
  for (int k = 0; k < p.stages; ++k) {
    out << format("stage %d on %s: memory %s (parameters+state %s, activations %s)\n", k, p.devices[k].str().c_str(),
                  bytes_str(memory[k].total()).c_str(), bytes_str(memory[k].parameter_bytes).c_str(),
                  bytes_str(memory[k].activation_bytes).c_str());
    for (int cell : p.schedule.cells[k]) {
      const CellSpec& s = p.cells[cell];
      double total = 0, input = 0, weight = 0;
      for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
        total += costs[i];
        input += times.layers[i].backward_input;
        weight += times.layers[i].backward_weight;
      }
      out << format("  cell %d: layers %d-%d, estimated %.3f ms per micro-batch of %lld (backward: B %.3f + W %.3f ms)\n",
                    cell, s.first_layer, s.first_layer + s.num_layers - 1, total * 1e3, static_cast<long long>(micro),
                    input, weight);
      for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) {
        const LayerTimes& l = times.layers[i];
        out << format("    %3d %-28s %10.3f ms  (backward %.3f: B %.3f + W %.3f)\n", i,
                      model.layer(i).describe().c_str(), costs[i] * 1e3, l.backward, l.backward_input,
                      l.backward_weight);
      }
    }
  }
  out << format("schedule %s, recompute %s (formula bubble %.3f):\n", p.schedule.name.c_str(),
                recompute_mode_name(p.recompute), formula_bubble(p.schedule))
      << schedule_chart(p.schedule) << "\n"
      << schedule_table(p.schedule);
}

void print_prediction(const Config& c, const layers::Sequential& model, const Plan& plan, std::ostream& out) {
  print_planned(plan, predict_config(c, model, plan), c.pipeline.memory_limit, out);
}

int plan_other_runs(const Config& config, layers::Sequential& model, const PlanCommandOptions& o, std::ostream& out) {
  DeviceSpec spec;
  const bool has_spec = !o.device_spec.empty();
  if (has_spec) spec = load_device_spec(o.device_spec);
  if (o.sweep) {
    SweepOptions sweep_options;
    sweep_options.devices = o.devices;
    sweep_options.spec = has_spec ? &spec : nullptr;
    sweep_options.micro_batches = micro_batch_counts(o.max_micro_batches);
    const bool cpu = config.pipeline.devices.empty() || parse_device(config.pipeline.devices[0]).is_cpu();
    if (!has_spec && cpu) sweep_options.host_available = std::max<int64_t>(0, host_available_bytes());
    out << sweep_table(sweep(config, model, sweep_options), o.rows);
    return 0;
  }
  Config c = config;
  const int n = o.devices > 0 ? o.devices : c.pipeline.partitions;
  c.pipeline.partitions = n;
  c.pipeline.replicas = 1;
  c.pipeline.devices.clear();  // labels only: the devices are not this machine's
  c.pipeline.balance.clear();
  if (c.pipeline.balance_by == "profile" && has_spec) c.pipeline.balance_by = "estimate";
  const Plan plan = make_plan(c, model);
  if (!has_spec) {
    out << "Plan for " << n << " device" << (n == 1 ? "" : "s") << " like this machine's (balance";
    for (int b : plan.balance) out << " " << b;
    out << "):\n";
    print_prediction(c, model, plan, out);
    return 0;
  }
  const partition::CostModel cm = spec.cost_model(dtype_name(model.output_dtype()));
  const CostSource costs(model, ProfileStore{}, "", Device::cuda(0), 0, cm, {}, c.optimizer.optimizer);
  // The balancer's split by the spec's roofline.
  c.pipeline.balance = partition::balance_by_cost(
      partition::layer_costs(model, plan.largest_micro_batch(), recomputes(plan.recompute), {}, cm),
      plan.num_cells());
  const Plan spec_plan = make_plan(c, model);
  const PlannedRun run =
      predict(spec_plan, model, costs, [&spec](int a, int b) { return spec.link(a, b); }, c.optimizer.optimizer);
  out << "Plan for " << n << " x " << spec.name << " (" << spec.source << "; " << spec.devices_per_node
      << " per node, " << spec.intra_node.kind << " within, " << spec.inter_node.kind << " between nodes), balance";
  for (int b : spec_plan.balance) out << " " << b;
  out << ":\n";
  print_planned(spec_plan, run, c.pipeline.memory_limit > 0 ? c.pipeline.memory_limit : spec.memory_bytes, out);
  return 0;
}

int profile_command(const Config& config, const ProfileOptions& o, const Launch& launch, std::ostream& out) {
  RunModel run = build_run_model(config);
  const Config c = run.config;
  const std::string hash = model_hash(*run.model);
  create_profile_directory(c.pipeline.profile);
  if (launch.size > 1) {  // the MPI transport between ranks 0 and 1
    profile_mpi_link(c, o, launch, out);
    return 0;
  }
  set_cpu_blas_threads(c.train.blas_threads);
  const Device device = first_device(c);
  const Plan run_sizes = plan_sizes(c);  // the run's own micro-batches
  const int64_t own = run_sizes.largest_micro_batch();
  const std::set<int64_t> sizes = sizes_to_profile(o, run_sizes);
  const std::unique_ptr<Dataset> data = make_dataset(c);
  ProfileStore store = load_profile(c.pipeline.profile);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // One copy of the model per stage computing at once (gradients must not be shared).
  std::vector<std::unique_ptr<layers::Sequential>> copies;
  copies.push_back(std::move(run.model));
  for (int at_once : concurrency_levels(o, device, cores)) {
    check_concurrency(at_once, device, cores);
    while (static_cast<int>(copies.size()) < at_once) copies.push_back(build_run_model(config).model);
    for (int64_t n : sizes) {
      if (n < 1) throw UserError("--micro-batches: sizes must be at least 1, got " + std::to_string(n));
      auto [x, y] = data->batch(batch_key(c.train.seed, 0), n);
      ProfileEntry e = measure_together(copies, at_once, x, y, device, c, o);
      print_measurement(e, n, at_once, o.warmup, out);
      if (n == own && at_once == 1) print_layer_times(e, out);
      store.put(std::move(e));
    }
  }
  profile_in_process_link(store, o.repeats, out);
  save_profile(c.pipeline.profile, store);
  out << "Profile: " << c.pipeline.profile << " (model " << hash << ")\n";
  return 0;
}

}  // namespace pipeline
}  // namespace gpipe
