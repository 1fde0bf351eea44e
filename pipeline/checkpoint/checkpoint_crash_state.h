// The state checkpoint_crash_writer saves and checkpoint_verify expects at a step: two
// stages of model and optimizer tensors (F32, F64, I32, a step count) whose every value
// depends on the step, so a checkpoint of one step can never pass for another.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pipeline/checkpoint/checkpoint.h"

namespace gpipe {
namespace pipeline {

inline std::vector<ShardTensors> crash_test_shards(int64_t step) {
  std::vector<ShardTensors> shards(2);
  for (int k = 0; k < 2; ++k) {
    const std::string p = "layers." + std::to_string(k) + ".";
    std::vector<float> w(128 * 256);  // 128 KiB: a save takes a few writes
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((step * 7919 + k * 104729 + i) % 100003) / 7.f;
    std::vector<double> b(256);
    for (size_t i = 0; i < b.size(); ++i) b[i] = 1.0 / (1.0 + step + k + i);
    shards[k].model[p + "weight"] = Tensor::from_vector<float>(w, {128, 256});
    shards[k].model[p + "bias"] = Tensor::from_vector<double>(b, {256});
    shards[k].model[p + "ids"] = Tensor::from_vector<int32_t>({static_cast<int32_t>(step), k, -1}, {3});
    for (float& v : w) v = -v;
    shards[k].optimizer[p + "weight" + kExpAvgSuffix] = Tensor::from_vector<float>(w, {128, 256});
    shards[k].optimizer[p + "weight" + kStepSuffix] = step_tensor(step);
  }
  return shards;
}

inline nlohmann::json crash_test_state(int64_t step) {
  return {{"data_position", step * 128}, {"lr_step", step}, {"rng", {{"dropout", step * 31}}}};
}

}  // namespace pipeline
}  // namespace gpipe
