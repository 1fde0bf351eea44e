#include "pipeline/train/checkpointing.h"

#include <fcntl.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <mutex>
#include <set>

#include "pipeline/train/run_directory.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// What the signal handlers saw; read after each step.
volatile std::sig_atomic_t g_save_requested = 0;
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_save_signal(int) { g_save_requested = 1; }

// Set in a multi-process run.
volatile std::sig_atomic_t g_under_mpi = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {  // a second one: stop at once
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
  // mpirun, once signalled itself (SIGTERM reaches the ranks only after its
  // odls_base_sigkill_timeout), no longer reads the ranks' output: a rank blocked writing
  // to a full pipe would never reach its save. Non-blocking, such a write fails and the
  // rank goes on to save; what it prints from here on may be lost, its checkpoint is not.
  if (g_under_mpi && sig != SIGUSR2) {
    for (int fd : {1, 2}) {
      const int flags = ::fcntl(fd, F_GETFL);
      if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    }
  }
}

struct sigaction install(int sig, void (*handler)(int)) {
  struct sigaction now {}, before {};
  now.sa_handler = handler;
  sigemptyset(&now.sa_mask);
  now.sa_flags = SA_RESTART;
  sigaction(sig, &now, &before);
  return before;
}

// SIGUSR2 stops like SIGTERM: it is what `gpipe run` sends mpirun, which forwards it to
// every rank and, unlike SIGINT and SIGTERM, does not kill them a second later.
constexpr int kSignals[] = {SIGUSR1, SIGINT, SIGTERM, SIGUSR2};
constexpr int kNumSignals = sizeof kSignals / sizeof kSignals[0];
struct sigaction g_before[kNumSignals];
// The RunCheckpoints alive in this process (several: a job's ranks as threads, each its
// own): the first installs the handlers, the last puts the ones before back.
std::mutex g_signals_mu;
int g_signal_users = 0;

const char* signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGUSR2 ? "SIGUSR2 (a stop request)" : sig == SIGTERM ? "SIGTERM" : "a signal";
}

}  // namespace

nlohmann::json model_fingerprint(const layers::Sequential& model) {
  nlohmann::json layers = nlohmann::json::array();
  for (int i = 0; i < model.size(); ++i) layers.push_back(model.layer(i).describe());
  // The dtype of what the checkpoint holds: a bf16 or fp16 model's float32 master weights
  // (its precision, a setting of the run, is in run_identity and "precision").
  return {{"layers", layers}, {"input", shape_str(model.input_shape())}, {"dtype", dtype_name(master_dtype(model.dtype()))}};
}

RunCheckpoints::RunCheckpoints(const Config& config, const Plan& plan, layers::Sequential& model, Executor& executor,
                               const Launch& launch, Transport& transport, const layers::Sequential* whole)
    : config_(config), plan_(plan), model_(model), whole_(whole != nullptr ? *whole : model), executor_(executor),
      launch_(launch), transport_(transport),
      store_(checkpoint_dir(config), config.checkpoint.keep, config.run.id), run_id_(config.run.id) {
  // Several processes: stages (K > 1), or replicas or tensor-group members of a
  // one-stage pipeline (K = 1 x T x D).
  multi_ = launch.size > 1 || launch.replica_count() > 1 || launch.tensor > 1;
  // Replica 0 writes the shards of its stages (member 0 of each stage's tensor group:
  // every member gathers its blocks into the whole tensors, Executor::save_state).
  writes_ = launch.replica == 0 && launch.member == 0;
  finalizes_ = writes_ && launch.rank == 0;     // its rank 0 the index and the trainer state
  if (config.checkpoint.async) writer_ = std::make_unique<AsyncCheckpointWriter>(store_);
  std::lock_guard<std::mutex> lock(g_signals_mu);
  g_under_mpi = multi_ && !launch.threads;  // mpirun's ranks, not threads standing for them
  if (g_signal_users++ > 0) return;
  g_save_requested = 0;
  g_stop_signal = 0;
  for (int i = 0; i < kNumSignals; ++i) g_before[i] = install(kSignals[i], i == 0 ? on_save_signal : on_stop_signal);
}

