// Reading checkpoints: finding the newest complete one, loading it with every file
// checked against its index, and checking that it fits the model.
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <set>
#include <sstream>

#include "pipeline/checkpoint/checkpoint.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// "step-42" -> 42; nullopt for anything else ("step-", "step-0x1", "step-42.tmp", ...).
std::optional<int64_t> parse_step_dir(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  int64_t step = 0;
  const char* first = name.data() + 5;
  const char* last = name.data() + name.size();
  const auto [end, ec] = std::from_chars(first, last, step);
  if (ec != std::errc() || end != last || step < 0 || *first == '+' || *first == '-') return std::nullopt;
  if (step_dir_name(step) != name) return std::nullopt;  // no leading zeros: one name per step
  return step;
}

bool is_complete_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path + "/COMPLETE", ec);
}

json read_json(const std::string& path, const std::string& what) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    throw UserError("checkpoint " + what + " '" + path + "' cannot be read: " + e.what());
  }
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw UserError("checkpoint " + what + " '" + path + "' is not valid JSON (corrupt or truncated): " + e.what());
  }
}

using detail::join_names;

// What every shard of a checkpoint must say of itself: the trainer state's step and run,
// and (format 2 on) a checksum for each of its tensors.
struct ShardExpectation {
  int64_t step = 0;
  std::string run_id;  // empty: the trainer state names no run (a store given no run id, or format 1)
  bool checksums = true;
};

// The shard's own header against the trainer state: its step, its run.
void check_shard_identity(const std::string& path, const SafetensorsHeader& h, const ShardExpectation& expect) {
  const auto step = h.metadata.find("step");
  if (step == h.metadata.end() || step->second != std::to_string(expect.step)) {
    throw CheckpointDamaged("checkpoint shard '" + path + "' says it holds step " +
                            (step == h.metadata.end() ? std::string("(none)") : step->second) +
                            " but its checkpoint is of step " + std::to_string(expect.step) +
                            " (a shard copied in from another checkpoint)");
  }
  const auto run = h.metadata.find("run_id");
  const std::string shard_run = run == h.metadata.end() ? "" : run->second;
  if (shard_run != expect.run_id) {
    auto named = [](const std::string& id) { return id.empty() ? std::string("(none)") : id; };
    throw CheckpointDamaged("checkpoint shard '" + path + "' belongs to run " + named(shard_run) +
                            " but its checkpoint is of run " + named(expect.run_id) +
                            " (a shard copied in from another run)");
  }
}

// Each tensor read from `path` against the checksum its shard's metadata holds for it.
void verify_checksums(const std::string& path, const SafetensorsHeader& h, const TensorMap& read) {
  const auto it = h.metadata.find("checksums");
  json sums;
  try {
    if (it != h.metadata.end()) sums = json::parse(it->second);
  } catch (const json::exception&) {
  }
  if (!sums.is_object()) {
    throw CheckpointDamaged("checkpoint shard '" + path + "' has no readable \"checksums\" in its metadata, so its "
                            "tensors cannot be verified (a damaged or foreign shard)");
  }
  for (const auto& [name, t] : read) {
    const auto want = sums.find(name);
    if (want == sums.end() || !want->is_string()) {
      throw CheckpointDamaged("checkpoint shard '" + path + "' lists no checksum for tensor '" + name + "'");
    }
    heartbeat();
    const std::string got = tensor_checksum(t);
    if (got != want->get<std::string>()) {
      throw CheckpointDamaged("checkpoint shard '" + path + "': tensor '" + name + "' does not match its checksum (" +
                              got + ", saved " + want->get<std::string>() + "): the file was damaged after it was saved");
    }
  }
}

// Reads the `kind` index of checkpoint `dir` and the shards it names, into `out`.
void load_kind(const std::string& dir, const std::string& kind, const std::function<bool(const std::string&)>& want,
               const ShardExpectation& expect, TensorMap& out) {
  const std::string index_name = kind + ".safetensors.index.json";
  const std::string index_path = dir + "/" + index_name;
  const json index = read_json(index_path, "index");
  const auto bad = [&](const std::string& problem) {
    throw UserError("checkpoint index '" + index_path + "': " + problem);
  };
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    bad("expected {\"metadata\": {\"total_size\": N}, \"weight_map\": {name: file}}");
  }
  if (!index.contains("metadata") || !index["metadata"].is_object() || !index["metadata"].contains("total_size") ||
      !index["metadata"]["total_size"].is_number_unsigned()) {
    bad("metadata.total_size is missing or not a non-negative integer");
  }
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string()) bad("the file of '" + it.key() + "' is not a string");
    const std::string file = it.value().get<std::string>();
    // Only files of this directory: an index must not reach elsewhere.
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
      bad("'" + it.key() + "' is mapped to '" + file + "', not a file name in the checkpoint directory");
    }
    by_file[file].push_back(it.key());
  }
  uint64_t total = 0;
  for (const auto& [file, names] : by_file) {
    const std::string path = dir + "/" + file;
    const SafetensorsHeader h = read_safetensors_header(path);
    detail::check_shard_names(path, h, names, index_name);
    check_shard_identity(path, h, expect);
    for (const SafetensorsEntry& e : h.entries) total += e.end - e.begin;
    heartbeat();  // loading a checkpoint is progress, for gpipe run (runtime/heartbeat.h)
    SafetensorsFile f = load_safetensors(path, [&](const std::string& n) { return !want || want(n); });
    if (expect.checksums) verify_checksums(path, h, f.tensors);
    for (auto& kv : f.tensors) out.emplace(kv.first, std::move(kv.second));
  }
  if (total != index["metadata"]["total_size"].get<uint64_t>()) {
    bad("metadata.total_size is " + index["metadata"]["total_size"].dump() + " but the shards hold " +
        std::to_string(total) + " bytes of tensors");
  }
}

}  // namespace

