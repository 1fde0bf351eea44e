#include "kernels/cuda_backend.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <type_traits>

#include "kernels/cuda_elementwise.h"
#include "kernels/cuda_kernels.h"
#include "kernels/op_checks.h"
#include "kernels/transformer_checks.h"
#include "runtime/bf16.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_allocator.h"
#include "runtime/cuda_runtime.h"
#include "runtime/error.h"
#include "runtime/fp16.h"

namespace gpipe {

namespace {

using ops::dispatch_float;
using ops::dispatch_storage;

// Column-major gemm: C (m x n) = alpha * op(A) (m x k) op(B) (k x n) + beta * C.
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha,
          const float* a, int lda, const float* b, int ldb, double beta, float* c, int ldc) {
  const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
  GPIPE_CUBLAS_CHECK(cublasSgemm(h, ta, tb, m, n, k, &al, a, lda, b, ldb, &be, c, ldc));
}
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha,
          const double* a, int lda, const double* b, int ldb, double beta, double* c, int ldc) {
  GPIPE_CUBLAS_CHECK(cublasDgemm(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc));
}

// Strided-batched column-major gemm: for i < batch, C_i = alpha op(A_i) op(B_i) + beta C_i
// with X_i = x + i * stride_x.
void gemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha,
                  const float* a, int lda, long long sa, const float* b, int ldb, long long sb, double beta, float* c,
                  int ldc, long long sc, int batch) {
  const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
  GPIPE_CUBLAS_CHECK(
      cublasSgemmStridedBatched(h, ta, tb, m, n, k, &al, a, lda, sa, b, ldb, sb, &be, c, ldc, sc, batch));
}
void gemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha,
                  const double* a, int lda, long long sa, const double* b, int ldb, long long sb, double beta,
                  double* c, int ldc, long long sc, int batch) {
  GPIPE_CUBLAS_CHECK(
      cublasDgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb, sb, &beta, c, ldc, sc, batch));
}

// ---- Narrow storage (Backend::computes_narrow).

void check_storage(const Tensor& t, const char* op) {
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kF64 && !is_narrow(t.dtype())) {
    throw Error(std::string(op) + ": " + t.str() + " must be float32, float64, bfloat16 or float16");
  }
  if (!t.is_contiguous()) throw Error(std::string(op) + ": " + t.str() + " must be contiguous");
}

cudaDataType narrow_type(DType t) { return t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F; }

// A product of 16-bit a and b into c of their type or float32 (cublasGemmEx's
// combinations for CUBLAS_COMPUTE_32F); returns its dimensions.
ops::GemmDims check_narrow_matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c) {
  for (const Tensor* t : {&a, &b, &c}) {
    check_storage(*t, "matmul");
    if (t->dim() != 2) throw Error("matmul: " + t->str() + " must be 2-D");
  }
  if (b.dtype() != a.dtype() || (c.dtype() != a.dtype() && c.dtype() != DType::kF32)) {
    throw Error("matmul: " + a.str() + " @ " + b.str() + " -> " + c.str() + ": a 16-bit product needs a and b of one type and c of theirs or float32");
  }
  return ops::matmul_dims(a, ta, b, tb, c);
}

int to_int(int64_t v, const char* what, const char* op = "matmul") {
  if (v > INT_MAX) {
    throw Error(std::string(op) + ": " + what + " = " + std::to_string(v) + " exceeds cuBLAS's 32-bit limit");
  }
  return static_cast<int>(v);
}

// ---- The deferred checks of labels and token ids (see "Deferred input errors" below).

// The CPU backend's message for a bad label, word for word (kernels/cpu_backend.cc).
std::string label_error(const DeferredCheck& c, int64_t row, int32_t label, Device) {
  return "label " + std::to_string(label) + " in row " + std::to_string(row) + " is outside [0, " +
         std::to_string(c.limit) + "); the model's last layer must have as many outputs as there are classes";
}

// labels (rows) against [0, classes).
DeferredCheck label_check(const char* op, int64_t rows, int64_t classes) {
  DeferredCheck c;
  c.op = op;
  c.count = rows;
  c.limit = classes;
  c.message = label_error;
  return c;
}

// The CPU reference's message for a bad token id, word for word
// (kernels/cpu_transformer_ops.cc); position p = b T + t.
std::string token_error(const DeferredCheck& c, int64_t p, int32_t id, Device) {
  return "token id " + std::to_string(id) + " at (b=" + std::to_string(p / c.seq) + ", t=" +
         std::to_string(p % c.seq) + ") is outside the vocabulary [0, " + std::to_string(c.limit) +
         "); make the embedding's vocab option larger than every id in the data";
}

// ids (B, T) against [0, vocab).
DeferredCheck token_check(const char* op, const Tensor& ids, int64_t vocab) {
  DeferredCheck c;
  c.op = op;
  c.count = ids.numel();
  c.limit = vocab;
  c.seq = std::max<int64_t>(ids.size(1), 1);
  c.message = token_error;
  return c;
}

// ---- Argument checks of the transformer ops: the CPU reference's, shared through
// kernels/transformer_checks.h, so both backends reject the same calls.
using ops::AttentionDims;
using ops::check_dropout_p;

// Pinned host memory: item() and sum_squares land in the first kItemBytes, the error
// slots' read-back follows.
constexpr size_t kItemBytes = 16;

}  // namespace

CudaBackend::CudaBackend(Device device) : device_(device) {
  GPIPE_CHECK(device.is_cuda(), "CudaBackend on " + device.str());
  stream_ = &compute_stream_for(device_);  // UserError if the device does not exist
  try {
    DeviceGuard guard(device_.index);
    GPIPE_CUBLAS_CHECK(cublasCreate(&blas_));
    GPIPE_CUBLAS_CHECK(cublasSetStream(blas_, cuda_stream()));
    // Full float32 precision: no TF32 tensor-core rounding, so results match the CPU
    // reference to float32 accuracy; and no reductions in a 16-bit output's type (a
    // split-K product of bfloat16 into bfloat16 would otherwise be allowed to add its
    // partial sums in bfloat16), so a 16-bit product is rounded once, as the widening
    // reference's.
    GPIPE_CUBLAS_CHECK(cublasSetMathMode(
        blas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    const size_t slot_bytes = kMaxDeferredChecks * sizeof(cuda::ErrorSlot);
    GPIPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slots_), slot_bytes));
    // All slots free (kNoError), ordered before every kernel that may flag one.
    GPIPE_CUDA_CHECK(cudaMemsetAsync(slots_, 0xFF, slot_bytes, cuda_stream()));
    GPIPE_CUDA_CHECK(cudaMallocHost(&host_staging_, kItemBytes + slot_bytes));
    host_slots_ = reinterpret_cast<cuda::ErrorSlot*>(static_cast<char*>(host_staging_) + kItemBytes);
  } catch (...) {
    release();
    throw;
  }
}

