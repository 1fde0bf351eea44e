#include "pipeline/planning/sweep.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "pipeline/planning/byte_units.h"
#include "pipeline/planning/plan.h"
#include "pipeline/planning/planner.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

std::string Candidate::label() const {
  std::string s = "K=" + std::to_string(stages);
  if (virtual_stages > 1) s += " v=" + std::to_string(virtual_stages);
  s += " M=" + std::to_string(micro_batches) + " " + schedule + " recompute=" + recompute_mode_name(recompute);
  if (blas_threads > 1) s += " blas_threads=" + std::to_string(blas_threads);
  if (replicas > 1) s += " D=" + std::to_string(replicas) + (shard_optimizer ? " sharded" : "");
  if (tensor_parallel > 1) s += " T=" + std::to_string(tensor_parallel) + (sequence_parallel ? " seq" : "");
  if (!precision.empty()) s += " " + precision;
  return s;
}

std::string Candidate::overrides() const {
  std::string s = "--set pipeline.partitions=" + std::to_string(stages) +
                  " --set pipeline.micro_batches=" + std::to_string(micro_batches) +
                  " --set pipeline.recompute=" + recompute_mode_name(recompute) + " --set pipeline.schedule=" + schedule;
  if (virtual_stages > 1) s += " --set pipeline.virtual_stages=" + std::to_string(virtual_stages);
  if (blas_threads > 1) s += " --set train.blas_threads=" + std::to_string(blas_threads);
  if (replicas > 1) s += std::string(" --set pipeline.shard_optimizer=") + (shard_optimizer ? "optimizer" : "none");
  if (tensor_parallel > 1 || tensor_swept) s += " --set pipeline.tensor_parallel=" + std::to_string(tensor_parallel);
  if (tensor_parallel > 1 && tensor_swept) {
    s += std::string(" --set pipeline.sequence_parallel=") + (sequence_parallel ? "true" : "false");
  }
  if (!precision.empty()) s += " --set model.dtype=" + precision;
  return s;
}

namespace {

// Device time of the compute in a step: a stage's busy time keeps each of its BLAS
// threads' cores busy, and each of its tensor group's devices (a member's time each).
double total_busy(const Candidate& c) {
  double b = 0;
  for (const auto& s : c.run.stages) b += s.busy_ms;
  return b * c.blas_threads * c.tensor_parallel;
}

int devices_used(const Candidate& c) { return c.stages * c.blas_threads * c.replicas * c.tensor_parallel; }

// Why `c` predicts fewer samples/s than `best`: the largest of three factors of the
// ratio of their step times per sample.
std::string why_lost(const Candidate& c, const Candidate& best) {
  const double slower = best.run.samples_per_second / c.run.samples_per_second;
  if (slower < 1.01) return "as fast (within 1%)";
  const double work = total_busy(c) / total_busy(best);  // compute per step: same batch
  const double devices = static_cast<double>(devices_used(best)) / devices_used(c);
  auto inefficiency = [](const Candidate& x) {  // step time x devices / device compute: 1 with no idle time
    return x.run.step_ms * devices_used(x) / std::max(1e-12, total_busy(x));
  };
  const double idle = inefficiency(c) / inefficiency(best);
  char buf[160];
  if (work >= devices && work >= idle) {
    std::string what;
    if (c.precision != best.precision) what = c.precision;
    if (c.recompute != best.recompute) {
      what += (what.empty() ? "" : ", ") + std::string("recompute ") + recompute_mode_name(c.recompute);
    }
    if (c.micro_batches > best.micro_batches) {
      what += (what.empty() ? "" : ", ") + std::string("thinner micro-batches");
    }
    if (c.blas_threads > best.blas_threads) {
      what += (what.empty() ? "" : ", ") + std::to_string(c.blas_threads) + " BLAS threads per stage";
    }
    if (c.tensor_parallel > best.tensor_parallel) {
      what += (what.empty() ? "" : ", ") + std::string("the tensor group's sums");
    }
    std::snprintf(buf, sizeof buf, "slower ops: +%.0f%% compute per sample%s%s%s", 100 * (work - 1),
                  what.empty() ? "" : " (", what.c_str(), what.empty() ? "" : ")");
  } else if (devices >= idle) {
    std::snprintf(buf, sizeof buf, "uses %d devices, the recommended plan %d", devices_used(c), devices_used(best));
  } else if (c.run.bubble > best.run.bubble) {
    std::snprintf(buf, sizeof buf, "bubble %.2f vs %.2f", c.run.bubble, best.run.bubble);
  } else {
    // Idle, but not in the pipeline's bubble: the optimizer step, which runs on one thread.
    // With sharded optimizer state: the reduce-scatter and all-gather instead of the
    // all-reduce, and one shard's update.
    auto outside = [](const Candidate& x) {  // total_busy is one replica's
      return x.run.step_ms - total_busy(x) / (x.stages * x.blas_threads * x.tensor_parallel);
    };
    const char* why = c.shard_optimizer == best.shard_optimizer ? ""
                      : c.shard_optimizer ? " (sharded optimizer: RS and AG, not overlapped with backward)"
                                          : " (unsharded optimizer: every replica updates all of it)";
    std::snprintf(buf, sizeof buf, "time outside compute %.1f vs %.1f ms a step%s", outside(c), outside(best), why);
  }
  return buf;
}

// ---- The sweep's steps, in the order sweep() takes them.

// Devices to plan for: the option's, else one of the spec's, else this machine's cores (CPU configs) or GPUs.
int device_count(const SweepOptions& o, bool cpu) {
  int n = o.devices;
  if (n <= 0) n = o.spec != nullptr ? 1 : (cpu ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))
                                             : std::max(1, cuda_device_count()));
  return n;
}

