// Mixed precision for every backend: a Backend that runs ops whose operands include
// narrow tensors (bfloat16, float16: is_narrow) on a backend that computes in float32
// and float64.
//
// An op with no narrow operand goes straight to the wrapped backend, and so does one the
// wrapped backend computes itself in the narrow type (Backend::computes_narrow: the CUDA
// backend's products and elementwise ops, which do the same float32 arithmetic and the
// same single rounding without the temporaries). Otherwise each
// narrow operand is widened into a float32 temporary (exact), the wrapped backend's
// float32 op runs on the temporaries and the float32 operands, and each narrow operand
// the op writes is rounded back (to nearest, ties to even: Backend::cast). An operand
// the op accumulates into (matmul with beta != 0, add_bias, dW +=) is widened before and
// rounded after. So, as the backend's documentation of each op says for float32, sums
// and products accumulate in float32 and statistics (a layer norm's, a softmax's) are
// computed in float32; what is rounded is only what the op stores.
//
// A bf16 or fp16 model keeps its gradients, master weights and optimizer state in
// float32 and its activations, messages and kept tensors narrow: its ops mix the two
// types, and every mix is widened the same way. backend_for() returns every backend
// wrapped in one of these. The widening costs a pass over each narrow operand per op;
// measured in bench/RESULTS.md ("Mixed precision").
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>

#include "kernels/backend.h"

namespace gpipe {

struct CpuCapture;  // widening_backend.cc

class WideningBackend : public Backend {
 public:
  explicit WideningBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  Backend& inner() { return *inner_; }
  Device device() const override { return inner_->device(); }
  Stream& stream() override { return inner_->stream(); }

  void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
              double beta) override;
  void matmul_weight(const Tensor& a, bool trans_a, const Tensor& w, bool trans_w, Tensor& c, double alpha,
                     double beta) override;
  // Fused attention: the wrapped backend's, which takes 16-bit operands as they are.
  bool has_fused_attention(DType t, const AttentionSizes& dims) override {
    return inner_->has_fused_attention(t, dims);
  }
  // The ops of kernels/backend_ops.inc. GPIPE_OP and GPIPE_NARROW_OP ops: generated from
  // their marked calls (widening_backend.cc). By hand: bias_grad (db is added into only
  // when beta != 0); copy, cast, transpose_blocks, synchronize and fused attention go to the wrapped
  // backend as they are; the fused ops go to the wrapped backend when no operand is
  // narrow or when it computes them in the narrow type (kRmsNorm, kSwiglu), else they
  // are composed here of widened generic ops (Backend's defaults), which is the
  // reference; the multi-tensor ops go to the wrapped backend whole when no operand is
  // narrow (a narrow model's optimizer works on float32 masters), else each tensor is
  // widened.
#define GPIPE_OP(R, name, params, call) R name params override;
#define GPIPE_FUSED_OP(R, name, params) R name params override;
#include "kernels/backend_ops.inc"

  // Capture (Backend::begin_capture). A GPU backend captures its own stream (a CUDA
  // graph): these go to it. On the CPU this backend captures the calls themselves: from
  // begin_capture to end_capture each op this thread calls is kept, with copies of its
  // operands (tensors share their buffers, so they live as long as the capture), instead
  // of run, and so are host_step's work and the CPU events recorded on its stream (an
  // OpClock's); a replay makes the same calls in the same order.
  void begin_capture() override;
  std::unique_ptr<CapturedOps> end_capture() override;
  void abort_capture() noexcept override;
  bool capturing() const override;
  // Other threads' calls join the capture this backend's beginning thread holds
  // (Backend::join_capture): one list, in the order of the calls.
  void join_capture() override;
  void leave_capture() noexcept override;
  void host_step(const std::function<void()>& work) override;

 private:
  bool capturing_here() const;  // this thread captures the calls made to this backend
  void capture(const char* op, std::function<void()> run);
  template <typename R>
  void capture_as(const char* op, std::function<void()> run) {
    if constexpr (std::is_void_v<R>) {
      capture(op, std::move(run));
    } else {
      throw CaptureError(std::string(op) + " hands the host a value");
    }
  }
  std::unique_ptr<Backend> inner_;
  // The CPU capture begun on this backend (begin_capture to end_capture or
  // abort_capture), which other threads join.
  std::atomic<CpuCapture*> cpu_capture_{nullptr};
};

}  // namespace gpipe