CudaBackend::~CudaBackend() {
  // At process exit the CUDA runtime may be unloaded before this static object is
  // destroyed; then calls fail with cudaErrorCudartUnloading and we leave the handles
  // to the driver (cublasDestroy on an unloaded runtime is not safe).
  int current = 0;
  if (is_teardown(cudaGetDevice(&current))) {
    cudaGetLastError();
    return;
  }
  const cudaError_t e = cudaStreamSynchronize(cuda_stream());
  if (is_teardown(e)) {
    cudaGetLastError();
    return;
  }
  if (e != cudaSuccess) {
    spdlog::warn("~CudaBackend on {}: cudaStreamSynchronize failed: {}", device_.str(), cudaGetErrorString(e));
    cudaGetLastError();
  }
  release();
}

void CudaBackend::release() noexcept {
  NoThrowDeviceGuard guard(device_.index, "~CudaBackend");
  if (!guard.ok()) return;  // cannot select the device: leave the resources to the driver
  log_unreported_errors();
  if (host_staging_ != nullptr) {
    const cudaError_t e = cudaFreeHost(host_staging_);
    if (e != cudaSuccess) spdlog::warn("cudaFreeHost failed: {}", cudaGetErrorString(e));
    host_staging_ = nullptr;
    host_slots_ = nullptr;
  }
  if (slots_ != nullptr) {
    const cudaError_t e = cudaFree(slots_);
    if (e != cudaSuccess) spdlog::warn("cudaFree failed: {}", cudaGetErrorString(e));
    slots_ = nullptr;
  }
  release_attention_graphs();  // kernels/cuda_attention_ops.cc; before the cuDNN handle they were built with
  release_cudnn();  // kernels/cuda_conv_ops.cc
  release_multi_tables();  // kernels/cuda_multi_tensor_ops.cc
  release_lt();            // kernels/cuda_linear_ops.cc
  if (blas_ != nullptr) {
    const cublasStatus_t st = cublasDestroy(blas_);
    if (st != CUBLAS_STATUS_SUCCESS) spdlog::warn("cublasDestroy failed: {}", cublas_status_string(st));
    blas_ = nullptr;
  }
  cudaGetLastError();
}

cudaStream_t CudaBackend::cuda_stream() const { return static_cast<cudaStream_t>(stream_->native()); }

void CudaBackend::check_on_device(const Tensor& t, const char* op) const {
  if (t.device() != device_) {
    throw Error(std::string(op) + ": " + t.str() + " is not on " + device_.str() +
                ", the device of this backend; copy it there first (Backend::copy)");
  }
}

bool CudaBackend::computes_narrow(NarrowOp op, DType t) const {
  // Every NarrowOp: the products and the elementwise ops below; the linear ops through
  // cuBLASLt (without it, WideningBackend composes them as before).
  if (op == NarrowOp::kLinear) return is_narrow(t) && cuda_cublaslt_enabled();
  return is_narrow(t);
}

void CudaBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha,
                         double beta) {
  const bool narrow = is_narrow(a.dtype());
  const auto d = narrow ? check_narrow_matmul(a, ta, b, tb, c) : ops::check_matmul(a, ta, b, tb, c);
  check_on_device(a, "matmul");
  check_on_device(b, "matmul");
  check_on_device(c, "matmul");
  if (d.m == 0 || d.n == 0) return;
  if (d.k == 0) {  // cuBLAS leaves c untouched when k == 0; the definition says beta * c.
    if (!is_narrow(c.dtype())) return scale(c, beta);
    Tensor wide = empty(c.shape(), DType::kF32);  // scale has no 16-bit kernel: widen, scale, round
    cast(c, wide);
    scale(wide, beta);
    cast(wide, c);
    return;
  }
  const int m = to_int(d.m, "M"), n = to_int(d.n, "N"), k = to_int(d.k, "K");
  const int lda = to_int(a.size(1), "a's row length"), ldb = to_int(b.size(1), "b's row length");
  const int ldc = to_int(c.size(1), "c's row length");
  DeviceGuard guard(device_.index);
  if (narrow) {
    // 16-bit a and b, float32 products and sums (CUBLAS_COMPUTE_32F; alpha and beta are
    // then float), c read and written in its own type: alpha op(a) op(b) + beta c is
    // formed in float32 and rounded once into a 16-bit c, as the widening reference
    // does. The operand order and transposes are those of the float32 call below.
    const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    const cudaDataType ab = narrow_type(a.dtype());
    const cudaDataType ct = c.dtype() == DType::kF32 ? CUDA_R_32F : ab;
    GPIPE_CUBLAS_CHECK(cublasGemmEx(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                                    &al, b.raw_data(), ab, ldb, a.raw_data(), ab, lda, &be, c.raw_data(), ct, ldc,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // cuBLAS is column-major. A row-major (r, s) array with row length s is, read
    // column-major, its transpose (s, r) with leading dimension s. So the row-major
    // c (M, N) is column-major c^T (N, M), and c^T = op(b)^T op(a)^T: a column-major gemm
    // with the operands swapped, each transposed iff it was transposed in the row-major call:
    //   b read column-major is b^T: op(b)^T = b^T (tb false) or b (tb true -> OP_T); ld = b's row length
    //   a read column-major is a^T: op(a)^T = a^T (ta false) or a (ta true -> OP_T); ld = a's row length
    gemm(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, alpha, b.data<T>(), ldb,
         a.data<T>(), lda, beta, c.data<T>(), ldc);
  });
}

void CudaBackend::add_bias(Tensor& y, const Tensor& bias) {
  check_storage(y, "add_bias");
  if (y.dim() != 2) throw Error("add_bias: " + y.str() + " must be 2-D");
  check_storage(bias, "add_bias");
  GPIPE_CHECK(bias.dtype() == y.dtype() && bias.numel() == y.size(1),
              "add_bias: bias " + bias.str() + " for " + y.str());
  check_on_device(y, "add_bias");
  check_on_device(bias, "add_bias");
  DeviceGuard guard(device_.index);
  dispatch_storage(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::add_bias(y.data<T>(), bias.data<T>(), y.size(0), y.size(1), cuda_stream());
  });
}