// Bytes per device a candidate may hold: the option's, else pipeline.memory_limit, else the spec's memory (0: none).
int64_t memory_limit_per_device(const Config& base, const SweepOptions& o) {
  return o.memory_limit > 0 ? o.memory_limit
         : base.pipeline.memory_limit > 0 ? base.pipeline.memory_limit
         : o.spec != nullptr ? o.spec->memory_bytes
                             : 0;
}

// The op costs the candidates are predicted with: the config's profile, or on a device description the spec's
// roofline; one CostSource per number of stages computing at once, made when first asked for.
class SweepCosts {
 public:
  // launches: the model's ops per layer (ActivationLayout::launches), for the cost
  // model's launch term.
  SweepCosts(const Config& base, const layers::Sequential& model, const SweepOptions& o, bool cpu,
             std::shared_ptr<const std::vector<partition::LayerLaunches>> launches)
      : base_(base),
        model_(model),
        o_(o),
        cpu_(cpu),
        store_(load_profile(base.pipeline.profile)),
        overrides_(cost_overrides(base)),
        device_(o.spec != nullptr ? Device::cuda(0) : first_device(base)),
        // A 16-bit model at the spec's 16-bit peak where it gives one (DeviceSpec::cost_model_for).
        spec_cm_(o.spec != nullptr ? o.spec->cost_model_for(model.output_dtype())
                                  : partition::CostModel{}),
        launches_(std::move(launches)) {}

  const ProfileStore& store() const { return store_; }

  // The costs of k stages (CPU stages computing at once slow each other down); of a
  // candidate whose step is captured (captures()), each op at a graph node's cost.
  const CostSource& for_stages(int k, bool captured = false) {
    const int at_once =
        cpu_ && o_.spec == nullptr ? std::min(k, static_cast<int>(std::thread::hardware_concurrency())) : 1;
    auto& slot = by_concurrency_[{at_once, captured}];
    if (!slot) {
      partition::CostModel cm = cost_model(at_once);
      if (captured) cm.price_captured();
      slot = std::make_unique<CostSource>(model_, o_.spec != nullptr ? none_ : store_,
                                          o_.spec != nullptr ? "" : base_.pipeline.profile, device_,
                                          base_.train.blas_threads, cm, overrides_,
                                          base_.optimizer.optimizer, 1.0, at_once);
    }
    return *slot;
  }

