// A run's identity: the keys run_identity records are the ones the config reader lets
// checkpoint.allow_changes name (identity_keys, config.h).
#include <doctest/doctest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pipeline/config/config.h"
#include "pipeline/train/run_directory.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {
const char* kConfig = R"(model:
  input: [4]
  layers:
    - {type: linear, out: 2}
  loss: softmax_cross_entropy
data: {classes: 2}
optimizer: {type: sgd, lr: 0.1}
train: {steps: 1, batch_size: 4, seed: 3}
)";
}  // namespace

TEST_CASE("run_identity records exactly identity_keys(), the keys allow_changes may name") {
  const nlohmann::json id = run_identity(parse_config(kConfig, "t.yaml"));
  std::vector<std::string> recorded;
  for (auto it = id.begin(); it != id.end(); ++it) recorded.push_back(it.key());
  std::vector<std::string> listed = identity_keys();
  std::sort(recorded.begin(), recorded.end());
  std::sort(listed.begin(), listed.end());
  CHECK(recorded == listed);
  CHECK(std::adjacent_find(listed.begin(), listed.end()) == listed.end());  // each key once
  CHECK(std::find(listed.begin(), listed.end(), "all") == listed.end());    // "all" is not a key
}
