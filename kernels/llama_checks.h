// Argument checks of the LLaMA ops (Backend::rope, rope_backward, pack_qkv,
// pack_qkv_backward), shared by every backend so that CPU and CUDA reject the same calls
// with the same messages. A head width or a head count a config chose is a UserError
// naming the fix; a wrong buffer from a layer is an Error.
#pragma once

#include <string>

#include "kernels/op_checks.h"
#include "runtime/error.h"

namespace gpipe {
namespace ops {

// x viewed as (B, T, heads, D): B, T, D.
struct RopeDims {
  int64_t batch, seq, head_dim;
};

// What check_rope checks but the element type (a GPU rotates 16-bit storage itself).
inline RopeDims check_rope_dims(const Tensor& x, const Tensor& y, int heads, double base, const char* op) {
  check_same(x, y, op);
  if (!x.is_contiguous()) throw Error(std::string(op) + ": " + x.str() + " must be contiguous");
  if (x.dim() != 3) throw Error(std::string(op) + ": " + x.str() + " must be (B, T, heads * head_dim)");
  const int64_t C = x.size(2);
  if (heads <= 0 || C % heads != 0) {
    throw UserError(std::string(op) + ": " + std::to_string(C) + " channels do not split into " +
                    std::to_string(heads) + " heads; choose heads that divide the width");
  }
  const int64_t D = C / heads;
  if (D % 2 != 0) {
    throw UserError(std::string(op) + ": rotary embeddings rotate pairs of a head's channels, and the head width " +
                    std::to_string(D) + " (" + std::to_string(C) + " / " + std::to_string(heads) +
                    " heads) is odd; choose dim and heads with an even dim / heads");
  }
  if (!(base > 1.0)) {
    throw UserError(std::string(op) + ": the rotary base must be greater than 1, got " + std::to_string(base) +
                    "; LLaMA uses 10000");
  }
  return {x.size(0), x.size(1), D};
}

inline RopeDims check_rope(const Tensor& x, const Tensor& y, int heads, double base, const char* op) {
  check_float(x, op);
  return check_rope_dims(x, y, heads, base, op);
}

// q (B, T, H D), k and v (B, T, KV D), qkv (B, T, 3 H D): B, T, D, H, KV.
struct PackDims {
  int64_t batch, seq, head_dim, heads, kv_heads;
};

inline PackDims check_pack_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qkv, int heads,
                               const char* op) {
  for (const Tensor* t : {&q, &k, &v, &qkv}) {
    check_float(*t, op);
    if (t->dim() != 3 || !t->is_contiguous() || t->dtype() != q.dtype()) {
      throw Error(std::string(op) + ": " + t->str() + " must be contiguous (B, T, C) of " + dtype_name(q.dtype()));
    }
  }
  const int64_t B = q.size(0), T = q.size(1), C = q.size(2), KC = k.size(2);
  if (heads <= 0 || C <= 0 || C % heads != 0) {
    throw UserError(std::string(op) + ": " + std::to_string(C) + " channels do not split into " +
                    std::to_string(heads) + " heads; choose heads that divide the width");
  }
  const int64_t D = C / heads;
  if (KC % D != 0 || KC == 0 || heads % (KC / D) != 0) {
    throw UserError(std::string(op) + ": " + std::to_string(KC) + " key/value channels are not a whole number of " +
                    std::to_string(D) + "-wide heads dividing the " + std::to_string(heads) +
                    " query heads; choose kv_heads that divide heads");
  }
  if (k.shape() != v.shape() || k.size(0) != B || k.size(1) != T || qkv.shape() != Shape{B, T, 3 * C}) {
    throw Error(std::string(op) + ": q " + q.str() + ", k " + k.str() + ", v " + v.str() + " and qkv " + qkv.str() +
                " must be (B, T, H D), (B, T, KV D) twice and (B, T, 3 H D)");
  }
  return {B, T, D, heads, KC / D};
}

}  // namespace ops
}  // namespace gpipe