  // The costs of one stage with n BLAS threads, on CPUs with no spec and n > 1 (nullptr otherwise): measured so
  // (gpipe profile --set train.blas_threads=N), or the single-thread costs over n.
  std::unique_ptr<CostSource> threaded(int n) const {
    if (!(cpu_ && o_.spec == nullptr && n > 1)) return nullptr;
    const partition::CostModel cm = cost_model(1);
    const CostSource probe(model_, store_, base_.pipeline.profile, device_, n, cm, overrides_,
                           base_.optimizer.optimizer);
    return probe.has_profile()
               ? std::make_unique<CostSource>(model_, store_, base_.pipeline.profile, device_, n, cm, overrides_,
                                              base_.optimizer.optimizer)
               : std::make_unique<CostSource>(model_, store_, base_.pipeline.profile, device_,
                                              base_.train.blas_threads, cm, overrides_, base_.optimizer.optimizer,
                                              1.0 / n);
  }

 private:
  // The spec's roofline on a device description; on this machine's devices the probed
  // peak of one of `at_once` stages computing together (device_peak.h).
  partition::CostModel cost_model(int at_once) const {
    partition::CostModel cm = spec_cm_;
    if (o_.spec == nullptr) {
      Plan stages;
      stages.devices.assign(at_once, device_);
      cm = probed_cost_model(stages, model_.output_dtype(), base_.train.blas_threads);
    }
    cm.launches = launches_;
    // A member's sums over its tensor group: processes of this machine (MPI), or devices
    // of one node of the description.
    const int T = base_.pipeline.tensor_parallel;
    if (T > 1) price_tensor_group(cm, T, o_.spec != nullptr ? o_.spec->link(0, 1) : local_link(store_, true));
    return cm;
  }

  const Config& base_;
  const layers::Sequential& model_;
  const SweepOptions& o_;
  const bool cpu_;
  const ProfileStore store_;
  const std::vector<std::optional<double>> overrides_;
  const Device device_;
  const partition::CostModel spec_cm_;
  const std::shared_ptr<const std::vector<partition::LayerLaunches>> launches_;
  // On a device description there is no profile: the spec's roofline.
  const ProfileStore none_;
  std::map<std::pair<int, bool>, std::unique_ptr<CostSource>> by_concurrency_;  // (at once, captured)
};

// A way to split the model: stages, virtual stages per stage, BLAS threads per stage, schedule.
struct Shape {
  int k, v, threads;
  std::string schedule;
};

// Every shape the sweep tries on n devices: each number of stages (on a device description only powers of two and
// n) with each flat schedule and, with layers enough, interleaved; on CPUs also one stage with every core's BLAS
// threads.
std::vector<Shape> candidate_shapes(int n, int layers, bool cpu, const SweepOptions& o) {
  std::vector<Shape> shapes;
  const std::vector<std::string> flat = {"gpipe", "1f1b", "zero_bubble"};
  for (int k = 1; k <= std::min(n, layers); ++k) {
    if (o.spec != nullptr && k > 1 && (k & (k - 1)) != 0 && k != n) continue;  // powers of two and N
    for (const auto& s : flat) shapes.push_back({k, 1, 1, s});
    if (k > 1 && 2 * k <= layers) shapes.push_back({k, 2, 1, "interleaved_1f1b"});
  }
  if (cpu && o.spec == nullptr && n > 1) {
    for (const auto& s : flat) shapes.push_back({1, 1, n, s});  // one stage, every core's BLAS threads
  }
  return shapes;
}

