// Argument checks of the convolution ops, shared by the CPU reference
// (kernels/cpu_conv_ops.cc) and the CUDA backend (kernels/cuda_conv_ops.cc), so both
// reject the same calls with the same messages.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/op_checks.h"
#include "runtime/dtype.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace ops {

// A layer validates what a user wrote; these catch a layer (or a test) passing the
// wrong buffer, so they are Errors that name every operand.

inline std::string str(const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); }

inline void check_4d(const Tensor& t, const char* op, const char* what) {
  if (!t.defined() || t.dim() != 4) {
    throw Error(std::string(op) + ": " + what + " " + str(t) + " must be a 4-D NCHW tensor");
  }
  check_float(t, op);
}

// `t` must be contiguous, of `like`'s dtype and of shape `want`.
inline void check_shape(const Tensor& t, const Tensor& like, const Shape& want, const char* op, const char* what,
                        const std::string& because) {
  if (!t.defined() || t.dtype() != like.dtype() || t.shape() != want || !t.is_contiguous()) {
    throw Error(std::string(op) + ": " + what + " is " + str(t) + ", expected contiguous " + dtype_name(like.dtype()) +
                shape_str(want) + " " + because);
  }
}

inline void check_window(int kernel, int stride, int pad, const char* op) {
  if (kernel < 1 || stride < 1 || pad < 0) {
    throw Error(std::string(op) + ": kernel " + std::to_string(kernel) + ", stride " + std::to_string(stride) +
                " and pad " + std::to_string(pad) + " must be >= 1, >= 1 and >= 0");
  }
}

// Output extent of a window sliding over `in` (+ padding on both sides); the message
// names the input when the window does not fit even once.
inline int64_t out_extent(int64_t in, int64_t kernel, int stride, int pad, const Tensor& x, const char* op) {
  if (in + 2 * pad < kernel) {
    throw Error(std::string(op) + ": a " + std::to_string(kernel) + "-wide window does not fit in input " + x.str() +
                " with padding " + std::to_string(pad));
  }
  return (in + 2 * pad - kernel) / stride + 1;
}

struct ConvDims {
  int64_t N, C, H, W;  // input
  int64_t K, R, S;     // weights
  int64_t P, Q;        // output
};

inline ConvDims check_conv(const Tensor& x, const Tensor& w, int stride, int pad, const char* op) {
  check_4d(x, op, "input");
  check_4d(w, op, "weight");
  if (stride < 1 || pad < 0) {
    throw Error(std::string(op) + ": stride " + std::to_string(stride) + " and pad " + std::to_string(pad) +
                " must be >= 1 and >= 0");
  }
  if (w.dtype() != x.dtype()) {
    throw Error(std::string(op) + ": input " + x.str() + " and weight " + w.str() + " differ in dtype");
  }
  ConvDims d{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), 0, 0};
  if (w.size(1) != d.C) {
    throw Error(std::string(op) + ": input " + x.str() + " and weight " + w.str() + " do not fit: the weight takes " +
                std::to_string(w.size(1)) + " input channels, the input has " + std::to_string(d.C));
  }
  if (d.K < 1 || d.C < 1 || d.R < 1 || d.S < 1) throw Error(std::string(op) + ": empty weight " + w.str());
  d.P = out_extent(d.H, d.R, stride, pad, x, op);
  d.Q = out_extent(d.W, d.S, stride, pad, x, op);
  return d;
}

inline std::string conv_because(const Tensor& x, const Tensor& w, int stride, int pad) {
  return "for input " + shape_str(x.shape()) + " and weight " + shape_str(w.shape()) + " (stride " +
         std::to_string(stride) + ", pad " + std::to_string(pad) + ")";
}

// Per-channel view of an (N, C, ...) tensor: channel c of sample n is the contiguous
// run [(n C + c) E, (n C + c + 1) E), E = positions per plane.
struct ChannelDims {
  int64_t N, C, E;
};
inline ChannelDims channel_dims(const Tensor& t) {
  return {t.size(0), t.size(1), t.numel() / std::max<int64_t>(1, t.size(0) * t.size(1))};
}

inline void check_per_channel(const Tensor& v, const Tensor& x, const char* op, const char* what) {
  check_shape(v, x, {x.size(1)}, op, what, "(one value per channel of " + x.str() + ")");
}

struct PoolDims {
  int64_t N, C, H, W, P, Q;
};

// beta is null for backward, which does not take it.
inline void check_batchnorm(const Tensor& x, const Tensor& gamma, const Tensor* beta, double eps, const char* op) {
  check_4d(x, op, "input");
  check_per_channel(gamma, x, op, "gamma");
  if (beta != nullptr) check_per_channel(*beta, x, op, "beta");
  if (!(eps >= 0)) throw Error(std::string(op) + ": eps " + std::to_string(eps) + " must be >= 0");
  if (x.size(0) * x.size(2) * x.size(3) == 0) {
    throw Error(std::string(op) + ": input " + x.str() + " has no values per channel to normalise over");
  }
}

// Max pooling's padding must leave every window at least one real value (PyTorch's
// rule, pad <= kernel / 2), so that each output has a maximum and an argmax.
inline PoolDims check_maxpool(const Tensor& x, int kernel, int stride, int pad, const char* op) {
  check_4d(x, op, "input");
  check_window(kernel, stride, pad, op);
  if (pad > kernel / 2) {
    throw Error(std::string(op) + ": pad " + std::to_string(pad) + " must be at most half the kernel (" +
                std::to_string(kernel) + "), or some windows would hold only padding");
  }
  return {x.size(0),
          x.size(1),
          x.size(2),
          x.size(3),
          out_extent(x.size(2), kernel, stride, pad, x, op),
          out_extent(x.size(3), kernel, stride, pad, x, op)};
}

inline std::string pool_because(const Tensor& x, int kernel, int stride, int pad) {
  return "for input " + shape_str(x.shape()) + " (kernel " + std::to_string(kernel) + ", stride " +
         std::to_string(stride) + ", pad " + std::to_string(pad) + ")";
}

inline PoolDims check_avgpool(const Tensor& x, int kernel, int stride, const char* op) {
  check_4d(x, op, "input");
  check_window(kernel, stride, 0, op);
  return {x.size(0),
          x.size(1),
          x.size(2),
          x.size(3),
          out_extent(x.size(2), kernel, stride, 0, x, op),
          out_extent(x.size(3), kernel, stride, 0, x, op)};
}

}  // namespace ops
}  // namespace gpipe
