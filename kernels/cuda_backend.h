// The CUDA backend: cuBLAS for matrix products (cuBLASLt for a linear layer's product
// with its bias: kernels/cuda_linear_ops.cc), the kernels of kernels/cuda_kernels.cu
// for everything else, all queued on one non-blocking stream per backend. Same
// semantics as the CPU reference (kernels/cpu_backend.cc) for float32 and float64.
// bfloat16 and float16: the matrix products (cublasGemmEx, 16-bit inputs, float32
// compute, c in the 16-bit type or float32), the elementwise ops add_bias, relu, gelu
// and their backwards, axpy and the fused ops (RMSNorm, SwiGLU: kernels/cuda_elementwise.cu)
// (kernels templated on the storage type: load into float32, compute, round once on
// store) take them as they are (computes_narrow); the other
// ops' narrow operands are widened around the backend by the WideningBackend that
// backend_for() wraps it in (kernels/widening_backend.h), as the CPU backend's are.
//
// Every op returns as soon as its work is queued, copies from the host included (they
// go through pinned staging buffers). The backend waits for its stream only where the
// host needs a result: sum_squares, argmax_correct and item (host values), a copy to
// host memory, and synchronize. Its stream is the device's compute stream
// (compute_stream_for), which the allocator and the transports order themselves with.
//
// Bad data a user can pass (a label outside the classes, a token id outside the
// vocabulary, an argmax outside its plane) is found by the kernels on the device and
// reported later, not by the op that saw it: each of those waits also reads back the
// kernels' error records, and throws the CPU reference's error for the first bad value
// (a UserError for labels and token ids, an Error for argmax, as on the CPU) to the
// thread that queued the op: two stages sharing the GPU share this backend, and each
// gets its own errors (kernels/deferred_checks.h). The pipeline executor synchronises
// at the end of every stage's program, so a bad batch fails the step it came in. Until
// then, outputs computed from the bad values are garbage (never out-of-bounds
// accesses). See "Deferred input errors" in cuda_backend.cc.
// Compiled only in CUDA builds (GPIPE_WITH_CUDA).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda_kernels.h"
#include "kernels/deferred_checks.h"

namespace gpipe {

struct LtState;  // kernels/cuda_linear_ops.cc
struct LtCall;

class CudaBackend : public Backend {
 public:
  // Takes the device's compute stream, creates the cuBLAS handle (bound to it), the error
  // slots and a small pinned host buffer on `device`. Throws UserError if the device
  // does not exist.
  explicit CudaBackend(Device device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return device_; }
  Stream& stream() override { return *stream_; }

  bool computes_narrow(NarrowOp op, DType t) const override;
  void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
              double beta) override;
  // The ops of kernels/backend_ops.inc, all of them on the device (the fused and
  // multi-tensor ops included). Where they live:
  //   cuda_backend.cc: elementwise, loss, optimizer, transformer and generic row ops,
  //     copies and casts (kernels in cuda_kernels.cu and cuda_elementwise.cu);
  //   cuda_llama_ops.cc: rope, pack_qkv (cuda_llama.cu);
  //   cuda_attention_ops.cc: fused attention, cuDNN's fused SDPA through its frontend's
  //     graph API, one graph per shape, built on first use and kept (bfloat16 and
  //     float16: cuda_fused_attention_available);
  //   cuda_fused_ops.cc: RMSNorm and SwiGLU, one kernel each (cuda_elementwise.cu);
  //   cuda_multi_tensor_ops.cc: one launch for the tensors of one element type (float32
  //     or float64; cast_all: float32 into a 16-bit type), over a table kept on the
  //     device per list of pointers; other calls loop (Backend's default);
  //   cuda_conv_ops.cc: cuDNN for convolutions, batch norm and average pooling,
  //     cuda_conv_kernels.cu for max pooling (maxpool2d_backward checks argmax on the
  //     device as it scatters; a bad index is reported at the next wait) and channel bias.
  // synchronize waits for all work queued on this backend's stream, then throws the error
  // of the first bad label, token id or argmax that an op of the calling thread flagged.
  bool has_fused_attention(DType t, const AttentionSizes& dims) override;
#define GPIPE_OP(R, name, params, call) R name params override;
#define GPIPE_FUSED_OP(R, name, params) R name params override;
#include "kernels/backend_ops.inc"

  // Capture into a CUDA graph (Backend::begin_capture; kernels/cuda_capture.cc): stream
  // capture of this backend's stream in relaxed mode, its blocks from a private pool of
  // the device's allocator, each deferred check kept with the graph and registered again
  // before each replay (the replay's kernels flag the same slots), the multi-tensor
  // tables it uses kept while it lives. An op that waits for the stream or reads it back
  // (item, sum_squares, a host copy, synchronize, a full set of checks) or copies from
  // pageable host memory fails the capture; abort_capture drops it.
  void begin_capture() override;
  std::unique_ptr<CapturedOps> end_capture() override;
  void abort_capture() noexcept override;
  bool capturing() const override { return capture_ != nullptr; }
  // Another stage's thread on this device: its blocks from the capture's pool too.
  void join_capture() override;
  void leave_capture() noexcept override;

 private:
  friend class CudaCapturedOps;
  // A capture in progress: its private pool's name (the address of `key`), its thread,
  // the multi-tensor tables its graph reads.
  struct Capture {
    std::unique_ptr<char> key = std::make_unique<char>();
    std::thread::id thread = std::this_thread::get_id();
    std::vector<const int64_t*> tables;
  };
  std::unique_ptr<Capture> capture_;
  // Tables a capture's graph reads (multi_table): release_multi_tables keeps them.
  std::multiset<const int64_t*> captured_tables_;
  // A captured graph's launch, its checks registered first (CudaCapturedOps::replay).
  void replay_graph(void* exec, const std::vector<DeferredChecks::Queued>& checks);
  void note_captured_table(const int64_t* table);  // multi_table, while capturing
  // At most this many checks wait for one read-back; the next one waits first (only a
  // caller that queues this many validating ops with no sum_squares, item, host copy or
  // synchronize in between pays that wait).
  static constexpr size_t kMaxDeferredChecks = 1024;