void CudaBackend::bias_grad(const Tensor& dy, Tensor& db, double beta) {
  ops::check_matrix(dy, "bias_grad");
  ops::check_float(db, "bias_grad");
  GPIPE_CHECK(db.dtype() == dy.dtype() && db.numel() == dy.size(1), "bias_grad: " + db.str() + " for " + dy.str());
  check_on_device(dy, "bias_grad");
  check_on_device(db, "bias_grad");
  DeviceGuard guard(device_.index);
  // (chunks, cols) partial column sums in double, one row chunk per block row.
  const int64_t partials = cuda::bias_grad_workspace(dy.size(0), dy.size(1));
  Tensor work = empty({std::max<int64_t>(partials, 1)}, DType::kF64);
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::bias_grad(dy.data<T>(), db.data<T>(), dy.size(0), dy.size(1), beta, work.data<double>(), cuda_stream());
  });
}

void CudaBackend::relu(const Tensor& x, Tensor& y) {
  check_storage(x, "relu");
  ops::check_same(x, y, "relu");
  check_on_device(x, "relu");
  check_on_device(y, "relu");
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::relu(x.data<T>(), y.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_storage(y, "relu_backward");
  ops::check_same(y, dy, "relu_backward");
  ops::check_same(y, dx, "relu_backward");
  check_on_device(y, "relu_backward");
  check_on_device(dy, "relu_backward");
  check_on_device(dx, "relu_backward");
  DeviceGuard guard(device_.index);
  dispatch_storage(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::relu_backward(y.data<T>(), dy.data<T>(), dx.data<T>(), y.numel(), cuda_stream());
  });
}

void CudaBackend::gelu(const Tensor& x, Tensor& y) {
  check_storage(x, "gelu");
  ops::check_same(x, y, "gelu");
  check_on_device(x, "gelu");
  check_on_device(y, "gelu");
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::gelu(x.data<T>(), y.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  check_storage(x, "gelu_backward");
  ops::check_same(x, dy, "gelu_backward");
  ops::check_same(x, dx, "gelu_backward");
  check_on_device(x, "gelu_backward");
  check_on_device(dy, "gelu_backward");
  check_on_device(dx, "gelu_backward");
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::gelu_backward(x.data<T>(), dy.data<T>(), dx.data<T>(), x.numel(), cuda_stream());
  });
}

// ---- Deferred input errors
//
// Labels, token ids and argmax indices live on the device, and a bad one must still
// surface as the CPU reference's error, not as a silent wrong loss or an out-of-bounds
// access. Waiting for the stream in the op to find out would stall the host inside
// every layer, so the check travels with the stream instead:
//
//   host                                          stream
//   op: shape checks, then                        op's kernel: uses the good values,
//       slot i = defer_check({op, limit, ...})     skips a bad one and lowers slots_[i]
//       (checks_: host bookkeeping only, with      to (index << 32 | value), atomicMin
//        the calling thread as the owner)
//   ... more ops, more slots ...                  ...
//   wait(): queue copy slots_[0, n) -> pinned     copy, after all those kernels
//           cudaStreamSynchronize (needed anyway)
//           any flagged: queue the reset          memset slots_[0, n) = kNoError
//           throw the caller's first error
//
// wait() runs only where the backend waits anyway: synchronize(), item(),
// sum_squares(), argmax_correct() and copies to host memory. The pipeline executor
// calls synchronize() at the end of each stage's program, so a bad batch fails the step
// it came in at the latest. Reported is the caller's first flagged op (in queue order)
// at its smallest index: what the CPU, which stops at the first bad value, reports. A
// flagged op of another thread (a stage sharing this GPU) is kept for that thread's
// next wait (kernels/deferred_checks.h). Outputs computed after a bad value are
// garbage until then; the kernels never index with it.

cuda::ErrorSlot* CudaBackend::defer_check(const DeferredCheck& check) {
  // Every slot taken: read them back now (throwing the first error, if any) to free them;
  // a captured step cannot wait, so it cannot hold more checked ops than there are slots.
  if (checks_.full() && capture_) {
    throw CaptureError("a step with more than " + std::to_string(kMaxDeferredChecks) + " ops that check their data");
  }
  if (checks_.full()) wait();
  return slots_ + checks_.add(check, std::this_thread::get_id());
}

void CudaBackend::wait() {
  cudaStream_t s = cuda_stream();
  const size_t n = checks_.size();
  if (n > 0) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(host_slots_, slots_, n * sizeof(cuda::ErrorSlot), cudaMemcpyDeviceToHost, s));
  }
  GPIPE_CUDA_CHECK(cudaStreamSynchronize(s));
  if (n > 0 && checks_.resolve(host_slots_, device_)) {
    // Free the slots before throwing, so the backend keeps working after the error; the
    // reset is ordered before any kernel queued later.
    GPIPE_CUDA_CHECK(cudaMemsetAsync(slots_, 0xFF, n * sizeof(cuda::ErrorSlot), s));
  }
  checks_.throw_first(std::this_thread::get_id());
}

void CudaBackend::log_unreported_errors() noexcept {
  if (slots_ == nullptr || host_slots_ == nullptr) return;
  const size_t n = checks_.size();
  cudaStream_t s = cuda_stream();
  const cuda::ErrorSlot* read = nullptr;
  if (n > 0 && cudaMemcpyAsync(host_slots_, slots_, n * sizeof(cuda::ErrorSlot), cudaMemcpyDeviceToHost, s) ==
                   cudaSuccess &&
      cudaStreamSynchronize(s) == cudaSuccess) {
    read = host_slots_;
  }
  cudaGetLastError();
  try {
    for (const std::string& m : checks_.drain(read, device_)) {
      spdlog::warn("~CudaBackend on {}: an input error was never reported (no synchronize() after it): {}",
                   device_.str(), m);
    }
  } catch (...) {
  }
}

void CudaBackend::softmax_xent(const Tensor& logits, const Tensor& labels, const LossScale& loss_scale, int ignore_index,
                               Tensor& probs, Tensor& loss) {
  const cuda::LossScaleArg scale = loss_scale_arg(loss_scale, "softmax_xent");
  ops::check_xent(logits, labels, probs);
  GPIPE_CHECK(loss.numel() == 1 && loss.dtype() == logits.dtype(), "softmax_xent: loss " + loss.str());
  check_on_device(logits, "softmax_xent");
  check_on_device(labels, "softmax_xent");
  check_on_device(probs, "softmax_xent");
  check_on_device(loss, "softmax_xent");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  DeviceGuard guard(device_.index);
  // (rows) workspace, back in the stream-ordered cache on return.
  Tensor row_loss = empty({rows}, logits.dtype());
  cuda::ErrorSlot* error = defer_check(label_check("softmax_xent", rows, cols));
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent(logits.data<T>(), labels.data<int32_t>(), rows, cols, scale, ignore_index, probs.data<T>(),
                       row_loss.data<T>(), loss.data<T>(), error, cuda_stream());
  });
}