CheckpointListing list_checkpoints(const std::string& dir) {
  CheckpointListing out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto step = parse_step_dir(entry.path().filename().string());
    std::error_code ec2;
    if (!step || !entry.is_directory(ec2)) continue;
    const std::string path = dir + "/" + entry.path().filename().string();
    (is_complete_dir(path) ? out.complete : out.incomplete).push_back({*step, path});
  }
  if (ec) throw UserError("cannot list the checkpoint folder '" + dir + "': " + ec.message());
  const auto by_step = [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; };
  std::sort(out.complete.begin(), out.complete.end(), by_step);
  std::sort(out.incomplete.begin(), out.incomplete.end(), by_step);
  return out;
}

std::string checkpoint_run_id(const std::string& step_dir) {
  try {
    const json st = json::parse(read_file(step_dir + "/trainer_state.json"));
    if (st.is_object() && st.contains("run_id") && st["run_id"].is_string()) return st["run_id"].get<std::string>();
    if (st.is_object()) return "";  // a trainer state without a run: a store given none
  } catch (const std::exception&) {  // none yet (a torn save) or unreadable: ask the shards
  }
  std::error_code ec;
  std::vector<std::string> shards;
  for (const auto& entry : fs::directory_iterator(step_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0) shards.push_back(name);
  }
  std::sort(shards.begin(), shards.end());
  for (const std::string& name : shards) {
    try {
      const SafetensorsHeader h = read_safetensors_header(step_dir + "/" + name);
      const auto run = h.metadata.find("run_id");
      return run == h.metadata.end() ? "" : run->second;
    } catch (const std::exception&) {  // a torn or damaged shard: the next one
    }
  }
  return "";
}

bool belongs_to_run(const std::string& step_dir, const std::string& run_id) {
  if (run_id.empty()) return true;
  const std::string theirs = checkpoint_run_id(step_dir);
  return theirs.empty() || theirs == run_id;
}

std::optional<CheckpointRef> find_latest_complete(const std::string& dir) {
  const CheckpointListing listing = list_checkpoints(dir);
  for (const CheckpointRef& c : listing.incomplete) {
    spdlog::warn("checkpoint {} is incomplete (no COMPLETE marker: its save was interrupted); skipping it", c.path);
  }
  std::optional<CheckpointRef> newest;
  if (!listing.complete.empty()) newest = listing.complete.back();
  std::error_code ec;
  const std::string latest_path = dir + "/latest";
  if (!fs::exists(latest_path, ec)) return newest;
  std::string named;
  try {
    named = read_file(latest_path);
  } catch (const Error& e) {
    spdlog::warn("checkpoint: cannot read {}: {}", latest_path, e.what());
  }
  while (!named.empty() && (named.back() == '\n' || named.back() == ' ')) named.pop_back();
  for (const CheckpointRef& c : listing.complete) {
    if (step_dir_name(c.step) != named) continue;
    if (newest && newest->step > c.step) {
      spdlog::info("checkpoint: {} names {}; the newer complete {} is not used (its save ended before `latest` "
                   "was updated, or it is from a run that went on from an older checkpoint)",
                   latest_path, named, newest->path);
    }
    return c;
  }
  if (newest) {
    spdlog::warn("checkpoint: {} names '{}', which is missing or incomplete; using the newest complete checkpoint, {}",
                 latest_path, named, newest->path);
  } else {
    spdlog::warn("checkpoint: {} names '{}', which is missing or incomplete, and no complete checkpoint exists",
                 latest_path, named);
  }
  return newest;
}