RunCheckpoints::~RunCheckpoints() {
  std::lock_guard<std::mutex> lock(g_signals_mu);
  if (--g_signal_users > 0) return;
  for (int i = 0; i < kNumSignals; ++i) {
    // A stop request (gpipe run's SIGUSR2 through mpirun) that comes while a finished run
    // exits must not kill it by SIGUSR2's default action: its work is done and written.
    if (kSignals[i] == SIGUSR2 && g_before[i].sa_handler == SIG_DFL) {
      std::signal(SIGUSR2, SIG_IGN);
      continue;
    }
    sigaction(kSignals[i], &g_before[i], nullptr);
  }
}

double RunCheckpoints::sum_over_job(double value) {
  if (!multi_) return value;
  value = transport_.all_reduce_sum(launch_.rank, value);
  if (launch_.replicas != nullptr && launch_.replicas->size() > 1) value = launch_.replicas->all_reduce_sum(value);
  if (launch_.tensor > 1) value = launch_.tensor_group->all_reduce_sum(value);
  return value;
}

nlohmann::json RunCheckpoints::trainer_state(int64_t done, double lr) const {
  return {{"step", done},
          {"next_step", done},
          {"learning_rate", lr},
          {"model", model_fingerprint(whole_)},
          {"optimizer", config_.optimizer.optimizer.type},
          // The training precision: the tensors are float32 (master weights) for float32
          // and bf16 alike, so either resumes the other (with checkpoint.allow_changes).
          {"precision", dtype_name(model_.dtype())},
          {"saved_with", {{"partitions", plan_.stages},
                          {"virtual_stages", plan_.virtual_stages},
                          {"micro_batches", plan_.micro_batches()},
                          {"replicas", plan_.replicas},
                          {"tensor_parallel", plan_.tensor_parallel},
                          {"sequence_parallel", plan_.sequence_parallel},
                          {"schedule", plan_.schedule.name}}},
          // Every random stream is a function of these and of the step: the batches of
          // step s (train.seed, data.seed) and dropout's masks (model.seed, s, sample).
          {"rng", {{"train_seed", config_.train.seed}, {"data_seed", config_.data.seed},
                   {"model_seed", config_.model.seed}}},
          {"config", config_.source},
          // The run as configured (YAML after --set) and the fields a resume compares.
          {"effective_config", config_.effective},
          {"identity", run_identity(config_)},
          // fp16's dynamic loss scale, to go on from (0 and 0 without loss scaling).
          {"loss_scale", {{"scale", executor_.loss_scale()}, {"clean_steps", executor_.clean_steps()}}},
          {"history", history_ ? history_(done) : nlohmann::json()},
          // A fork: the run and step it went on from (null for a run of its own).
          {"parent", parent_}};
}

void RunCheckpoints::save(int64_t done, double lr) {
  try {
    write_checkpoint(done, lr);
  } catch (const CheckpointDamaged&) {
    throw;
  } catch (const UserError& e) {  // a full disk, another run's step in the way: what to run once it is fixed
    const std::string& again = config_.run.resume_command;
    if (again.empty()) throw;
    throw UserError(std::string(e.what()) + "; then continue this run with: " + again);
  }
}

void RunCheckpoints::write_checkpoint(int64_t done, double lr) {
  saved_step_ = done;
  const int K = plan_.stages;
  std::vector<ShardTensors> shards;
  // Sharded optimizer state: every replica takes part in the save (its slots are
  // gathered whole), replica 0 writes; so does every member of a tensor group (its
  // blocks are joined whole), member 0 writes.
  if (writes_ || plan_.shard_optimizer || plan_.tensor_parallel > 1) {
    for (int k = 0; k < K; ++k) {
      if (multi_ && k != launch_.rank) continue;
      StageState s = executor_.save_state(k);  // host copies
      if (writes_) shards.push_back({std::move(s.model), std::move(s.optimizer)});
    }
  }
  const nlohmann::json state = trainer_state(done, lr);
  std::vector<ShardNames> names;
  for (int k = 0; k < K; ++k) {
    const StageStateNames n = executor_.state_names(k);
    names.push_back({n.model, n.optimizer});
  }
  if (!multi_) {
    if (writer_) {
      writer_->save(done, std::move(shards), state);
    } else {
      store_.save(done, shards, state);
      last_saved_ = store_.step_path(done);
      spdlog::info("saved checkpoint {}", last_saved_);
    }
    return;
  }
  if (writer_) {
    finalize_pending();  // one save at a time
    if (writes_) writer_->save_shard(done, launch_.rank, K, std::move(shards.front()));
    pending_ = done;
    pending_state_ = state;
    return;
  }
  if (writes_) store_.write_shard(done, launch_.rank, K, shards.front().model, shards.front().optimizer);
  sum_over_job(0.0);  // every shard is durable
  if (finalizes_) store_.finalize(done, K, names, state);
  sum_over_job(0.0);  // the checkpoint is complete before anyone goes on
  last_saved_ = store_.step_path(done);
  if (finalizes_) spdlog::info("saved checkpoint {}", last_saved_);
}

