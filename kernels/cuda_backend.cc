#include "kernels/cuda_backend.h"

#include <spdlog/spdlog.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda_kernels.h"
#include "kernels/op_checks.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_runtime.h"
#include "runtime/error.h"

namespace gpipe {

namespace {

// "The process is exiting and CUDA is already torn down" (static destructors at exit).
bool is_teardown(cudaError_t e) { return e == cudaErrorCudartUnloading || e == cudaErrorContextIsDestroyed; }

// Sets the backend's device for the scope of an op and restores the caller's device:
// kernel launches, cuBLAS calls and allocations all act on the current device, and the
// stream and handle belong to device_.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    GPIPE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != index) {
      GPIPE_CUDA_CHECK(cudaSetDevice(index));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (!switched_) return;
    const cudaError_t e = cudaSetDevice(previous_);
    if (e != cudaSuccess && !is_teardown(e)) {
      spdlog::warn("cudaSetDevice({}) while restoring the current device failed: {}", previous_,
                   cudaGetErrorString(e));
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Calls f(T*) with T = float or double per the tensor's dtype (the pointer is a tag).
template <typename F>
void dispatch_float(const Tensor& t, F&& f) {
  if (t.dtype() == DType::kF32) {
    f(static_cast<float*>(nullptr));
  } else if (t.dtype() == DType::kF64) {
    f(static_cast<double*>(nullptr));
  } else {
    throw Error("expected a float32 or float64 tensor, got " + t.str());
  }
}

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

int to_int(int64_t v, const char* what) {
  if (v > INT_MAX) {
    throw Error(std::string("matmul: ") + what + " = " + std::to_string(v) + " exceeds cuBLAS's 32-bit limit");
  }
  return static_cast<int>(v);
}

// The CPU backend's message for a bad label, word for word (kernels/cpu_backend.cc).
std::string label_error(int32_t label, int64_t row, int64_t classes) {
  return "label " + std::to_string(label) + " in row " + std::to_string(row) + " is outside [0, " +
         std::to_string(classes) + "); the model's last layer must have as many outputs as there are classes";
}

constexpr size_t kStagingBytes = 16;

}  // namespace

CudaBackend::CudaBackend(Device device) : device_(device) {
  GPIPE_CHECK(device.is_cuda(), "CudaBackend on " + device.str());
  stream_ = make_cuda_stream(device_);  // UserError if the device does not exist
  try {
    DeviceGuard guard(device_.index);
    GPIPE_CUBLAS_CHECK(cublasCreate(&blas_));
    GPIPE_CUBLAS_CHECK(cublasSetStream(blas_, cuda_stream()));
    // Full float32 precision: no TF32 tensor-core rounding, so results match the CPU
    // reference to float32 accuracy (CUBLAS_DEFAULT_MATH never lowers precision).
    GPIPE_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
    GPIPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&bad_row_), sizeof(unsigned)));
    GPIPE_CUDA_CHECK(cudaMallocHost(&host_staging_, kStagingBytes));
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
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_.index) != cudaSuccess) {
    cudaGetLastError();
    return;  // cannot select the device: leave the resources to the driver
  }
  if (host_staging_ != nullptr) {
    const cudaError_t e = cudaFreeHost(host_staging_);
    if (e != cudaSuccess) spdlog::warn("cudaFreeHost failed: {}", cudaGetErrorString(e));
    host_staging_ = nullptr;
  }
  if (bad_row_ != nullptr) {
    const cudaError_t e = cudaFree(bad_row_);
    if (e != cudaSuccess) spdlog::warn("cudaFree failed: {}", cudaGetErrorString(e));
    bad_row_ = nullptr;
  }
  if (blas_ != nullptr) {
    const cublasStatus_t st = cublasDestroy(blas_);
    if (st != CUBLAS_STATUS_SUCCESS) spdlog::warn("cublasDestroy failed: {}", cublas_status_string(st));
    blas_ = nullptr;
  }
  cudaGetLastError();
  if (previous != device_.index && cudaSetDevice(previous) != cudaSuccess) cudaGetLastError();
}

cudaStream_t CudaBackend::cuda_stream() const { return static_cast<cudaStream_t>(stream_->native()); }

void CudaBackend::check_on_device(const Tensor& t, const char* op) const {
  if (t.device() != device_) {
    throw Error(std::string(op) + ": " + t.str() + " is not on " + device_.str() +
                ", the device of this backend; copy it there first (Backend::copy)");
  }
}

void CudaBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha,
                         double beta) {
  const auto d = ops::check_matmul(a, ta, b, tb, c);
  check_on_device(a, "matmul");
  check_on_device(b, "matmul");
  check_on_device(c, "matmul");
  if (d.m == 0 || d.n == 0) return;
  if (d.k == 0) {  // cuBLAS leaves c untouched when k == 0; the definition says beta * c.
    scale(c, beta);
    return;
  }
  const int m = to_int(d.m, "M"), n = to_int(d.n, "N"), k = to_int(d.k, "K");
  const int lda = to_int(a.size(1), "a's row length"), ldb = to_int(b.size(1), "b's row length");
  const int ldc = to_int(c.size(1), "c's row length");
  DeviceGuard guard(device_.index);
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
  ops::check_matrix(y, "add_bias");
  ops::check_float(bias, "add_bias");
  GPIPE_CHECK(bias.dtype() == y.dtype() && bias.numel() == y.size(1),
              "add_bias: bias " + bias.str() + " for " + y.str());
  check_on_device(y, "add_bias");
  check_on_device(bias, "add_bias");
  DeviceGuard guard(device_.index);
  dispatch_float(y, [&](auto* tag) {
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
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::bias_grad(dy.data<T>(), db.data<T>(), dy.size(0), dy.size(1), beta, cuda_stream());
  });
}

