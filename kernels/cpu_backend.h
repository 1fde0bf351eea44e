// The reference backend: OpenBLAS for matrix products, plain loops for the rest.
// Every other backend is tested against this one.
#pragma once

#include "kernels/backend.h"

namespace gpipe {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(Device device) : device_(device), stream_(device) {}
  Device device() const override { return device_; }
  Stream& stream() override { return stream_; }

  void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
              double beta) override;
  void matmul_weight(const Tensor& a, bool trans_a, const Tensor& w, bool trans_w, Tensor& c, double alpha,
                     double beta) override;
  // The ops of kernels/backend_ops.inc: elementwise, loss and SGD ops, copies and casts
  // in cpu_backend.cc; the transformer ops, Adam and the sum of squares in
  // cpu_transformer_ops.cc; LLaMA's in cpu_llama_ops.cc; convolution ops in
  // cpu_conv_ops.cc; the generic elementwise and row ops in cpu_elementwise_ops.cc,
  // broadcasting, reductions and softmax in cpu_tensor_ops.cc. The fused and
  // multi-tensor ops are Backend's defaults (the composition is the reference), but
  // for the few below that compute the composition's bits in one pass.
#define GPIPE_OP(R, name, params, call) R name params override;
#include "kernels/backend_ops.inc"
  // SwiGLU in one pass over the elements (cpu_elementwise_ops.cc), each element by the
  // formulas of Backend::swiglu's composition (unary silu, then mul), so the outputs are
  // the composition's bit for bit; the backward takes each element's sigmoid once for
  // SiLU's value and its slope, where the composition takes it twice.
  void swiglu(const Tensor& a, const Tensor& b, Tensor& y) override;
  void swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) override;
  // Fused attention in float32 and float64 (cpu_transformer_ops.cc): the exact path's
  // per-head code, keeping what a flash kernel keeps; its backward recomputes each
  // head's probabilities, so outputs and gradients are pack_qkv then attention's, bit
  // for bit (cpu_fused_attention_available).
  bool has_fused_attention(DType t, const AttentionSizes& dims) override;
  void fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                       Tensor& stats) override;
  void fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& out, const Tensor& stats, int heads, Tensor& dq, Tensor& dk,
                                Tensor& dv) override;

 private:
  Device device_;
  CpuStream stream_;
};

// Whether CpuBackend runs fused_attention for element type t: float32 and float64,
// unless GPIPE_FUSED_ATTENTION is "0" (the way to keep the probabilities, as a GPU's
// float32 does). bfloat16 and float16 are widened to the exact path.
bool cpu_fused_attention_available(DType t);

}  // namespace gpipe
