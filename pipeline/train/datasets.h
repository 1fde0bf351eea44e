// Training data. A Dataset hands out a mini-batch for a step as host tensors
// (inputs, targets) and a fixed validation set in batches. Every batch is a pure
// function of (seed, step), so runs are reproducible and any rank can produce any
// batch. Files are read whole at start; a missing or malformed file is a UserError
// that names the file and what is wrong with it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/config/config.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace pipeline {

// The key of step `step`'s training batch (Dataset::batch): a function of train.seed and
// the step only, so every process, every launch and every K and M draw the same batch.
inline uint64_t batch_key(uint64_t train_seed, int64_t step) {
  return train_seed * 1000003ULL + static_cast<uint64_t>(step);
}

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Inputs (n, *input_shape()) and targets (n, *target_shape()) for a training step.
  virtual std::pair<Tensor, Tensor> batch(uint64_t step, int64_t n) const = 0;
  // Validation samples [first, first + n); validation_size() of them in all.
  virtual std::pair<Tensor, Tensor> validation(int64_t first, int64_t n) const = 0;
  virtual int64_t validation_size() const = 0;
  virtual Shape input_shape() const = 0;
  virtual DType input_dtype() const = 0;
  virtual Shape target_shape() const = 0;  // {} for one class per sample, {T} for tokens
  virtual int64_t classes() const = 0;      // target values lie in [0, classes)
  virtual std::string describe() const = 0;
};

// A learnable synthetic task: x ~ N(0, 1), label(x) = argmax(W2 tanh(scale W1 x)) for a
// fixed random teacher network.
std::unique_ptr<Dataset> make_teacher_data(int64_t input_dim, int64_t classes, int64_t hidden, double scale,
                                           uint64_t seed, DType dtype, int64_t validation_samples);

// Language modelling on token sequences: a sample is a window of seq_len + 1 tokens at
// a random offset; inputs are its first seq_len tokens, targets the next ones. The
// last `validation_fraction` of the tokens is held out and read in consecutive
// windows.
std::unique_ptr<Dataset> make_token_data(std::vector<int32_t> tokens, int64_t vocab, int64_t seq_len,
                                         double validation_fraction, uint64_t seed, std::string name);
// Bytes of any file as tokens (vocabulary 256).
std::vector<int32_t> read_byte_tokens(const std::string& path);
// A file of little-endian uint16 token ids, each below vocab.
std::vector<int32_t> read_uint16_tokens(const std::string& path, int64_t vocab);

// CIFAR-10's binary format: records of 1 label byte (0-9) and 3072 pixel bytes (1024
// red, 1024 green, 1024 blue, row-major 32x32). Images are scaled to [0, 1] and
// normalised per channel with CIFAR-10's mean and standard deviation. The last
// `validation_fraction` of the records is held out.
std::unique_ptr<Dataset> make_cifar_data(const std::string& path, double validation_fraction, uint64_t seed);

// The dataset a config's data section describes (the trainer's and the profiler's).
std::unique_ptr<Dataset> make_dataset(const Config& config);

}  // namespace pipeline
}  // namespace gpipe
