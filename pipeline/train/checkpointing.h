// Saving and resuming a training run: periodic saves (checkpoint.every), a save on
// demand (SIGUSR1 to rank 0) and a save before a clean stop (SIGINT, SIGTERM), through
// the checkpoint store (checkpoint.h); and the resume that puts a fresh executor where a
// saved run stopped, whatever the new run's K, M, D or devices, since everything is
// saved under the model's own names.
//
// Every process of a multi-process run takes the same decisions at the same step: the
// signal flags are summed over the pipeline and the replicas after each step. Replica
// 0's ranks each write their stage's shard; rank 0 writes the index and the trainer
// state once every shard is durable. Nothing is gathered to one rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "layers/sequential.h"
#include "pipeline/checkpoint/checkpoint_writer.h"
#include "pipeline/config/config.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/plan.h"
#include "pipeline/train/launch.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

// A run that stopped cleanly on SIGINT or SIGTERM; the program exits with 128 + signal.
class RunStopped : public Error {
 public:
  RunStopped(int signal, const std::string& what) : Error(what), signal_(signal) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

class RunCheckpoints {
 public:
  // Installs the signal handlers (restored by the destructor). `transport` connects this
  // process's stages (in-process or across processes). `whole`: the unsplit model (on
  // shapes) whose layers a checkpoint's fingerprint names, for a member of a tensor
  // group (pipeline.tensor_parallel > 1, whose checkpoints are whole by name and resume
  // at any T); nullptr: `model` itself.
  RunCheckpoints(const Config& config, const Plan& plan, layers::Sequential& model, Executor& executor,
                 const Launch& launch, Transport& transport, const layers::Sequential* whole = nullptr);
  ~RunCheckpoints();
  RunCheckpoints(const RunCheckpoints&) = delete;
  RunCheckpoints& operator=(const RunCheckpoints&) = delete;

  // With checkpoint.resume: takes on the run that claim_directories recorded for the
  // folder (run.json; collective), loads the checkpoint, checks that it is intact (a
  // damaged one is named and skipped for the newest intact one before it, on every
  // process alike), that it is this run's (or, for a fork, its parent's) and that it fits
  // this model and config (run_identity, unless checkpoint.allow_changes says so), and
  // restores this process's stages. Returns the step to continue at (0 for a fresh run).
  int64_t resume();
  // The run's id: the config's (a new run's or its supervisor's), or after resume() the
  // folder's run (a fork's own new id).
  const std::string& run_id() const { return run_id_; }
  // A fork's parent ({"run_id", "step", "checkpoint"}), null otherwise; after resume().
  const nlohmann::json& parent() const { return parent_; }
  // The history the resumed checkpoint carried (ReportBuilder::history); null if none.
  const nlohmann::json& resumed_history() const { return resumed_history_; }
  // What each save stores as the run's history: called with the step count saved.
  void set_history(std::function<nlohmann::json(int64_t)> history) { history_ = std::move(history); }
  // After `done` steps (collective in a multi-process run): saves when due (every
  // checkpoint.every steps and the last step; with checkpoint.every 0, the last step of a
  // launch that resumed, so that the next --resume goes on from its end, not from the
  // checkpoint it started at), asked for by SIGUSR1, or before stopping; throws
  // RunStopped after a stop signal's save.
  void after_step(int64_t done, double lr);
  // At the end of the run: the last async save is complete and finalized.
  void wait_for_last_save();
  // After the run's `done` steps and its reports (`reports`: their path, for the
  // message); collective. RunStopped when a stop signal came in the last step (whose save
  // after_step made) or after it (saved here, if the last step was not). The run is
  // complete either way; it exits with 128 + the signal like any stopped run.
  void finish(int64_t done, double lr, const std::string& reports);
  const std::string& last_saved() const { return last_saved_; }

 private:
  nlohmann::json trainer_state(int64_t done, double lr) const;
  // Loads the first of `candidates` that is intact on every process; CheckpointDamaged
  // (naming each one tried) when none is.
  LoadedCheckpoint load_first_intact(const std::vector<CheckpointRef>& candidates, const LoadFilter& filter);
  void check_same_run(const LoadedCheckpoint& loaded) const;
  // Saves after `done` steps; a UserError (a full disk, another run's step in the way)
  // says the command that continues the run once it is fixed.
  void save(int64_t done, double lr);
  void write_checkpoint(int64_t done, double lr);
  void finalize_pending();
  double sum_over_job(double value);

  const Config& config_;
  const Plan& plan_;
  layers::Sequential& model_;
  const layers::Sequential& whole_;  // what the fingerprint names
  Executor& executor_;
  const Launch& launch_;
  Transport& transport_;
  CheckpointStore store_;
  std::unique_ptr<AsyncCheckpointWriter> writer_;
  bool multi_ = false, writes_ = false, finalizes_ = false;
  int64_t pending_ = -1;  // an async multi-process save whose shards may still be writing
  int stopped_by_ = 0;    // the stop signal every process agreed on in the last step
  int64_t saved_step_ = -1;
  nlohmann::json pending_state_;
  std::string last_saved_;
  std::string run_id_;
  nlohmann::json parent_;
  nlohmann::json resumed_history_;
  bool resumed_ = false;  // this launch continues from a checkpoint: it saves its last step too
  std::function<nlohmann::json(int64_t)> history_;
};

// The layers' descriptions, stored with a checkpoint so that another model's
// checkpoint is refused by name.
nlohmann::json model_fingerprint(const layers::Sequential& model);

}  // namespace pipeline
}  // namespace gpipe
