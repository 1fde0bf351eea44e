// One run per output directory: what makes a run itself (its id, the config fields that
// decide its result), the lock that keeps a second run out of its directories, what a
// fresh run finds of an earlier one there (refused, or moved aside with --start-over),
// and the room its checkpoints need, checked before the first step. The trainer calls
// these before it trains (see trainer.cc); the supervisor takes the lock for its whole job.
//
//   <output.dir>/.gpipe.lock        flock'ed by the running job; says its pid, run and start
//   <output.dir>/previous/<run>/    an earlier run moved aside by --start-over
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pipeline/config/config.h"

namespace gpipe {
namespace pipeline {

// A new run's id: its UTC start time and 32 random bits, "20261125-183012-5f3a9c1e".
std::string new_run_id();

// The fields whose change makes a resumed run a different run: model.seed and
// model.dtype, every data field, the optimizer (type, lr, momentum, betas, eps, weight
// decay, the lr schedule's kind and floor, clipping), train.seed and train.batch_size.
// The layers themselves are compared by model_fingerprint (checkpointing.h). What may
// change: train.steps and the warm-up (the lr schedule's length), logging and
// evaluation, the pipeline (K, M, schedule, recompute, devices, replicas), output and
// checkpoint settings.
nlohmann::json run_identity(const Config& config);
// The keys whose values differ between a saved identity and this run's, as
// "optimizer.lr: 0.003 -> 0.01", leaving out those `allowed` lists ("all": every one).
std::vector<std::string> identity_changes(const nlohmann::json& saved, const nlohmann::json& now,
                                          const std::vector<std::string>& allowed);

// An exclusive advisory lock (flock) on <dir>/.gpipe.lock for each directory, held for
// the object's life; the kernel releases it when the process dies, so a lock file left
// by a dead process is simply taken over. A directory locked by a live process is a
// UserError naming its pid, run, start time and command, unless that holder is this
// run's own supervisor (same run id), which holds it for the job's every launch.
class DirectoryLock {
 public:
  DirectoryLock(const std::vector<std::string>& dirs, const std::string& run_id);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  std::vector<int> fds_;
};

// The directories a run writes to and must hold: output.dir, and checkpoint.dir when it
// lies outside output.dir.
std::vector<std::string> run_directories(const Config& config);

// What an earlier run left where a fresh run would write: its checkpoints (step-*,
// latest) and its reports (report.json, report.html, trace.json).
struct PriorRun {
  std::string run_id;                     // from its newest checkpoint or its report; "" if unknown
  std::vector<std::string> reports;       // in output.dir
  std::vector<std::string> checkpoints;   // in the checkpoint folder: step-* and latest
  std::vector<std::string> found() const;  // both
};
std::optional<PriorRun> find_prior_run(const Config& config);
// Moves what `prior` found to <output.dir>/previous/<its run id, or "run-N">/ (the
// checkpoints into its checkpoints/); returns that folder. UserError if it cannot (e.g.
// checkpoint.dir on another file system).
std::string move_prior_run_aside(const Config& config, const PriorRun& prior);
// A fresh run (no resume) in directories that hold another run's files: refused with
// the choices (--resume when there are checkpoints, another output.dir, --start-over),
// or with --start-over moved aside. A resume (checkpoint.resume: auto) of a directory
// whose run left reports but no checkpoint is refused too: it would start from step 0
// and overwrite them. Call with the lock held.
void claim_directories(const Config& config);

// Before the first step: the checkpoint folder can be created and written, and its file
// system has room for one more checkpoint of `checkpoint_bytes` (the older ones stay until
// it is complete). UserError naming the path, the bytes needed and the bytes free.
void check_checkpoint_room(const std::string& dir, int64_t checkpoint_bytes);

// The current shell-quoted form of a word for a command a user may paste.
std::string shell_quote(const std::string& word);

}  // namespace pipeline
}  // namespace gpipe
