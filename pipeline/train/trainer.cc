#include "pipeline/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <ostream>
#include <thread>
#include <utility>
#include <vector>

#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/memory_check.h"
#include "pipeline/planning/plan.h"
#include "pipeline/train/checkpointing.h"
#include "pipeline/train/datasets.h"
#include "pipeline/train/gemm_rates.h"
#include "pipeline/train/auto_plan.h"
#include "pipeline/train/run_artifacts.h"
#include "pipeline/train/run_directory.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/inprocess_replica_group.h"
#include "runtime/inprocess_transport.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// Rows of host tensors, one after the other.
Tensor concat_rows(const std::vector<Tensor>& parts) {
  if (parts.size() == 1) return parts[0];
  Shape shape = parts[0].shape();
  shape[0] = 0;
  for (const Tensor& t : parts) shape[0] += t.size(0);
  Tensor out = Tensor::empty(shape, parts[0].dtype(), Device::cpu());
  int64_t row = 0;
  for (const Tensor& t : parts) {
    Tensor into = out.narrow_rows(row, t.size(0));
    copy_tensor(t, into);
    row += t.size(0);
  }
  return out;
}

// Mean loss and accuracy (argmax over the classes, per target; both over the targets
// the loss counts, ignore_index left out) of the model on validation samples [0, n),
// in chunks of `chunk` samples (the last may be shorter). Each chunk is one micro-batch
// of the executor's forward-only program (Executor::evaluate), M chunks per call;
// replica d takes chunks d, d + D, ... Every process gets the totals.
std::pair<double, double> evaluate(Executor& executor, const Dataset& data, int64_t n, int64_t chunk,
                                   const Launch& launch) {
  const int D = launch.replicas != nullptr ? launch.replicas->size() : 1;
  const int M = executor.schedule().num_micro_batches;
  std::vector<int64_t> mine;  // this replica's chunks
  for (int64_t c = launch.replica; c * chunk < n; c += D) mine.push_back(c);
  EvalResult total;
  for (size_t first = 0; first < mine.size(); first += M) {
    heartbeat();
    std::vector<Tensor> xs, ys;
    for (size_t i = first; i < std::min(mine.size(), first + M); ++i) {
      const int64_t start = mine[i] * chunk;
      auto [x, y] = data.validation(start, std::min(chunk, n - start));
      xs.push_back(x);
      ys.push_back(y);
    }
    total = executor.evaluate(concat_rows(xs), concat_rows(ys), chunk, total);
  }
  total = executor.all_reduce_scores(total);
  const double counted = std::max(total.counted, 1.0);
  return {total.loss_sum / counted, total.correct / counted};
}

// A multi-process step's timings, each process holding only its own stage's: stage 0
// receives every stage's, so that it reports the whole pipeline as one process would.
// Every process times from its own step start; they start together (the previous
// step ended in a collective), to within a transport latency.
StepResult gather_timings(StepResult r, const Launch& launch) {
  const int me = launch.rank;
  const std::vector<std::vector<double>> all = launch.transport->gather_to_first(me, encode_trace(r.stages.at(me)));
  for (size_t k = 0; k < all.size(); ++k) r.stages.at(k) = decode_trace(all[k], static_cast<int>(k));
  return r;
}

// The model must read what the data gives and predict what it asks for.
void check_model_fits_data(const layers::Sequential& model, const Dataset& data) {
  // Float data goes into a bf16 or fp16 model rounded (layers::model_input).
  const bool rounded = is_narrow(model.input_dtype()) && data.input_dtype() == master_dtype(model.input_dtype());
  if (model.input_shape() != data.input_shape() || (model.input_dtype() != data.input_dtype() && !rounded)) {
    throw UserError("the data gives " + std::string(dtype_name(data.input_dtype())) + shape_str(data.input_shape()) +
                    " per sample but the model takes " + dtype_name(model.input_dtype()) +
                    shape_str(model.input_shape()) + "; set model.input (and data.seq_len for text) to match");
  }
  Shape want = data.target_shape();
  want.push_back(data.classes());
  if (model.output_shape() != want) {
    throw UserError("the model's last layer produces " + shape_str(model.output_shape()) + " per sample but the data needs " +
                    shape_str(want) + " (" + std::to_string(data.classes()) + " classes" +
                    (data.target_shape().empty() ? std::string() : " per position") +
                    "); make the last layer's out equal to data.classes (or the vocabulary)");
  }
}

// The process's start, as the static initialisation of this library sees it: where the
// start-up's first phase begins.
const auto g_process_start = std::chrono::steady_clock::now();

