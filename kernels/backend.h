// The backend interface: every numerical op the layers need, with one CPU
// implementation (the reference, on OpenBLAS) and one CUDA implementation (cuBLAS and
// small kernels) that have the same semantics. Layers call only this; they never call
// BLAS, CUDA or NCCL themselves. The ops are declared once, with their semantics, in
// kernels/backend_ops.inc; this class holds the products and what the ops share.
//
// Conventions: tensors are contiguous and row-major; matrices are 2-D (rows, cols);
// floating-point ops accept float32 and float64 (float64 exists for finite-difference
// and exact-equality tests), and all operands of one call share a dtype and device.
// Outputs are written, never resized: the caller allocates them with empty()/zeros().
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kernels/broadcast.h"
#include "kernels/step_scalars.h"
#include "kernels/unary.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace gpipe {

struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  // false: Adam with L2 in the gradient; true: AdamW
};

struct SgdParams {
  double lr = 0.01;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

// A dropout mask's key (Backend::dropout): a fixed key, or one mixed from the step,
// mixed_key(base, multiplier, step) (runtime/philox.h), whose step is the host's `step`
// or, when `scalars` is defined, the step's scalars' kStepIndex (kernels/step_scalars.h),
// read by the op when it runs: then a training step's dropout calls are the same at every
// step. The same key either way, for the same step.
struct DropoutKey {
  DropoutKey(uint64_t key = 0) : key(key) {}  // NOLINT: a fixed key converts
  static DropoutKey of_step(uint64_t base, uint64_t multiplier, uint64_t step, Tensor scalars = {}) {
    DropoutKey k;
    k.base = base;
    k.multiplier = multiplier;
    k.step = step;
    k.scalars = std::move(scalars);
    return k;
  }
  uint64_t key = 0;                            // when multiplier is 0
  uint64_t base = 0, multiplier = 0, step = 0;  // else
  Tensor scalars;
  bool from_device() const { return multiplier != 0 && scalars.defined(); }
  // The key for the host's step (what the device computes from kStepIndex when that
  // holds the same step).
  uint64_t host_key() const;
};

// A loss's factor (the loss ops' `scale`): a host value, or when `scalars` is defined the
// step's scalars' kStepLossScale (kernels/step_scalars.h), read by the op when it runs,
// which holds `value` (so that a step's loss calls are the same whatever its factor).
struct LossScale {
  LossScale(double value = 1.0) : value(value) {}  // NOLINT: a value converts
  LossScale(double value, Tensor scalars) : value(value), scalars(std::move(scalars)) {}
  double value;
  Tensor scalars;
  bool from_device() const { return scalars.defined(); }
};

// Throws unless `scalars` is a step's scalars (float64, kStepScalarCount, contiguous) on
// `device`; and one slot of a step's scalars that live on the host, checked so (what a CPU
// op reads when it runs).
void check_step_scalars(const Tensor& scalars, Device device, const char* op);
double host_step_scalar(const Tensor& scalars, StepScalar slot, const char* op);

// The step's scalars (kernels/step_scalars.h) of step `step` (from 1) of Adam or SGD
// with p, as the host computes them (in double): the learning rate and count, and
// Adam's decay and bias corrections; no norm, a scale of 1, no skip.
StepScalarValues adam_step_scalars(const AdamParams& p, int64_t step);
StepScalarValues sgd_step_scalars(const SgdParams& p, int64_t step);

// What end_capture returns: a stage's captured ops, replayed in order with the same
// operands (the same buffers, whatever they hold by then). Destroying it frees what the
// capture kept (a GPU's graph and its memory pool) once no replay is queued.
class CapturedOps {
 public:
  virtual ~CapturedOps() = default;
  // Queues every captured op again, in the order captured, on the capturing backend's
  // stream (runs them, on the CPU). The calling thread must be the capturing one.
  virtual void replay() = 0;
  // The captured ops' count: backend calls (CPU) or the graph's nodes (GPU).
  virtual int64_t nodes() const = 0;
  // After a replay() that threw: the stage (runtime/logging.h's thread_stage()) whose
  // thread captured the call that failed, where the replay runs the calls (the CPU; stages
  // captured together are replayed on one thread); -1 where not known.
  virtual int failed_stage() const { return -1; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual Stream& stream() = 0;

  Tensor empty(const Shape& shape, DType dtype) { return Tensor::empty(shape, dtype, device()); }
  Tensor zeros(const Shape& shape, DType dtype);

  // c = alpha * op(a) @ op(b) + beta * c, op(x) = x or x^T.
  //   a: (M, K) or (K, M) if trans_a;  b: (K, N) or (N, K) if trans_b;  c: (M, N)
  virtual void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                      double alpha = 1.0, double beta = 0.0) = 0;
  // The same product with b a layer's weight (a parameter, contiguous). Inside a
  // FrozenWeights window on the calling thread, a backend may reuse a copy of b in the
  // layout its matrix library prefers (the CPU backend's oneDNN path), made by an
  // earlier call in the window.
  virtual void matmul_weight(const Tensor& a, bool trans_a, const Tensor& w, bool trans_w, Tensor& c,
                             double alpha = 1.0, double beta = 0.0) {
    matmul(a, trans_a, w, trans_w, c, alpha, beta);
  }
  // The ops a backend computes itself on narrow operands (bfloat16, float16: is_narrow):
  // it loads them into float32, computes in float32 and rounds what it stores once, to
  // nearest even, which is what WideningBackend does around the float32 op, less the
  // float32 temporaries. WideningBackend hands such a call to the backend as it is.
  //   kMatmul (matmul, matmul_weight, linear_input_grad_add): a and b of type t, c of type t or
  //   float32 (dx of type t);
  //   the others: every floating-point operand of type t.
  // The CPU reference computes none (the widening is the reference); the CUDA backend
  // computes the products (cublasGemmEx) and the elementwise ops of backend_ops.inc
  // marked GPIPE_NARROW_OP.
  //   kAxpy, kRope (rope and rope_backward): x and y of type t; kEmbedding (embedding, embedding_slice):
  //   table, pos and out of type t; the fused ops (kRmsNorm: rmsnorm and its three backward
  //   ops; kSwiglu: swiglu and swiglu_backward): their activations of type t, their
  //   per-row statistics and the weight gradient of the master type (float32); kLinear
  //   (linear_bias, linear_weight_grad, linear_residual): x, w, bias, residual, y and dy of
  //   type t, dw and db float32.
  enum class NarrowOp {
    kMatmul, kAddBias, kRelu, kReluBackward, kGelu, kGeluBackward, kAxpy, kRmsNorm, kSwiglu, kRope, kEmbedding,
    kLinear
  };
  virtual bool computes_narrow(NarrowOp op, DType t) const {
    (void)op;
    (void)t;
    return false;
  }
  // Elementwise functions with their derivatives (kernels/unary.h lists them, with f and
  // f'; kernels/unary_math.h has the formulas both backends compute):
  //   unary:          y = f(x)
  //   unary_backward: dx = dy * f'(x), from the input x (keep x for backward)
  // x, y, dy, dx: one float type and shape; y may be x, dx may be dy. kRelu and kGelu are
  // the relu and gelu ops below (relu_backward from x: x > 0 exactly where relu(x) > 0).
  void unary(Unary f, const Tensor& x, Tensor& y) {
    if (f == Unary::kRelu) return relu(x, y);
    if (f == Unary::kGelu) return gelu(x, y);
    unary_impl(f, x, y);
  }
  void unary_backward(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) {
    if (f == Unary::kRelu) return relu_backward(x, dy, dx);
    if (f == Unary::kGelu) return gelu_backward(x, dy, dx);
    unary_backward_impl(f, x, dy, dx);
  }

