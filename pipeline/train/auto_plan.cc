#include "pipeline/train/auto_plan.h"

#include <algorithm>
#include <cstdio>
#include <ostream>
#include <string>
#include <thread>

#include "pipeline/planning/plan.h"
#include "pipeline/planning/profile.h"
#include "pipeline/planning/sweep.h"
#include "pipeline/train/measured_sweep.h"
#include "pipeline/train/profiling.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {

// "pipeline.partitions and train.blas_threads"
std::string auto_key_names(const AutoKeys& a) {
  std::vector<std::string> names;
  if (a.partitions) names.push_back("pipeline.partitions");
  if (a.micro_batches) names.push_back("pipeline.micro_batches");
  if (a.schedule) names.push_back("pipeline.schedule");
  if (a.blas_threads) names.push_back("train.blas_threads");
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  }
  return s;
}

bool keeps_named_keys(const Candidate& k, const Config& c) {
  const AutoKeys& a = c.autos;
  const std::string schedule = c.pipeline.schedule == "fill_drain" ? "gpipe" : c.pipeline.schedule;
  return k.fits && k.recompute == c.pipeline.recompute && (a.partitions || k.stages == c.pipeline.partitions) &&
         (a.micro_batches || k.micro_batches == c.pipeline.micro_batches) &&
         (a.schedule || (k.schedule == schedule && k.virtual_stages == c.pipeline.virtual_stages)) &&
         (a.blas_threads || k.blas_threads == c.train.blas_threads);
}

bool has_profile_of(const std::string& path, const layers::Sequential& model) {
  const std::string hash = model_hash(model);
  const ProfileStore store = load_profile(path);
  return std::any_of(store.entries.begin(), store.entries.end(),
                     [&](const ProfileEntry& e) { return e.key.model_hash == hash; });
}

}  // namespace

// Each auto key at its plain value (auto_plan.h).
Config plain_for_auto(const Config& config, const layers::Sequential& model) {
  Config c = config;
  if (c.autos.partitions) {
    int devices = static_cast<int>(c.pipeline.devices.size());
    if (devices == 0) devices = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    c.pipeline.partitions = std::max(1, std::min(devices, model.size()));
    if (static_cast<int>(c.pipeline.devices.size()) > c.pipeline.partitions) {
      c.pipeline.devices.resize(c.pipeline.partitions);
    }
  }
  if (c.autos.micro_batches) {
    const int64_t rows = c.train.batch_size / std::max(1, c.pipeline.replicas);
    c.pipeline.micro_batches = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(8, rows)));
  }
  if (c.autos.schedule) {
    c.pipeline.schedule = "gpipe";
    c.pipeline.virtual_stages = 1;
  }
  if (c.autos.blas_threads) c.train.blas_threads = 1;
  c.autos = AutoKeys{};
  return c;
}

void check_auto_launch(const Config& config, int processes) {
  if (config.autos.any() && (processes > 1 || config.pipeline.replicas > 1)) {
    throw UserError(auto_key_names(config.autos) +
                    ": auto chooses in one process, and every process of this run would choose on its own; give "
                    "the values (`gpipe plan CONFIG --sweep` recommends them)");
  }
}