namespace {

LoadedCheckpoint load_checkpoint_files(const std::string& path_in, const LoadFilter& filter) {
  std::error_code ec;
  if (!fs::is_directory(path_in, ec)) {
    throw UserError("checkpoint '" + path_in + "' does not exist or is not a directory");
  }
  std::string path = path_in;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (!is_complete_dir(path)) {
    const std::string name = fs::path(path).filename().string();
    if (parse_step_dir(name)) {
      throw UserError("checkpoint '" + path + "' is incomplete: it has no COMPLETE marker (its save was interrupted); "
                      "load an older step-* directory, or the checkpoints folder for the newest complete one");
    }
    // A checkpoints folder: its newest complete checkpoint.
    const auto ref = find_latest_complete(path);
    if (!ref) {
      throw UserError("'" + path + "' is neither a checkpoint (no COMPLETE marker) nor a folder with a complete "
                      "step-* checkpoint in it");
    }
    path = ref->path;
  }
  LoadedCheckpoint out;
  out.path = path;
  const std::string state_path = path + "/trainer_state.json";
  out.trainer_state = read_json(state_path, "trainer state");
  const json& st = out.trainer_state;
  if (!st.is_object() || !st.contains("format_version") || !st["format_version"].is_number_integer()) {
    throw UserError("checkpoint trainer state '" + state_path + "' has no integer format_version (not a gpipe "
                    "checkpoint, or a corrupt one)");
  }
  const int64_t version = st["format_version"].get<int64_t>();
  if (version != kCheckpointFormatVersion && version != 1) {
    throw UserError("checkpoint '" + path + "' has format version " + st["format_version"].dump() +
                    "; this gpipe reads versions 1 and " + std::to_string(kCheckpointFormatVersion) +
                    " (was it written by another gpipe version?)");
  }
  if (!st.contains("step") || !st["step"].is_number_integer() || st["step"].get<int64_t>() < 0) {
    throw UserError("checkpoint trainer state '" + state_path + "' has no step");
  }
  out.step = st["step"].get<int64_t>();
  const auto dir_step = parse_step_dir(fs::path(path).filename().string());
  if (dir_step && *dir_step != out.step) {
    throw UserError("checkpoint '" + path + "' holds the trainer state of step " + std::to_string(out.step) +
                    "; a directory's files were mixed up");
  }
  ShardExpectation expect;
  expect.step = out.step;
  expect.checksums = version >= 2;
  if (st.contains("run_id")) {
    if (!st["run_id"].is_string() || st["run_id"].get<std::string>().empty()) {
      throw UserError("checkpoint trainer state '" + state_path + "' has a run_id that is not a non-empty string");
    }
    expect.run_id = st["run_id"].get<std::string>();
  }
  if (version < 2) {
    spdlog::warn("checkpoint {} was written before checkpoints carried checksums (format version 1): its tensors "
                 "are loaded without verifying their content", path);
  }
  load_kind(path, "model", filter.model, expect, out.model);
  load_kind(path, "optimizer", filter.optimizer, expect, out.optimizer);
  return out;
}

}  // namespace

LoadedCheckpoint load_checkpoint(const std::string& path, const LoadFilter& filter) {
  try {
    return load_checkpoint_files(path, filter);
  } catch (const CheckpointDamaged&) {
    throw;
  } catch (const UserError& e) {  // the format's checks (safetensors, indexes, trainer state)
    throw CheckpointDamaged(e.what());
  }
}

void check_tensors_fit(const TensorMap& loaded, const std::map<std::string, TensorSpec>& expected,
                       const std::string& what, const std::string& path) {
  std::vector<std::string> missing, extra, mismatched;
  for (const auto& [name, spec] : expected) {
    const auto it = loaded.find(name);
    if (it == loaded.end()) {
      missing.push_back(name);
    } else if (it->second.shape() != spec.shape || it->second.dtype() != spec.dtype) {
      mismatched.push_back(name + " is " + dtype_name(it->second.dtype()) + shape_str(it->second.shape()) +
                           " in the checkpoint but " + dtype_name(spec.dtype) + shape_str(spec.shape) +
                           " in the model" +
                           (it->second.dtype() == DType::kBF16 && spec.dtype != DType::kBF16
                                ? std::string(" (a bfloat16 tensor: convert it, e.g. tensor.float() in PyTorch, and "
                                              "save again)")
                                : std::string()));
    }
  }
  for (const auto& kv : loaded) {
    if (!expected.count(kv.first)) extra.push_back(kv.first);
  }
  if (missing.empty() && extra.empty() && mismatched.empty()) return;
  std::ostringstream os;
  os << "checkpoint '" << path << "' does not fit the model's " << what << " tensors:";
  if (!missing.empty()) os << " missing from the checkpoint: " << join_names(missing) << ";";
  if (!extra.empty()) os << " in the checkpoint but not in the model: " << join_names(extra) << ";";
  for (const auto& m : mismatched) os << " " << m << ";";
  os << " was it saved from another model or config? (its config is in trainer_state.json)";
  throw UserError(os.str());
}

}  // namespace pipeline
}  // namespace gpipe
