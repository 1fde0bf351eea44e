// Writes a small two-shard checkpoint and, beside it, expected.json: every tensor's
// dtype, shape, first values and sum, as gpipe saved them, so that
// bench/load_checkpoint_torch.py can check what PyTorch (or NumPy) reads from the files.
//   checkpoint_torch_fixture DIR      -> DIR/step-3/..., DIR/expected.json
#include <cstdio>

#include "pipeline/checkpoint/checkpoint.h"
#include "runtime/atomic_file.h"
#include "runtime/logging.h"

namespace {

using gpipe::Tensor;
using nlohmann::json;

json describe(const gpipe::TensorMap& tensors) {
  json out = json::object();
  for (const auto& [name, t] : tensors) {
    std::vector<double> v;
    if (t.dtype() == gpipe::DType::kF32) {
      for (float x : t.to_vector<float>()) v.push_back(x);
    } else if (t.dtype() == gpipe::DType::kF64) {
      v = t.to_vector<double>();
    } else {
      for (int32_t x : t.to_vector<int32_t>()) v.push_back(x);
    }
    double sum = 0;
    for (double x : v) sum += x;
    out[name] = {{"dtype", gpipe::safetensors_dtype_name(t.dtype())},
                 {"shape", t.shape()},
                 {"first", std::vector<double>(v.begin(), v.begin() + std::min<size_t>(v.size(), 8))},
                 {"sum", sum}};
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gpipe::pipeline;
  if (argc != 2) {
    std::fprintf(stderr, "usage: checkpoint_torch_fixture DIR\n");
    return 2;
  }
  gpipe::init_logging("warn");
  std::vector<ShardTensors> shards(2);
  std::vector<float> w(3 * 5);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i) - 1.0f / 3.0f;
  shards[0].model["layers.0.weight"] = Tensor::from_vector<float>(w, {3, 5});
  shards[0].model["layers.0.bias"] = Tensor::from_vector<float>({0.5f, -1.5f, 1e-7f}, {3});
  shards[0].optimizer["layers.0.weight.exp_avg"] = Tensor::from_vector<float>(std::vector<float>(15, 0.125f), {3, 5});
  shards[0].optimizer["layers.0.weight.step"] = step_tensor(3);
  shards[1].model["layers.1.table"] = Tensor::from_vector<double>({1.0 / 3, -2.5, 1e300, 0}, {2, 1, 2});
  shards[1].model["layers.1.ids"] = Tensor::from_vector<int32_t>({7, -8, 2147483647}, {3});
  shards[1].model["layers.1.scale"] = Tensor::from_vector<double>({42.0}, {});
  shards[1].optimizer["layers.1.table.momentum_buffer"] = Tensor::from_vector<double>({1, 2, 3, 4}, {2, 1, 2});
  try {
    const std::string dir = argv[1];
    CheckpointStore(dir).save(3, shards, {{"data_position", 384}});
    gpipe::TensorMap model, optimizer;
    for (const auto& s : shards) {
      model.insert(s.model.begin(), s.model.end());
      optimizer.insert(s.optimizer.begin(), s.optimizer.end());
    }
    const json expected = {{"checkpoint", CheckpointStore(dir).step_path(3)},
                           {"model", describe(model)},
                           {"optimizer", describe(optimizer)}};
    gpipe::write_file_atomically(dir + "/expected.json", expected.dump(2) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_torch_fixture: %s\n", e.what());
    return 1;
  }
  return 0;
}
