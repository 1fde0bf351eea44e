// An example of a model built entirely in C++: a small GPT-style byte-level language
// model (token and position embedding, pre-LayerNorm transformer blocks, a final
// LayerNorm, an output head tied to the token embedding), assembled from gpipe's layer
// classes. It reaches the trainer two ways:
//   * registered by name (register_tiny_gpt) and named in YAML, `model: {cpp: tiny_gpt}`,
//     by a program that is otherwise gpipe's command line (tiny_gpt_main.cc);
//   * handed to the trainer as a factory by a program that fills its whole config in
//     C++ (train_in_cpp.cc).
// Either way every process of `mpirun -np K` builds it and keeps its own stage.
#pragma once

#include <memory>

#include "layers/sequential.h"

namespace example {

struct TinyGptOptions {
  int64_t vocab = 256;  // bytes
  int64_t seq_len = 32;
  int64_t dim = 32;
  int64_t heads = 2;
  int64_t blocks = 2;
  double dropout = 0.0;
  uint64_t seed = 0;
};

// Layer i is seeded with mix_seed(seed, i), as gpipe seeds YAML models, so the weights
// do not depend on how the model is later partitioned.
std::unique_ptr<gpipe::layers::Sequential> make_tiny_gpt(const TinyGptOptions& options);

// `model: {cpp: tiny_gpt, dim: 32, heads: 2, blocks: 2, seq_len: 32, dropout: 0, seed: 0}`
// (every option may be left out).
void register_tiny_gpt();

}  // namespace example
