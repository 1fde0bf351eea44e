#include "pipeline/train/profiling.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <ostream>
#include <set>
#include <thread>

#include "kernels/backend.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/plan.h"
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
  // With --sweep on a CPU of several cores: one stage with every core's BLAS threads as
  // well, the sweep's other way to use the cores, measured rather than assumed to scale.
  if (o.sweep && device.is_cpu() && cores > 1 && c.train.blas_threads < cores && o.concurrency.empty()) {
    Config threaded = c;
    threaded.train.blas_threads = cores;
    set_cpu_blas_threads(cores);
    for (int64_t n : sizes) {
      auto [x, y] = data->batch(batch_key(c.train.seed, 0), n);
      ProfileEntry e = measure_together(copies, 1, x, y, device, threaded, o);
      out << cores << " BLAS threads, ";
      print_measurement(e, n, 1, o.warmup, out);
      store.put(std::move(e));
    }
    set_cpu_blas_threads(c.train.blas_threads);
  }
  profile_in_process_link(store, o.repeats, out);
  save_profile(c.pipeline.profile, store);
  out << "Profile: " << c.pipeline.profile << " (model " << hash << ")\n";
  return 0;
}

}  // namespace pipeline
}  // namespace gpipe
