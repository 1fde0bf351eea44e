// The elementwise functions a layer can apply with Backend::unary and differentiate with
// Backend::unary_backward (kernels/backend.h); their formulas are kernels/unary_math.h.
#pragma once

namespace gpipe {

enum class Unary {
  kRelu,     // max(x, 0); f' = 1 where x > 0, else 0
  kGelu,     // x Phi(x), the exact GELU (erf); f' = Phi(x) + x phi(x)
  kSilu,     // x sigmoid(x) (swish); f' = s (1 + x (1 - s)), s = sigmoid(x)
  kSigmoid,  // 1 / (1 + e^-x); f' = s (1 - s)
  kTanh,     // tanh x; f' = 1 - tanh^2 x
  kExp,      // e^x; f' = e^x
  kSquare,   // x^2; f' = 2 x
  kRsqrt,    // 1 / sqrt(x), for x > 0; f' = -x^(-3/2) / 2
};

// "relu", "gelu", "silu", "sigmoid", "tanh", "exp", "square", "rsqrt".
inline const char* unary_name(Unary f) {
  switch (f) {
    case Unary::kRelu: return "relu";
    case Unary::kGelu: return "gelu";
    case Unary::kSilu: return "silu";
    case Unary::kSigmoid: return "sigmoid";
    case Unary::kTanh: return "tanh";
    case Unary::kExp: return "exp";
    case Unary::kSquare: return "square";
    case Unary::kRsqrt: return "rsqrt";
  }
  return "?";
}

}  // namespace gpipe
