#include "pipeline/checkpointing.h"

#include <cmath>
#include <csignal>
#include <cstring>
#include <set>

#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// What the signal handlers saw; read after each step.
volatile std::sig_atomic_t g_save_requested = 0;
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_save_signal(int) { g_save_requested = 1; }

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {  // a second one: stop at once
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
}

struct sigaction install(int sig, void (*handler)(int)) {
  struct sigaction now {}, before {};
  now.sa_handler = handler;
  sigemptyset(&now.sa_mask);
  now.sa_flags = SA_RESTART;
  sigaction(sig, &now, &before);
  return before;
}

struct sigaction g_before[3];
constexpr int kSignals[3] = {SIGUSR1, SIGINT, SIGTERM};

}  // namespace

nlohmann::json model_fingerprint(const layers::Sequential& model) {
  nlohmann::json layers = nlohmann::json::array();
  for (int i = 0; i < model.size(); ++i) layers.push_back(model.layer(i).describe());
  return {{"layers", layers}, {"input", shape_str(model.input_shape())}, {"dtype", dtype_name(model.dtype())}};
}

RunCheckpoints::RunCheckpoints(const Config& config, const Plan& plan, layers::Sequential& model, Executor& executor,
                               const Launch& launch, Transport& transport)
    : config_(config), plan_(plan), model_(model), executor_(executor), launch_(launch), transport_(transport),
      store_(checkpoint_dir(config), config.checkpoint.keep) {
  multi_ = launch.size > 1;
  writes_ = launch.replica == 0;                // replica 0 writes the shards of its stages
  finalizes_ = writes_ && launch.rank == 0;     // its rank 0 the index and the trainer state
  if (config.checkpoint.async) writer_ = std::make_unique<AsyncCheckpointWriter>(store_);
  g_save_requested = 0;
  g_stop_signal = 0;
  for (int i = 0; i < 3; ++i) g_before[i] = install(kSignals[i], i == 0 ? on_save_signal : on_stop_signal);
}

RunCheckpoints::~RunCheckpoints() {
  for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &g_before[i], nullptr);
}

double RunCheckpoints::sum_over_job(double value) {
  if (!multi_) return value;
  value = transport_.all_reduce_sum(launch_.rank, value);
  if (launch_.replicas != nullptr && launch_.replicas->size() > 1) value = launch_.replicas->all_reduce_sum(value);
  return value;
}

nlohmann::json RunCheckpoints::trainer_state(int64_t done, double lr) const {
  return {{"step", done},
          {"next_step", done},
          {"learning_rate", lr},
          {"model", model_fingerprint(model_)},
          {"optimizer", config_.optimizer.optimizer.type},
          {"saved_with", {{"partitions", plan_.stages},
                          {"virtual_stages", plan_.virtual_stages},
                          {"micro_batches", plan_.micro_batches},
                          {"replicas", plan_.replicas},
                          {"schedule", plan_.schedule.name}}},
          // Every random stream is a function of these and of the step: the batches of
          // step s (train.seed, data.seed) and dropout's masks (model.seed, s, sample).
          {"rng", {{"train_seed", config_.train.seed}, {"data_seed", config_.data.seed},
                   {"model_seed", config_.model.seed}}},
          {"config", config_.source}};
}

void RunCheckpoints::save(int64_t done, double lr) {
  const int K = plan_.stages;
  std::vector<ShardTensors> shards;
  if (writes_) {
    for (int k = 0; k < K; ++k) {
      if (multi_ && k != launch_.rank) continue;
      StageState s = executor_.save_state(k);  // host copies
      shards.push_back({std::move(s.model), std::move(s.optimizer)});
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
  // Every N steps, and at the end of the run.
  const bool due = config_.checkpoint.every > 0 &&
                   (done % config_.checkpoint.every == 0 || done == config_.train.steps);
  if (due || asked || stop) save(done, lr);
  if (stop) {
    finish();
    const int sig = g_stop_signal != 0 ? static_cast<int>(g_stop_signal) : SIGTERM;
    throw RunStopped(sig, std::string("stopped by ") + (sig == SIGINT ? "SIGINT" : "SIGTERM") + " after step " +
                              std::to_string(done) + "; saved " + last_saved_ + "; continue with --resume");
  }
}

void RunCheckpoints::finish() {
  if (multi_) {
    finalize_pending();
  } else if (writer_) {
    writer_->wait();
  }
  if (writer_ && !multi_ && last_saved_.empty()) {
    if (auto ref = find_latest_complete(store_.dir())) last_saved_ = ref->path;
  }
}

int64_t RunCheckpoints::resume() {
  const std::string& want = config_.checkpoint.resume;
  if (want.empty()) return 0;
  std::string path = want;
  if (want == "auto") {
    const auto ref = find_latest_complete(store_.dir());
    if (!ref) {
      spdlog::info("no complete checkpoint in {}: starting from step 0", store_.dir());
      return 0;
    }
    path = ref->path;
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
  LoadedCheckpoint loaded = load_checkpoint(path, filter);
  const nlohmann::json& state = loaded.trainer_state;
  const nlohmann::json want_model = model_fingerprint(model_);
  if (!state.contains("model") || state["model"] != want_model) {
    std::string why = "its model differs";
    if (state.contains("model") && state["model"].contains("layers")) {
      const auto& theirs = state["model"]["layers"];
      const auto& ours = want_model["layers"];
      for (size_t i = 0; i < std::max(theirs.size(), ours.size()); ++i) {
        const std::string a = i < theirs.size() ? theirs[i].get<std::string>() : "(none)";
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
  std::map<std::string, Tensor> model(loaded.model.begin(), loaded.model.end());
  std::map<std::string, Tensor> optimizer(loaded.optimizer.begin(), loaded.optimizer.end());
  for (int k = 0; k < plan_.stages; ++k) {
    if (multi_ && k != launch_.rank) continue;
    executor_.restore_state(k, model, optimizer);
  }
  executor_.set_step(static_cast<uint64_t>(loaded.step));
  spdlog::info("resumed from {} at step {}", loaded.path, loaded.step);
  return loaded.step;
}

}  // namespace pipeline
}  // namespace gpipe
