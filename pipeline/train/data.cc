#include "pipeline/train/data.h"

#include <cmath>
#include <vector>

#include "kernels/backend.h"
#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace pipeline {

TeacherData::TeacherData(int64_t input_dim, int64_t classes, int64_t hidden, double scale, uint64_t seed,
                         DType dtype)
    : input_dim_(input_dim), classes_(classes), hidden_(hidden), seed_(seed), dtype_(dtype) {
  if (classes < 2) throw UserError("data.classes must be at least 2, got " + std::to_string(classes));
  Rng rng(mix_seed(seed, 0xDA7A));
  w1_ = Tensor::empty({hidden, input_dim}, DType::kF64, Device::cpu());
  w2_ = Tensor::empty({classes, hidden}, DType::kF64, Device::cpu());
  const double s1 = scale / std::sqrt(static_cast<double>(input_dim));
  const double s2 = 1.0 / std::sqrt(static_cast<double>(hidden));
  for (int64_t i = 0; i < w1_.numel(); ++i) w1_.data<double>()[i] = s1 * rng.normal();
  for (int64_t i = 0; i < w2_.numel(); ++i) w2_.data<double>()[i] = s2 * rng.normal();
}

std::pair<Tensor, Tensor> TeacherData::make(uint64_t stream, int64_t n) const {
  Backend& be = backend_for(Device::cpu());
  Tensor x64 = Tensor::empty({n, input_dim_}, DType::kF64, Device::cpu());  // (n, D)
  Rng rng(mix_seed(seed_, stream));
  for (int64_t i = 0; i < x64.numel(); ++i) x64.data<double>()[i] = rng.normal();
  Tensor h = Tensor::empty({n, hidden_}, DType::kF64, Device::cpu());  // (n, H)
  be.matmul(x64, false, w1_, true, h);
  for (int64_t i = 0; i < h.numel(); ++i) h.data<double>()[i] = std::tanh(h.data<double>()[i]);
  Tensor logits = Tensor::empty({n, classes_}, DType::kF64, Device::cpu());  // (n, C)
  be.matmul(h, false, w2_, true, logits);

  Tensor y = Tensor::empty({n}, DType::kI32, Device::cpu());
  for (int64_t i = 0; i < n; ++i) {
    const double* row = logits.data<double>() + i * classes_;
    int32_t best = 0;
    for (int64_t c = 1; c < classes_; ++c) {
      if (row[c] > row[best]) best = static_cast<int32_t>(c);
    }
    y.data<int32_t>()[i] = best;
  }
  if (dtype_ == DType::kF64) return {x64, y};
  Tensor x = Tensor::empty({n, input_dim_}, dtype_, Device::cpu());
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(x64.data<double>()[i]);
  return {x, y};
}

std::pair<Tensor, Tensor> TeacherData::batch(uint64_t step, int64_t n) const { return make(step + 1, n); }

std::pair<Tensor, Tensor> TeacherData::eval_set(int64_t n) const { return make(0, n); }

}  // namespace pipeline
}  // namespace gpipe