// Where the time from launch to the first step went, by phase, logged once before the
// first step (issue 36: a start-up must not cost in proportion to the model's FLOPs).
class StartupPhases {
 public:
  // The phase that ends now, named.
  void end(const char* name) {
    const auto now = std::chrono::steady_clock::now();
    phases_.emplace_back(name, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }
  // "start-up: 3.21 s to the first step: launch 0.12 s, model 1.02 s, ..."
  std::string line() const {
    double total = 0;
    std::string parts;
    char buf[96];
    for (const auto& [name, s] : phases_) {
      total += s;
      std::snprintf(buf, sizeof buf, "%s%s %.2f s", parts.empty() ? "" : ", ", name, s);
      parts += buf;
    }
    std::snprintf(buf, sizeof buf, "start-up: %.2f s to the first step: ", total);
    return buf + parts;
  }

 private:
  std::chrono::steady_clock::time_point last_ = g_process_start;
  std::vector<std::pair<const char*, double>> phases_;
};

// This process's claim on the run: a run id (a fresh one unless mpirun or gpipe run gave
// one), its heartbeat for gpipe run (runtime/heartbeat.h), and, on the job's first
// process, the lock on the run's directories; a fresh run does not write where another
// run's checkpoints or reports are.
struct RunClaim {
  Config config;  // with its run id
  std::unique_ptr<HeartbeatWriter> beats;
  std::unique_ptr<DirectoryLock> lock;
  std::vector<std::string> new_records;  // the run.json files this launch wrote where there were none
  bool trained = false;                   // the first step has started: the claim stands
  // A launch that fails before its first step in a folder it claimed afresh (a
  // checkpoint refused, a model that does not fit) leaves no run.json behind, nor the
  // lock files and folders it made.
  ~RunClaim() {
    if (trained || std::uncaught_exceptions() == 0) return;
    for (const std::string& p : new_records) std::remove(p.c_str());
    if (lock) lock->abandon();  // its lock files and the folders it made, now empty
  }
  RunClaim(Config c) : config(std::move(c)) {}
  RunClaim(RunClaim&&) = delete;
};

void claim_run(RunClaim& claim, const Launch& launch) {
  Config& c = claim.config;
  if (c.run.id.empty()) c.run.id = new_run_id();  // mpirun: MpiLaunch::join gave every rank one
  if (!c.run.heartbeat_dir.empty()) {
    claim.beats = std::make_unique<HeartbeatWriter>(c.run.heartbeat_dir + "/rank-" + std::to_string(launch.world_rank()));
  }
  if (launch.first()) {
    claim.lock = std::make_unique<DirectoryLock>(run_directories(c), c.run.id);
    // Whose run this is (a fresh one, the folder's, or a fork), recorded in run.json,
    // which every process reads back when it resumes (RunCheckpoints::resume).
    ClaimedRun claimed = claim_directories(c);
    c.run.id = claimed.run_id;
    claim.new_records = std::move(claimed.created_records);
  }
}

// One process per stage, tensor-group member and replica, as the config asks: otherwise
// a UserError naming the mpirun command that fits.
void check_launch(const Config& c, const Launch& launch) {
  const bool multi = launch.size > 1;
  const int D = c.pipeline.replicas, T = c.pipeline.tensor_parallel;
  const int np = plan_sizes(c).ranks().size();
  const std::string product = T > 1 ? "pipeline.partitions x pipeline.tensor_parallel x pipeline.replicas"
                                    : "pipeline.partitions x pipeline.replicas";
  if (D > 1 && (launch.replicas == nullptr || launch.replicas->size() != D)) {
    throw UserError("pipeline.replicas = " + std::to_string(D) + " needs " + std::to_string(D) +
                    " copies of the pipeline: launch mpirun -np " + std::to_string(np) + " (" + product + ")");
  }
  if (T > 1 && (launch.tensor != T || launch.tensor_group == nullptr)) {
    throw UserError("pipeline.tensor_parallel = " + std::to_string(T) + " splits each stage over " + std::to_string(T) +
                    " processes: launch mpirun -np " + std::to_string(np) + " (" + product + ")");
  }
  if (multi && launch.size != c.pipeline.partitions) {
    throw UserError("launched as " + std::to_string(launch.layout().size()) + " processes but " + product + " is " +
                    std::to_string(np) + "; run one process per stage" + (T > 1 ? ", tensor-group member" : "") +
                    " and replica: mpirun -np " + std::to_string(np));
  }
  GPIPE_CHECK(!multi || launch.transport != nullptr, "a multi-process launch needs a transport");
}

// What the log, the report and the trace call each stage: its cells' layers, and its
// device.
struct StageNames {
  std::vector<std::string> layers, devices;
};

StageNames stage_names(const Plan& plan, const layers::Sequential& model) {
  StageNames names;
  for (int k = 0; k < plan.stages; ++k) {
    std::string layers_text;
    for (int cell : plan.schedule.cells[k]) {
      const CellSpec& s = plan.cells[cell];
      layers_text += (layers_text.empty() ? "" : kChunkSeparator) + describe_layers(model, s.first_layer, s.num_layers);
    }
    names.layers.push_back(layers_text);
    names.devices.push_back(plan.devices[k].str());
  }
  return names;
}

// `whole`: the unsplit model (on shapes) when this process holds a member of it.
void log_run(const Dataset& data, layers::Sequential& model, layers::Sequential* whole, const Plan& plan,
             const StageNames& names) {
  std::string balance_text;
  for (size_t i = 0; i < plan.balance.size(); ++i) balance_text += (i ? ", " : "") + std::to_string(plan.balance[i]);
  spdlog::info("data: {}", data.describe());
  spdlog::info("model: {} layers, {} parameters; {} stages, balance [{}], {} micro-batches, schedule {}, recompute {}",
               model.size(), (whole != nullptr ? *whole : model).parameter_count(), plan.stages, balance_text,
               plan.micro_batches(),
               plan.schedule.name, recompute_mode_name(plan.recompute));
  for (int k = 0; k < plan.stages; ++k) {
    spdlog::info("stage {} on {}: layers {}", k, names.devices[k], names.layers[k]);
  }
  if (plan.tensor_parallel > 1) {
    const RankLayout r = plan.ranks();
    spdlog::info("tensor parallelism: each stage on {} processes (its tensor group: ranks (replica x {} + stage) x {} "
                 "+ member), {} processes in all; the report and checkpoints are member 0's, checkpoints whole by name",
                 r.tensor, r.stages, r.tensor, r.size());
  }
}

layers::LrSchedule lr_schedule(const Config& c) {
  layers::LrSchedule lr;
  lr.kind = c.optimizer.schedule;
  lr.base_lr = c.optimizer.optimizer.lr;
  lr.warmup_steps = c.optimizer.warmup_steps;
  lr.total_steps = c.train.steps;
  lr.min_lr = c.optimizer.min_lr;
  return lr;
}

// A step whose loss is not finite ends the run before anything of it is written.
void check_loss_finite(double loss, int number, double lr) {
  if (std::isfinite(loss)) return;
  char now[32];
  std::snprintf(now, sizeof now, "%g", lr);  // std::to_string(1e300) has 300 digits
  throw UserError("the loss became " + std::string(std::isnan(loss) ? "NaN" : "infinite") + " at step " +
                  std::to_string(number) + "; lower optimizer.lr (now " + now +
                  "), set optimizer.clip_grad_norm, or check the data. Nothing was written for this step.");
}

// Step `step`: this replica's rows of the mini-batch through the executor at learning
// rate `lr`, with every stage's timings gathered into the first stage's process; a loss
// that is not finite ends the run.
StepResult run_step(Executor& executor, Transport& transport, const Dataset& data, const Config& c, const Plan& plan,
                    const Launch& launch, int step, double lr) {
  heartbeat();
  transport.set_step(step);
  if (plan.replicas > 1) launch.replicas->set_step(step);
  if (plan.tensor_parallel > 1) launch.tensor_group->set_step(step);
  auto [x, y] = data.batch(batch_key(c.train.seed, step), c.train.batch_size);
  if (plan.replicas > 1) {  // each replica takes its own rows of the mini-batch
    x = x.narrow_rows(launch.replica * plan.replica_batch, plan.replica_batch);
    y = y.narrow_rows(launch.replica * plan.replica_batch, plan.replica_batch);
  }
  executor.set_lr(lr);
  StepResult r = executor.step(x, y);
  if (launch.size > 1) r = gather_timings(std::move(r), launch);
  check_loss_finite(r.loss, step + 1, lr);  // the step's number, as the progress lines print it
  return r;
}

// The progress line of step number `number` (from 1): its loss, the validation
// loss when one was taken (val_loss >= 0), the gradient norm when clipping measured it,
// the learning rate and the speed since the last line.
std::string progress_line(int number, int steps, double loss, double val_loss, double grad_norm, double lr,
                          double samples_per_second) {
  char line[256];
  size_t len = 0;
  // snprintf returns the length it wanted, not what it wrote: a diverging float64
  // loss printed with %.4f has hundreds of digits, and must cut the line short
  // rather than write past it.
  auto append = [&](const char* format, auto... args) {
    if (len < sizeof line) len += static_cast<size_t>(std::snprintf(line + len, sizeof line - len, format, args...));
  };
  append("step %5d/%d  loss %.4f", number, steps, loss);
  if (val_loss >= 0) append("  val_loss %.4f", val_loss);
  if (grad_norm >= 0) append("  grad_norm %.3f", grad_norm);
  append("  lr %.3g  %.1f samples/s", lr, samples_per_second);
  return line;
}

// report.json in output.dir, with trace.json and report.html beside it (RunArtifacts);
// returns report.json's path. `regenerated`: why they are written again (a finished run's
// resume), and then report.json only if `json_file`.
std::string write_reports(const Config& c, const ReportBuilder& report, RunArtifacts& artifacts,
                          const RunCheckpoints& checkpoints, const Dataset& data, const Plan& plan, std::ostream& out,
                          const std::string& regenerated = "", bool json_file = true) {
  std::filesystem::path dir(c.output.dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UserError("cannot create output.dir '" + dir.string() + "': " + ec.message());
  nlohmann::json j = report.json();
  j["run_id"] = checkpoints.run_id();
  if (!checkpoints.parent().is_null()) j["parent"] = checkpoints.parent();  // a fork: what it went on from
  if (!regenerated.empty()) j["regenerated"] = regenerated;
  j["config"] = c.source;
  j["effective_config"] = c.effective;
  j["data"] = data.describe();
  j["balance"] = plan.balance;
  if (plan.replicas > 1) j["replicas"] = plan.replicas;
  if (plan.tensor_parallel > 1) j["tensor_parallel"] = plan.tensor_parallel;
  if (plan.sequence_parallel) j["sequence_parallel"] = true;
  artifacts.write(dir, report, j, out);  // trace.json, report.html
  const auto path = dir / "report.json";
  if (json_file) write_file_atomically(path.string(), j.dump(2) + "\n");
  return path.string();
}

}  // namespace

// The executor's settings: the optimizer, this process's stage and rank, its replicas,
// its rows of the mini-batch, and the job's clock.
ExecutorOptions executor_options(const Config& c, const Launch& launch, const Plan& plan, double clock_offset_ms) {
  const bool multi = launch.size > 1;
  ExecutorOptions opts;
  opts.optimizer = c.optimizer.optimizer;
  opts.clip_grad_norm = c.optimizer.clip_grad_norm;
  opts.loss_scale = c.optimizer.loss_scale;
  opts.loss_scale_window = c.optimizer.loss_scale_window;
  opts.pin_threads = c.pipeline.pin_threads;
  opts.local_stage = multi || plan.tensor_parallel > 1 ? launch.rank : -1;
  opts.rank = launch.world_rank();
  opts.replicas = plan.replicas > 1 ? launch.replicas : nullptr;
  opts.tensor_group = plan.tensor_parallel > 1 ? launch.tensor_group : nullptr;
  opts.bucket_bytes = static_cast<int64_t>(c.pipeline.bucket_mb * (1 << 20));
  opts.shard_optimizer = plan.shard_optimizer;
  opts.sample_offset = launch.replica * plan.replica_batch;
  opts.micro_batch_sizes = plan.micro_batch_sizes;
  opts.clock_offset_ms = clock_offset_ms;
  opts.capture = c.pipeline.capture;
  opts.op_times = c.trace.ops;
  return opts;
}

std::vector<int> plan_balance(const Config& c, const layers::Sequential& model) {
  return make_plan(c, model).balance;
}

TrainResult train(const Config& config, std::ostream& out, const Launch& launch) {
  return train(config, MakeModel{}, out, launch);
}

void run_ranks_as_threads(const RankLayout& layout, double timeout_s, const std::function<void(const Launch&)>& rank) {
  const int K = layout.stages, T = layout.tensor, D = layout.replicas;
  std::vector<std::unique_ptr<InProcessTransport>> pipes;              // per (replica, member)
  std::vector<std::unique_ptr<InProcessReplicaHub>> tensor_hubs, replica_hubs;  // per (replica, stage); per (stage, member)
  for (int i = 0; i < D * T; ++i) pipes.push_back(std::make_unique<InProcessTransport>(K, timeout_s, /*ordered_repeats=*/true));
  for (int i = 0; i < D * K; ++i) tensor_hubs.push_back(std::make_unique<InProcessReplicaHub>(T, timeout_s));
  for (int i = 0; i < K * T; ++i) replica_hubs.push_back(std::make_unique<InProcessReplicaHub>(D, timeout_s));
  std::mutex failed_mu;
  std::exception_ptr failed;
  bool failed_is_abort = false;
  std::vector<std::thread> threads;
  for (int r = 0; r < layout.size(); ++r) {
    threads.emplace_back([&, r] {
      const RankPlace at = layout.place(r);
      const int d = at.replica, k = at.stage, t = at.member;
      InProcessReplicaGroup tensor(*tensor_hubs[static_cast<size_t>(d * K + k)], t);
      InProcessReplicaGroup replicas(*replica_hubs[static_cast<size_t>(k * T + t)], d);
      Launch launch;
      launch.rank = k;
      launch.size = K;
      launch.transport = pipes[static_cast<size_t>(d * T + t)].get();  // train() at K = 1 keeps its own
      launch.member = t;
      launch.tensor = T;
      launch.tensor_group = T > 1 ? &tensor : nullptr;
      launch.replica = d;
      launch.replicas = D > 1 ? &replicas : nullptr;
      launch.threads = true;
      set_thread_context(launch.world_rank(), -1);
      try {
        rank(launch);
      } catch (const std::exception& e) {
        const bool abort = dynamic_cast<const Aborted*>(&e) != nullptr;
        {
          std::lock_guard<std::mutex> lock(failed_mu);
          if (!failed || (failed_is_abort && !abort)) {
            failed = std::current_exception();
            failed_is_abort = abort;
          }
        }
        const std::string why = "rank " + std::to_string(launch.world_rank()) + " failed: " + e.what();
        for (auto& p : pipes) p->abort(why);
        for (auto& h : tensor_hubs) h->abort(why);
        for (auto& h : replica_hubs) h->abort(why);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  if (failed) std::rethrow_exception(failed);
}

namespace {

// pipeline.tensor_parallel = T > 1 in one process (no mpirun): the job's K x T x D ranks
// as threads (run_ranks_as_threads), each running train() as its rank would under mpirun,
// with one run id. Only the first rank writes (to `out`, the reports, the checkpoints'
// index). (D > 1 at T = 1 still takes mpirun, as PyTorch's DDP takes a process per
// replica: check_launch says so.)
TrainResult train_ranks_as_threads(const Config& config, const MakeModel& make_model, std::ostream& out) {
  const RankLayout layout = plan_sizes(config).ranks();
  const int K = layout.stages, T = layout.tensor, D = layout.replicas;
  check_auto_launch(config, T);  // each rank would choose on its own
  const std::string what = "pipeline.tensor_parallel = " + std::to_string(T) +
                           (D > 1 ? " and pipeline.replicas = " + std::to_string(D) : std::string());
  for (const std::string& d : config.pipeline.devices) {
    if (parse_device(d).is_cuda()) {
      throw UserError(what + " on GPUs runs one process per GPU (NCCL between them): launch mpirun -np " +
                      std::to_string(layout.size()) +
                      " (pipeline.partitions x pipeline.tensor_parallel x pipeline.replicas); in one process the "
                      "ranks are threads on CPU stages");
    }
  }
  Config c = config;
  if (c.run.id.empty()) c.run.id = new_run_id();  // one run, as MpiLaunch::join gives every rank
  spdlog::info("{}: {} ranks as threads of this process ({} stage(s) x {} tensor-group member(s) x {} replica(s); "
               "mpirun runs them as processes)",
               what, layout.size(), K, T, D);
  std::vector<TrainResult> results(static_cast<size_t>(layout.size()));
  run_ranks_as_threads(layout, c.pipeline.timeout_s, [&](const Launch& launch) {
    results[static_cast<size_t>(launch.world_rank())] = train(c, make_model, out, launch);
  });
  return results[0];
}

}  // namespace

TrainResult train(const Config& config, const MakeModel& make_model, std::ostream& out, const Launch& launch) {
  if (launch.transport == nullptr && launch.size == 1 && launch.tensor == 1 && launch.replicas == nullptr &&
      config.pipeline.tensor_parallel > 1) {
    return train_ranks_as_threads(config, make_model, out);  // they come back here, one per rank
  }
  // One run per directory: the job's first process holds its directories' lock.
  const bool owner = launch.first();
  StartupPhases startup;
  startup.end("launch");  // the config read, MPI joined
  RunClaim claim(config);
  claim_run(claim, launch);
  startup.end("claim");
  const Config& identified = claim.config;
  // Weights that cannot fit are refused before any is allocated (memory_check.h): all of
  // them, which this machine holds between its processes.
  if (!make_model) check_weights_fit(identified, host_available_bytes());
  // Tensor parallelism: this process builds (on shapes, then with its weights) its member
  // of the model; the unsplit model on shapes is what the data and checkpoints see.
  std::unique_ptr<layers::Sequential> whole_shapes;
  if (identified.pipeline.tensor_parallel > 1) {
    if (make_model || identified.model.cpp) {
      throw UserError("pipeline.tensor_parallel splits the YAML layers of model.layers (linear, attention, the "
                      "blocks, the embedding and the head); a model built in C++ is built whole: set "
                      "pipeline.tensor_parallel: 1, or describe the model in YAML");
    }
    check_launch(identified, launch);
    whole_shapes = std::move(build_run_model_on_shapes(identified).model);
    claim.config.model.member = tensor_member(claim.config, launch.member);  // check_launch: launch.tensor is T
  }
  // The model: YAML layers, a registered C++ model, or make_model (run_model.h); `c`
  // describes it. YAML layers are built on shapes first (what auto and the plan read,
  // without weights), and with their weights once planned: in a process of a
  // multi-process run, only its own stage's.
  RunModel run = !make_model && !identified.model.cpp ? build_run_model_on_shapes(identified)
                                                     : build_run_model(identified, make_model);
  const bool yaml_layers = run.on_shapes;  // else built with its weights already, whole
  startup.end(yaml_layers ? "model on shapes" : "model build+init");
  if (make_model && run.config.autos.any()) {
    throw UserError("auto (pipeline.partitions, pipeline.micro_batches, pipeline.schedule, train.blas_threads) measures "
                    "the model the config describes; for a model built in C++ give the values (`gpipe plan "
                    "CONFIG --sweep` on a config naming it recommends them)");
  }
  // `auto` keys: the sweep's choice, said on `out` (auto_plan.h).
  if (run.config.autos.any()) {
    run.config = resolve_auto(run.config, *run.model, launch, out);
    startup.end("auto profile+sweep");
  }
  const Config& c = run.config;
  check_launch(c, launch);
  const bool multi = launch.size > 1;
  init_logging(c.train.log_level);
  if (c.pipeline.schedule == "interleaved_1f1b" && c.pipeline.virtual_stages == 1 && launch.first()) {
    spdlog::warn("pipeline.schedule interleaved_1f1b with pipeline.virtual_stages 1 (the default) is plain 1F1B; "
                 "set pipeline.virtual_stages: 2 or more to interleave (each stage then runs that many cells)");
  }
  set_cpu_blas_threads(c.train.blas_threads);
  std::unique_ptr<layers::Sequential>& model = run.model;
  const std::unique_ptr<Dataset> data = make_dataset(c);
  check_model_fits_data(whole_shapes ? *whole_shapes : *model, *data);
  startup.end("data");
  PlanOptions plan_options;
  plan_options.local_stage = multi ? launch.rank : -1;
  if (multi && launch.transport->sends_wait_for_receiver()) plan_options.comm = CommModel::kRendezvous;
  Plan plan = make_plan(c, *model, plan_options);
  const int K = plan.stages;
  TrainResult result;
  result.balance = plan.balance;
  check_run_fits(c, *model, plan, host_available_bytes());
  check_memory_limit(c, plan);
  startup.end("plan+memory check");
  if (yaml_layers && !multi) {
    model = layers::build_model(c.model);
    if (plan.tensor_parallel > 1) {
      spdlog::info("member {}/{}: this process holds {} of the model's {} parameters (its blocks of the split layers, "
                   "and the layers every member holds whole)",
                   launch.member, plan.tensor_parallel, model->parameter_count(), whole_shapes->parameter_count());
    }
    startup.end("model build+init");
  } else if (yaml_layers) {
    // This stage's layers with weights (the values the whole model would have: each
    // layer is seeded by its index; a member's blocks of them), the others' shapes only.
    std::vector<bool> mine(model->size(), false);
    for (int cell : plan.schedule.cells[launch.rank]) {
      const CellSpec& s = plan.cells[cell];
      for (int i = s.first_layer; i < s.first_layer + s.num_layers; ++i) mine[i] = true;
    }
    model = layers::build_model(c.model, [&](int i) { return mine[i]; });
    int64_t with_data = 0;
    for (int i = 0; i < model->size(); ++i) {
      for (const layers::Parameter* p : model->layer(i).parameters()) {
        if (!p->value.is_meta()) with_data += p->value.numel();
      }
    }
    spdlog::info("stage {}{}: this process holds {} of the model's {} parameters (its own layers'{}); the other "
                 "stages' layers are built on shapes, without weights",
                 launch.rank,
                 plan.tensor_parallel > 1
                     ? " member " + std::to_string(launch.member) + "/" + std::to_string(plan.tensor_parallel)
                     : std::string(),
                 with_data, whole_shapes ? whole_shapes->parameter_count() : model->parameter_count(),
                 model->ties().empty() ? "" : ", and the embedding a head of its own is tied to");
    startup.end("model build+init (this stage)");
  }
  if (plan.tensor_parallel > 1 && launch.first()) {
    // Linear layers the config leaves whole: every member of their stage computes them alike.
    std::string whole_linear;
    for (int i = 0; i < model->size(); ++i) {
      if (model->layer(i).type() != "linear") continue;
      bool split = false;
      for (const layers::Parameter* p : model->layer(i).parameters()) split = split || p->shard_count > 1;
      if (!split) whole_linear += (whole_linear.empty() ? "" : ", ") + std::to_string(i);
    }
    if (!whole_linear.empty()) {
      spdlog::warn("pipeline.tensor_parallel = {}: linear layer(s) {} are not split (no `parallel: column` or "
                   "`parallel: row`), so every member of their stage computes them whole, alike",
                   plan.tensor_parallel, whole_linear);
    }
  }
  if (c.pipeline.sequence_parallel && plan.tensor_parallel == 1 && launch.first()) {
    spdlog::warn("pipeline.sequence_parallel splits the positions between a tensor group's members; at "
                 "pipeline.tensor_parallel = 1 it does nothing");
  }
  if (plan.sequence_parallel && yaml_layers) {
    const int64_t mine = model->layer(0).output_shape().at(0), whole = whole_shapes->layer(0).output_shape().at(0);
    spdlog::info("sequence parallelism: member {} holds positions {} to {} of each sample's {} between the split "
                 "layers (the norms, the dropouts, the residual stream and the stages' messages); the split layers "
                 "all-gather them and reduce-scatter back",
                 launch.member, launch.member * mine, (launch.member + 1) * mine - 1, whole);
  }
  // Saves must not be the first to find a read-only or full disk: with periodic saves,
  // room for the next ones while the newest is kept (checkpoints_to_fit); always, a
  // writable folder (a stop signal saves too).
  if (owner) {
    // A torn save of this run (a save that failed, e.g. on a full disk) holds space that
    // no resume can use: freed before the room is counted.
    const std::string ck = checkpoint_dir(c);
    remove_torn_saves(ck, c.run.id);
    const int64_t every = c.checkpoint.every;
    // From step 0: at most this many; without checkpoint.every, a launch that resumes
    // saves its last step (RunCheckpoints::after_step).
    const int64_t saves = every > 0 ? (c.train.steps + every - 1) / every : c.checkpoint.resume.empty() ? 0 : 1;
    check_checkpoint_room(ck, checkpoint_bytes(whole_shapes ? *whole_shapes : *model, c.optimizer.optimizer),
                          checkpoints_to_fit(ck, c.run.id, saves));
  }

  const StageNames names = stage_names(plan, *model);
  log_run(*data, *model, whole_shapes.get(), plan, names);

  // The plan's prediction, the recorded steps and one clock for all ranks (collective).
  RunArtifacts artifacts(c, *model, plan, launch, names.layers, names.devices);
  startup.end("prediction+peaks");

  InProcessTransport in_process(K, c.pipeline.timeout_s);
  Transport& transport = multi ? *launch.transport : static_cast<Transport&>(in_process);
  Executor executor(*model, plan.cells, plan.schedule, transport,
                    executor_options(c, launch, plan, artifacts.clock_offset_ms()));
  if (plan.replicas > 1) {  // what the device holds of the optimizer's state, measured (planned: report.json)
    for (int k = 0; k < K; ++k) {
      if (multi && k != launch.rank) continue;
      spdlog::info("stage {} replica {}: optimizer state {} bytes on this device ({})", k, launch.replica,
                   executor.optimizer_state_bytes(k),
                   plan.shard_optimizer ? "its shard, 1/" + std::to_string(plan.replicas) : std::string("not sharded"));
    }
  }
  const layers::LrSchedule lr = lr_schedule(c);

  const int64_t eval_n = c.train.eval_samples > 0 ? std::min(c.train.eval_samples, data->validation_size())
                                                  : data->validation_size();
  auto validate = [&] { return evaluate(executor, *data, eval_n, c.train.batch_size, launch); };

  // The whole pipeline's report, kept by its first stage (in a multi-process run, the
  // other processes send it their timings every step); written by replica 0's.
  const bool reports = launch.rank == 0 && launch.member == 0;
  const bool writes = reports && launch.replica == 0;
  ReportBuilder report(names.layers, names.devices, plan.schedule, plan.recompute, plan.batch_size);
  report.set_layout(plan.replicas, plan.tensor_parallel, plan.sequence_parallel);
  report.set_turns(plan.turns);
  // Saved state: resume where a checkpoint left off, save every checkpoint.every steps,
  // on SIGUSR1, and before stopping on SIGINT or SIGTERM.
  RunCheckpoints checkpoints(c, plan, *model, executor, launch, transport, whole_shapes.get());
  if (reports) checkpoints.set_history([&](int64_t done) { return report.history(static_cast<int>(done)); });
  startup.end("weights to devices");
  const int start = static_cast<int>(checkpoints.resume());
  if (!c.checkpoint.resume.empty()) startup.end("checkpoint load+verify");
  result.start_step = start;
  if (reports && start > 0 && !checkpoints.resumed_history().is_null()) {
    report.carry_over(checkpoints.resumed_history(), start + 1);
  }
  if (start >= c.train.steps) {
    // A finished run resumed (a restart after its last checkpoint, the continue command
    // after a stop): its reports stay; a report.json or report.html that is missing (the
    // launch that ran the last step was killed before writing it) is written again from
    // the history its checkpoint carries: the losses and validations, not the lost
    // launch's timings (nor its trace.json, which holds nothing else).
    const std::filesystem::path dir(c.output.dir);
    const bool missing_json = !std::filesystem::exists(dir / "report.json");
    const bool missing = missing_json || !std::filesystem::exists(dir / "report.html");
    if (writes) {
      out << "The checkpoint at step " << start << " already reached train.steps = " << c.train.steps
          << ": nothing to train (raise train.steps to go on); "
          << (missing ? "writing its missing report from the checkpoint's history." : c.output.dir + " is left as it was.")
          << std::endl;
    }
    checkpoints.wait_for_last_save();
    result.checkpoint_path = checkpoints.last_saved();
    if (missing) {
      if (eval_n > 0) {
        std::tie(result.eval_loss, result.eval_accuracy) = validate();
        report.set_eval(result.eval_loss, result.eval_accuracy);
      }
      if (writes) {
        result.report_path = write_reports(
            c, report, artifacts, checkpoints, *data, plan, out,
            "written again by a resume after the run had finished (report.json was missing): its steps' losses and "
            "validations come from the checkpoint's history; the timings of the launch that ran them were lost",
            missing_json);
        out << "Report: " << result.report_path << std::endl;
      }
    }
    return result;
  }
  claim.trained = true;
  spdlog::info("{}", startup.line());
  artifacts.starts_at(start + 1);
  if (artifacts.has_prediction()) report.set_prediction(artifacts.prediction());
  if (reports) report.set_flops(plan.stage_flops, artifacts.stage_peaks());
  double window_ms = 0;
  int window_steps = 0;
  for (int step = start; step < c.train.steps; ++step) {
    const int number = step + 1;  // the step's number in every output (terminal, report, trace, page): from 1
    const StepResult r = run_step(executor, transport, *data, c, plan, launch, step, lr.at(step));
    result.losses.push_back(r.loss);
    if (r.skipped && writes) {
      out << "step " << number << ": the gradients overflowed float16 at loss scale "
          << static_cast<long long>(r.loss_scale) << "; the step was skipped and the scale is now "
          << static_cast<long long>(executor.loss_scale()) << std::endl;
    }
    // The first step warms caches and allocators; it is left out of the timings, and so
    // is the second with pipeline.capture, which captures the step before it runs it
    // (when the launch has more than those, else its last step is timed).
    const int warm = c.pipeline.capture ? 2 : 1;
    const bool timed = c.train.steps - start <= warm ? step + 1 == c.train.steps : step >= start + warm;
    if (reports) report.add_step(number, r.loss, r, timed);
    if (reports) artifacts.add_step(number, r.loss, r);
    window_ms += r.wall_ms;
    ++window_steps;
    const bool last = step + 1 == c.train.steps;
    const bool eval_now = eval_n > 0 && c.train.eval_interval > 0 && (step + 1) % c.train.eval_interval == 0 && !last;
    // The run's last validation, in the history before the last checkpoint is saved
    // (checkpoints.after_step below), so that a run resumed from it keeps it.
    if (eval_n > 0 && last) {
      std::tie(result.eval_loss, result.eval_accuracy) = validate();
      report.add_validation(number, result.eval_loss, result.eval_accuracy);
      report.set_eval(result.eval_loss, result.eval_accuracy);
    }
    if ((step + 1) % c.train.log_interval == 0 || last || step == 0 || eval_now) {
      double val_loss = last && eval_n > 0 ? result.eval_loss : -1;  // the last step's, taken above
      if (eval_now) {
        const auto [vl, va] = validate();
        report.add_validation(number, vl, va);
        val_loss = vl;
      }
      const std::string line = progress_line(number, c.train.steps, r.loss, val_loss, r.grad_norm, lr.at(step),
                                             c.train.batch_size * window_steps / (window_ms / 1000.0));
      if (writes) out << line << std::endl;
      window_ms = 0;
      window_steps = 0;
    }
    checkpoints.after_step(number, lr.at(step));
  }
  checkpoints.wait_for_last_save();
  result.checkpoint_path = checkpoints.last_saved();
  if (writes) {
    // Each matrix product of this process's stages (under mpirun the reporting process
    // runs stage 0), timed alone now that they are idle: by the one process or thread
    // that writes the report (replica 0's), so that no other replica times at once.
    std::vector<int> local;
    for (int k = 0; k < plan.stages; ++k) {
      if (launch.size <= 1 || k == 0) local.push_back(k);
    }
    try {
      // The other ranks wait in checkpoints.finish's collective meanwhile: a quarter of its
      // deadline at most, and never more than 10 s.
      const double budget = c.pipeline.timeout_s > 0 ? std::min(10.0, c.pipeline.timeout_s / 4) : 10.0;
      report.set_gemms(measure_gemm_rates(*model, plan, local, artifacts.stage_peaks(), launch.member, budget));
    } catch (const std::exception& e) {
      spdlog::warn("the run's matrix products could not be timed ({}): the report goes without them", e.what());
    }
  }
  if (reports) result.summary = report.summary();  // stage 0 of the pipeline reports for it
  if (writes) {
    out << "\n" << report.table();
    result.report_path = write_reports(c, report, artifacts, checkpoints, *data, plan, out);
    out << "Report: " << result.report_path << std::endl;
  }
  // A stop signal in the last step (or after it) ends the run here, its reports written.
  checkpoints.finish(c.train.steps, lr.at(c.train.steps - 1), result.report_path);
  return result;
}

}  // namespace pipeline
}  // namespace gpipe
