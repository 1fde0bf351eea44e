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
  if (is_narrow(pos.dtype())) {  // beside a 16-bit table (check_embedding's narrow_ok); else a mismatch below
    if (pos.dim() != 2 || !pos.is_contiguous()) throw Error(std::string(op) + ": " + pos.str() + " must be 2-D");
  } else {
    check_matrix(pos, op);
  }
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

// ---- Whole-op validation: every argument of one Backend op, as both backends check it.

inline void check_adam(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, int64_t step) {
  check_float(param, "adam_step");
  check_same(param, grad, "adam_step");
  check_same(param, m, "adam_step");
  check_same(param, v, "adam_step");
  if (step < 1) throw Error("adam_step: step counts from 1, got " + std::to_string(step));
}

struct EmbeddingDims {
  int64_t B, T, V, C;
};

// embedding (table, out) and embedding_backward (dtable, dout) take the same shapes.
// narrow_ok: a 16-bit table too (a GPU's embedding reads it as it is).
inline EmbeddingDims check_embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, const Tensor& out,
                                     const char* op, const char* out_name, bool narrow_ok = false) {
  check_ids(ids, op);
  if (narrow_ok && is_narrow(table.dtype())) {
    if (table.dim() != 2 || !table.is_contiguous()) {
      throw Error(std::string(op) + ": " + table.str() + " must be a contiguous 2-D table");
    }
  } else {
    check_matrix(table, op);
  }
  const EmbeddingDims d{ids.size(0), ids.size(1), table.size(0), table.size(1)};
  check_positions(pos, table, d.T, op);
  check_shape(out, {d.B, d.T, d.C}, table.dtype(), op, out_name);
  return d;
}

// embedding_slice (table, out) and its backward (dtable, dout): the table is rows
// [first, first + V) of a vocabulary of `vocab`.
inline EmbeddingDims check_embedding_slice(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                                           const Tensor& out, const char* op, const char* out_name,
                                           bool narrow_ok = false) {
  const EmbeddingDims d = check_embedding(ids, table, Tensor(), out, op, out_name, narrow_ok);
  if (first < 0 || vocab < 1 || first + d.V > vocab || vocab > INT32_MAX) {
    throw Error(std::string(op) + ": rows [" + std::to_string(first) + ", " + std::to_string(first + d.V) +
                ") are not inside a vocabulary of " + std::to_string(vocab));
  }
  return d;
}

// The vocabulary-parallel softmax cross-entropy's steps (Backend::softmax_xent_slice_*):
// logits (R, V') columns [first, first + V') of `vocab`, one label and one value per row.
inline void check_xent_slice(const Tensor& logits, const Tensor& labels, int64_t first, int64_t vocab,
                             const Tensor& per_row, const char* op) {
  check_xent(logits, labels, logits);
  check_shape(per_row, {logits.size(0)}, logits.dtype(), op, "rowmax / lse");
  if (first < 0 || first + logits.size(1) > vocab || vocab > INT32_MAX) {
    throw Error(std::string(op) + ": columns [" + std::to_string(first) + ", " +
                std::to_string(first + logits.size(1)) + ") are not inside a vocabulary of " + std::to_string(vocab));
  }
}

// first_column_equal's: logits (R, V'), a value and an index a row, of one float type.
inline void check_first_column_equal(const Tensor& logits, const Tensor& value, const Tensor& index) {
  const char* op = "first_column_equal";
  check_matrix(logits, op);
  check_shape(value, {logits.size(0)}, logits.dtype(), op, "value");
  check_shape(index, {logits.size(0)}, logits.dtype(), op, "index");
}

// softmax_xent_slice_loss's operands: sums (2R), rowmax, lse (R) and loss (1) of one float
// type, one int32 label a row.
inline void check_xent_slice_loss(const Tensor& sums, const Tensor& rowmax, const Tensor& labels, const Tensor& lse,
                                  const Tensor& loss) {
  const char* op = "softmax_xent_slice_loss";
  const int64_t rows = rowmax.numel();
  check_float(rowmax, op);
  check_shape(sums, {2 * rows}, rowmax.dtype(), op, "sums");
  check_shape(lse, {rows}, rowmax.dtype(), op, "lse");
  check_shape(loss, {1}, rowmax.dtype(), op, "loss");
  if (labels.dtype() != DType::kI32 || labels.numel() != rows) {
    throw Error(std::string(op) + ": labels " + labels.str() + " must be int32, one per row");
  }
}

struct RowDims {
  int64_t R, C;  // rows and channels of x viewed as (R, C)
};

inline RowDims check_layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, const Tensor& y,
                               const Tensor& mean, const Tensor& rstd) {
  check_float(x, "layernorm");
  check_same(x, y, "layernorm");
  if (x.dim() < 1 || x.size(-1) == 0) throw Error("layernorm: " + x.str() + " has no channels to normalise");
  const int64_t C = x.size(-1), R = x.numel() / C;
  check_shape(gamma, {C}, x.dtype(), "layernorm", "gamma");
  check_shape(beta, {C}, x.dtype(), "layernorm", "beta");
  check_shape(mean, {R}, x.dtype(), "layernorm", "mean");
  check_shape(rstd, {R}, x.dtype(), "layernorm", "rstd");
  if (!(eps >= 0.0)) throw Error("layernorm: eps " + std::to_string(eps) + " must be >= 0");
  return {R, C};
}

inline RowDims check_layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                                        const Tensor& dbeta) {
  check_float(x, "layernorm_backward");
  check_same(x, dy, "layernorm_backward");
  check_same(x, dx, "layernorm_backward");
  if (x.dim() < 1 || x.size(-1) == 0) throw Error("layernorm_backward: " + x.str() + " has no channels");
  const int64_t C = x.size(-1), R = x.numel() / C;
  check_shape(gamma, {C}, x.dtype(), "layernorm_backward", "gamma");
  check_shape(mean, {R}, x.dtype(), "layernorm_backward", "mean");
  check_shape(rstd, {R}, x.dtype(), "layernorm_backward", "rstd");
  check_shape(dgamma, {C}, x.dtype(), "layernorm_backward", "dgamma");
  check_shape(dbeta, {C}, x.dtype(), "layernorm_backward", "dbeta");
  return {R, C};
}

inline AttentionDims check_attention_forward(const Tensor& qkv, int heads, const Tensor& probs, const Tensor& out) {
  const AttentionDims d = check_attention(qkv, heads, "attention");
  check_shape(probs, {d.B, d.H, d.T, d.T}, qkv.dtype(), "attention", "probs");
  check_shape(out, {d.B, d.T, d.C}, qkv.dtype(), "attention", "out");
  return d;
}

inline AttentionDims check_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                                              const Tensor& dqkv) {
  const AttentionDims d = check_attention(qkv, heads, "attention_backward");
  check_shape(dout, {d.B, d.T, d.C}, qkv.dtype(), "attention_backward", "dout");
  check_shape(probs, {d.B, d.H, d.T, d.T}, qkv.dtype(), "attention_backward", "probs");
  check_shape(dqkv, {d.B, d.T, 3 * d.C}, qkv.dtype(), "attention_backward", "dqkv");
  return d;
}

}  // namespace ops
}  // namespace gpipe