void CudaBackend::softmax_xent_slice_sums(const Tensor& logits, const Tensor& labels, int64_t first, int64_t vocab,
                                          int ignore_index, const Tensor& rowmax, Tensor& sums) {
  ops::check_xent_slice(logits, labels, first, vocab, rowmax, "softmax_xent_slice_sums");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  ops::check_shape(sums, {2 * rows}, logits.dtype(), "softmax_xent_slice_sums", "sums");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &labels, &rowmax, &sums}) {
    check_on_device(*t, "softmax_xent_slice_sums");
  }
  DeviceGuard guard(device_.index);
  cuda::ErrorSlot* error = defer_check(label_check("softmax_xent_slice_sums", rows, vocab));
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent_slice_sums(logits.data<T>(), labels.data<int32_t>(), rows, cols, first, vocab, ignore_index,
                                  rowmax.data<T>(), sums.data<T>(), error, cuda_stream());
  });
}

void CudaBackend::softmax_xent_slice_loss(const Tensor& sums, const Tensor& rowmax, const Tensor& labels,
                                          int ignore_index, const LossScale& loss_scale, Tensor& lse, Tensor& loss) {
  const cuda::LossScaleArg scale = loss_scale_arg(loss_scale, "softmax_xent_slice_loss");
  ops::check_xent_slice_loss(sums, rowmax, labels, lse, loss);
  const int64_t rows = rowmax.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&sums, &rowmax, &labels, &lse, &loss}) {
    check_on_device(*t, "softmax_xent_slice_loss");
  }
  DeviceGuard guard(device_.index);
  Tensor row_loss = empty({rows}, rowmax.dtype());  // workspace, back in the stream-ordered cache on return
  dispatch_float(rowmax, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent_slice_loss(sums.data<T>(), rowmax.data<T>(), labels.data<int32_t>(), rows, ignore_index, scale,
                                  lse.data<T>(), row_loss.data<T>(), loss.data<T>(), cuda_stream());
  });
}

void CudaBackend::softmax_xent_slice_backward(const Tensor& logits, const Tensor& labels, int64_t first,
                                              int ignore_index, const Tensor& lse, const LossScale& loss_scale,
                                              Tensor& dlogits) {
  const cuda::LossScaleArg scale = loss_scale_arg(loss_scale, "softmax_xent_slice_backward");
  ops::check_xent_slice(logits, labels, first, INT32_MAX, lse, "softmax_xent_slice_backward");
  ops::check_same(logits, dlogits, "softmax_xent_slice_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &labels, &lse, &dlogits}) {
    check_on_device(*t, "softmax_xent_slice_backward");
  }
  DeviceGuard guard(device_.index);
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent_slice_backward(logits.data<T>(), labels.data<int32_t>(), logits.size(0), logits.size(1), first,
                                      ignore_index, lse.data<T>(), scale, dlogits.data<T>(), cuda_stream());
  });
}

void CudaBackend::first_column_equal(const Tensor& logits, const Tensor& value, int64_t first, int64_t none,
                                     Tensor& index) {
  ops::check_first_column_equal(logits, value, index);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&logits, &value, &index}) {
    check_on_device(*t, "first_column_equal");
  }
  DeviceGuard guard(device_.index);
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::first_column_equal(logits.data<T>(), value.data<T>(), logits.size(0), logits.size(1), first, none,
                             index.data<T>(), cuda_stream());
  });
}

void CudaBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels, const LossScale& loss_scale,
                                        int ignore_index, Tensor& dlogits) {
  const cuda::LossScaleArg scale = loss_scale_arg(loss_scale, "softmax_xent_backward");
  ops::check_xent(probs, labels, dlogits);
  check_on_device(probs, "softmax_xent_backward");
  check_on_device(labels, "softmax_xent_backward");
  check_on_device(dlogits, "softmax_xent_backward");
  const int64_t rows = probs.size(0), cols = probs.size(1);
  DeviceGuard guard(device_.index);
  cuda::ErrorSlot* error = defer_check(label_check("softmax_xent_backward", rows, cols));
  dispatch_float(probs, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent_backward(probs.data<T>(), labels.data<int32_t>(), rows, cols, scale, ignore_index,
                                dlogits.data<T>(), error, cuda_stream());
  });
}

int64_t CudaBackend::argmax_correct(const Tensor& logits, const Tensor& labels, int ignore_index) {
  ops::check_argmax_correct(logits, labels);
  check_on_device(logits, "argmax_correct");
  check_on_device(labels, "argmax_correct");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  if (rows == 0 || cols == 0) return 0;
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  // (1) eight bytes: the count, an unsigned 64-bit integer the kernel adds to.
  Tensor work = empty({1}, DType::kF64);
  auto* count = static_cast<unsigned long long*>(work.raw_data());
  GPIPE_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned long long), s));
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::argmax_correct(logits.data<T>(), labels.data<int32_t>(), rows, cols, ignore_index, count, s);
  });
  auto* host = static_cast<unsigned long long*>(host_staging_);
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(host, count, sizeof(unsigned long long), cudaMemcpyDeviceToHost, s));
  wait();  // and report what earlier ops flagged
  return static_cast<int64_t>(*host);
}

void CudaBackend::fill(Tensor& x, double value) {
  if (x.dtype() == DType::kI32) {
    GPIPE_CHECK(x.is_contiguous(), "fill: " + x.str() + " must be contiguous");
    check_on_device(x, "fill");
    DeviceGuard guard(device_.index);
    cuda::fill(x.data<int32_t>(), x.numel(), static_cast<int32_t>(value), cuda_stream());
    return;
  }
  ops::check_float(x, "fill");
  check_on_device(x, "fill");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::fill(x.data<T>(), x.numel(), static_cast<T>(value), cuda_stream());
  });
}

void CudaBackend::scale(Tensor& x, double alpha) {
  ops::check_float(x, "scale");
  check_on_device(x, "scale");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::scale(x.data<T>(), x.numel(), alpha, cuda_stream());  // alpha == 0 clears
  });
}

void CudaBackend::axpy(double alpha, const Tensor& x, Tensor& y) {
  check_storage(x, "axpy");
  ops::check_same(x, y, "axpy");
  check_on_device(x, "axpy");
  check_on_device(y, "axpy");
  DeviceGuard guard(device_.index);
  if (x.dtype() == DType::kBF16) {  // a 16-bit model's residual adds (NarrowOp::kAxpy)
    return cuda::axpy_narrow(alpha, x.data<BFloat16>(), y.data<BFloat16>(), x.numel(), cuda_stream());
  }
  if (x.dtype() == DType::kF16) {
    return cuda::axpy_narrow(alpha, x.data<Half>(), y.data<Half>(), x.numel(), cuda_stream());
  }
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::axpy(alpha, x.data<T>(), y.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p, bool first_step) {
  ops::check_float(param, "sgd_step");
  ops::check_same(param, grad, "sgd_step");
  const bool momentum = p.momentum != 0.0;
  if (momentum) ops::check_same(param, buf, "sgd_step");
  check_on_device(param, "sgd_step");
  check_on_device(grad, "sgd_step");
  if (momentum) check_on_device(buf, "sgd_step");
  DeviceGuard guard(device_.index);
  dispatch_float(param, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::sgd_step(param.data<T>(), grad.data<T>(), momentum ? buf.data<T>() : nullptr, param.numel(), p.lr,
                   p.momentum, p.weight_decay, p.nesterov, first_step, cuda_stream());
  });
}

