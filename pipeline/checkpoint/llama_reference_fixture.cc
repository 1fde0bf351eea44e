// Writes a checkpoint of a tiny LLaMA-style model (float64, every layer type of
// configs/llama.yaml, grouped-query attention with kv_heads < heads, norm scales that are
// not ones) and, beside it, llama_expected.json: the model's options, a batch of token
// ids and targets, and the logits and mean loss gpipe computes for them, so that
// bench/llama_reference.py can recompute both from the checkpoint's tensors alone with a
// LLaMA written independently of gpipe.
//   llama_reference_fixture DIR      -> DIR/step-1/..., DIR/llama_expected.json
#include <cstdio>

#include "layers/registry.h"
#include "layers/sequential.h"
#include "pipeline/checkpoint/checkpoint.h"
#include "runtime/atomic_file.h"
#include "runtime/logging.h"
#include "runtime/random.h"

namespace {

using gpipe::DType;
using gpipe::Tensor;
using nlohmann::json;

constexpr int64_t kVocab = 13, kDim = 16, kHeads = 4, kKvHeads = 2, kHidden = 24, kSeq = 6, kBatch = 3;
constexpr double kRopeBase = 100.0, kEps = 1e-5;

gpipe::layers::ModelSpec spec() {
  gpipe::layers::ModelSpec s;
  s.input = {kSeq};
  s.input_dtype = DType::kI32;
  s.dtype = DType::kF64;
  s.seed = 5;
  const std::string dim = std::to_string(kDim), heads = std::to_string(kHeads), kv = std::to_string(kKvHeads);
  s.layers = {{"embedding", {{"vocab", std::to_string(kVocab)}, {"dim", dim}, {"positions", "0"}}, {}, ""}};
  for (int i = 0; i < 2; ++i) {
    s.layers.push_back({"llama_block",
                        {{"heads", heads},
                         {"kv_heads", kv},
                         {"hidden", std::to_string(kHidden)},
                         {"rope_base", "100"},
                         {"eps", "1e-5"}},
                        {},
                        ""});
  }
  s.layers.push_back({"rmsnorm", {{"eps", "1e-5"}}, {}, ""});
  s.layers.push_back({"linear", {{"out", std::to_string(kVocab)}, {"bias", "false"}}, {}, ""});
  s.loss = {"softmax_cross_entropy", {}, {}, ""};
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gpipe::pipeline;
  if (argc != 2) {
    std::fprintf(stderr, "usage: llama_reference_fixture DIR\n");
    return 2;
  }
  gpipe::init_logging("warn");
  try {
    auto model = gpipe::layers::build_model(spec());
    gpipe::Backend& be = gpipe::backend_for(gpipe::Device::cpu());
    // Norm scales away from ones, so that a reference ignoring them disagrees.
    gpipe::Rng rng(7);
    ShardTensors shard;
    for (auto& [name, p] : model->named_parameters()) {
      if (name.find("norm") != std::string::npos) {
        std::vector<double> g(static_cast<size_t>(p->value.numel()));
        for (double& v : g) v = 0.5 + rng.uniform();
        be.copy(Tensor::from_vector<double>(g, p->value.shape()), p->value);
      }
      shard.model[name] = p->value;
    }
    std::vector<int32_t> ids, targets;
    for (int64_t i = 0; i < kBatch * kSeq; ++i) {
      ids.push_back(static_cast<int32_t>(rng.uniform() * kVocab) % kVocab);
      targets.push_back(static_cast<int32_t>(rng.uniform() * kVocab) % kVocab);
    }
    const Tensor x = Tensor::from_vector<int32_t>(ids, {kBatch, kSeq});
    const Tensor y = Tensor::from_vector<int32_t>(targets, {kBatch, kSeq});
    Tensor h = x;
    for (int i = 0; i < model->size(); ++i) h = model->layer(i).forward(be, h, nullptr);  // (B, T, V) logits
    const double loss = model->forward_backward(be, x, y, 1.0 / static_cast<double>(kBatch * kSeq));
    const std::string dir = argv[1];
    CheckpointStore(dir).save(1, {shard}, {{"data_position", 0}});
    const json expected = {
        {"checkpoint", CheckpointStore(dir).step_path(1)},
        {"model",
         {{"vocab", kVocab},
          {"dim", kDim},
          {"heads", kHeads},
          {"kv_heads", kKvHeads},
          {"hidden", kHidden},
          {"seq_len", kSeq},
          {"rope_base", kRopeBase},
          {"eps", kEps},
          {"blocks", 2},
          {"names", [&] {
             std::vector<std::string> n;
             for (auto& np : model->named_parameters()) n.push_back(np.first);
             return n;
           }()}}},
        {"ids", ids},
        {"targets", targets},
        {"logits", h.to_vector<double>()},
        {"loss", loss}};
    gpipe::write_file_atomically(dir + "/llama_expected.json", expected.dump(2) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_reference_fixture: %s\n", e.what());
    return 1;
  }
  return 0;
}