// A multi-process async save is finalized once every writer has finished.
void RunCheckpoints::finalize_pending() {
  if (pending_ < 0) return;
  if (writer_) writer_->wait();
  sum_over_job(0.0);
  if (finalizes_) {
    std::vector<ShardNames> names;
    for (int k = 0; k < plan_.stages; ++k) {
      const StageStateNames n = executor_.state_names(k);
      names.push_back({n.model, n.optimizer});
    }
    store_.finalize(pending_, plan_.stages, names, pending_state_);
    spdlog::info("saved checkpoint {}", store_.step_path(pending_));
  }
  sum_over_job(0.0);
  last_saved_ = store_.step_path(pending_);
  pending_ = -1;
}

void RunCheckpoints::after_step(int64_t done, double lr) {
  // The flags of every process, in one sum: stop signals count 1e6, save requests 1e3,
  // writers still busy with an async save 1.
  const bool busy = pending_ >= 0 && writer_ && !writer_->idle();
  const double flags = sum_over_job((g_stop_signal != 0 ? 1e6 : 0.0) + (g_save_requested != 0 ? 1e3 : 0.0) +
                                    (busy ? 1.0 : 0.0));
  g_save_requested = 0;
  const bool stop = flags >= 1e6;
  const bool asked = std::fmod(flags, 1e6) >= 1e3;
  if (pending_ >= 0 && std::fmod(flags, 1e3) == 0) finalize_pending();  // every writer is done
  // Every N steps, and at the end of the run; without N, at the end of a resumed launch
  // (a run that has checkpoints: its next --resume must not train these steps again).
  const bool due = (config_.checkpoint.every > 0 &&
                    (done % config_.checkpoint.every == 0 || done == config_.train.steps)) ||
                   (resumed_ && done == config_.train.steps);
  if (due || asked || stop) save(done, lr);
  if (stop) {
    wait_for_last_save();
    stopped_by_ = g_stop_signal != 0 ? static_cast<int>(g_stop_signal) : SIGTERM;
    // In the last step the run is complete: it goes on to its validation and reports,
    // and stops after them (finish).
    if (done >= config_.train.steps) return;
    const std::string& again = config_.run.resume_command;
    throw RunStopped(stopped_by_, std::string("stopped by ") + signal_name(stopped_by_) + " after step " +
                                      std::to_string(done) + "; saved " + last_saved_ +
                                      (!again.empty()             ? "; continue it with: " + again
                                       : config_.run.id_given ? std::string()  // its supervisor says how
                                                              : std::string("; continue it with checkpoint.resume: auto")));
  }
}

void RunCheckpoints::finish(int64_t done, double lr, const std::string& reports) {
  // A stop signal after the last step's flags were summed (during the validation, the
  // last save or the reports): the run is complete; it saves its last step if it has not,
  // so that its continue command finds it, and stops like any stopped run.
  if (stopped_by_ == 0 && sum_over_job(g_stop_signal != 0 ? 1.0 : 0.0) > 0) {
    stopped_by_ = g_stop_signal != 0 ? static_cast<int>(g_stop_signal) : SIGTERM;
    if (saved_step_ != done) save(done, lr);
    wait_for_last_save();
  }
  if (stopped_by_ == 0) return;
  const std::string& again = config_.run.resume_command;
  throw RunStopped(stopped_by_, std::string("stopped by ") + signal_name(stopped_by_) +
                                    " at the end of the run: its " + std::to_string(done) +
                                    " steps are done; saved " + last_saved_ +
                                    (reports.empty() ? "" : "; its report: " + reports) +
                                    (again.empty() ? "" : "; continue it with: " + again +
                                                              " (it trains on once train.steps is raised)"));
}

void RunCheckpoints::wait_for_last_save() {
  if (multi_) {
    finalize_pending();
  } else if (writer_) {
    writer_->wait();
  }
  if (writer_ && !multi_ && last_saved_.empty()) {
    if (auto ref = find_latest_complete(store_.dir())) last_saved_ = ref->path;
  }
}

