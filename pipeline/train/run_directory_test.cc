// A run's identity: the keys run_identity records are the ones the config reader lets
// checkpoint.allow_changes name (identity_keys, config.h), and identity_changes leaves
// out exactly the keys it is allowed to, reporting every other change.
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

TEST_CASE("identity_changes: an allowed key is left out, every other change is still reported") {
  const nlohmann::json saved = run_identity(parse_config(kConfig, "t.yaml"));
  // Two keys change: the learning rate and the training seed.
  const nlohmann::json now = run_identity(parse_config(kConfig, "t.yaml", {"optimizer.lr=0.2", "train.seed=7"}));
  const std::vector<std::string> both = {"optimizer.lr: 0.1 -> 0.2", "train.seed: 3 -> 7"};
  CHECK(identity_changes(saved, now, {}) == both);
  // Allowing one of them leaves the other refused, whichever is allowed.
  CHECK(identity_changes(saved, now, {"optimizer.lr"}) == std::vector<std::string>{"train.seed: 3 -> 7"});
  CHECK(identity_changes(saved, now, {"train.seed"}) == std::vector<std::string>{"optimizer.lr: 0.1 -> 0.2"});
  // An allowed key that did not change allows nothing else.
  CHECK(identity_changes(saved, now, {"data.seed"}) == both);
  CHECK(identity_changes(saved, now, {"optimizer.lr", "train.seed"}).empty());
  CHECK(identity_changes(saved, now, {"all"}).empty());
  CHECK(identity_changes(saved, saved, {}).empty());
}
