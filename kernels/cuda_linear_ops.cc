// The CUDA backend's linear ops (Backend::linear_bias, linear_weight_grad, linear_residual,
// linear_input_grad_add; issue 37 item 5): one cuBLASLt matmul each (the last one a cuBLAS
// product), float32 compute (no TF32) on float32, bfloat16 or float16 operands.
//   linear_bias         the BIAS epilogue adds the bias to the product before the one
//                       rounding into y's type, so the bias costs no pass of its own.
//   linear_weight_grad  dw += dy^T x with the BGRADB epilogue, which sums dy's columns
//                       (db's increment) while the product reads them: no second pass
//                       over dy, and on 16-bit dy no float32 copy of it. cuBLASLt writes
//                       the sums (it cannot add into db), so they land in a float32
//                       temporary that one axpy adds into db.
//   linear_residual     y = x w^T + residual: the residual as the product's C (beta 1),
//                       read in its type and added in float32 before the one rounding.
//   linear_input_grad_add  dx += dy w: cuBLAS's product with beta 1 (CudaBackend::matmul).
// The row-major call is the column-major product with the operands swapped, as
// CudaBackend::matmul explains: y^T (N x R) = w (N x K, read as K x N, transposed) x^T.
// An algorithm is chosen by cuBLASLt's heuristic once per shape, type and operand
// alignment and kept; the workspace (32 MiB, what PyTorch gives cuBLASLt on Hopper) is
// allocated on first use. Split-K sums are never kept in a 16-bit output's type
// (CUBLASLT_REDUCTION_SCHEME_INPLACE and OUTPUT_TYPE are excluded), as the backend's
// cuBLAS handle disallows reduced-precision reductions. Where the heuristic finds no
// algorithm, or GPIPE_CUBLASLT=0, the ops compose matmul and the bias ops (or axpy) as the CPU
// reference does.
#include <cublasLt.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include <spdlog/spdlog.h>

#include "kernels/cuda_backend.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_device.h"
#include "runtime/error.h"

namespace gpipe {

namespace {
std::atomic<int64_t> lt_calls{0};  // cuBLASLt matmuls queued by every CudaBackend (cuda_cublaslt_calls)
}  // namespace

int64_t cuda_cublaslt_calls() { return lt_calls.load(); }

bool cuda_cublaslt_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("GPIPE_CUBLASLT");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

// The cuBLASLt handle, its workspace and the algorithms chosen so far (CudaBackend::lt_).
struct LtState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  // Key: LtCall::key(); nullopt: the heuristic found no algorithm.
  std::map<std::array<int64_t, 17>, std::optional<cublasLtMatmulAlgo_t>> algos;
};

namespace {

cudaDataType lt_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    default: throw Error(std::string("cuBLASLt: no ") + dtype_name(t) + " here");
  }
}

// The largest power of two up to 256 that divides the address: what cuBLASLt may assume.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

}  // namespace

// Column-major D (m x n) = op(A) (m x k) op(B) (k x n) + beta C, C and D one buffer unless c_in
// is given (of D's layout), with
// an epilogue whose vector (a bias to add, or the bias gradient written) is `bias`.
struct LtCall {
  cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  cudaDataType ab_type = CUDA_R_32F;
  void* c = nullptr;  // D, and C where c_in is null
  const void* c_in = nullptr;  // C where it is not D (beta != 0): linear_residual's residual
  int64_t ldc = 0;
  cudaDataType c_type = CUDA_R_32F;
  float beta = 0;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;

  const void* c_source() const { return c_in != nullptr ? c_in : c; }
  std::array<int64_t, 17> key() const {
    return {op_a, op_b, m, n, k, lda, ldb, ab_type, ldc, c_type, epilogue, alignment(a), alignment(b),
            alignment(c), alignment(c_source()), alignment(bias), beta != 0};
  }
};

