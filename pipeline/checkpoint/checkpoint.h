// The checkpoint store: a training run's state on disk, in a layout any K, M, D or device
// can load and PyTorch can read, written so that a crash at any instant leaves the
// previous checkpoint complete. Independent of the executor: it stores named host tensors
// and a JSON trainer state that its caller gathers.
//
//   <dir>/step-<N>/model-00001-of-0000K.safetensors      one shard per stage (K stages)
//                  model.safetensors.index.json          {"metadata": {"total_size": B},
//                                                          "weight_map": {name: file}}
//                  optimizer-00001-of-0000K.safetensors  "<param>.<suffix>" (see below)
//                  optimizer.safetensors.index.json
//                  trainer_state.json                    the caller's object + format_version, step,
//                                                        run_id
//                  COMPLETE                              written last: the directory counts only with it
//   <dir>/latest                                         "step-<N>": the newest complete save
//
// Every shard's safetensors metadata says its step, its run's id and the checksum of each
// of its tensors (xxHash's XXH3-64, hex: Debian's libxxhash; a tensor's bytes as stored),
// so that a flipped byte, a shard copied in from another step or another run, is found
// when it is loaded, by name, instead of training on silently.
//
// Every file is written atomically (runtime/atomic_file.h). In a multi-process run each
// stage's rank of replica 0 calls write_shard for its own stage, in parallel, and after a
// barrier (the caller's) rank 0 calls finalize: nothing is gathered to one rank.
//
// Optimizer state names: the parameter's name plus a suffix, as PyTorch names them:
// ".momentum_buffer" (SGD), ".exp_avg" and ".exp_avg_sq" (Adam), and the step count as
// ".step", a float64 scalar (shape ()), exact up to 2^53 steps (step_tensor/step_value).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace pipeline {

// 2: shards carry run_id and per-tensor checksums, which are verified on load.
// 1 (before checksums) still loads, with a warning that its content is not verified.
constexpr int kCheckpointFormatVersion = 2;
constexpr const char* kMomentumSuffix = ".momentum_buffer";
constexpr const char* kExpAvgSuffix = ".exp_avg";
constexpr const char* kExpAvgSqSuffix = ".exp_avg_sq";
constexpr const char* kStepSuffix = ".step";
// Milliseconds to sleep before each file of a save, so that a test can kill the writer
// in the middle of a save reliably. Unset or 0 in real runs.
constexpr const char* kCheckpointPauseEnv = "GPIPE_CHECKPOINT_PAUSE_MS";

Tensor step_tensor(int64_t steps);                         // F64 scalar
int64_t step_value(const Tensor& t, const std::string& name);  // checks dtype, shape, integrality

// "step-42", "model-00001-of-00002.safetensors" (shard is 0-based, the name 1-based).
std::string step_dir_name(int64_t step);
std::string shard_file_name(const std::string& kind, int shard, int num_shards);  // kind: model | optimizer

struct ShardTensors {
  TensorMap model, optimizer;  // contiguous host tensors
};
struct ShardNames {
  std::vector<std::string> model, optimizer;
};
ShardNames names_of(const ShardTensors& shard);

// XXH3-64 of a contiguous host tensor's bytes, as 16 hex digits: the checksum each shard's
// metadata holds for each tensor ("checksums", a JSON object of name -> digest).
std::string tensor_checksum(const Tensor& t);

class CheckpointStore {
 public:
  // dir: the checkpoints folder, created on the first save. keep: complete checkpoints
  // kept (the newest `keep` at or below the one just saved; 0 keeps all). run_id: the
  // run's identity, written into every shard and the trainer state.
  explicit CheckpointStore(std::string dir, int keep = 0, std::string run_id = "");
  const std::string& dir() const { return dir_; }
  const std::string& run_id() const { return run_id_; }
  int keep() const { return keep_; }
  std::string step_path(int64_t step) const;