LoadedCheckpoint RunCheckpoints::load_first_intact(const std::vector<CheckpointRef>& candidates,
                                                  const LoadFilter& filter) {
  std::string tried;
  for (const CheckpointRef& c : candidates) {
    LoadedCheckpoint loaded;
    std::string problem;
    try {
      loaded = load_checkpoint(c.path, filter);
    } catch (const CheckpointDamaged& e) {
      problem = e.what();
    }
    // Every process reads its own stages' tensors: all of them must find theirs intact.
    const double damaged = sum_over_job(problem.empty() ? 0.0 : 1.0);
    if (damaged == 0) {
      if (!tried.empty()) {
        spdlog::warn("resuming from {}, the newest intact checkpoint (the newer ones above are damaged)", loaded.path);
      }
      return loaded;
    }
    if (problem.empty()) problem = "a shard another process reads is damaged (see its message)";
    spdlog::warn("checkpoint {} cannot be used: {}; trying an older one", c.path, problem);
    tried += (tried.empty() ? "" : "; ") + c.path + ": " + problem;
  }
  throw CheckpointDamaged("no intact checkpoint to resume from (" + tried +
                          "). Resume from a copy you trust (checkpoint.resume=PATH), or start afresh with --start-over");
}

// A checkpoint of another run, or one whose config decides another result, is refused.
void RunCheckpoints::check_same_run(const LoadedCheckpoint& loaded) const {
  const nlohmann::json& state = loaded.trainer_state;
  // This run's own checkpoint, or a fork's parent (claim_directories allowed it).
  const std::string theirs = state.value("run_id", std::string());
  const bool parent = parent_.is_object() && parent_.value("run_id", std::string()) == theirs &&
                      parent_.value("step", int64_t{-1}) == loaded.step;
  if (!theirs.empty() && theirs != run_id_ && !parent) {
    throw UserError("checkpoint " + loaded.path + " belongs to run " + theirs + ", not to this run " + run_id_ +
                    ": a run resumes only its own checkpoints. Continue that run in its own output.dir with "
                    "--resume, or fork it into a fresh one (--set checkpoint.resume=" + loaded.path +
                    " --set output.dir=<a new folder>)");
  }
  const nlohmann::json want_model = model_fingerprint(whole_);
  if (!state.contains("model") || state["model"] != want_model) {
    std::string why = "its model differs";
    if (state.contains("model") && state["model"].contains("layers")) {
      const auto& saved = state["model"]["layers"];
      const auto& ours = want_model["layers"];
      for (size_t i = 0; i < std::max(saved.size(), ours.size()); ++i) {
        const std::string a = i < saved.size() ? saved[i].get<std::string>() : "(none)";
        const std::string b = i < ours.size() ? ours[i].get<std::string>() : "(none)";
        if (a != b) {
          why = "its layer " + std::to_string(i) + " is " + a + " but this model's is " + b;
          break;
        }
      }
    }
    throw UserError("checkpoint " + loaded.path + " was saved from another model: " + why +
                    "; resume with the config it was saved with, or point checkpoint.dir elsewhere");
  }
  if (state.value("optimizer", std::string()) != config_.optimizer.optimizer.type) {
    throw UserError("checkpoint " + loaded.path + " holds the state of optimizer " +
                    state.value("optimizer", std::string("?")) + " but optimizer.type is " +
                    config_.optimizer.optimizer.type + "; resume with the optimizer it was saved with");
  }
  if (state.contains("identity") && state["identity"].is_object()) {
    const auto changes = identity_changes(state["identity"], run_identity(config_), config_.checkpoint.allow_changes);
    if (!changes.empty()) {
      std::string list, keys;
      for (const auto& ch : changes) {
        list += (list.empty() ? "" : "; ") + ch;
        keys += (keys.empty() ? "" : ",") + ch.substr(0, ch.find(':'));
      }
      throw UserError("resuming " + loaded.path + " with a config that makes it another run: " + list +
                      ". Resume with the values it was saved with (its config is in trainer_state.json), or say the "
                      "change is meant: --set checkpoint.allow_changes=[" + keys + "]");
    }
  }
}