namespace {

// The descriptors of one call, destroyed with it.
class LtDescriptors {
 public:
  explicit LtDescriptors(const LtCall& call) {
    try {
      GPIPE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      set(CUBLASLT_MATMUL_DESC_TRANSA, call.op_a);
      set(CUBLASLT_MATMUL_DESC_TRANSB, call.op_b);
      set(CUBLASLT_MATMUL_DESC_EPILOGUE, call.epilogue);
      if (call.bias != nullptr) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, call.bias);
      const bool na = call.op_a == CUBLAS_OP_N, nb = call.op_b == CUBLAS_OP_N;
      GPIPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, call.ab_type, na ? call.m : call.k, na ? call.k : call.m,
                                                    call.lda));
      GPIPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, call.ab_type, nb ? call.k : call.n, nb ? call.n : call.k,
                                                    call.ldb));
      GPIPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c_, call.c_type, call.m, call.n, call.ldc));
    } catch (...) {
      release();
      throw;
    }
  }
  ~LtDescriptors() { release(); }
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;

  cublasLtMatmulDesc_t op() const { return op_; }
  cublasLtMatrixLayout_t a() const { return a_; }
  cublasLtMatrixLayout_t b() const { return b_; }
  cublasLtMatrixLayout_t c() const { return c_; }

 private:
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    GPIPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, attr, &value, sizeof(value)));
  }
  void release() noexcept {
    if (c_ != nullptr) cublasLtMatrixLayoutDestroy(c_);
    if (b_ != nullptr) cublasLtMatrixLayoutDestroy(b_);
    if (a_ != nullptr) cublasLtMatrixLayoutDestroy(a_);
    if (op_ != nullptr) cublasLtMatmulDescDestroy(op_);
    c_ = b_ = a_ = nullptr;
    op_ = nullptr;
  }
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
};

// A cuBLASLt call that failed where the composition can stand in: said once a process.
void warn_once(const char* what, cublasStatus_t st) {
  static std::atomic<bool> warned{false};
  if (warned.exchange(true)) return;
  spdlog::warn("cuBLASLt: {} failed ({}); the linear ops with a bias or a residual compose cuBLAS's product and the "
               "bias or axpy kernels instead where it does (GPIPE_CUBLASLT=0 always does)",
               what, cublas_status_string(st));
}

// The heuristic's first algorithm for the call, or nullopt.
std::optional<cublasLtMatmulAlgo_t> choose(cublasLtHandle_t handle, const LtCall& call, const LtDescriptors& d) {
  cublasLtMatmulPreference_t pref = nullptr;
  GPIPE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  std::optional<cublasLtMatmulAlgo_t> out;
  try {
    auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
      GPIPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
    };
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(LtState::kWorkspaceBytes));
    set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
        static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(call.a));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(call.b));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(call.c_source()));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(call.c));
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle, d.op(), d.a(), d.b(), d.c(), d.c(), pref, 1, &result, &found);
    // NOT_SUPPORTED: no algorithm for this configuration (an answer, not an error). Any
    // other failure: the same, said once (the composition computes the op).
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) warn_once("the heuristic", st);
    if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS &&
        result.workspaceSize <= LtState::kWorkspaceBytes) {
      out = result.algo;
    }
  } catch (...) {
    cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  return out;
}

}  // namespace

LtState& CudaBackend::lt() {
  std::lock_guard<std::mutex> lock(lt_mu_);
  if (lt_ == nullptr) {
    auto s = std::make_unique<LtState>();
    GPIPE_CUBLAS_CHECK(cublasLtCreate(&s->handle));
    const cudaError_t e = cudaMalloc(&s->workspace, LtState::kWorkspaceBytes);
    if (e != cudaSuccess) {
      cublasLtDestroy(s->handle);
      GPIPE_CUDA_CHECK(e);
    }
    lt_ = s.release();
  }
  return *lt_;
}