  cudaStream_t cuda_stream() const;
  // Throws gpipe::Error unless `t` lives on this backend's device.
  void check_on_device(const Tensor& t, const char* op) const;
  // Registers the check of the op about to be queued (for the calling thread) and
  // returns its error slot (which holds cuda::kNoError). The device must be current.
  cuda::ErrorSlot* defer_check(const DeferredCheck& check);
  // The one place the backend waits for its stream: queues the read-back of the pending
  // checks' slots into pinned memory, waits, resets the slots if any was flagged (so
  // the backend stays usable), then throws the calling thread's first flagged error.
  // The device must be current.
  void wait();
  // ~CudaBackend: logs what the pending checks flagged instead of throwing.
  void log_unreported_errors() noexcept;
  // dropout and dropout_backward: the same map (dropout is linear and diagonal).
  void dropout_impl(const Tensor& in, double p, const DropoutKey& key, int64_t sample_offset, int64_t element_offset,
                    Tensor& out, const char* op);
  void release() noexcept;
  // The device table of a multi-tensor launch over `lists` (parallel lists of tensors,
  // the empty ones left out), built and copied on first use, then kept: a stage's
  // parameters, gradients and state do not move, so every later step finds it.
  // nullopt-like: a table with tensors == 0 when every tensor is empty.
  cuda::MultiTensorTable multi_table(const std::vector<const std::vector<Tensor>*>& lists, const char* op);
  // Frees the tables (keep_captured: not those a captured graph reads).
  void release_multi_tables(bool keep_captured = false) noexcept;
  // The device pointer of a step's scalars (kernels/step_scalars.h), checked; a loss's
  // factor as the kernels take it (its slot there, or its value).
  const double* step_scalars_on_device(const Tensor& scalars, const char* op) const;
  cuda::LossScaleArg loss_scale_arg(const LossScale& scale, const char* op) const;
  // The cuDNN state (handle bound to stream_, descriptors, chosen algorithms), created
  // on first use by a convolution op; kernels/cuda_conv_ops.cc.
  struct CudnnState& cudnn();
  void release_cudnn() noexcept;  // called by release(); the device is already current
  void* cudnn_handle();            // cudnn()'s cudnnHandle_t, for files that do not see CudnnState
  // The fused attention's built graphs and the shapes cuDNN refused (struct AttentionGraphs,
  // kernels/cuda_attention_ops.cc).
  void* attention_graphs_ = nullptr;
  void release_attention_graphs() noexcept;
  // cuBLASLt for linear_bias and linear_weight_grad (kernels/cuda_linear_ops.cc): its
  // handle, workspace and chosen algorithms, created on first use; lt_matmul queues one
  // call and returns true, or returns false (nothing queued) where cuBLASLt has no
  // algorithm for it. The device must be current.
  LtState& lt();
  void release_lt() noexcept;
  bool lt_matmul(const LtCall& call);
  LtState* lt_ = nullptr;
  std::mutex lt_mu_;  // lt_ and its algorithms: stages sharing the GPU share this backend
  // rope and rope_backward on bfloat16 or float16 (kernels/cuda_llama_ops.cc).
  void rope_narrow(const Tensor& x, int heads, double base, double sign, Tensor& y, const char* op);

  Device device_;
  Stream* stream_ = nullptr;          // the device's compute stream (non-blocking; not owned)
  cublasHandle_t blas_ = nullptr;     // bound to stream_
  cuda::ErrorSlot* slots_ = nullptr;  // device (kMaxDeferredChecks): error slots, kNoError when free
  void* host_staging_ = nullptr;      // pinned host: 16 bytes where item() and sum_squares land,
  cuda::ErrorSlot* host_slots_ = nullptr;  // then (kMaxDeferredChecks) where slots_ is read back
  DeferredChecks checks_{kMaxDeferredChecks};  // checks queued since the last wait(), in op order
  void* cudnn_ = nullptr;             // CudnnState*, see cudnn()
  // multi_table's tables: the host image (the key) -> its copy on the device.
  std::map<std::vector<int64_t>, int64_t*> multi_tables_;
};

// A CUDA backend for `device` (the registry in backend_for() calls this).
std::unique_ptr<Backend> make_cuda_backend(Device device);

// Whether CudaBackend runs fused_attention for element type t and head width head_dim:
// built with cuDNN's frontend (GPIPE_WITH_CUDNN_FRONTEND), t bfloat16 or float16, head_dim
// a multiple of 8 up to 128, a cuDNN of 9.0 or later, and GPIPE_FUSED_ATTENTION not "0"
// (the way to keep the exact attention). Needs no device.
bool cuda_fused_attention_available(DType t, int64_t head_dim);

// Whether CudaBackend computes linear_bias and linear_weight_grad through cuBLASLt's
// epilogues: unless GPIPE_CUBLASLT is "0" (then they compose matmul and the bias ops, as
// the CPU reference does).
bool cuda_cublaslt_enabled();
// How many cuBLASLt matmuls the CUDA backends have queued so far (the tests' evidence
// that a call took cuBLASLt, not the composition it falls back to).
int64_t cuda_cublaslt_calls();

}  // namespace gpipe
