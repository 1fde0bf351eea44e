// Test helpers for tensor parallelism (layers/tensor_parallel.h): a tensor group of T
// members as threads of this process (GroupCollectives over an InProcessReplicaGroup), the
// GPT and LLaMA configs the tests split, and a block of a whole tensor written out index by
// index (independently of the layers' block arithmetic).
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "layers/tensor_parallel.h"
#include "runtime/inprocess_replica_group.h"
#include "tests/testing.h"

namespace gpipe {
namespace testing {

// Runs member(r, group) for r = 0 .. T-1, each on its own thread with its own member of
// one group; returns each member's error ("" when it finished).
inline std::vector<std::string> run_members(int T, const std::function<void(int, layers::TensorCollectives&)>& member) {
  InProcessReplicaHub hub(T, 30.0);
  std::vector<std::string> errors(static_cast<size_t>(T));
  std::vector<std::thread> threads;
  for (int r = 0; r < T; ++r) {
    threads.emplace_back([&, r] {
      try {
        InProcessReplicaGroup threads_group(hub, r);
        layers::GroupCollectives group(threads_group);  // what a run's tensor group uses
        member(r, group);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// A GPT-style config (a tied head, dropout) and a LLaMA-style one (grouped-query attention,
// dropout), float64, small enough for T = 4 members: heads, kv heads, hidden features and
// the vocabulary all divide by 4.
inline const char* kTensorParallelGpt = R"(model:
  input: [6]
  input_dtype: int32
  dtype: float64
  layers:
    - {type: embedding, vocab: 16, dim: 8}
    - repeat: 2
      layers:
        - {type: transformer_block, heads: 4, dropout: 0.1}
    - {type: layernorm}
    - {type: linear, out: 16, tied: true, bias: false}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 3}
)";
inline const char* kTensorParallelLlama = R"(model:
  input: [6]
  input_dtype: int32
  dtype: float64
  layers:
    - {type: embedding, vocab: 16, dim: 16, positions: 0}
    - repeat: 2
      layers:
        - {type: llama_block, heads: 8, kv_heads: 4, hidden: 24, dropout: 0.1}
    - {type: rmsnorm}
    - {type: linear, out: 16, bias: false}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 3}
)";

// A config of the above with samples of `positions` tokens (for sequence parallelism, a
// multiple of T).
inline std::string with_positions(const std::string& text, int positions) {
  std::string out = text;
  const std::string six = "input: [6]";
  out.replace(out.find(six), six.size(), "input: [" + std::to_string(positions) + "]");
  return out;
}

// The LLaMA config with fewer key/value heads than a group of 4 members: at T = 4 each of
// its 2 key/value heads is replicated over the 2 members whose query heads it serves.
inline std::string tensor_parallel_llama(int kv_heads) {
  std::string text = kTensorParallelLlama;
  const std::string four = "kv_heads: 4";
  text.replace(text.find(four), four.size(), "kv_heads: " + std::to_string(kv_heads));
  return text;
}
inline const std::string kTensorParallelLlamaFewKv = tensor_parallel_llama(2);
// Multi-query attention (one key/value head): whole on every member, each holding it alike.
inline const std::string kTensorParallelLlamaMqa = tensor_parallel_llama(1);

// Block `rank` of `count` along dimension `dim` of a 1-D or 2-D tensor (of each of
// `groups` equal parts of that dimension), as doubles, in row-major order.
inline std::vector<double> block_of(const Tensor& t, int dim, int rank, int count, int groups = 1) {
  const std::vector<double> v = to_doubles(t);
  const int64_t rows = t.size(0), cols = t.dim() == 1 ? 1 : t.size(1);
  const int64_t extent = dim == 0 ? rows : cols, part = extent / groups, len = part / count;
  std::vector<double> out;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (((dim == 0 ? r : c) % part) / len == rank) out.push_back(v[static_cast<size_t>(r * cols + c)]);
    }
  }
  return out;
}

}  // namespace testing
}  // namespace gpipe
