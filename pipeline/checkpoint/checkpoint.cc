// Writing checkpoints: shards, indexes, trainer state, the COMPLETE marker, `latest`
// and rotation. Reading them is in checkpoint_load.cc.
#include "pipeline/checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <thread>

#include <xxhash.h>

#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kComplete = "COMPLETE";
constexpr const char* kTrainerState = "trainer_state.json";

std::string index_file_name(const std::string& kind) { return kind + ".safetensors.index.json"; }

// The test hook: sleeps before each file of a save when GPIPE_CHECKPOINT_PAUSE_MS is set,
// and says which file comes next, so a test can kill the writer right there.
void pause_before(const std::string& file) {
  heartbeat();  // a save is progress too (runtime/heartbeat.h)
  const char* v = std::getenv(kCheckpointPauseEnv);
  if (v == nullptr || *v == '\0') return;
  const long ms = std::strtol(v, nullptr, 10);
  if (ms <= 0) return;
  spdlog::info("checkpoint: pausing {} ms before writing {} ({})", ms, file, kCheckpointPauseEnv);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

// Removes a checkpoint directory so that no crash can leave it looking complete: the
// marker goes first (and durably), then the rest.
void remove_checkpoint_dir(const std::string& path, const std::string& why) {
  std::error_code ec;
  const std::string marker = path + "/" + kComplete;
  if (::unlink(marker.c_str()) == 0) fsync_directory(path);
  fs::remove_all(path, ec);
  if (ec) {
    spdlog::warn("checkpoint: could not delete {} ({}): {}", path, why, ec.message());
  } else {
    spdlog::info("checkpoint: deleted {} ({})", path, why);
  }
}

void check_shard_index(int shard, int num_shards) {
  if (num_shards < 1 || num_shards > 99999 || shard < 0 || shard >= num_shards) {
    throw Error("checkpoint shard " + std::to_string(shard) + " of " + std::to_string(num_shards) +
                ": need 0 <= shard < num_shards <= 99999");
  }
}

// Checks one written shard file against the names it should hold and adds its tensors
// to the index being built.
void index_shard(const std::string& dir, const std::string& file, int64_t step, const std::string& run_id,
                 const std::vector<std::string>& names, json& weight_map, uint64_t& total) {
  const std::string path = dir + "/" + file;
  const SafetensorsHeader h = read_safetensors_header(path);
  const auto meta = h.metadata.find("step");
  if (meta != h.metadata.end() && meta->second != std::to_string(step)) {
    throw Error("checkpoint shard '" + path + "' was written for step " + meta->second + ", not " +
                std::to_string(step) + "; was every shard of this step written before finalize?");
  }
  const auto run = h.metadata.find("run_id");
  if (!run_id.empty() && (run == h.metadata.end() || run->second != run_id)) {
    throw Error("checkpoint shard '" + path + "' was written by run " +
                (run == h.metadata.end() ? std::string("(none)") : run->second) + ", not by this run " + run_id +
                "; does another run write to " + dir + "?");
  }
  detail::check_shard_names(path, h, names, "the stage that saved it");
  for (const SafetensorsEntry& e : h.entries) {
    if (weight_map.contains(e.name)) {
      throw Error("tensor '" + e.name + "' is in two checkpoint shards, " + weight_map[e.name].get<std::string>() +
                  " and " + file + "; a tensor (a tied weight too) is saved by one stage only");
    }
    weight_map[e.name] = file;
    total += e.end - e.begin;
  }
}

}  // namespace

namespace detail {

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 10);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

void check_shard_names(const std::string& path, const SafetensorsHeader& header,
                       const std::vector<std::string>& expected, const std::string& listed_by) {
  const std::set<std::string> want(expected.begin(), expected.end());
  std::set<std::string> have;
  for (const SafetensorsEntry& e : header.entries) have.insert(e.name);
  std::vector<std::string> missing, extra;
  for (const auto& n : want) {
    if (!have.count(n)) missing.push_back(n);
  }
  for (const auto& n : have) {
    if (!want.count(n)) extra.push_back(n);
  }
  if (!missing.empty()) {
    throw UserError("checkpoint shard '" + path + "' lacks tensor(s) that " + listed_by + " lists: " +
                    join_names(missing) + " (a torn, replaced or mismatched shard)");
  }
  if (!extra.empty()) {
    throw UserError("checkpoint shard '" + path + "' holds tensor(s) that " + listed_by + " does not list: " +
                    join_names(extra));
  }
}

}  // namespace detail

Tensor step_tensor(int64_t steps) { return Tensor::from_vector<double>({static_cast<double>(steps)}, {}); }

