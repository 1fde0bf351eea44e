// Synthetic data that can actually be learned: inputs x ~ N(0, 1) and labels from a
// fixed random teacher network, label(x) = argmax(W2 tanh(scale * W1 x)). Every batch
// is a pure function of (seed, step), so runs are reproducible and any rank could
// produce the same batch.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/tensor.h"

namespace gpipe {
namespace pipeline {

class TeacherData {
 public:
  TeacherData(int64_t input_dim, int64_t classes, int64_t hidden, double scale, uint64_t seed, DType dtype);
  // Inputs (n, input_dim) of the model's dtype and int32 labels (n), on the host.
  std::pair<Tensor, Tensor> batch(uint64_t step, int64_t n) const;
  // A held-out set drawn from a stream no training step uses.
  std::pair<Tensor, Tensor> eval_set(int64_t n) const;
  // Fraction of each class in a sample of the task (to see it is not degenerate).
  int64_t classes() const { return classes_; }

 private:
  std::pair<Tensor, Tensor> make(uint64_t stream, int64_t n) const;
  int64_t input_dim_, classes_, hidden_;
  uint64_t seed_;
  DType dtype_;
  Tensor w1_, w2_;  // float64 (hidden, input_dim), (classes, hidden)
};

}  // namespace pipeline
}  // namespace gpipe