void CudaBackend::adam_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p,
                            int64_t step) {
  ops::check_adam(param, grad, m, v, step);
  check_on_device(param, "adam_step");
  check_on_device(grad, "adam_step");
  check_on_device(m, "adam_step");
  check_on_device(v, "adam_step");
  // Decay and bias corrections in double on the host, in the one place the multi-tensor
  // step's come from too (adam_step_scalars), so that both give the same bits.
  const StepScalarValues s = adam_step_scalars(p, step);
  DeviceGuard guard(device_.index);
  dispatch_float(param, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::adam_step(param.data<T>(), grad.data<T>(), m.data<T>(), v.data<T>(), param.numel(), p.lr, p.beta1,
                    p.beta2, p.eps, p.weight_decay, p.decoupled, s[kStepDecay], s[kStepBiasCorrection1],
                    s[kStepBiasCorrection2], cuda_stream());
  });
}

double CudaBackend::sum_squares(const Tensor& x) {
  ops::check_float(x, "sum_squares");
  check_on_device(x, "sum_squares");
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  DeviceGuard guard(device_.index);
  const int64_t partials = cuda::sum_squares_workspace(n);
  Tensor work = empty({partials + 1}, DType::kF64);  // (partials) block sums, then the total
  double* total = work.data<double>() + partials;
  cudaStream_t s = cuda_stream();
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::sum_squares(x.data<T>(), n, work.data<double>(), total, s);
  });
  auto* host = static_cast<double*>(host_staging_);
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(host, total, sizeof(double), cudaMemcpyDeviceToHost, s));
  wait();  // and report what earlier ops flagged
  return *host;
}

void CudaBackend::embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, Tensor& out) {
  const ops::EmbeddingDims d = ops::check_embedding(ids, table, pos, out, "embedding", "out", /*narrow_ok=*/true);
  const int64_t B = d.B, T = d.T, V = d.V, C = d.C;
  check_on_device(ids, "embedding");
  check_on_device(table, "embedding");
  if (pos.defined()) check_on_device(pos, "embedding");
  check_on_device(out, "embedding");
  DeviceGuard guard(device_.index);
  cuda::ErrorSlot* error = defer_check(token_check("embedding", ids, V));
  dispatch_storage(table, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    cuda::embedding(ids.data<int32_t>(), table.data<Real>(), pos.defined() ? pos.data<Real>() : nullptr,
                    out.data<Real>(), B, T, V, C, error, cuda_stream());
  });
}

void CudaBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, Tensor& dpos) {
  const ops::EmbeddingDims d = ops::check_embedding(ids, dtable, dpos, dout, "embedding_backward", "dout");
  const int64_t B = d.B, T = d.T, V = d.V, C = d.C;
  check_on_device(ids, "embedding_backward");
  check_on_device(dout, "embedding_backward");
  check_on_device(dtable, "embedding_backward");
  if (dpos.defined()) check_on_device(dpos, "embedding_backward");
  DeviceGuard guard(device_.index);
  const size_t bytes = cuda::embedding_backward_workspace_bytes(B * T, V, C, dtype_size(dtable.dtype()));
  // Sort keys, positions, CUB's scratch and the per-segment partial sums; freed (to the
  // stream-ordered cache) on return.
  Tensor work = empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::kI32);
  cuda::ErrorSlot* error = defer_check(token_check("embedding_backward", ids, V));
  dispatch_float(dtable, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    cuda::embedding_backward(ids.data<int32_t>(), dout.data<Real>(), dtable.data<Real>(),
                             dpos.defined() ? dpos.data<Real>() : nullptr, B, T, V, C,
                             bytes > 0 ? work.raw_data() : nullptr, bytes, error, cuda_stream());
  });
}

void CudaBackend::embedding_slice(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab,
                                  Tensor& out) {
  const ops::EmbeddingDims d =
      ops::check_embedding_slice(ids, table, first, vocab, out, "embedding_slice", "out", /*narrow_ok=*/true);
  check_on_device(ids, "embedding_slice");
  check_on_device(table, "embedding_slice");
  check_on_device(out, "embedding_slice");
  DeviceGuard guard(device_.index);
  cuda::ErrorSlot* error = defer_check(token_check("embedding_slice", ids, vocab));
  dispatch_storage(table, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    cuda::embedding_slice(ids.data<int32_t>(), table.data<Real>(), out.data<Real>(), d.B, d.T, d.V, d.C, first, vocab,
                          error, cuda_stream());
  });
}

void CudaBackend::embedding_slice_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                                           Tensor& dtable) {
  const ops::EmbeddingDims d =
      ops::check_embedding_slice(ids, dtable, first, vocab, dout, "embedding_slice_backward", "dout");
  check_on_device(ids, "embedding_slice_backward");
  check_on_device(dout, "embedding_slice_backward");
  check_on_device(dtable, "embedding_slice_backward");
  DeviceGuard guard(device_.index);
  const size_t bytes = cuda::embedding_backward_workspace_bytes(d.B * d.T, d.V, d.C, dtype_size(dtable.dtype()));
  Tensor work = empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::kI32);  // as embedding_backward's
  cuda::ErrorSlot* error = defer_check(token_check("embedding_slice_backward", ids, vocab));
  dispatch_float(dtable, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    cuda::embedding_slice_backward(ids.data<int32_t>(), dout.data<Real>(), dtable.data<Real>(), d.B, d.T, d.V, d.C,
                                   first, vocab, bytes > 0 ? work.raw_data() : nullptr, bytes, error, cuda_stream());
  });
}

void CudaBackend::layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                            Tensor& mean, Tensor& rstd) {
  const ops::RowDims d = ops::check_layernorm(x, gamma, beta, eps, y, mean, rstd);
  const int64_t R = d.R, C = d.C;
  for (const Tensor* t : {&x, &gamma, &beta}) check_on_device(*t, "layernorm");
  for (const Tensor* t : {&y, &mean, &rstd}) check_on_device(*t, "layernorm");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::layernorm(x.data<T>(), gamma.data<T>(), beta.data<T>(), eps, y.data<T>(), mean.data<T>(), rstd.data<T>(),
                    R, C, cuda_stream());
  });
}