int64_t step_value(const Tensor& t, const std::string& name) {
  if (t.dtype() != DType::kF64 || t.numel() != 1 || !t.device().is_cpu()) {
    throw UserError("checkpoint tensor '" + name + "' should be a float64 scalar step count, not " + t.str());
  }
  const double v = t.to_vector<double>()[0];
  if (!(v >= 0 && v <= 9007199254740992.0) || std::floor(v) != v) {
    throw UserError("checkpoint tensor '" + name + "' holds " + std::to_string(v) + ", not a step count");
  }
  return static_cast<int64_t>(v);
}

std::string step_dir_name(int64_t step) { return "step-" + std::to_string(step); }

std::string shard_file_name(const std::string& kind, int shard, int num_shards) {
  check_shard_index(shard, num_shards);
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.safetensors", shard + 1, num_shards);
  return kind + buf;
}

std::string tensor_checksum(const Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous()) throw Error("tensor_checksum of a tensor not in host memory: " + t.str());
  const XXH64_hash_t h = XXH3_64bits(t.raw_data(), t.nbytes());
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

ShardNames names_of(const ShardTensors& shard) {
  ShardNames n;
  for (const auto& kv : shard.model) n.model.push_back(kv.first);
  for (const auto& kv : shard.optimizer) n.optimizer.push_back(kv.first);
  return n;
}

CheckpointStore::CheckpointStore(std::string dir, int keep, std::string run_id)
    : dir_(std::move(dir)), keep_(keep), run_id_(std::move(run_id)) {
  if (dir_.empty()) throw UserError("checkpoint.dir is empty; give a folder for the checkpoints");
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  if (keep_ < 0) throw UserError("checkpoint.keep is " + std::to_string(keep_) + "; use 0 (keep all) or more");
}

std::string CheckpointStore::step_path(int64_t step) const {
  if (step < 0) throw Error("checkpoint of a negative step " + std::to_string(step));
  return dir_ + "/" + step_dir_name(step);
}

void CheckpointStore::write_shard(int64_t step, int shard, int num_shards, const TensorMap& model,
                                  const TensorMap& optimizer) const {
  check_shard_index(shard, num_shards);
  const std::string sd = step_path(step);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw UserError("cannot create the checkpoint folder '" + dir_ + "': " + ec.message());
  if (::mkdir(sd.c_str(), 0755) == 0) {
    fsync_directory(dir_);
  } else if (errno != EEXIST) {
    throw UserError("cannot create '" + sd + "': " + std::strerror(errno));
  } else if (!belongs_to_run(sd, run_id_)) {
    throw UserError("cannot save step " + std::to_string(step) + ": " + sd + " holds a checkpoint of another run (" +
                    checkpoint_run_id(sd) + "), not of this run " + run_id_ + ", and gpipe never overwrites another "
                    "run's checkpoint. Move it out of " + dir_ + " (mv " + sd + " <elsewhere>), then continue this run "
                    "(the same command with --resume)");
  }
  // Saving a step again (after a resume from an older checkpoint): it is not complete
  // until finalize has checked the new shards.
  const std::string marker = sd + "/" + kComplete;
  if (::unlink(marker.c_str()) == 0) {
    fsync_directory(sd);
    spdlog::info("checkpoint: {} is saved again; it counts as complete once finalized", sd);
  }
  for (const auto& [kind, tensors] : {std::make_pair("model", &model), std::make_pair("optimizer", &optimizer)}) {
    json sums = json::object();
    for (const auto& [name, t] : *tensors) {
      heartbeat();
      sums[name] = tensor_checksum(t);
    }
    StringMap meta = {{"format", "pt"},
                      {"step", std::to_string(step)},
                      {"shard", std::to_string(shard + 1) + "/" + std::to_string(num_shards)},
                      {"checksums", sums.dump()}};
    if (!run_id_.empty()) meta["run_id"] = run_id_;
    const std::string path = sd + "/" + shard_file_name(kind, shard, num_shards);
    pause_before(path);
    try {
      save_safetensors(path, *tensors, meta);
    } catch (const UserError& e) {  // a full or read-only disk: how much this save needs
      uint64_t bytes = 0;
      for (const TensorMap* m : {&model, &optimizer}) {
        for (const auto& kv : *m) bytes += kv.second.nbytes();
      }
      throw UserError(std::string(e.what()) + " (this stage's share of the checkpoint of step " + std::to_string(step) +
                      " is " + std::to_string((bytes + 999999) / 1000000) + " MB)");
    }
  }
}

