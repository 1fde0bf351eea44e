// Test program for checkpoint_kill_test.sh: finds the newest complete checkpoint under
// DIR (warning about torn ones), loads it and checks every tensor and the trainer state
// bit for bit against what checkpoint_crash_writer saves for that step. Prints
// "verified step N" and exits 0, or names the first difference and exits 1.
//   checkpoint_verify DIR
#include <cstdio>
#include <cstring>

#include "pipeline/checkpoint/checkpoint.h"
#include "pipeline/checkpoint/checkpoint_crash_state.h"
#include "runtime/logging.h"

namespace {
int check(const gpipe::TensorMap& got, const gpipe::TensorMap& want, const char* what) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "checkpoint_verify: %zu %s tensors, expected %zu\n", got.size(), what, want.size());
    return 1;
  }
  for (const auto& [name, t] : want) {
    const auto it = got.find(name);
    if (it == got.end() || it->second.dtype() != t.dtype() || it->second.shape() != t.shape() ||
        std::memcmp(it->second.raw_data(), t.raw_data(), t.nbytes()) != 0) {
      std::fprintf(stderr, "checkpoint_verify: %s tensor '%s' differs from what was saved\n", what, name.c_str());
      return 1;
    }
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace gpipe::pipeline;
  if (argc != 2) {
    std::fprintf(stderr, "usage: checkpoint_verify DIR\n");
    return 2;
  }
  gpipe::init_logging("info");
  try {
    const auto ref = find_latest_complete(argv[1]);
    if (!ref) {
      std::fprintf(stderr, "checkpoint_verify: no complete checkpoint in %s\n", argv[1]);
      return 1;
    }
    const LoadedCheckpoint c = load_checkpoint(ref->path);
    gpipe::TensorMap model, optimizer;
    for (const auto& s : crash_test_shards(c.step)) {
      model.insert(s.model.begin(), s.model.end());
      optimizer.insert(s.optimizer.begin(), s.optimizer.end());
    }
    nlohmann::json state = crash_test_state(c.step);
    state["step"] = c.step;
    state["format_version"] = kCheckpointFormatVersion;
    if (check(c.model, model, "model") || check(c.optimizer, optimizer, "optimizer")) return 1;
    if (c.trainer_state != state) {
      std::fprintf(stderr, "checkpoint_verify: trainer state differs: %s\n", c.trainer_state.dump().c_str());
      return 1;
    }
    std::printf("verified step %lld\n", static_cast<long long>(c.step));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_verify: %s\n", e.what());
    return 1;
  }
  return 0;
}