  // What has_fused_attention is asked about (fused_attention in kernels/backend_ops.inc).
  struct AttentionSizes {
    int64_t batch, seq, heads, kv_heads, head_dim;
  };
  // Whether this backend runs fused_attention for element type t and these sizes, asked
  // before each use: a GPU prepares the shape's kernels then, and says no, once with a
  // warning, where it cannot. The CPU runs float32 and float64 (the exact path's bits),
  // a CUDA build with cuDNN's frontend bfloat16 and float16.
  virtual bool has_fused_attention(DType t, const AttentionSizes& dims) {
    (void)t;
    (void)dims;
    return false;
  }

  // A step's scalars (kernels/step_scalars.h) as the host sees them: read back (waits for
  // the work queued before), or written (before any op queued after reads them). The
  // tensor: float64, kStepScalarCount elements, on this backend's device.
  StepScalarValues read_step_scalars(const Tensor& scalars);
  void write_step_scalars(const StepScalarValues& values, Tensor& scalars);
  Tensor step_scalars(const StepScalarValues& values);  // a new tensor holding `values`

  // Capture (pipeline.capture): between begin_capture and
  // end_capture the ops this thread calls on this backend are captured, not run, and
  // end_capture returns them, to be replayed as often as wanted with the same operands:
  // on a GPU, stream capture into a CUDA graph, its memory from a pool kept for it; on
  // the CPU, the calls themselves (WideningBackend). An op that hands the host a value
  // (item, sum_squares_all, a copy to the host, synchronize on a GPU) cannot be
  // captured: it throws CaptureError, and the caller then calls abort_capture, which
  // drops what was captured. Nothing captured has run. A backend that cannot capture
  // throws CaptureError from begin_capture. On the CPU a copy between host tensors is a
  // captured call like any other: host code that reads values it copied must wait for them
  // (synchronize), which a capture refuses.
  virtual void begin_capture();
  virtual std::unique_ptr<CapturedOps> end_capture();
  virtual void abort_capture() noexcept {}
  virtual bool capturing() const { return false; }
  // Stages on other threads that share this backend (K stages on one device, pipeline.capture)
  // are captured with the one that began: each of their threads joins the capture in
  // progress before its first op of the step and leaves it after its last, before the
  // beginning thread ends (or aborts) it; the ops of all are then one capture, in the order
  // they were called, replayed by the beginning thread. A backend that cannot throws
  // CaptureError from join_capture.
  virtual void join_capture();
  virtual void leave_capture() noexcept {}
  // Host work between ops that must run in their order at every replay (the CPU's
  // FrozenWeights windows): runs now, or while the CPU captures, is captured with them.
  // On a GPU it runs now only: a replay does no host work.
  virtual void host_step(const std::function<void()>& work) { work(); }

