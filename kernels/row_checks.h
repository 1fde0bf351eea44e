// Argument checks of the generic elementwise and row ops (Backend::mul, scale_rows,
// scale_columns, row_dot, row_inverse_rms), shared by every backend so that CPU and CUDA
// reject the same calls with the same messages.
#pragma once

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

}  // namespace ops
}  // namespace gpipe