Config resolve_auto(const Config& config, const layers::Sequential& model, const Launch& launch, std::ostream& out) {
  if (!config.autos.any()) return config;
  const std::string keys = auto_key_names(config.autos);
  check_auto_launch(config, launch.size);
  if (config.autos.partitions && !config.pipeline.balance.empty()) {
    throw UserError("pipeline.balance fixes the number of stages but pipeline.partitions is auto: remove "
                    "pipeline.balance (the sweep balances each plan) or give pipeline.partitions");
  }
  if (config.autos.schedule && !config.pipeline.schedule_file.empty()) {
    throw UserError("pipeline.schedule_file is a schedule of your own but pipeline.schedule is auto: remove one");
  }
  if (!has_profile_of(config.pipeline.profile, model)) {
    // A short one: each micro-batch size the sweep tries, alone, with every core busy and
    // with every core's BLAS threads, one warm-up and at least three timed passes or a
    // second; `gpipe profile CONFIG --sweep` takes a longer one, which the next run reuses.
    out << "auto: no profile of this model in " << config.pipeline.profile
        << "; measuring a short one first (each micro-batch size the sweep tries, 1 warm-up and 3 timed passes or "
           "at least a second each; `gpipe profile CONFIG --sweep` measures a longer one)" << std::endl;
    ProfileOptions po;
    po.sweep = true;
    po.min_seconds = 1;
    po.warmup = 1;
    po.repeats = 3;
    profile_command(config, po, Launch{}, out);
  }
  SweepOptions so;  // as `gpipe plan CONFIG --sweep` runs it
  so.devices = static_cast<int>(config.pipeline.devices.size());
  so.micro_batches = micro_batch_counts(32);
  if (first_device(config).is_cpu()) so.host_available = std::max<int64_t>(0, host_available_bytes());
  SweepResult all = sweep(config, model, so);
  // The candidates that keep the config's named keys, by prediction; then the best few of
  // them and the config's own plan (its auto keys at their defaults) timed on this
  // machine, and the measured fastest chosen (measured_sweep.h).
  SweepResult r = all;
  r.candidates.clear();
  for (const Candidate& k : all.candidates) {
    if (keeps_named_keys(k, config)) r.candidates.push_back(k);
  }
  r.recommended = r.candidates.empty() ? -1 : 0;
  const Config own = plain_for_auto(config, model);
  const std::string not_here = why_not_measured(own, r, false);
  if (r.recommended >= 0 && not_here.empty()) {
    measure_candidates(own, model, r, MeasureOptions{}, out);
  } else if (r.recommended >= 0) {
    out << "auto: not timed (the choice is the prediction's): " << not_here << std::endl;
  }
  const Candidate* best = r.recommended >= 0 ? &r.candidates[r.recommended] : nullptr;
  const Candidate* next = nullptr;
  int considered = 0;
  for (const Candidate& k : r.candidates) {
    if (!k.fits || k.own) continue;
    ++considered;
    if (&k != best && next == nullptr) next = &k;
  }
  if (best == nullptr) {
    throw UserError(keys + " = auto: no plan that fits keeps the config's other keys (recompute " +
                    recompute_mode_name(config.pipeline.recompute) + ") within " +
                    (r.memory_limit > 0 ? "the memory limit" : "this machine's memory") +
                    "; see `gpipe plan CONFIG --sweep` and give the values");
  }
  Config c = config;
  c.pipeline.partitions = best->stages;
  c.pipeline.micro_batches = best->micro_batches;
  c.pipeline.schedule = best->schedule;
  c.pipeline.virtual_stages = best->virtual_stages;
  c.train.blas_threads = best->blas_threads;
  c.pipeline.balance = best->balance;
  if (static_cast<int>(c.pipeline.devices.size()) > best->stages) c.pipeline.devices.resize(best->stages);
  c.autos = AutoKeys{};

  std::string chose;
  auto add = [&](bool on, const std::string& key, const std::string& value) {
    if (on) chose += (chose.empty() ? "" : ", ") + key + "=" + value;
  };
  add(config.autos.partitions, "pipeline.partitions", std::to_string(best->stages));
  add(config.autos.micro_batches, "pipeline.micro_batches", std::to_string(best->micro_batches));
  add(config.autos.schedule, "pipeline.schedule",
      best->schedule + (best->virtual_stages > 1 ? " (virtual_stages=" + std::to_string(best->virtual_stages) + ")" : ""));
  add(config.autos.blas_threads, "train.blas_threads", std::to_string(best->blas_threads));
  char line[500];
  if (best->measured_ms > 0) {
    std::snprintf(line, sizeof line,
                  "auto: %s: of %d plans that fit and keep the config's other keys, the fastest timed here, %s, "
                  "measured %.2f ms a step (predicted %.2f ms, %.1f samples/s, bubble %.3f)",
                  chose.c_str(), considered, best->label().c_str(), best->measured_ms, best->run.step_ms,
                  best->run.samples_per_second, best->run.bubble);
  } else {
    std::snprintf(line, sizeof line,
                  "auto: %s: the fastest of %d plans that fit and keep the config's other keys, %s, predicted "
                  "%.2f ms a step, %.1f samples/s, bubble %.3f",
                  chose.c_str(), considered, best->label().c_str(), best->run.step_ms, best->run.samples_per_second,
                  best->run.bubble);
  }
  out << line;
  if (next != nullptr) {
    std::snprintf(line, sizeof line, "; the next, %s, %.1f samples/s (%s)", next->label().c_str(),
                  next->run.samples_per_second, next->verdict.c_str());
    out << line;
  }
  out << "; costs: " << r.costs << std::endl;
  return c;
}

}  // namespace pipeline
}  // namespace gpipe