namespace {

// This run's complete checkpoints, newest first: the one `latest` names (or the newest),
// then the older ones; another run's are never among them.
std::vector<CheckpointRef> own_checkpoints(const std::string& dir, const std::string& run_id) {
  std::vector<CheckpointRef> out;
  const auto first = find_latest_complete(dir);
  if (!first) return out;
  if (belongs_to_run(first->path, run_id)) out.push_back(*first);
  const CheckpointListing listing = list_checkpoints(dir);
  for (auto it = listing.complete.rbegin(); it != listing.complete.rend(); ++it) {
    if (it->step < first->step && belongs_to_run(it->path, run_id)) out.push_back(*it);
  }
  return out;
}

}  // namespace

int64_t RunCheckpoints::resume() {
  const std::string& want = config_.checkpoint.resume;
  if (want.empty()) return 0;
  // The job's first process has claimed the folder (claim_directories): whose run this
  // is, and a fork's parent, are in its run.json from here on.
  sum_over_job(0.0);
  const ClaimedRun claimed = claimed_run(config_);
  parent_ = claimed.parent;
  if (claimed.run_id != run_id_) {  // saves from here on belong to the run it continues
    run_id_ = claimed.run_id;
    store_ = CheckpointStore(store_.dir(), store_.keep(), run_id_);
    if (writer_) writer_ = std::make_unique<AsyncCheckpointWriter>(store_);
  }
  std::vector<CheckpointRef> candidates = own_checkpoints(store_.dir(), run_id_);
  // checkpoint.resume=PATH: that checkpoint, unless PATH is the fork's parent, whose own
  // checkpoints (once it has saved some) come first, as with auto.
  if (want != "auto" && !names_fork_parent(parent_, want)) candidates = {{-1, resume_step_dir(want)}};
  // A fork that has saved nothing of its own yet goes on from its parent.
  if (candidates.empty() && parent_.is_object() && parent_.value("checkpoint", std::string()) != "") {
    candidates = {{-1, parent_.value("checkpoint", std::string())}};
  }
  if (candidates.empty()) {
    spdlog::info("no complete checkpoint in {} (of run {}): starting from step 0", store_.dir(), run_id_);
    return 0;
  }
  // This process reads what its stages restore: their parameters, buffers and
  // optimizer state, a tied copy from its owner's name.
  std::set<std::string> model_names, optimizer_names;
  for (int k = 0; k < plan_.stages; ++k) {
    if (multi_ && k != launch_.rank) continue;
    const StageStateNames n = executor_.state_names(k);
    model_names.insert(n.model_needed.begin(), n.model_needed.end());
    optimizer_names.insert(n.optimizer_needed.begin(), n.optimizer_needed.end());
  }
  LoadFilter filter;
  filter.model = [&](const std::string& n) { return model_names.count(n) > 0; };
  filter.optimizer = [&](const std::string& n) { return optimizer_names.count(n) > 0; };
  LoadedCheckpoint loaded = load_first_intact(candidates, filter);
  check_same_run(loaded);
  const nlohmann::json& state = loaded.trainer_state;
  if (state.contains("history")) resumed_history_ = state["history"];
  std::map<std::string, Tensor> model(loaded.model.begin(), loaded.model.end());
  std::map<std::string, Tensor> optimizer(loaded.optimizer.begin(), loaded.optimizer.end());
  for (int k = 0; k < plan_.stages; ++k) {
    if (multi_ && k != launch_.rank) continue;
    executor_.restore_state(k, model, optimizer);
  }
  executor_.set_step(static_cast<uint64_t>(loaded.step));
  // fp16's loss scale goes on where it was (a checkpoint of another precision saved 0:
  // the scale starts from optimizer.loss_scale).
  if (state.contains("loss_scale") && state["loss_scale"].is_object()) {
    const auto& ls = state["loss_scale"];
    if (!ls.contains("scale") || !ls["scale"].is_number() || !ls.contains("clean_steps") ||
        !ls["clean_steps"].is_number_integer()) {
      throw CheckpointDamaged("checkpoint " + loaded.path + ": trainer_state.json's loss_scale is malformed (" +
                              ls.dump() + "); resume from another checkpoint, or remove loss_scale to start the scale afresh");
    }
    executor_.set_loss_scale(ls["scale"].get<double>(), ls["clean_steps"].get<int>());
  }
  spdlog::info("resumed from {} after step {} (run {})", loaded.path, loaded.step, run_id_.empty() ? "?" : run_id_);
  resumed_ = true;
  return loaded.step;
}

}  // namespace pipeline
}  // namespace gpipe