void CudaBackend::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                     const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  const ops::RowDims d = ops::check_layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
  const int64_t R = d.R, C = d.C;
  for (const Tensor* t : {&dy, &x, &gamma, &mean, &rstd}) check_on_device(*t, "layernorm_backward");
  for (const Tensor* t : {&dx, &dgamma, &dbeta}) check_on_device(*t, "layernorm_backward");
  if (R == 0) return;
  DeviceGuard guard(device_.index);
  // (2, chunks, C) partial sums of dgamma and dbeta, in double.
  Tensor work = empty({cuda::layernorm_backward_workspace(R, C)}, DType::kF64);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::layernorm_backward(dy.data<T>(), x.data<T>(), gamma.data<T>(), mean.data<T>(), rstd.data<T>(),
                             dx.data<T>(), dgamma.data<T>(), dbeta.data<T>(), R, C, work.data<double>(),
                             cuda_stream());
  });
}

// Attention runs per batch element b, each cuBLAS call batched over the H heads with
// strided pointers into qkv (no head is copied out):
//
//   qkv row t:  [ q_h0 q_h1 ... | k_h0 k_h1 ... | v_h0 v_h1 ... ]   (3C, ld 3C)
//                 ^ q + h D       ^ q + C + h D   ^ q + 2C + h D
//
// cuBLAS is column-major: a row-major (r, c) block with row stride ld reads as its
// transpose (c, r) with leading dimension ld. So each row-major product X = A B below
// is issued as the column-major X^T = B^T A^T, and each operand stored as Y (row-major)
// is passed as OP_N when the formula wants Y^T and as OP_T when it wants Y.

void CudaBackend::attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) {
  const AttentionDims d = ops::check_attention_forward(qkv, heads, probs, out);
  const int64_t B = d.B, T = d.T, C = d.C, H = d.H, D = d.D;
  check_on_device(qkv, "attention");
  check_on_device(probs, "attention");
  check_on_device(out, "attention");
  if (B == 0 || T == 0) return;
  if (D == 0) throw Error("attention: qkv " + qkv.str() + " has no channels");
  const int iT = to_int(T, "T", "attention"), iD = to_int(D, "D", "attention");
  const int ld = to_int(3 * C, "3C", "attention"), ldo = to_int(C, "C", "attention");
  const int iH = static_cast<int>(H);
  const long long tt = static_cast<long long>(T) * T;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  DeviceGuard guard(device_.index);
  dispatch_float(qkv, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* pqkv = qkv.data<Real>();  // (B, T, 3C)
    Real* pp = probs.data<Real>();        // (B, H, T, T)
    Real* po = out.data<Real>();          // (B, T, C)
    for (int64_t b = 0; b < B; ++b) {
      const Real* q = pqkv + b * T * 3 * C;  // head h at + h D, (T, D) with ld 3C
      const Real* k = q + C;
      Real* p = pp + b * H * tt;  // head h at + h T^2, (T, T)
      // scores (T, T) = scale q k^T;  column-major: scores^T = scale k q^T
      gemm_batched(blas_, CUBLAS_OP_T, CUBLAS_OP_N, iT, iT, iD, scale, k, ld, D, q, ld, D, 0.0, p, iT, tt, iH);
    }
    cuda::causal_softmax(pp, B * H * T, T, cuda_stream());
    for (int64_t b = 0; b < B; ++b) {
      const Real* v = pqkv + b * T * 3 * C + 2 * C;  // (T, D), ld 3C
      const Real* p = pp + b * H * tt;
      // out_h (T, D), ld C = probs (T, T) v (T, D);  column-major: out^T = v^T probs^T
      gemm_batched(blas_, CUBLAS_OP_N, CUBLAS_OP_N, iD, iT, iT, 1.0, v, ld, D, p, iT, tt, 0.0, po + b * T * C, ldo, D,
                   iH);
    }
  });
}

void CudaBackend::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                                     Tensor& dqkv) {
  const AttentionDims d = ops::check_attention_backward(dout, qkv, probs, heads, dqkv);
  const int64_t B = d.B, T = d.T, C = d.C, H = d.H, D = d.D;
  check_on_device(dout, "attention_backward");
  check_on_device(qkv, "attention_backward");
  check_on_device(probs, "attention_backward");
  check_on_device(dqkv, "attention_backward");
  if (B == 0 || T == 0) return;
  if (D == 0) throw Error("attention_backward: qkv " + qkv.str() + " has no channels");
  const int iT = to_int(T, "T", "attention_backward"), iD = to_int(D, "D", "attention_backward");
  const int ld = to_int(3 * C, "3C", "attention_backward"), ldo = to_int(C, "C", "attention_backward");
  const int iH = static_cast<int>(H);
  const long long tt = static_cast<long long>(T) * T;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  DeviceGuard guard(device_.index);
  // (H, T, T): dprobs, then dscores in place, for one batch element at a time (the
  // stream orders element b + 1's first write after element b's last read).
  Tensor work = empty({H, T, T}, qkv.dtype());
  cudaStream_t s = cuda_stream();
  dispatch_float(qkv, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    Real* ds = work.data<Real>();
    for (int64_t b = 0; b < B; ++b) {
      const Real* q = qkv.data<Real>() + b * T * 3 * C;  // (T, D) per head, ld 3C
      const Real* k = q + C;
      const Real* v = q + 2 * C;
      Real* dq = dqkv.data<Real>() + b * T * 3 * C;
      Real* dk = dq + C;
      Real* dv = dq + 2 * C;
      const Real* p = probs.data<Real>() + b * H * tt;  // (T, T) per head
      const Real* go = dout.data<Real>() + b * T * C;   // (T, D) per head, ld C
      // dprobs (T, T) = dout v^T;  column-major: dprobs^T = v dout^T
      gemm_batched(blas_, CUBLAS_OP_T, CUBLAS_OP_N, iT, iT, iD, 1.0, v, ld, D, go, ldo, D, 0.0, ds, iT, tt, iH);
      cuda::causal_softmax_backward(p, ds, H * T, T, s);  // dscores, masked entries 0
      // dq (T, D) = scale dscores k;  column-major: dq^T = scale k^T dscores^T
      gemm_batched(blas_, CUBLAS_OP_N, CUBLAS_OP_N, iD, iT, iT, scale, k, ld, D, ds, iT, tt, 0.0, dq, ld, D, iH);
      // dk (T, D) = scale dscores^T q;  column-major: dk^T = scale q^T dscores
      gemm_batched(blas_, CUBLAS_OP_N, CUBLAS_OP_T, iD, iT, iT, scale, q, ld, D, ds, iT, tt, 0.0, dk, ld, D, iH);
      // dv (T, D) = probs^T dout;  column-major: dv^T = dout^T probs
      gemm_batched(blas_, CUBLAS_OP_N, CUBLAS_OP_T, iD, iT, iT, 1.0, go, ldo, D, p, iT, tt, 0.0, dv, ld, D, iH);
    }
  });
}

