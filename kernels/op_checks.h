// Argument checks shared by every backend, so CPU and CUDA reject the same mistakes
// with the same messages.
#pragma once

#include <string>

#include "runtime/bf16.h"
#include "runtime/error.h"
#include "runtime/fp16.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace ops {

// Calls f(Real*) with a null pointer of the tensor's element type, float or double
// (the pointer is a tag).
template <typename F>
inline void dispatch_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::kF32) {
    f(static_cast<float*>(nullptr));
  } else if (t.dtype() == DType::kF64) {
    f(static_cast<double*>(nullptr));
  } else {
    throw Error("expected a float32 or float64 tensor, got " + t.str());
  }
}

// Calls f(S*) with a null pointer of the tensor's storage type: float, double, BFloat16
// or Half (runtime/bf16.h, fp16.h), for the ops a GPU computes on 16-bit operands as they
// are (Backend::computes_narrow).
template <typename F>
void dispatch_storage(const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::kF32: return f(static_cast<float*>(nullptr));
    case DType::kF64: return f(static_cast<double*>(nullptr));
    case DType::kBF16: return f(static_cast<BFloat16*>(nullptr));
    case DType::kF16: return f(static_cast<Half*>(nullptr));
    default: throw Error("expected a float32, float64, bfloat16 or float16 tensor, got " + t.str());
  }
}

inline void check_float(const Tensor& t, const char* op) {
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kF64) {
    throw Error(std::string(op) + ": " + t.str() + " must be float32 or float64");
  }
  if (!t.is_contiguous()) throw Error(std::string(op) + ": " + t.str() + " must be contiguous");
}

inline void check_cast(const Tensor& src, const Tensor& dst) {
  auto castable = [](DType t) { return t == DType::kF32 || t == DType::kF64 || is_narrow(t); };
  if (!castable(src.dtype()) || !castable(dst.dtype())) {
    throw Error("cast: " + src.str() + " -> " + dst.str() + ": float32, float64, bfloat16 and float16 only");
  }
  if (is_narrow(src.dtype()) && is_narrow(dst.dtype()) && src.dtype() != dst.dtype()) {
    throw Error("cast: " + src.str() + " -> " + dst.str() + ": between bfloat16 and float16, go through float32");
  }
  if (src.numel() != dst.numel()) throw Error("cast: " + src.str() + " -> " + dst.str() + " differ in size");
  if (!src.is_contiguous() || !dst.is_contiguous()) {
    throw Error("cast: " + src.str() + " -> " + dst.str() + " must be contiguous");
  }
}

inline void check_same(const Tensor& a, const Tensor& b, const char* op) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) {
    throw Error(std::string(op) + ": operands " + a.str() + " and " + b.str() + " differ in dtype or shape");
  }
  if (!b.is_contiguous()) throw Error(std::string(op) + ": " + b.str() + " must be contiguous");
}

inline void check_matrix(const Tensor& t, const char* op) {
  check_float(t, op);
  if (t.dim() != 2) throw Error(std::string(op) + ": " + t.str() + " must be 2-D");
}

// Shapes of c = op(a) @ op(b); returns {M, N, K}.
struct GemmDims {
  int64_t m, n, k;
};
// The dimensions alone, for operands already checked to be 2-D.
inline GemmDims matmul_dims(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c) {
  const int64_t m = ta ? a.size(1) : a.size(0);
  const int64_t k = ta ? a.size(0) : a.size(1);
  const int64_t kb = tb ? b.size(1) : b.size(0);
  const int64_t n = tb ? b.size(0) : b.size(1);
  if (k != kb || c.size(0) != m || c.size(1) != n) {
    throw Error("matmul: shapes do not fit: " + shape_str(a.shape()) + (ta ? "^T" : "") + " @ " +
                shape_str(b.shape()) + (tb ? "^T" : "") + " -> " + shape_str(c.shape()));
  }
  return {m, n, k};
}

inline GemmDims check_matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c) {
  check_matrix(a, "matmul");
  check_matrix(b, "matmul");
  check_matrix(c, "matmul");
  if (a.dtype() != b.dtype() || a.dtype() != c.dtype()) throw Error("matmul: mixed dtypes");
  return matmul_dims(a, ta, b, tb, c);
}

inline void check_xent(const Tensor& logits, const Tensor& labels, const Tensor& probs) {
  check_matrix(logits, "softmax_xent");
  if (labels.dtype() != DType::kI32 || labels.dim() != 1 || labels.size(0) != logits.size(0)) {
    throw Error("softmax_xent: labels " + labels.str() + " must be int32 with one label per row of " +
                logits.str());
  }
  check_same(logits, probs, "softmax_xent");
}

inline void check_argmax_correct(const Tensor& logits, const Tensor& labels) {
  check_matrix(logits, "argmax_correct");
  if (labels.dtype() != DType::kI32 || labels.dim() != 1 || labels.size(0) != logits.size(0) ||
      !labels.is_contiguous()) {
    throw Error("argmax_correct: labels " + labels.str() + " must be int32 with one label per row of " +
                logits.str());
  }
}

// transpose_blocks' operands (kernels/backend_ops.inc): returns the bytes of one block.
inline int64_t check_transpose_blocks(const Tensor& src, int64_t rows, int64_t cols, const Tensor& dst) {
  const std::string what = "transpose_blocks of " + src.str() + " into " + dst.str();
  GPIPE_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(), what + ": one dtype and size");
  GPIPE_CHECK(src.is_contiguous() && dst.is_contiguous(), what + ": contiguous tensors");
  GPIPE_CHECK(rows >= 1 && cols >= 1 && src.numel() % (rows * cols) == 0,
              what + ": no " + std::to_string(rows) + " x " + std::to_string(cols) + " equal blocks");
  const auto* s = static_cast<const char*>(src.raw_data());
  const auto* d = static_cast<const char*>(dst.raw_data());
  const size_t n = src.nbytes();
  GPIPE_CHECK(n == 0 || s + n <= d || d + n <= s, what + ": the two overlap (not in place)");
  return static_cast<int64_t>(n) / (rows * cols);
}

}  // namespace ops
}  // namespace gpipe
