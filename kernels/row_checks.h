// Argument checks of the generic elementwise and row ops (Backend::mul, scale_rows,
// scale_columns, row_dot, row_inverse_rms), shared by every backend so that CPU and CUDA
// reject the same calls with the same messages.
#pragma once

#include <initializer_list>
#include <string>

#include "kernels/op_checks.h"

namespace gpipe {
namespace ops {

// x viewed as (rows, cols), cols its last dimension.
struct RowView {
  int64_t rows, cols;
};

inline RowView check_rows(const Tensor& x, const char* op) {
  check_float(x, op);
  if (x.dim() < 1) throw Error(std::string(op) + ": " + x.str() + " needs at least one dimension");
  const int64_t cols = x.size(x.dim() - 1);
  return {cols > 0 ? x.numel() / cols : 0, cols};
}

// A per-row or per-column factor: `n` contiguous elements of `dtype`, any shape.
inline void check_factor(const Tensor& v, int64_t n, DType dtype, const char* op, const char* what) {
  if (v.dtype() != dtype || v.numel() != n || !v.is_contiguous()) {
    throw Error(std::string(op) + ": " + what + " " + v.str() + " must be " + dtype_name(dtype) + " with " +
                std::to_string(n) + " contiguous elements");
  }
}

// The fused ops (Backend::rmsnorm, swiglu and their backward ops) on a GPU: x of a float
// or 16-bit type t, contiguous; `like_x` of x's shape and type; g (C) of t; rstd (R)
// and dg (C) of master_dtype(t) (each may be null where the op has none).
inline RowView check_fused(const Tensor& x, std::initializer_list<const Tensor*> like_x, const Tensor* g,
                           const Tensor* rstd, const Tensor* dg, const char* op) {
  const DType t = x.dtype();
  if (t != DType::kF32 && t != DType::kF64 && !is_narrow(t)) {
    throw Error(std::string(op) + ": " + x.str() + " must be float32, float64, bfloat16 or float16");
  }
  if (!x.is_contiguous()) throw Error(std::string(op) + ": " + x.str() + " must be contiguous");
  if (x.dim() < 1) throw Error(std::string(op) + ": " + x.str() + " needs at least one dimension");
  for (const Tensor* y : like_x) check_same(x, *y, op);
  const int64_t cols = x.size(x.dim() - 1);
  const RowView v{cols > 0 ? x.numel() / cols : 0, cols};
  if (g != nullptr) check_factor(*g, v.cols, t, op, "g");
  if (rstd != nullptr) check_factor(*rstd, v.rows, master_dtype(t), op, "rstd");
  if (dg != nullptr) check_factor(*dg, v.cols, master_dtype(t), op, "dg");
  return v;
}

}  // namespace ops
}  // namespace gpipe