  // Every other op, declared once (its semantics beside its declaration there).
#define GPIPE_OP(R, name, params, call) virtual R name params = 0;
#define GPIPE_FUSED_OP(R, name, params) virtual R name params;
#include "kernels/backend_ops.inc"
};

// Whether backend_for(device) runs fused_attention for element type t and head width
// head_dim, asked without making that backend (the planner's shape probe asks on a
// machine that may not have the device).
bool fused_attention_available(Device device, DType t, int64_t head_dim);
// Whether a GPU build with cuDNN's frontend runs it (bfloat16 and float16, head_dim a
// multiple of 8 up to 128, unless GPIPE_FUSED_ATTENTION is "0"), whatever this
// machine's build: what the planner assumes of the GPUs of a device description.
bool gpu_fused_attention_expected(DType t, int64_t head_dim);

// The backend of a device, created on first use and alive for the process. CPU
// backends are stateless and thread-safe; a CUDA backend owns its stream and cuBLAS
// handle and is used by one stage thread at a time.
Backend& backend_for(Device device);

// Limits the BLAS library to `threads` threads per call (1 = the calling thread only,
// so one pipeline stage uses one core): OpenBLAS, and oneDNN's OpenMP team on every
// thread that calls it. Also checks GPIPE_GEMM (kernels/cpu_gemm.h), so that a bad value
// stops a run before it starts.
void set_cpu_blas_threads(int threads);

// A promise, for as long as it lives, that no parameter changes: while one is alive on
// a thread, matmul_weight on that thread may keep copies of the weights it reads (in
// oneDNN's packed layout) and reuse them. They are freed when the last one on the thread
// ends. The pipeline executor holds one around each stage's instructions except the
// optimizer step; code that writes a parameter (an optimizer step, a checkpoint load,
// a finite-difference probe) must run with none alive on any thread that computes with
// that parameter. Without one nothing is cached, so a stale copy cannot exist.
class FrozenWeights {
 public:
  FrozenWeights();
  ~FrozenWeights();
  FrozenWeights(const FrozenWeights&) = delete;
  FrozenWeights& operator=(const FrozenWeights&) = delete;
};

}  // namespace gpipe