// The config of one candidate: the base config run in this shape, with m micro-batches, this recompute mode and
// the optimizer state sharded over the config's replicas or not, balanced by estimate.
Config candidate_config(const Config& base, const Shape& sh, int m, RecomputeMode mode, bool shard) {
  Config c = base;
  c.pipeline.partitions = sh.k;
  c.pipeline.virtual_stages = sh.v;
  c.pipeline.micro_batches = m;
  c.pipeline.recompute = mode;
  c.pipeline.schedule = sh.schedule;
  c.pipeline.schedule_file.clear();
  c.pipeline.shard_optimizer = shard ? "optimizer" : "none";
  c.pipeline.devices.clear();
  c.pipeline.balance_by = "estimate";
  c.train.blas_threads = sh.threads;
  return c;
}

// The candidate config `c` describes, its stages balanced by the costs the prediction uses and its step predicted
// with them; none when its schedule cannot take its K, v, M.
std::optional<Candidate> predict_candidate(Config c, const layers::Sequential& model, const CostSource& src,
                                           const LinkFn& link, const PredictOptions& po) {
  Candidate cand;
  cand.stages = c.pipeline.partitions;
  cand.virtual_stages = c.pipeline.virtual_stages;
  cand.micro_batches = c.pipeline.micro_batches;
  cand.blas_threads = c.train.blas_threads;
  cand.recompute = c.pipeline.recompute;
  cand.schedule = c.pipeline.schedule;
  cand.replicas = c.pipeline.replicas;
  cand.shard_optimizer = c.pipeline.shard_optimizer == "optimizer";
  cand.tensor_parallel = c.pipeline.tensor_parallel;
  cand.sequence_parallel = c.pipeline.sequence_parallel && cand.tensor_parallel > 1;
  try {
    // Balance by the costs the prediction uses, at this micro-batch size.
    const CostTable& t = src.at(plan_sizes(c).largest_micro_batch());
    std::vector<double> per_layer;
    for (const LayerTimes& l : t.layers) {
      per_layer.push_back(l.forward + l.backward + (recomputes(cand.recompute) ? l.recompute : 0.0));
    }
    per_layer.back() += t.loss_forward + t.loss_backward;
    c.pipeline.balance = partition::balance_by_cost(per_layer, cand.stages * cand.virtual_stages);
    PlanOptions plan_options;
    plan_options.layout = po.layout;  // the model's, probed once for every candidate
    const Plan plan = make_plan(c, model, plan_options);
    cand.balance = plan.balance;
    cand.run = predict(plan, model, src, link, c.optimizer.optimizer, po);
  } catch (const UserError&) {
    return std::nullopt;  // this schedule cannot take these K, v, M
  }
  return cand;
}

// Scales a candidate's predicted step by the profile's timings of plans that use the cores
// alike (StepCalibration), when there are any.
void calibrate(Candidate& cand, const ProfileStore& store, const std::string& hash, const std::string& device,
               const std::string& dtype) {
  const StepCalibration* c = store.calibration(hash, device, dtype, cand.stages, cand.blas_threads);
  if (c == nullptr) return;
  cand.correction = c->ratio;
  cand.run.step_ms *= c->ratio;
  cand.run.span_ms *= c->ratio;
  cand.run.samples_per_second /= c->ratio;
}

// Weighs a predicted candidate's memory: its fullest device against the limit per device, and on this machine's
// CPUs all its stages against the memory they share.
void weigh_memory(Candidate& cand, int64_t memory_limit, const SweepOptions& o) {
  for (const PlannedStage& s : cand.run.stages) {
    cand.peak_device_bytes = std::max(cand.peak_device_bytes, s.total_bytes());
    cand.total_bytes += s.total_bytes();
  }
  cand.total_bytes *= cand.replicas * cand.tensor_parallel;  // every replica's and member's (on CPUs they share the host)
  cand.fits = (memory_limit <= 0 || cand.peak_device_bytes <= memory_limit) &&
              (o.host_available <= 0 || o.spec != nullptr || cand.total_bytes <= o.host_available);
}

// Puts the fitting candidates first, each group by predicted samples/s, and recommends the first if it fits.
void rank(SweepResult& out) {
  std::stable_sort(out.candidates.begin(), out.candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    return a.run.samples_per_second > b.run.samples_per_second;
  });
  if (out.candidates.front().fits) out.recommended = 0;
}

