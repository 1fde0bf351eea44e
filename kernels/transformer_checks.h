// Argument checks of the transformer ops, shared by the CPU reference
// (kernels/cpu_transformer_ops.cc) and the CUDA backend, so both reject the same calls
// with the same messages. Checks that need host data or BLAS's int range stay in the
// CPU file.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/op_checks.h"
#include "runtime/dtype.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace ops {

// Internal mistakes (a layer passing the wrong buffer) are Errors; what a user can cause
// (a dropout probability) is a UserError that names the value and the fix.

inline void check_shape(const Tensor& t, const Shape& want, DType dtype, const char* op, const char* what) {
  if (!t.defined() || t.dtype() != dtype || t.shape() != want || !t.is_contiguous()) {
    throw Error(std::string(op) + ": " + what + " is " + (t.defined() ? t.str() : std::string("undefined")) +
                ", expected contiguous " + dtype_name(dtype) + shape_str(want));
  }
}

inline void check_ids(const Tensor& ids, const char* op) {
  if (!ids.defined() || ids.dtype() != DType::kI32 || ids.dim() != 2 || !ids.is_contiguous()) {
    throw Error(std::string(op) + ": token ids " + (ids.defined() ? ids.str() : std::string("undefined")) +
                " must be contiguous int32 (B, T)");
  }
}

// pos: (P >= T, C) of the table's dtype, or undefined.
inline void check_positions(const Tensor& pos, const Tensor& table, int64_t T, const char* op) {
  if (!pos.defined()) return;
  check_matrix(pos, op);
  if (pos.dtype() != table.dtype() || pos.size(1) != table.size(1) || pos.size(0) < T) {
    throw Error(std::string(op) + ": position table " + pos.str() + " must be " + dtype_name(table.dtype()) +
                " (P >= " + std::to_string(T) + ", " + std::to_string(table.size(1)) + ")");
  }
}

struct AttentionDims {
  int64_t B, T, C, H, D;
};

// qkv (B, T, 3C) with C divisible by heads.
inline AttentionDims check_attention(const Tensor& qkv, int heads, const char* op) {
  check_float(qkv, op);
  if (qkv.dim() != 3 || qkv.size(2) % 3 != 0) {
    throw Error(std::string(op) + ": qkv " + qkv.str() + " must be (B, T, 3C)");
  }
  const int64_t C = qkv.size(2) / 3;
  if (heads < 1 || C % heads != 0) {
    throw Error(std::string(op) + ": " + std::to_string(C) + " channels do not split into " +
                std::to_string(heads) + " heads");
  }
  return {qkv.size(0), qkv.size(1), C, heads, C / heads};
}

inline void check_dropout_p(double p, const char* op) {
  if (!(p >= 0.0 && p < 1.0)) {  // also rejects NaN
    throw UserError(std::string(op) + ": dropout probability " + std::to_string(p) +
                    " must be in [0, 1); use 0 to disable dropout");
  }
}

}  // namespace ops
}  // namespace gpipe
