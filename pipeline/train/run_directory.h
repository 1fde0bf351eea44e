// One run per output directory: what makes a run itself (its id, the config fields that
// decide its result), which run a folder belongs to, the lock that keeps a second run out
// of its directories, what a run finds of another there (refused, moved aside with
// --start-over, or forked from into a fresh folder), and the room its checkpoints need,
// checked before the first step. The trainer calls these before it trains (see
// trainer.cc); the supervisor takes the lock for its whole job.
//
//   <output.dir>/run.json           the run the folder belongs to (a fork: and its parent)
//   <checkpoint.dir>/run.json       the same, where checkpoint.dir lies outside output.dir
//   <dir>/.gpipe.lock               in each: flock'ed by the running job; its pid, run and start
//   <output.dir>/previous/<run>/    an earlier run moved aside by --start-over
//
// A run owns its checkpoints: every step directory it resumes, keeps or deletes carries its
// run id (checkpoint_run_id). A step of another run found in its checkpoint folder is never
// resumed, deleted or overwritten: the run is refused, naming it. Resuming another run's
// checkpoint (checkpoint.resume=PATH) is a fork: allowed only into a fresh output.dir, as a
// new run that records its parent (run.json, trainer_state.json, report.json).
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
// checkpoint settings. Its keys are identity_keys() (config.h), which checkpoint.allow_changes
// is checked against; run_directory_test keeps the two equal.
nlohmann::json run_identity(const Config& config);
// The keys whose values differ between a saved identity and this run's, as
// "optimizer.lr: 0.003 -> 0.01", leaving out those `allowed` lists ("all": every one).
std::vector<std::string> identity_changes(const nlohmann::json& saved, const nlohmann::json& now,
                                          const std::vector<std::string>& allowed);

// The record of the run a folder belongs to: <dir>/run.json.
//   {"run_id": "...", "created": "2026-11-28 08:00:00 UTC",
//    "parent": {"run_id": "...", "step": 30, "checkpoint": "/abs/path/step-30"}}  (a fork only)
constexpr const char* kRunRecordFile = "run.json";
struct RunRecord {
  std::string run_id;
  nlohmann::json parent;  // null, or what a fork continued from: run_id, step, checkpoint
};
// nullopt when `dir` has none; UserError naming the file when it is not a record.
std::optional<RunRecord> read_run_record(const std::string& dir);

// The run output.dir belongs to: its run.json's, or for a folder written before run.json
// existed, its report.json's, else its oldest checkpoint's; "" when it holds nothing of a run.
std::string folder_run_id(const Config& config);

// What a launch of `train` continues or starts, decided once by claim_directories on the
// job's first process and recorded in run.json, which every process reads back.
struct ClaimedRun {
  std::string run_id;
  nlohmann::json parent;  // a fork's (RunRecord::parent); null otherwise
  // The run.json files claim_directories wrote where there were none: a launch that fails
  // before its first step removes them, so that a refused run leaves no claim behind.
  std::vector<std::string> created_records;
};

// An exclusive advisory lock (flock) on <dir>/.gpipe.lock for each directory, held for
// the object's life; the kernel releases it when the process dies, so a lock file left
// by a dead process is simply taken over. A directory locked by a live process is a
// UserError naming its pid, run, start time and command, unless that holder is this
// run's own supervisor (a `supervisor` lock of the same run id, which holds it for the
// job's every launch) and this is not a supervisor itself.
//
// A launch that is refused leaves nothing behind: the constructor, when it throws, and
// abandon(), for a launch that fails before its first step, remove the lock files and
// the directories it created and put back the holder a lock file it found held (the last
// run's pid, run and command). A lock file is unlinked while still locked; a process
// that opened it before and locks it after finds that its file no longer has that name
// (fstat against stat) and locks the file the name holds then.
class DirectoryLock {
 public:
  DirectoryLock(const std::vector<std::string>& dirs, const std::string& run_id, bool supervisor = false);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  // Releases the locks as the destructor does, and first undoes what the constructor
  // wrote: its lock files and directories, removed (a directory only while empty), and
  // the earlier holder's text written back into a lock file that existed.
  void abandon() noexcept;