void CudaBackend::relu(const Tensor& x, Tensor& y) {
  ops::check_float(x, "relu");
  ops::check_same(x, y, "relu");
  check_on_device(x, "relu");
  check_on_device(y, "relu");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::relu(x.data<T>(), y.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  ops::check_float(y, "relu_backward");
  ops::check_same(y, dy, "relu_backward");
  ops::check_same(y, dx, "relu_backward");
  check_on_device(y, "relu_backward");
  check_on_device(dy, "relu_backward");
  check_on_device(dx, "relu_backward");
  DeviceGuard guard(device_.index);
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::relu_backward(y.data<T>(), dy.data<T>(), dx.data<T>(), y.numel(), cuda_stream());
  });
}

void CudaBackend::gelu(const Tensor& x, Tensor& y) {
  ops::check_float(x, "gelu");
  ops::check_same(x, y, "gelu");
  check_on_device(x, "gelu");
  check_on_device(y, "gelu");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::gelu(x.data<T>(), y.data<T>(), x.numel(), cuda_stream());
  });
}

void CudaBackend::gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  ops::check_float(x, "gelu_backward");
  ops::check_same(x, dy, "gelu_backward");
  ops::check_same(x, dx, "gelu_backward");
  check_on_device(x, "gelu_backward");
  check_on_device(dy, "gelu_backward");
  check_on_device(dx, "gelu_backward");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::gelu_backward(x.data<T>(), dy.data<T>(), dx.data<T>(), x.numel(), cuda_stream());
  });
}

// The one place where an op waits for the host: labels live on the device, and an
// invalid one must surface as a UserError from this call (as on the CPU), not as a
// silent wrong loss or an out-of-bounds read. The kernels record the first bad row in
// bad_row_ instead of reading out of bounds; here we copy that one word into pinned
// memory and wait for the stream. The loss is needed on the host right after the
// forward pass in practice (item()), so the wait costs little beyond the kernels
// themselves. Only when a row is flagged is its label fetched, for the message.
void CudaBackend::check_labels(const Tensor& labels, int64_t classes, const char* op) {
  cudaStream_t s = cuda_stream();
  auto* host_row = static_cast<unsigned*>(host_staging_);
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(host_row, bad_row_, sizeof(unsigned), cudaMemcpyDeviceToHost, s));
  GPIPE_CUDA_CHECK(cudaStreamSynchronize(s));
  const unsigned row = *host_row;
  if (row == cuda::kNoBadRow) return;
  GPIPE_CHECK(static_cast<int64_t>(row) < labels.numel(), std::string(op) + ": bad label row out of range");
  auto* host_label = reinterpret_cast<int32_t*>(static_cast<char*>(host_staging_) + 8);
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(host_label, labels.data<int32_t>() + row, sizeof(int32_t),
                                   cudaMemcpyDeviceToHost, s));
  GPIPE_CUDA_CHECK(cudaStreamSynchronize(s));
  throw UserError(label_error(*host_label, static_cast<int64_t>(row), classes));
}

void CudaBackend::softmax_xent(const Tensor& logits, const Tensor& labels, double scale, int ignore_index,
                               Tensor& probs, Tensor& loss) {
  ops::check_xent(logits, labels, probs);
  GPIPE_CHECK(loss.numel() == 1 && loss.dtype() == logits.dtype(), "softmax_xent: loss " + loss.str());
  check_on_device(logits, "softmax_xent");
  check_on_device(labels, "softmax_xent");
  check_on_device(probs, "softmax_xent");
  check_on_device(loss, "softmax_xent");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  DeviceGuard guard(device_.index);
  Tensor row_loss = empty({rows}, logits.dtype());  // (rows) workspace, alive until the stream is synced
  dispatch_float(logits, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent(logits.data<T>(), labels.data<int32_t>(), rows, cols, scale, ignore_index, probs.data<T>(),
                       row_loss.data<T>(), loss.data<T>(), bad_row_, cuda_stream());
  });
  check_labels(labels, cols, "softmax_xent");
}

void CudaBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels, double scale, int ignore_index,
                                        Tensor& dlogits) {
  ops::check_xent(probs, labels, dlogits);
  check_on_device(probs, "softmax_xent_backward");
  check_on_device(labels, "softmax_xent_backward");
  check_on_device(dlogits, "softmax_xent_backward");
  const int64_t rows = probs.size(0), cols = probs.size(1);
  DeviceGuard guard(device_.index);
  dispatch_float(probs, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::softmax_xent_backward(probs.data<T>(), labels.data<int32_t>(), rows, cols, scale, ignore_index,
                                dlogits.data<T>(), bad_row_, cuda_stream());
  });
  check_labels(labels, cols, "softmax_xent_backward");
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
  ops::check_float(x, "axpy");
  ops::check_same(x, y, "axpy");
  check_on_device(x, "axpy");
  check_on_device(y, "axpy");
  DeviceGuard guard(device_.index);
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
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), src.nbytes(), cudaMemcpyDefault, s));
  // A host buffer may be read or freed as soon as we return: wait. Device-to-device
  // copies stay queued, ordered with the other work on the stream.
  if (src.device().is_cpu() || dst.device().is_cpu()) GPIPE_CUDA_CHECK(cudaStreamSynchronize(s));
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
    GPIPE_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  switch (x.dtype()) {
    case DType::kF32: return *static_cast<const float*>(host);
    case DType::kF64: return *static_cast<const double*>(host);
    default: return *static_cast<const int32_t*>(host);
  }
}

void CudaBackend::synchronize() { stream_->synchronize(); }

std::unique_ptr<Backend> make_cuda_backend(Device device) { return std::make_unique<CudaBackend>(device); }

}  // namespace gpipe