void CudaBackend::release_lt() noexcept {
  if (lt_ == nullptr) return;
  if (lt_->workspace != nullptr) {
    const cudaError_t e = cudaFree(lt_->workspace);
    if (e != cudaSuccess) cudaGetLastError();
  }
  if (lt_->handle != nullptr) cublasLtDestroy(lt_->handle);
  delete lt_;
  lt_ = nullptr;
}

bool CudaBackend::lt_matmul(const LtCall& call) {
  LtState& s = lt();
  const LtDescriptors d(call);
  std::optional<cublasLtMatmulAlgo_t> algo;
  {
    std::lock_guard<std::mutex> lock(lt_mu_);
    auto it = s.algos.find(call.key());
    if (it == s.algos.end()) it = s.algos.emplace(call.key(), choose(s.handle, call, d)).first;
    algo = it->second;
  }
  if (!algo) return false;
  const float alpha = 1.0f;
  const cublasStatus_t st = cublasLtMatmul(s.handle, d.op(), &alpha, call.a, d.a(), call.b, d.b(), &call.beta,
                                           call.c_source(), d.c(), call.c, d.c(), &*algo, s.workspace, LtState::kWorkspaceBytes,
                                           cuda_stream());
  // A refusal (the call's arguments, not the device) queues nothing: this shape is the
  // composition's from now on. A launch or execution failure is the device's: thrown.
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
    warn_once("cublasLtMatmul", st);
    std::lock_guard<std::mutex> lock(lt_mu_);
    s.algos[call.key()] = std::nullopt;
    return false;
  }
  GPIPE_CUBLAS_CHECK(st);
  ++lt_calls;
  return true;
}

namespace {

using Operands = std::initializer_list<const Tensor*>;

void check_contiguous(Operands ts, const char* op) {
  for (const Tensor* t : ts) {
    if (!t->is_contiguous()) throw Error(std::string(op) + ": " + t->str() + " must be contiguous");
  }
}

// A linear layer's forward product, y (R x N) = x (R x K) w^T, all of x's type, into y (D and
// C, beta 0, no epilogue): linear_bias and linear_residual add theirs.
LtCall forward_call(const Tensor& x, const Tensor& w, Tensor& y) {
  LtCall call;
  call.op_a = CUBLAS_OP_T;  // w (N x K) read column-major as K x N, transposed: N x K
  call.op_b = CUBLAS_OP_N;  // x (R x K) read column-major as K x R
  call.m = w.size(0);
  call.n = x.size(0);
  call.k = x.size(1);
  call.a = w.raw_data();
  call.lda = w.size(1);
  call.b = x.raw_data();
  call.ldb = x.size(1);
  call.ab_type = lt_type(x.dtype());
  call.c = y.raw_data();
  call.ldc = y.size(1);
  call.c_type = lt_type(x.dtype());
  call.beta = 0;
  return call;
}

}  // namespace

void CudaBackend::linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  check_contiguous({&x, &w, &bias, &y}, "linear_bias");
  const DType t = x.dtype();
  const bool fits = x.dim() == 2 && w.dim() == 2 && y.dim() == 2 && bias.dim() == 1 && w.size(1) == x.size(1) &&
                    y.size(0) == x.size(0) && y.size(1) == w.size(0) && bias.numel() == w.size(0);
  const bool typed = (t == DType::kF32 || is_narrow(t)) && w.dtype() == t && bias.dtype() == t && y.dtype() == t;
  // Anything else (float64, mixed types, a shape that does not fit) is the composition's,
  // whose ops check and name it.
  if (!cuda_cublaslt_enabled() || !fits || !typed || x.numel() == 0 || y.numel() == 0) {
    return Backend::linear_bias(x, w, bias, y);
  }
  for (const Tensor* u : Operands{&x, &w, &bias, &y}) check_on_device(*u, "linear_bias");
  DeviceGuard guard(device_.index);
  LtCall call = forward_call(x, w, y);
  call.epilogue = CUBLASLT_EPILOGUE_BIAS;  // bias (N): D's rows
  call.bias = const_cast<void*>(bias.raw_data());
  if (!lt_matmul(call)) Backend::linear_bias(x, w, bias, y);
}