  // Writes one stage's model and optimizer shard of `step` durably. If step-N was
  // complete already (a step saved again), it stops counting as complete here and counts
  // again when finalize has run. A step directory of another run (checkpoint_run_id) is
  // never written into: UserError naming it and its run.
  void write_shard(int64_t step, int shard, int num_shards, const TensorMap& model, const TensorMap& optimizer) const;
  // After every shard is durable: checks each shard file against `names` (one entry per
  // shard; a missing file, a missing or extra tensor, a tensor in two shards is an Error),
  // writes both indexes and trainer_state.json, removes stray files (temporaries of a
  // torn save, shards of another count), writes COMPLETE, then `latest`, then deletes
  // checkpoints beyond `keep` and torn saves older than this one, of this run only: a step
  // directory of another run is left as it is and does not count towards `keep`, and a torn
  // one that names no run yet (perhaps still being copied in) is left too.
  void finalize(int64_t step, int num_shards, const std::vector<ShardNames>& names,
                const nlohmann::json& trainer_state) const;
  // Every shard, then finalize: single-process runs.
  void save(int64_t step, const std::vector<ShardTensors>& shards, const nlohmann::json& trainer_state) const;

 private:
  void rotate(int64_t saved_step) const;
  std::string dir_;
  int keep_;
  std::string run_id_;
};

struct CheckpointRef {
  int64_t step = 0;
  std::string path;  // the step directory
};

// Step directories under `dir`, by step: complete ones and torn ones.
struct CheckpointListing {
  std::vector<CheckpointRef> complete, incomplete;
};
CheckpointListing list_checkpoints(const std::string& dir);

// The run a step directory belongs to: its trainer_state.json's run_id, or for a torn save
// without one, the run_id in the metadata of its first readable shard; "" when nothing in
// it names a run (an empty torn save, a store given no run id). Never throws.
std::string checkpoint_run_id(const std::string& step_dir);
// Does step directory `step_dir` belong to run `run_id`? A step that names no run counts as
// the folder's, and with no `run_id` (a store given none) every step does.
bool belongs_to_run(const std::string& step_dir, const std::string& run_id);

// The checkpoint to resume from: the one `latest` names if it is complete, else the
// newest complete one (a warning says why `latest` was not used). Every torn step-*
// directory is skipped with a warning that names it. nullopt when there is none.
std::optional<CheckpointRef> find_latest_complete(const std::string& dir);

struct LoadedCheckpoint {
  int64_t step = 0;
  std::string path;
  TensorMap model, optimizer;  // host tensors by name
  nlohmann::json trainer_state;  // as written, with format_version and step
};

// Which tensors to read (all when unset): a stage of a resumed run reads its own.
struct LoadFilter {
  std::function<bool(const std::string&)> model, optimizer;
};

// Loads the step directory `path` (or, for a checkpoints folder, its latest complete
// checkpoint), checking every file against its index, every shard's step and run id
// against the trainer state, and every tensor read against its checksum. Throws
// CheckpointDamaged naming the file and the problem: no COMPLETE marker, an unknown
// format version, a missing or corrupt shard, a tensor listed in an index but missing
// from its file (by name), a shard of another step or run, a checksum that differs.
LoadedCheckpoint load_checkpoint(const std::string& path, const LoadFilter& filter = {});

// A checkpoint that cannot be used as it is on disk (torn, damaged, mixed up): resume
// falls back to an older one. A checkpoint that is intact but does not fit the run
// (another model, optimizer or run) is a plain UserError.
class CheckpointDamaged : public UserError {
 public:
  using UserError::UserError;
};

// Does a loaded map fit what the model expects? Throws UserError listing the missing and
// extra tensors and every dtype or shape mismatch with both shapes; `what` says which
// map ("model", "optimizer") and `path` the checkpoint.
struct TensorSpec {
  Shape shape;
  DType dtype = DType::kF32;
};
void check_tensors_fit(const TensorMap& loaded, const std::map<std::string, TensorSpec>& expected,
                       const std::string& what, const std::string& path);

namespace detail {
// Shared by finalize and load: a shard file must hold exactly `expected` (as `listed_by`
// lists them); throws UserError naming the file and the missing or extra tensors.
void check_shard_names(const std::string& path, const SafetensorsHeader& header,
                       const std::vector<std::string>& expected, const std::string& listed_by);
// "a, b, c and 7 more": the first ten names, for messages.
std::string join_names(const std::vector<std::string>& names);
}  // namespace detail

}  // namespace pipeline
}  // namespace gpipe