// Gives each candidate its verdict: "recommended", over which memory limit, or why it lost to the recommended one.
void give_verdicts(SweepResult& out, const SweepOptions& o) {
  for (size_t i = 0; i < out.candidates.size(); ++i) {
    Candidate& c = out.candidates[i];
    if (static_cast<int>(i) == out.recommended) {
      c.verdict = "recommended";
    } else if (!c.fits) {
      const bool over_device = out.memory_limit > 0 && c.peak_device_bytes > out.memory_limit;
      c.verdict = over_device
                      ? "memory: " + bytes_str(c.peak_device_bytes) + " on a device > " + bytes_str(out.memory_limit)
                      : "memory: " + bytes_str(c.total_bytes) + " in all > " + bytes_str(o.host_available) + " available";
    } else {
      c.verdict = why_lost(c, out.candidates[out.recommended]);
    }
  }
}

// Where `best` sits at the edge of what the sweep tried, each with how to look further: the most micro-batches tried
// (when the batch allows more), every device it planned for (when the model could be split further), the most
// virtual stages it tries (when the layers allow more).
std::vector<std::string> edge_notes(const Candidate& best, const SweepOptions& o, int devices, bool cpu,
                                    int most_m, int layers, int64_t batch) {
  std::vector<std::string> notes;
  if (best.micro_batches == most_m && most_m < batch) {
    const int64_t next = std::min<int64_t>(2 * int64_t{most_m}, batch);
    const std::string of = best.replicas > 1 ? "a replica's batch (train.batch_size / pipeline.replicas) " : "train.batch_size ";
    notes.push_back("M=" + std::to_string(most_m) + " is the most micro-batches the sweep tried (" + of +
                    std::to_string(batch) + " allows up to " + std::to_string(batch) +
                    "); more may be faster still: add --max-micro-batches " + std::to_string(next) + " to try up to " +
                    std::to_string(next));
  }
  if (devices_used(best) == devices && !(best.stages == layers && best.blas_threads == 1)) {
    const std::string which = o.devices > 0      ? "--devices " + std::to_string(devices)
                              : o.spec != nullptr ? "one " + o.spec->name
                              : cpu               ? "this machine's " + std::to_string(devices) + " cores"
                                                  : "this machine's " + std::to_string(devices) + " GPUs";
    notes.push_back(best.label() + " uses every device the sweep planned for (" + which +
                    "); more devices may be faster: --devices " + std::to_string(2 * devices) + " plans for " +
                    std::to_string(2 * devices) +
                    (o.spec != nullptr ? "" : " (with --device-spec FILE for devices this machine does not have)"));
  }
  if (best.virtual_stages == 2 && 4 * best.stages <= layers) {
    Candidate v4 = best;
    v4.virtual_stages = 4;
    notes.push_back("v=2 is the most virtual stages the sweep tries; to compare v=4: gpipe plan CONFIG " +
                    v4.overrides());
  }
  return notes;
}

}  // namespace

// edge_notes of the recommended candidate of `out`, a sweep of `base` and its model.
std::vector<std::string> recommended_edges(const SweepResult& out, const Config& base,
                                           const layers::Sequential& model, const SweepOptions& o) {
  const int64_t batch = base.train.batch_size / std::max(1, base.pipeline.replicas);  // each replica's
  int most_m = 0;
  for (int m : o.micro_batches) {
    if (m <= batch) most_m = std::max(most_m, m);
  }
  return edge_notes(out.candidates[out.recommended], o, out.devices, first_device(base).is_cpu(), most_m,
                    model.size(), batch);
}

std::vector<int> tensor_sizes(const Config& base, const SweepOptions& o) {
  const int n = device_count(o, first_device(base).is_cpu());
  const int per_replica = n / std::max(1, base.pipeline.replicas);
  const int node = o.spec != nullptr ? std::max(1, o.spec->devices_per_node) : per_replica;
  std::vector<int> out;
  for (int t = 1; t <= std::min(per_replica, node); t *= 2) out.push_back(t);
  if (out.empty()) out.push_back(1);
  return out;
}