void CudaBackend::linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual, Tensor& y) {
  check_contiguous({&x, &w, &residual, &y}, "linear_residual");
  const DType t = x.dtype();
  const bool fits = x.dim() == 2 && w.dim() == 2 && y.dim() == 2 && w.size(1) == x.size(1) &&
                    y.size(0) == x.size(0) && y.size(1) == w.size(0) && residual.shape() == y.shape();
  const bool typed = (t == DType::kF32 || is_narrow(t)) && w.dtype() == t && residual.dtype() == t && y.dtype() == t;
  if (!cuda_cublaslt_enabled() || !fits || !typed || x.numel() == 0 || y.numel() == 0) {
    return Backend::linear_residual(x, w, residual, y);
  }
  for (const Tensor* u : Operands{&x, &w, &residual, &y}) check_on_device(*u, "linear_residual");
  DeviceGuard guard(device_.index);
  LtCall call = forward_call(x, w, y);
  call.c_in = residual.raw_data();  // C, added (beta 1); y is D
  call.beta = 1;
  if (!lt_matmul(call)) Backend::linear_residual(x, w, residual, y);
}

// One product adding into dx (cuBLAS's beta 1; a 16-bit dx read, added to in float32 and
// rounded once).
void CudaBackend::linear_input_grad_add(const Tensor& dy, const Tensor& w, Tensor& dx) {
  matmul_weight(dy, false, w, false, dx, 1.0, 1.0);
}

void CudaBackend::linear_weight_grad(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor& db) {
  check_contiguous({&dy, &x, &dw, &db}, "linear_weight_grad");
  const DType t = dy.dtype();
  const bool fits = dy.dim() == 2 && x.dim() == 2 && dw.dim() == 2 && db.dim() == 1 && x.size(0) == dy.size(0) &&
                    dw.size(0) == dy.size(1) && dw.size(1) == x.size(1) && db.numel() == dy.size(1);
  const bool typed = (t == DType::kF32 || is_narrow(t)) && x.dtype() == t && dw.dtype() == DType::kF32 &&
                     db.dtype() == DType::kF32;
  auto compose = [&] {
    if (!is_narrow(t)) return Backend::linear_weight_grad(dy, x, dw, db);
    matmul(dy, true, x, false, dw, 1.0, 1.0);  // 16-bit operands, float32 dw
    Tensor wide = empty(dy.shape(), DType::kF32);  // bias_grad sums one type: dy widened, as WideningBackend does
    cast(dy, wide);
    bias_grad(wide, db, 1.0);
  };
  if (!cuda_cublaslt_enabled() || !fits || !typed || dy.numel() == 0 || x.numel() == 0) return compose();
  for (const Tensor* u : Operands{&dy, &x, &dw, &db}) check_on_device(*u, "linear_weight_grad");
  DeviceGuard guard(device_.index);
  Tensor sums = empty({db.numel()}, DType::kF32);  // this call's column sums of dy
  LtCall call;
  call.op_a = CUBLAS_OP_N;  // x (R x K) read column-major as K x R
  call.op_b = CUBLAS_OP_T;  // dy (R x N) read column-major as N x R, transposed: R x N
  call.m = x.size(1);
  call.n = dy.size(1);
  call.k = x.size(0);
  call.a = x.raw_data();
  call.lda = x.size(1);
  call.b = dy.raw_data();
  call.ldb = dy.size(1);
  call.ab_type = lt_type(t);
  call.c = dw.raw_data();
  call.ldc = dw.size(1);
  call.c_type = CUDA_R_32F;
  call.beta = 1;                             // dw += ...
  call.epilogue = CUBLASLT_EPILOGUE_BGRADB;  // op(B)'s sums over k (R): N of them, D's columns
  call.bias = sums.raw_data();
  if (!lt_matmul(call)) return compose();
  axpy(1.0, sums, db);
}

}  // namespace gpipe
