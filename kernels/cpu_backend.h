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
  // The ops of kernels/backend_ops.inc: elementwise, loss and optimizer ops in
  // cpu_backend.cc, the transformer ops in cpu_transformer_ops.cc, LLaMA's in
  // cpu_llama_ops.cc, convolution ops in cpu_conv_ops.cc, the generic elementwise and
  // row ops in cpu_elementwise_ops.cc, copies and casts in cpu_tensor_ops.cc. The fused
  // and multi-tensor ops are Backend's defaults (the composition is the reference).
#define GPIPE_OP(R, name, params, call) R name params override;
#include "kernels/backend_ops.inc"

 private:
  Device device_;
  CpuStream stream_;
};

}  // namespace gpipe
