// The elementwise functions of Backend::unary and their derivatives, one formula for
// both backends: the CPU reference (kernels/cpu_elementwise_ops.cc) and the CUDA kernels
// (kernels/cuda_elementwise.cu) compile these same lines, in the element type T (float
// or double), so they differ only where the two math libraries' exp and tanh differ in
// the last bit. ReLU and GELU are not here: Backend::unary hands them to relu and gelu.
#pragma once

#include <cmath>

#include "kernels/unary.h"

#if defined(__CUDACC__)
#define GPIPE_UNARY_FN __host__ __device__ inline
#else
#define GPIPE_UNARY_FN inline
#endif

namespace gpipe {
namespace ops {

// The math library of the side compiling: CUDA's device functions on the GPU, <cmath> on
// the host.
GPIPE_UNARY_FN float exp_of(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
GPIPE_UNARY_FN double exp_of(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
GPIPE_UNARY_FN float tanh_of(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}
GPIPE_UNARY_FN double tanh_of(double x) {
#if defined(__CUDA_ARCH__)
  return ::tanh(x);
#else
  return std::tanh(x);
#endif
}
GPIPE_UNARY_FN float sqrt_of(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);  // IEEE (no fast-math), as <cmath>'s
#else
  return std::sqrt(x);
#endif
}
GPIPE_UNARY_FN double sqrt_of(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// 1 / (1 + e^-x), with the exponential of a non-positive number only (no overflow).
template <typename T>
GPIPE_UNARY_FN T sigmoid_of(T x) {
  if (x >= T(0)) return T(1) / (T(1) + exp_of(-x));
  const T e = exp_of(x);
  return e / (T(1) + e);
}

// SiLU's value x s and its slope s + x s (1 - s), and the sigmoid's slope s (1 - s), from
// s = sigmoid(x): unary_value and unary_slope compute them this way, and a fused SwiGLU's
// backward both of SiLU's from one sigmoid.
template <typename T>
GPIPE_UNARY_FN T silu_from_sigmoid(T x, T s) {
  return x * s;
}
template <typename T>
GPIPE_UNARY_FN T silu_slope_from_sigmoid(T x, T s) {
  return s * (T(1) + x * (T(1) - s));
}
// The sigmoid's slope s (1 - s), from s.
template <typename T>
GPIPE_UNARY_FN T sigmoid_slope_from_sigmoid(T s) {
  return s * (T(1) - s);
}

// f(x) for f other than ReLU and GELU.
template <typename T>
GPIPE_UNARY_FN T unary_value(Unary f, T x) {
  switch (f) {
    case Unary::kSilu: return silu_from_sigmoid(x, sigmoid_of(x));
    case Unary::kSigmoid: return sigmoid_of(x);
    case Unary::kTanh: return tanh_of(x);
    case Unary::kExp: return exp_of(x);
    case Unary::kSquare: return x * x;
    case Unary::kRsqrt: return T(1) / sqrt_of(x);
    default: return x;  // kRelu, kGelu: never reach here (Backend::unary)
  }
}

// f'(x), from the input x (so a layer keeps its input for backward, and recompute needs
// nothing else).
template <typename T>
GPIPE_UNARY_FN T unary_slope(Unary f, T x) {
  switch (f) {
    case Unary::kSilu: return silu_slope_from_sigmoid(x, sigmoid_of(x));
    case Unary::kSigmoid: return sigmoid_slope_from_sigmoid(sigmoid_of(x));
    case Unary::kTanh: {
      const T t = tanh_of(x);
      return T(1) - t * t;
    }
    case Unary::kExp: return exp_of(x);
    case Unary::kSquare: return T(2) * x;
    case Unary::kRsqrt: {  // -x^(-3/2) / 2
      const T r = T(1) / sqrt_of(x);
      return T(-0.5) * r * r * r;
    }
    default: return T(1);  // kRelu, kGelu: never reach here
  }
}

}  // namespace ops
}  // namespace gpipe