TensorMembers tensor_members(const Config& base, const SweepOptions& o) {
  TensorMembers out;
  const std::vector<int> sizes = tensor_sizes(base, o);
  if (base.model.cpp || base.model.layers.empty() || (sizes.size() == 1 && base.pipeline.tensor_parallel == 1)) {
    return out;
  }
  for (int T : sizes) {
    for (bool sequence : {false, true}) {
      if (T == 1 && sequence) continue;  // nothing to split
      Config at = base;
      at.pipeline.tensor_parallel = T;
      at.pipeline.sequence_parallel = sequence;
      try {
        out.runs.push_back(build_member_on_shapes(at, 0));
      } catch (const UserError& e) {
        // A model that does not split by positions: said only where the config asks for it.
        if (!sequence || base.pipeline.sequence_parallel) {
          out.unsplit.push_back("T=" + std::to_string(T) + (sequence ? " with sequence parallelism" : "") + ": " +
                                e.what());
        }
        if (!sequence) break;  // nor by positions, then
      }
    }
  }
  return out;
}

std::vector<SweptPrecision> TensorMembers::swept() const {
  std::vector<SweptPrecision> out;
  for (const RunModel& r : runs) out.push_back({"", &r.config, r.model.get()});
  return out;
}

std::vector<int> micro_batch_counts(int most) {
  std::vector<int> counts;
  for (int m = 1; m < most; m *= 2) counts.push_back(m);
  counts.push_back(most);
  return counts;
}

SweepResult sweep(const Config& base, const layers::Sequential& model, const SweepOptions& o) {
  SweepResult out;
  const bool cpu = first_device(base).is_cpu();
  int n = device_count(o, cpu);
  out.devices = n;
  // D replicas of each candidate, each with 1/D of the devices (one each at least) and
  // 1/D of the batch.
  const int D = std::max(1, base.pipeline.replicas);
  if (D > n && o.devices > 0) {
    throw UserError("pipeline.replicas is " + std::to_string(D) + " but --devices is " + std::to_string(n) +
                    ": each replica needs one device at least; give --devices " + std::to_string(D) +
                    " or more, or fewer replicas");
  }
  if (base.train.batch_size % D != 0) {
    throw UserError("train.batch_size " + std::to_string(base.train.batch_size) + " does not split over " +
                    std::to_string(D) + " replicas (pipeline.replicas); give a multiple of " + std::to_string(D));
  }
  // Each stage on T devices (its tensor group): a replica's devices hold n / (D T) stages.
  const int T = std::max(1, base.pipeline.tensor_parallel);
  const int per_replica = std::max(1, n / (D * T));
  if (D * T > n) {
    n = D * T;
    out.devices = n;
  }
  std::vector<bool> shard_modes = {false};
  if (D > 1 && optimizer_slots(base.optimizer.optimizer) > 0) shard_modes.push_back(true);
  out.memory_limit = memory_limit_per_device(base, o);
  // The model on shapes, once for every candidate: what it keeps, and its ops.
  const ActivationLayout layout = probe_activations(model, {o.spec != nullptr ? Device::cuda(0) : first_device(base)});
  SweepCosts costs(base, model, o, cpu, layout.launches);
  const CostSource& first = costs.for_stages(std::min(per_replica, model.size()) * D);
  out.costs = o.spec != nullptr ? o.spec->name + " (" + o.spec->source + "): " + first.describe() : first.describe();
  const LinkCost local = local_link(costs.store(), false);
  // Stage k's first device is k T (a stage's members side by side): the link between stages.
  const LinkFn link = o.spec != nullptr ? LinkFn([&o, T](int a, int b) { return o.spec->link(a * T, b * T); })
                                        : LinkFn([local](int, int) { return local; });

  const std::vector<Shape> shapes = candidate_shapes(per_replica, model.size(), cpu, o);
  const std::unique_ptr<CostSource> threaded = costs.threaded(per_replica);
  const int64_t batch = base.train.batch_size / D;  // each replica's
  PredictOptions po;
  po.layout = &layout;
  const std::string hash = model_hash(model), device = cpu ? "cpu" : "cuda", dtype = dtype_name(model.dtype());
  int corrected = 0;  // the timings' classes that apply
  for (const StepCalibration& c : costs.store().calibrations) {
    corrected += c.model_hash == hash && c.device == device && c.dtype == dtype;
  }
  if (corrected > 0 && o.spec == nullptr) {
    out.costs += "; step times scaled by " + std::to_string(corrected) + " timing" + (corrected == 1 ? "" : "s") +
                 " of this model's plans (calibrations in " + base.pipeline.profile + ")";
  }
  for (const Shape& sh : shapes) {
    for (int m : o.micro_batches) {
      if (m > batch) continue;
      for (RecomputeMode mode : {RecomputeMode::kNever, RecomputeMode::kExceptLast, RecomputeMode::kAlways}) {
        if (sh.k == 1 && sh.schedule != "gpipe") continue;  // one stage: every schedule is the same
        for (bool shard : shard_modes) {
          const Config c = candidate_config(base, sh, m, mode, shard);
          // With pipeline.capture, a candidate that takes it (one stage) is priced captured.
          const CostSource& src = sh.threads > 1 ? *threaded : costs.for_stages(sh.k * D * T, captures(c, model));
          std::optional<Candidate> cand = predict_candidate(c, model, src, link, po);
          if (!cand) continue;
          if (o.spec == nullptr) calibrate(*cand, costs.store(), hash, device, dtype);  // this machine's timings
          weigh_memory(*cand, out.memory_limit, o);
          out.candidates.push_back(std::move(*cand));
        }
      }
    }
  }
  if (out.candidates.empty()) {
    throw UserError("no way to run this config could be planned (the model has " + std::to_string(model.size()) +
                    " layers, train.batch_size " + std::to_string(base.train.batch_size) +
                    (D > 1 ? " over " + std::to_string(D) + " replicas" : std::string()) + ")");
  }
  rank(out);
  give_verdicts(out, o);
  if (out.recommended >= 0) out.edges = recommended_edges(out, base, model, o);
  return out;
}