void CudaBackend::dropout(const Tensor& x, double p, const DropoutKey& key, int64_t sample_offset,
                          int64_t element_offset, Tensor& y) {
  dropout_impl(x, p, key, sample_offset, element_offset, y, "dropout");
}

void CudaBackend::dropout_backward(const Tensor& dy, double p, const DropoutKey& key, int64_t sample_offset,
                                   int64_t element_offset, Tensor& dx) {
  dropout_impl(dy, p, key, sample_offset, element_offset, dx, "dropout_backward");  // the same linear map as forward
}

void CudaBackend::dropout_impl(const Tensor& in, double p, const DropoutKey& key, int64_t sample_offset,
                               int64_t element_offset, Tensor& out, const char* op) {
  ops::check_float(in, op);
  ops::check_same(in, out, op);
  if (in.dim() < 1) throw Error(std::string(op) + ": " + in.str() + " needs a batch dimension");
  check_dropout_p(p, op);
  if (sample_offset < 0) throw Error(std::string(op) + ": negative sample offset " + std::to_string(sample_offset));
  if (element_offset < 0) throw Error(std::string(op) + ": negative element offset " + std::to_string(element_offset));
  check_on_device(in, op);
  check_on_device(out, op);
  const int64_t rows = in.size(0);
  if (rows == 0 || in.numel() == 0) return;
  cuda::DropoutKeyArgs k;
  if (key.from_device()) {  // finished by the kernel from the step's index on the device
    k.base = key.base;
    k.multiplier = key.multiplier;
    k.step = step_scalars_on_device(key.scalars, op);
  } else {
    k.key = key.host_key();
  }
  DeviceGuard guard(device_.index);
  dispatch_float(in, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::dropout(in.data<T>(), out.data<T>(), rows, in.numel() / rows, p, k, sample_offset, element_offset,
                  cuda_stream());
  });
}

void CudaBackend::cast(const Tensor& src, Tensor& dst) {
  ops::check_cast(src, dst);
  check_on_device(src, "cast");
  check_on_device(dst, "cast");
  if (src.dtype() == dst.dtype()) return copy(src, dst);
  DeviceGuard guard(device_.index);
  cuda::cast(src.raw_data(), src.dtype(), dst.raw_data(), dst.dtype(), src.numel(), cuda_stream());
}

void CudaBackend::copy(const Tensor& src, Tensor& dst) {
  GPIPE_CHECK(src.dtype() == dst.dtype(), "copy " + src.str() + " -> " + dst.str());
  GPIPE_CHECK(src.numel() == dst.numel(), "copy " + src.str() + " -> " + dst.str());
  GPIPE_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy of non-contiguous tensors");
  auto here = [&](Device d) { return d.is_cpu() || d == device_; };
  if (!here(src.device()) || !here(dst.device())) {
    throw Error("copy " + src.str() + " -> " + dst.str() + ": the backend of " + device_.str() +
                " copies between the host and " + device_.str() + " only; use copy_tensor for other devices");
  }
  if (src.nbytes() == 0) return;
  if (src.device().is_cpu() && dst.device().is_cpu()) {
    // No queued work touches host memory (device-to-host copies here complete before
    // returning), so a plain memcpy is ordered correctly.
    std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
    return;
  }
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  if (src.device().is_cpu()) {
    // Inputs and targets of every micro-batch: through a pinned buffer that is reused
    // once an event says this copy is done, so the host runs on (no wait).
    stage_to_device(src.raw_data(), dst.raw_data(), src.nbytes(), device_, s);
    return;
  }
  if (dst.device().is_cpu()) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), src.nbytes(), cudaMemcpyDeviceToHost, s));
    wait();  // the host reads it on return (and what earlier ops flagged is reported)
    return;
  }
  // On the device: queued, ordered with the other work on the stream.
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), src.nbytes(), cudaMemcpyDeviceToDevice, s));
}

void CudaBackend::transpose_blocks(const Tensor& src, int64_t rows, int64_t cols, Tensor& dst) {
  const int64_t block = ops::check_transpose_blocks(src, rows, cols, dst);
  check_on_device(src, "transpose_blocks");
  check_on_device(dst, "transpose_blocks");
  if (src.nbytes() == 0) return;
  DeviceGuard guard(device_.index);
  const char* from = static_cast<const char*>(src.raw_data());
  char* to = static_cast<char*>(dst.raw_data());
  const auto b = static_cast<size_t>(block);
  // 2-D copies queued on the stream, along the shorter side (fewer calls, the smaller
  // pitch): row r of src's blocks is column r of dst's (`cols` blocks from pitch `block`
  // to pitch `rows` blocks), or column c of src's is row c of dst's. A pitch past what
  // cudaMemcpy2D takes (2^31 - 1 bytes) falls back to one copy a block.
  const int64_t shorter = std::min(rows, cols);
  if (shorter * block > static_cast<int64_t>(INT_MAX)) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        GPIPE_CUDA_CHECK(cudaMemcpyAsync(to + (c * rows + r) * block, from + (r * cols + c) * block, b,
                                         cudaMemcpyDeviceToDevice, cuda_stream()));
      }
    }
  } else if (rows <= cols) {
    for (int64_t r = 0; r < rows; ++r) {
      GPIPE_CUDA_CHECK(cudaMemcpy2DAsync(to + r * block, b * static_cast<size_t>(rows), from + r * cols * block, b, b,
                                         static_cast<size_t>(cols), cudaMemcpyDeviceToDevice, cuda_stream()));
    }
  } else {
    for (int64_t c = 0; c < cols; ++c) {
      GPIPE_CUDA_CHECK(cudaMemcpy2DAsync(to + c * rows * block, b, from + c * block, b * static_cast<size_t>(cols), b,
                                         static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, cuda_stream()));
    }
  }
}

double CudaBackend::item(const Tensor& x) {
  GPIPE_CHECK(x.numel() == 1, "item() of " + x.str());
  if (x.dtype() != DType::kF32 && x.dtype() != DType::kF64 && x.dtype() != DType::kI32) {
    throw Error("item() of " + x.str());
  }
  void* host = host_staging_;
  if (x.device().is_cpu()) {
    host = x.raw_data();  // already on the host, written synchronously
  } else {
    check_on_device(x, "item");
    DeviceGuard guard(device_.index);
    cudaStream_t s = cuda_stream();
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(host_staging_, x.raw_data(), dtype_size(x.dtype()), cudaMemcpyDeviceToHost, s));
    wait();  // and report what earlier ops flagged
  }
  switch (x.dtype()) {
    case DType::kF32: return *static_cast<const float*>(host);
    case DType::kF64: return *static_cast<const double*>(host);
    default: return *static_cast<const int32_t*>(host);
  }
}