 private:
  struct Held {
    int fd = -1;
    std::string path;      // <dir>/.gpipe.lock
    bool created = false;  // the lock file did not exist before
    std::string previous;  // its holder text before this lock wrote its own
  };
  std::vector<Held> held_;
  std::vector<std::string> created_dirs_;  // the directories it created
};

// The directories a run writes to and must hold, each locked: output.dir and
// checkpoint.dir (also when it lies inside output.dir, so that another run given it as its
// checkpoint.dir is kept out), in the order of their absolute paths.
std::vector<std::string> run_directories(const Config& config);

// What an earlier run left where a fresh run would write: its checkpoints (step-*,
// latest) and its reports (report.json, report.html, trace.json).
struct PriorRun {
  std::string run_id;                     // folder_run_id; "" if unknown
  std::vector<std::string> reports;       // in output.dir
  std::vector<std::string> checkpoints;   // in the checkpoint folder: step-* and latest
  std::vector<std::string> records;       // run.json of output.dir and checkpoint.dir
  std::vector<std::string> found() const;  // reports and checkpoints
};
std::optional<PriorRun> find_prior_run(const Config& config);
// Moves what `prior` found to <output.dir>/previous/<its run id, or "run-N">/ (the
// checkpoints into its checkpoints/); returns that folder. UserError if it cannot (e.g.
// checkpoint.dir on another file system).
std::string move_prior_run_aside(const Config& config, const PriorRun& prior);
// Decides whose run this launch is and records it in run.json (call with the lock held):
//  - a fresh run (no checkpoint.resume) in directories that hold another run's files is
//    refused with the choices (--resume when there are checkpoints, another output.dir,
//    --start-over), or with --start-over that run is moved aside (only its own files);
//  - a resume (checkpoint.resume: auto) continues the folder's run; refused where its
//    run left reports but no checkpoint (it would start from step 0 and overwrite them);
//  - checkpoint.resume=PATH of the folder's own run continues it; of another run, it is a
//    fork: into a fresh output.dir only, as config.run.id with PATH's run and step as its
//    parent (and a fork resumed with the same PATH continues the fork);
//  - a step directory of another run in the checkpoint folder, a checkpoint.dir that is
//    another run's folder or lies inside one, and (with a run id given by gpipe run) a
//    folder of another run are refused, naming that run and what to do.
// With `record` false nothing is written or moved (gpipe run's check before its first
// launch, which claims for itself); --start-over is then not looked at.
ClaimedRun claim_directories(const Config& config, bool record = true);


// The run every process of a launch continues, as claim_directories recorded it: the
// folder's run.json (UserError when there is none: claim_directories did not run).
ClaimedRun claimed_run(const Config& config);

// Does checkpoint.resume=`path` name a fork's parent (`parent`, a run record's): its step
// directory, or the checkpoints folder it was in? Then resuming continues the fork.
bool names_fork_parent(const nlohmann::json& parent, const std::string& path);

// The step directory a checkpoint.resume=PATH names: PATH itself, or for a checkpoints
// folder its latest complete checkpoint. UserError when it is neither.
std::string resume_step_dir(const std::string& path);

// Torn saves (step directories without COMPLETE) of run `run_id` in `dir`: removed, so that
// their space counts as free before check_checkpoint_room; another run's are left alone.
void remove_torn_saves(const std::string& dir, const std::string& run_id);

// Before the first step: the checkpoint folder can be created and written, and its file
// system has room for what this run's next saves add, `count` checkpoints of
// `checkpoint_bytes` (checkpoints_to_fit). UserError naming the path, the bytes needed and
// free, and the checkpoints that hold the space.
void check_checkpoint_room(const std::string& dir, int64_t checkpoint_bytes, int count = 1);
// How many checkpoints of run `run_id` must fit beside what `dir` holds before its next
// saves rotate anything: the newest is deleted only once the next is complete, so a run
// with no complete checkpoint of its own yet needs room for two (its first, and the second
// while the first is kept), one with some needs room for one; `saves` (the saves the run
// will make, e.g. 1 when it saves only at its end) caps it; 0 without periodic saves.
int checkpoints_to_fit(const std::string& dir, const std::string& run_id, int64_t saves);

// The current shell-quoted form of a word for a command a user may paste.
std::string shell_quote(const std::string& word);

}  // namespace pipeline
}  // namespace gpipe