SweepResult sweep(const std::vector<SweptPrecision>& precisions, const SweepOptions& o) {
  GPIPE_CHECK(!precisions.empty(), "sweep: no precision to try");
  SweepResult out;  // one precision too: its candidates then carry --set model.dtype, which may not be the config's
  std::vector<SweepResult> each;
  for (const SweptPrecision& p : precisions) {
    each.push_back(sweep(*p.config, *p.model, o));
    const bool tensor = p.name.empty();  // the config's precision at another T
    for (Candidate& c : each.back().candidates) {
      c.precision = p.name;
      c.tensor_swept = tensor;
      out.candidates.push_back(c);
    }
    const int T = p.config->pipeline.tensor_parallel;
    const std::string name =
        tensor ? "T=" + std::to_string(T) + (T > 1 && p.config->pipeline.sequence_parallel ? " seq" : "") : p.name;
    out.costs += (out.costs.empty() ? "" : "\n       ") + name + ": " + each.back().costs;
  }
  out.devices = 0;  // the same options: the same devices (the most any T used) and limit
  for (const SweepResult& r : each) out.devices = std::max(out.devices, r.devices);
  out.memory_limit = each.front().memory_limit;
  rank(out);
  give_verdicts(out, o);
  if (out.recommended >= 0) {
    const Candidate& best = out.candidates[out.recommended];
    for (const SweptPrecision& p : precisions) {
      if (p.name == best.precision && p.config->pipeline.tensor_parallel == best.tensor_parallel &&
          (p.config->pipeline.sequence_parallel && p.config->pipeline.tensor_parallel > 1) == best.sequence_parallel) {
        out.edges = recommended_edges(out, *p.config, *p.model, o);
      }
    }
  }
  return out;
}