void CudaBackend::synchronize() {
  DeviceGuard guard(device_.index);
  wait();
}

std::unique_ptr<Backend> make_cuda_backend(Device device) { return std::make_unique<CudaBackend>(device); }

}  // namespace gpipe

// ==== Generic elementwise and row ops (Backend::mul, scale_rows, scale_columns, row_dot,
// row_inverse_rms): argument checks shared with the CPU (kernels/row_checks.h), kernels in
// kernels/cuda_elementwise.cu. A separate block, so that it merges apart from the rest.

#include "kernels/cuda_elementwise.h"
#include "kernels/row_checks.h"

namespace gpipe {

void CudaBackend::unary_impl(Unary f, const Tensor& x, Tensor& y) {
  const std::string op = std::string("unary ") + unary_name(f);
  ops::check_float(x, op.c_str());
  ops::check_same(x, y, op.c_str());
  check_on_device(x, op.c_str());
  check_on_device(y, op.c_str());
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::unary(f, x.data<T>(), y.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::unary_backward_impl(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const std::string op = std::string("unary_backward ") + unary_name(f);
  ops::check_float(x, op.c_str());
  ops::check_same(x, dy, op.c_str());
  ops::check_same(x, dx, op.c_str());
  check_on_device(x, op.c_str());
  check_on_device(dy, op.c_str());
  check_on_device(dx, op.c_str());
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::unary_backward(f, x.data<T>(), dy.data<T>(), dx.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::mul(const Tensor& a, const Tensor& b, Tensor& y) {
  ops::check_float(a, "mul");
  ops::check_same(a, b, "mul");
  ops::check_same(a, y, "mul");
  check_on_device(a, "mul");
  check_on_device(b, "mul");
  check_on_device(y, "mul");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::mul(a.data<T>(), b.data<T>(), y.data<T>(), a.numel(), cuda_stream());
  });
}

void CudaBackend::scale_rows(const Tensor& x, const Tensor& s, Tensor& y) {
  const ops::RowView d = ops::check_rows(x, "scale_rows");
  ops::check_same(x, y, "scale_rows");
  ops::check_factor(s, d.rows, x.dtype(), "scale_rows", "s");
  check_on_device(x, "scale_rows");
  check_on_device(s, "scale_rows");
  check_on_device(y, "scale_rows");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::scale_rows(x.data<T>(), s.data<T>(), y.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::scale_columns(const Tensor& x, const Tensor& s, Tensor& y) {
  const ops::RowView d = ops::check_rows(x, "scale_columns");
  ops::check_same(x, y, "scale_columns");
  ops::check_factor(s, d.cols, x.dtype(), "scale_columns", "s");
  check_on_device(x, "scale_columns");
  check_on_device(s, "scale_columns");
  check_on_device(y, "scale_columns");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::scale_columns(x.data<T>(), s.data<T>(), y.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::row_dot(const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  const ops::RowView d = ops::check_rows(a, "row_dot");
  ops::check_same(a, b, "row_dot");
  ops::check_factor(out, d.rows, a.dtype(), "row_dot", "out");
  check_on_device(a, "row_dot");
  check_on_device(b, "row_dot");
  check_on_device(out, "row_dot");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(a, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::row_dot(a.data<T>(), b.data<T>(), alpha, out.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::row_inverse_rms(const Tensor& x, double eps, Tensor& out) {
  const ops::RowView d = ops::check_rows(x, "row_inverse_rms");
  ops::check_factor(out, d.rows, x.dtype(), "row_inverse_rms", "out");
  check_on_device(x, "row_inverse_rms");
  check_on_device(out, "row_inverse_rms");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::row_inverse_rms(x.data<T>(), eps, out.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) {
  const std::string name = std::string("binary ") + binary_name(op);
  const ops::Broadcast p = ops::check_binary(a, b, y, name.c_str());
  check_on_device(a, name.c_str());
  check_on_device(b, name.c_str());
  check_on_device(y, name.c_str());
  DeviceGuard guard(device_.index);
  ops::dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::binary<T>(op, p, a.data<T>(), b.data<T>(), y.data<T>(), cuda_stream());
  });
}

void CudaBackend::sum_to(const Tensor& x, Tensor& y) {
  const ops::Broadcast p = ops::check_sum_to(x, y);
  check_on_device(x, "sum_to");
  check_on_device(y, "sum_to");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::sum_to<T>(p, x.data<T>(), y.data<T>(), y.numel(), cuda_stream());
  });
}

void CudaBackend::reduce_rows(Reduce op, const Tensor& x, Tensor& y) {
  const std::string name = std::string("reduce_rows ") + reduce_name(op);
  const ops::RowView d = ops::check_rows(x, name.c_str());
  ops::check_factor(y, d.rows, x.dtype(), name.c_str(), "y");
  check_on_device(x, name.c_str());
  check_on_device(y, name.c_str());
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::reduce_rows<T>(op, x.data<T>(), y.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::reduce_rows_backward(Reduce op, const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx) {
  const std::string name = std::string("reduce_rows_backward ") + reduce_name(op);
  const ops::RowView d = ops::check_rows(x, name.c_str());
  ops::check_factor(y, d.rows, x.dtype(), name.c_str(), "y");
  ops::check_factor(dy, d.rows, x.dtype(), name.c_str(), "dy");
  ops::check_same(x, dx, name.c_str());
  for (const Tensor* t : {&x, &y, &dy, static_cast<const Tensor*>(&dx)}) check_on_device(*t, name.c_str());
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::reduce_rows_backward<T>(op, x.data<T>(), y.data<T>(), dy.data<T>(), dx.data<T>(), d.rows, d.cols,
                                  cuda_stream());
  });
}

void CudaBackend::softmax(const Tensor& x, Tensor& y) {
  const ops::RowView d = ops::check_rows(x, "softmax");
  ops::check_same(x, y, "softmax");
  check_on_device(x, "softmax");
  check_on_device(y, "softmax");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax<T>(x.data<T>(), y.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const ops::RowView d = ops::check_rows(y, "softmax_backward");
  ops::check_same(y, dy, "softmax_backward");
  ops::check_same(y, dx, "softmax_backward");
  for (const Tensor* t : {&y, &dy, static_cast<const Tensor*>(&dx)}) check_on_device(*t, "softmax_backward");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_backward<T>(y.data<T>(), dy.data<T>(), dx.data<T>(), d.rows, d.cols, cuda_stream());
  });
}

}  // namespace gpipe