void CheckpointStore::finalize(int64_t step, int num_shards, const std::vector<ShardNames>& names,
                               const json& trainer_state) const {
  if (static_cast<int>(names.size()) != num_shards) {
    throw Error("checkpoint finalize: " + std::to_string(names.size()) + " shard name lists for " +
                std::to_string(num_shards) + " shards");
  }
  if (!trainer_state.is_object() && !trainer_state.is_null()) throw Error("trainer state must be a JSON object");
  const std::string sd = step_path(step);
  std::set<std::string> keep_files = {kTrainerState};
  for (const std::string kind : {"model", "optimizer"}) {
    json weight_map = json::object();
    uint64_t total = 0;
    for (int k = 0; k < num_shards; ++k) {
      const std::string file = shard_file_name(kind, k, num_shards);
      index_shard(sd, file, step, run_id_, kind == "model" ? names[k].model : names[k].optimizer, weight_map, total);
      keep_files.insert(file);
    }
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string path = sd + "/" + index_file_name(kind);
    keep_files.insert(index_file_name(kind));
    pause_before(path);
    write_file_atomically(path, index.dump(2) + "\n");
  }
  json state = trainer_state.is_null() ? json::object() : trainer_state;
  if (state.contains("step") && state["step"] != json(step)) {
    throw Error("trainer state says step " + state["step"].dump() + " but the checkpoint is of step " +
                std::to_string(step));
  }
  if (!run_id_.empty()) {
    if (state.contains("run_id") && state["run_id"] != json(run_id_)) {
      throw Error("trainer state says run " + state["run_id"].dump() + " but the store saves run " + run_id_);
    }
    state["run_id"] = run_id_;
  }
  state["step"] = step;
  state["format_version"] = kCheckpointFormatVersion;
  pause_before(sd + "/" + kTrainerState);
  write_file_atomically(sd + "/" + kTrainerState, state.dump(2) + "\n");
  // Leftovers of a torn earlier save of this step: temporaries, shards of another count.
  for (const auto& entry : fs::directory_iterator(sd)) {
    const std::string name = entry.path().filename().string();
    if (keep_files.count(name)) continue;
    std::error_code ec;
    fs::remove_all(entry.path(), ec);
    spdlog::debug("checkpoint: removed stray {} from {}", name, sd);
  }
  pause_before(sd + "/" + kComplete);
  write_file_atomically(sd + "/" + kComplete, "step " + std::to_string(step) + "\n");
  pause_before(dir_ + "/latest");
  write_file_atomically(dir_ + "/latest", step_dir_name(step) + "\n");
  rotate(step);
}

void CheckpointStore::save(int64_t step, const std::vector<ShardTensors>& shards, const json& trainer_state) const {
  const int K = static_cast<int>(shards.size());
  std::vector<ShardNames> names;
  for (int k = 0; k < K; ++k) {
    write_shard(step, k, K, shards[k].model, shards[k].optimizer);
    names.push_back(names_of(shards[k]));
  }
  finalize(step, K, names, trainer_state);
}

void CheckpointStore::rotate(int64_t saved_step) const {
  const CheckpointListing listing = list_checkpoints(dir_);
  // Another run's step directory is never deleted (nor counted): only this run's are ours.
  const auto ours = [&](const CheckpointRef& c) {
    // A COMPLETE marker without a readable trainer state is no save of this store's (each
    // writes the state first): a step directory being copied in, or a damaged one.
    try {
      if (!json::parse(read_file(c.path + "/" + kTrainerState)).is_object()) throw Error("not an object");
    } catch (const std::exception&) {
      spdlog::warn("checkpoint: {} has a COMPLETE marker but no readable trainer_state.json (being copied in, or "
                   "damaged): whose it is cannot be told, so it is left as it is", c.path);
      return false;
    }
    if (belongs_to_run(c.path, run_id_)) return true;
    spdlog::warn("checkpoint: {} belongs to another run ({}); left as it is", c.path, checkpoint_run_id(c.path));
    return false;
  };
  // Torn saves older than this one: nothing of this run writes them any more (saves are in
  // order). Only those that say they are this run's: one that names no run yet may be a
  // step directory being copied in (the next launch clears this run's, remove_torn_saves).
  for (const CheckpointRef& c : listing.incomplete) {
    if (c.step < saved_step && (run_id_.empty() || checkpoint_run_id(c.path) == run_id_)) {
      remove_checkpoint_dir(c.path, "an interrupted save, older than " + step_dir_name(saved_step));
    }
  }
  if (keep_ == 0) return;
  // Newer complete ones belong to a run that was resumed from an older checkpoint: left alone.
  int kept = 0;
  for (auto it = listing.complete.rbegin(); it != listing.complete.rend(); ++it) {
    if (it->step > saved_step || !ours(*it)) continue;
    if (++kept > keep_) remove_checkpoint_dir(it->path, "checkpoint.keep is " + std::to_string(keep_));
  }
}

}  // namespace pipeline
}  // namespace gpipe