std::string sweep_table(const SweepResult& r, int max_rows) {
  std::ostringstream os;
  int fitting = 0;
  for (const auto& c : r.candidates) fitting += c.fits;
  os << "Sweep: " << r.candidates.size() << " candidates on " << r.devices << " device" << (r.devices == 1 ? "" : "s")
     << ", " << fitting << " within the memory limit"
     << (r.memory_limit > 0 ? " of " + bytes_str(r.memory_limit) + " per device"
                            : " (none per device; give one with --set pipeline.memory_limit=8GiB)")
     << "\n";
  os << "costs: " << r.costs << "\n";
  // The rows shown, and the one unit of their peak column.
  // Every timed candidate (and the recommended one) is shown, whatever max_rows says.
  std::vector<size_t> rows;
  int64_t largest = 0;
  bool timed = false;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const Candidate& c = r.candidates[i];
    timed = timed || c.measured_ms > 0;
    if (static_cast<int>(rows.size()) >= max_rows && static_cast<int>(i) != r.recommended && c.measured_ms <= 0 &&
        !c.own) {
      continue;
    }
    rows.push_back(i);
    largest = std::max(largest, c.peak_device_bytes);
  }
  const ByteUnit unit = byte_unit_for(largest);
  char line[500];
  std::snprintf(line, sizeof line, "%4s  %-57s %9s %11s %10s %6s %12s  %s\n", "rank", "candidate", "step ms",
                timed ? "measured ms" : "", "samples/s", "bubble", (std::string("peak ") + unit.name).c_str(), "verdict");
  os << line;
  int off = 0;  // timed candidates whose prediction is off by more than 15%
  for (size_t i : rows) {
    const Candidate& c = r.candidates[i];
    std::string verdict = static_cast<int>(i) == r.recommended
                              ? (c.measured_ms > 0 ? "<< recommended (measured fastest)" : "<< recommended")
                              : c.verdict;
    if (c.own && verdict.find("own plan") == std::string::npos) verdict += " (the config's own plan)";
    char measured[32] = "";
    if (c.measured_ms > 0) {
      std::snprintf(measured, sizeof measured, "%.3f", c.measured_ms);
      const double ratio = c.measured_ms / c.run.step_ms - 1.0;
      if (std::fabs(ratio) > 0.15) {
        ++off;
        char note[64];
        std::snprintf(note, sizeof note, "; measured %+.0f%% off the prediction", 100.0 * ratio);
        verdict += note;
      }
    }
    std::snprintf(line, sizeof line, "%4zu  %-57s %9.2f %11s %10.1f %6.3f %12s  %s\n", i + 1, c.label().c_str(),
                  c.run.step_ms, measured, c.run.samples_per_second, c.run.bubble,
                  in_unit(c.peak_device_bytes, unit).c_str(), verdict.c_str());
    os << line;
  }
  const int shown = static_cast<int>(rows.size());
  if (shown < static_cast<int>(r.candidates.size())) {
    os << "  (" << r.candidates.size() - shown << " more not shown)\n";
  }
  if (timed) os << "step ms and samples/s: predicted; measured ms: a real step's median, timed here\n";
  if (off > 0) {
    os << "The prediction is off by more than 15% for " << off << " of the timed plans: the recommendation follows "
       << "the measured times (a `gpipe profile CONFIG --sweep` brings the predictions closer)\n";
  }
  if (r.recommended >= 0) {
    os << "Recommended: " << r.candidates[r.recommended].label() << "\n  " << r.candidates[r.recommended].overrides()
       << "\n";
    if (!r.edges.empty()) os << "At the edge of the search:\n";
    for (const std::string& e : r.edges) os << "  " << e << "\n";
  } else {
    os << "No candidate fits the memory limit: raise pipeline.memory_limit, use more devices, or shrink "
          "train.batch_size\n";
  }
  return os.str();
}

}  // namespace pipeline
}  // namespace gpipe
