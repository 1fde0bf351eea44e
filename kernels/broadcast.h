// The broadcasting binary ops, the last-axis reductions and their shapes (Backend::binary,
// sum_to, reduce_rows; kernels/backend.h), shared by the CPU reference and the CUDA
// kernels so that both index the same way and reject the same calls with the same
// messages.
//
// Broadcasting is NumPy's: shapes are aligned at their last dimension, a missing leading
// dimension counts as 1, and two sizes fit when they are equal or one of them is 1.
#pragma once

#include <cstdint>
#include <string>

#if !defined(__CUDACC__)
#include "kernels/op_checks.h"
#endif

#if defined(__CUDACC__)
#define GPIPE_BROADCAST_FN __host__ __device__ inline
#else
#define GPIPE_BROADCAST_FN inline
#endif

namespace gpipe {

// y = a op b elementwise, broadcast.
enum class Binary { kAdd, kSub, kMul, kDiv };
// A reduction over the last axis: sum, mean, max (the largest; a NaN wins), norm
// (sqrt of the sum of squares).
enum class Reduce { kSum, kMean, kMax, kNorm };

inline const char* binary_name(Binary op) {
  switch (op) {
    case Binary::kAdd: return "add";
    case Binary::kSub: return "sub";
    case Binary::kMul: return "mul";
    case Binary::kDiv: return "div";
  }
  return "?";
}
inline const char* reduce_name(Reduce op) {
  switch (op) {
    case Reduce::kSum: return "sum";
    case Reduce::kMean: return "mean";
    case Reduce::kMax: return "max";
    case Reduce::kNorm: return "norm";
  }
  return "?";
}

template <typename T>
GPIPE_BROADCAST_FN T binary_value(Binary op, T a, T b) {
  switch (op) {
    case Binary::kAdd: return a + b;
    case Binary::kSub: return a - b;
    case Binary::kMul: return a * b;
    case Binary::kDiv: return a / b;
  }
  return a;
}

namespace ops {

constexpr int kMaxBroadcastDims = 8;

// How an output of `dims` dimensions reads two operands: element (i_0, ..., i_{d-1}) of
// the output reads a at sum_k i_k a_stride[k] and b at sum_k i_k b_stride[k]; a stride
// is 0 along a dimension the operand broadcasts. Plain data, passed to CUDA kernels by
// value.
struct Broadcast {
  int dims = 0;
  int64_t size[kMaxBroadcastDims] = {};
  int64_t a_stride[kMaxBroadcastDims] = {};
  int64_t b_stride[kMaxBroadcastDims] = {};
  int64_t numel = 1;
};

#if !defined(__CUDACC__)  // the checks, on the host side of both backends
// The broadcast shape of a and b, or an Error naming both.
inline Shape broadcast_shape(const Shape& a, const Shape& b, const char* op) {
  const size_t d = a.size() > b.size() ? a.size() : b.size();
  Shape out(d, 1);
  for (size_t k = 0; k < d; ++k) {
    const int64_t sa = k + a.size() >= d ? a[k + a.size() - d] : 1;
    const int64_t sb = k + b.size() >= d ? b[k + b.size() - d] : 1;
    if (sa != sb && sa != 1 && sb != 1) {
      throw Error(std::string(op) + ": shapes " + shape_str(a) + " and " + shape_str(b) +
                  " do not broadcast (dimension " + std::to_string(k) + " of the result: " + std::to_string(sa) +
                  " against " + std::to_string(sb) + "; sizes must be equal or 1, aligned at the last dimension)");
    }
    out[k] = sa == 1 ? sb : sa;
  }
  return out;
}

// The strides of operand `s` (contiguous) read as a tensor of shape `out`, 0 where it
// broadcasts.
inline void broadcast_strides(const Shape& s, const Shape& out, int64_t* strides) {
  const size_t d = out.size();
  int64_t stride = 1;
  for (size_t k = d; k-- > 0;) {
    const int64_t size = k + s.size() >= d ? s[k + s.size() - d] : 1;
    strides[k] = size == 1 ? 0 : stride;
    stride *= size;
  }
}

// Checks y = a op b (one float dtype, contiguous; y of the broadcast shape) and plans it.
inline Broadcast check_binary(const Tensor& a, const Tensor& b, const Tensor& y, const char* op) {
  check_float(a, op);
  check_float(b, op);
  check_float(y, op);
  if (a.dtype() != b.dtype() || a.dtype() != y.dtype()) {
    throw Error(std::string(op) + ": operands " + a.str() + ", " + b.str() + " and result " + y.str() +
                " differ in dtype");
  }
  const Shape out = broadcast_shape(a.shape(), b.shape(), op);
  if (out != y.shape()) {
    throw Error(std::string(op) + ": the result " + y.str() + " must have the broadcast shape " + shape_str(out));
  }
  if (out.size() > static_cast<size_t>(kMaxBroadcastDims)) {
    throw Error(std::string(op) + ": " + std::to_string(out.size()) + " dimensions; at most " +
                std::to_string(kMaxBroadcastDims) + " (reshape first)");
  }
  Broadcast p;
  p.dims = static_cast<int>(out.size());
  for (int k = 0; k < p.dims; ++k) {
    p.size[k] = out[k];
    p.numel *= out[k];
  }
  broadcast_strides(a.shape(), out, p.a_stride);
  broadcast_strides(b.shape(), out, p.b_stride);
  return p;
}

// Checks y = x summed over the dimensions y broadcasts along (y's shape broadcasts to
// x's) and plans it as x read at a stride 1 (the "a" side) and y at 0 along the summed
// dimensions (the "b" side).
inline Broadcast check_sum_to(const Tensor& x, const Tensor& y) {
  check_float(x, "sum_to");
  check_float(y, "sum_to");
  if (x.dtype() != y.dtype()) throw Error("sum_to: " + x.str() + " and " + y.str() + " differ in dtype");
  const Shape out = broadcast_shape(x.shape(), y.shape(), "sum_to");
  if (out != x.shape()) {
    throw Error("sum_to: " + y.str() + " does not broadcast to " + x.str() + " (the sum's shape must broadcast to x's)");
  }
  if (out.size() > static_cast<size_t>(kMaxBroadcastDims)) {
    throw Error("sum_to: " + std::to_string(out.size()) + " dimensions; at most " + std::to_string(kMaxBroadcastDims));
  }
  Broadcast p;
  p.dims = static_cast<int>(out.size());
  for (int k = 0; k < p.dims; ++k) {
    p.size[k] = out[k];
    p.numel *= out[k];
  }
  broadcast_strides(x.shape(), out, p.a_stride);
  broadcast_strides(y.shape(), out, p.b_stride);
  return p;
}
#endif

}  // namespace ops
}  // namespace gpipe
