// The convolution ops of the CUDA backend (kernels/backend.h, "Convolution ops"), with
// the semantics, argument checks and error texts of the CPU reference
// (kernels/cpu_conv_ops.cc):
//   * conv2d and conv2d_backward: cuDNN (legacy API). Full float32 precision (FMA
//     math, no TF32 tensor-core rounding, like the backend's cuBLAS handle) and, where
//     cuDNN offers one, a deterministic algorithm that is neither FFT nor Winograd,
//     chosen by cuDNN's heuristics once per shape and remembered;
//   * batchnorm_train, batchnorm_backward and batchnorm_eval: cuDNN's spatial batch
//     normalisation, with two small conversions (kernels/cuda_conv_kernels.cu) between
//     the contract's biased variance and the inverse standard deviation cuDNN keeps; see
//     "Batch normalisation" below;
//   * avgpool2d and avgpool2d_backward: cuDNN pooling (average over the window, no
//     padding);
//   * channel bias and max pooling: kernels/cuda_conv_kernels.cu (deterministic;
//     cuDNN's max pooling has no argmax).
// Every op returns as soon as its work is queued. maxpool2d_backward checks argmax as
// it scatters, on the device: a bad index is skipped and becomes the CPU's Error at the
// backend's next wait ("Deferred input errors" in kernels/cuda_backend.cc).
#include <cudnn.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/conv_checks.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_conv_kernels.h"
#include "kernels/cuda_kernels.h"
#include "kernels/op_checks.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_runtime.h"
#include "runtime/error.h"

namespace gpipe {

// Algorithms and workspace sizes cuDNN chose, per convolution shape.
struct ConvChoice {
  int algo = 0;      // cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t
  size_t bytes = 0;  // its workspace
};
using ConvKey = std::array<int64_t, 10>;  // dtype, N, C, H, W, K, R, S, stride, pad

// One per CudaBackend (CudaBackend::cudnn_), created by the first op that needs cuDNN.
// The descriptors are set afresh by each call; the backend is used by one thread at a
// time, so they need no lock.
struct CudnnState {
  cudnnHandle_t handle = nullptr;  // bound to the backend's stream
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnTensorDescriptor_t bn = nullptr;  // batch norm: (1, C, 1, 1) parameters and statistics
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnPoolingDescriptor_t pool = nullptr;
  std::map<ConvKey, ConvChoice> forward, backward_data, backward_filter;
};

namespace {

// The argument checks are kernels/conv_checks.h, shared with the CPU reference.
using ops::channel_dims;
using ops::ChannelDims;
using ops::check_4d;
using ops::check_avgpool;
using ops::check_batchnorm;
using ops::check_conv;
using ops::check_maxpool;
using ops::check_per_channel;
using ops::check_shape;
using ops::check_window;
using ops::conv_because;
using ops::ConvDims;
using ops::dispatch_float;
using ops::out_extent;
using ops::pool_because;
using ops::PoolDims;
using ops::str;

// ---- cuDNN helpers

// cuDNN's 4-D descriptors take int extents and strides.
int cudnn_int(int64_t v, const Tensor& t, const char* op) {
  if (v > INT_MAX || t.numel() > INT_MAX) {
    throw Error(std::string(op) + ": " + t.str() + " is too large for cuDNN's 32-bit tensor descriptors");
  }
  return static_cast<int>(v);
}

cudnnDataType_t cudnn_type(DType t) { return t == DType::kF64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT; }

void set_tensor(cudnnTensorDescriptor_t desc, const Tensor& t, const Shape& shape, const char* op) {
  GPIPE_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, cudnn_type(t.dtype()),
                                               cudnn_int(shape[0], t, op), cudnn_int(shape[1], t, op),
                                               cudnn_int(shape[2], t, op), cudnn_int(shape[3], t, op)));
}

// The blending factors (alpha, beta) in the element type of the data: cuDNN reads
// doubles for double tensors and floats otherwise.
struct Blend {
  float f[2];
  double d[2];
  const void* alpha(DType t) const { return t == DType::kF64 ? static_cast<const void*>(&d[0]) : &f[0]; }
  const void* beta(DType t) const { return t == DType::kF64 ? static_cast<const void*>(&d[1]) : &f[1]; }
};
Blend blend(double alpha, double beta) {
  return {{static_cast<float>(alpha), static_cast<float>(beta)}, {alpha, beta}};
}

// Workspace larger than this is not considered when choosing an algorithm.
constexpr size_t kMaxWorkspaceBytes = size_t(1) << 30;

bool fast_transform(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool fast_transform(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool fast_transform(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// From cuDNN's heuristic ranking (fastest first), the first usable entry in order of
// preference: deterministic and neither FFT nor Winograd (their transforms round
// differently from a direct sum), then any deterministic one, then any. Tensor-core
// math types are never taken (the descriptor asks for FMA math in float32). Returns
// the index, or -1.
template <typename Perf>
int choose_algo(const std::vector<Perf>& perf, int count, DType dtype) {
  for (int pass = 0; pass < 3; ++pass) {
    for (int i = 0; i < count; ++i) {
      const Perf& p = perf[i];
      if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxWorkspaceBytes) continue;
      if (dtype == DType::kF32 &&
          (p.mathType == CUDNN_TENSOR_OP_MATH || p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)) {
        continue;
      }
      if (pass < 2 && p.determinism != CUDNN_DETERMINISTIC) continue;
      if (pass < 1 && fast_transform(p.algo)) continue;
      return i;
    }
  }
  return -1;
}

// The CPU reference's message for a bad argmax (kernels/cpu_conv_ops.cc), with dx
// described as Tensor::str() does; dx lives on `device`.
std::string argmax_error(const DeferredCheck& c, int64_t index, int32_t value, Device device) {
  const Shape dx_shape(c.shape.begin(), c.shape.end());
  return "maxpool2d_backward: argmax " + std::to_string(value) + " at " + std::to_string(index) + " is outside the " +
         std::to_string(c.limit) + "-value planes of " + dtype_name(c.dtype) + shape_str(dx_shape) + " on " +
         device.str() + "; pass the argmax that maxpool2d wrote for this input";
}

[[noreturn]] void no_algorithm(const char* op, const std::string& because) {
  throw Error(std::string(op) + ": cuDNN offers no usable algorithm " + because);
}

// Sets the convolution descriptors of `st` for x, w and y = conv(x, w).
void set_conv(CudnnState& st, const Tensor& x, const Tensor& w, const ConvDims& d, int stride, int pad,
              const char* op) {
  if (d.N * d.K * d.P * d.Q > INT_MAX) {
    throw Error(std::string(op) + ": the output " + shape_str({d.N, d.K, d.P, d.Q}) +
                " is too large for cuDNN's 32-bit tensor descriptors");
  }
  set_tensor(st.x, x, x.shape(), op);
  set_tensor(st.y, x, {d.N, d.K, d.P, d.Q}, op);  // y's extents (each <= its count, checked above)
  GPIPE_CUDNN_CHECK(cudnnSetFilter4dDescriptor(st.w, cudnn_type(w.dtype()), CUDNN_TENSOR_NCHW,
                                               cudnn_int(d.K, w, op), cudnn_int(d.C, w, op), cudnn_int(d.R, w, op),
                                               cudnn_int(d.S, w, op)));
  GPIPE_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(st.conv, pad, pad, stride, stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                                    cudnn_type(x.dtype())));
  // FMA math: no TF32 rounding of float32 operands on Ampere and later.
  GPIPE_CUDNN_CHECK(
      cudnnSetConvolutionMathType(st.conv, x.dtype() == DType::kF32 ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH));
}

ConvKey conv_key(const Tensor& x, const ConvDims& d, int stride, int pad) {
  return {static_cast<int64_t>(x.dtype()), d.N, d.C, d.H, d.W, d.K, d.R, d.S, stride, pad};
}

// The cached or newly chosen algorithms; the descriptors must be set (set_conv).
ConvChoice forward_algo(CudnnState& st, const ConvKey& key, DType dtype, const std::string& because) {
  auto it = st.forward.find(key);
  if (it != st.forward.end()) return it->second;
  int max_count = 0;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(st.handle, &max_count));
  std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(static_cast<size_t>(std::max(max_count, 1)));
  int count = 0;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(st.handle, st.x, st.w, st.conv, st.y, max_count, &count,
                                                           perf.data()));
  const int i = choose_algo(perf, count, dtype);
  if (i < 0) no_algorithm("conv2d", because);
  ConvChoice c;
  c.algo = perf[i].algo;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(st.handle, st.x, st.w, st.conv, st.y, perf[i].algo,
                                                            &c.bytes));
  st.forward.emplace(key, c);
  return c;
}

ConvChoice backward_data_algo(CudnnState& st, const ConvKey& key, DType dtype, const std::string& because) {
  auto it = st.backward_data.find(key);
  if (it != st.backward_data.end()) return it->second;
  int max_count = 0;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(st.handle, &max_count));
  std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(static_cast<size_t>(std::max(max_count, 1)));
  int count = 0;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(st.handle, st.w, st.y, st.conv, st.x, max_count,
                                                                &count, perf.data()));
  const int i = choose_algo(perf, count, dtype);
  if (i < 0) no_algorithm("conv2d_backward (input gradient)", because);
  ConvChoice c;
  c.algo = perf[i].algo;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(st.handle, st.w, st.y, st.conv, st.x, perf[i].algo,
                                                                 &c.bytes));
  st.backward_data.emplace(key, c);
  return c;
}

ConvChoice backward_filter_algo(CudnnState& st, const ConvKey& key, DType dtype, const std::string& because) {
  auto it = st.backward_filter.find(key);
  if (it != st.backward_filter.end()) return it->second;
  int max_count = 0;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(st.handle, &max_count));
  std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(static_cast<size_t>(std::max(max_count, 1)));
  int count = 0;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(st.handle, st.x, st.y, st.conv, st.w, max_count,
                                                                  &count, perf.data()));
  const int i = choose_algo(perf, count, dtype);
  if (i < 0) no_algorithm("conv2d_backward (weight gradient)", because);
  ConvChoice c;
  c.algo = perf[i].algo;
  GPIPE_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(st.handle, st.x, st.y, st.conv, st.w,
                                                                   perf[i].algo, &c.bytes));
  st.backward_filter.emplace(key, c);
  return c;
}

// Device scratch memory from the device's caching allocator, as a tensor so that it
// returns to the cache when the op returns (undefined when bytes == 0). Reuse is
// ordered by the stream: the next op that receives the block runs on the same
// stream, after this one's kernels.
Tensor scratch(Backend& b, size_t bytes) {
  if (bytes == 0) return Tensor();
  return b.empty({static_cast<int64_t>((bytes + sizeof(double) - 1) / sizeof(double))}, DType::kF64);
}

// ---- Batch-norm helpers

// Spatial mode: one mean, variance, gamma and beta per channel, over (N, H, W). Not
// SPATIAL_PERSISTENT, which cuDNN's header describes as possibly faster but limited in
// the range of values it handles.
constexpr cudnnBatchNormMode_t kBatchnormMode = CUDNN_BATCHNORM_SPATIAL;

std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// cuDNN refuses an eps below CUDNN_BN_MIN_EPSILON with CUDNN_STATUS_BAD_PARAM. That
// minimum is 0 in the cuDNN 9 we build with, and check_batchnorm already refuses
// eps < 0, so this fires only when built against an older cuDNN (whose minimum was
// 1e-5); it then names the value and the fix instead of cuDNN's bare status.
void check_cudnn_eps(double eps, const char* op) {
  if (eps < CUDNN_BN_MIN_EPSILON) {
    throw UserError(std::string(op) + ": eps " + number(eps) + " is below " + number(CUDNN_BN_MIN_EPSILON) +
                    ", the smallest that this build's cuDNN " + std::to_string(CUDNN_MAJOR) + "." +
                    std::to_string(CUDNN_MINOR) + " accepts (CUDNN_BN_MIN_EPSILON); give the BatchNorm2d layer "
                    "an eps of at least " + number(CUDNN_BN_MIN_EPSILON) + " (BatchNorm2dOptions::eps), or build "
                    "against a cuDNN whose minimum is 0 (cuDNN 9 is)");
  }
}

// Sets st.x to x's shape (also used for y, dy and dx, which share it) and st.bn to the
// (1, C, 1, 1) descriptor cuDNN derives from it: same element type as x (float for
// float32, double for float64), as gamma, beta, mean and var have.
void set_batchnorm(CudnnState& st, const Tensor& x, const char* op) {
  set_tensor(st.x, x, x.shape(), op);
  GPIPE_CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(st.bn, st.x, kBatchnormMode));
}

// Whether the memory of a and b overlaps.
bool overlaps(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.raw_data());
  const char* pb = static_cast<const char*>(b.raw_data());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

void destroy(CudnnState* st) noexcept {
  auto warn = [](cudnnStatus_t s, const char* what) {
    if (s != CUDNN_STATUS_SUCCESS) spdlog::warn("{} failed: {}", what, cudnnGetErrorString(s));
  };
  if (st->pool != nullptr) warn(cudnnDestroyPoolingDescriptor(st->pool), "cudnnDestroyPoolingDescriptor");
  if (st->conv != nullptr) warn(cudnnDestroyConvolutionDescriptor(st->conv), "cudnnDestroyConvolutionDescriptor");
  if (st->w != nullptr) warn(cudnnDestroyFilterDescriptor(st->w), "cudnnDestroyFilterDescriptor");
  if (st->bn != nullptr) warn(cudnnDestroyTensorDescriptor(st->bn), "cudnnDestroyTensorDescriptor");
  if (st->y != nullptr) warn(cudnnDestroyTensorDescriptor(st->y), "cudnnDestroyTensorDescriptor");
  if (st->x != nullptr) warn(cudnnDestroyTensorDescriptor(st->x), "cudnnDestroyTensorDescriptor");
  if (st->handle != nullptr) warn(cudnnDestroy(st->handle), "cudnnDestroy");
  delete st;
}

}  // namespace

// ---- cuDNN state

void* CudaBackend::cudnn_handle() { return cudnn().handle; }

CudnnState& CudaBackend::cudnn() {
  if (cudnn_ != nullptr) return *static_cast<CudnnState*>(cudnn_);
  // The caller holds a DeviceGuard: the handle is created on device_.
  auto* st = new CudnnState;
  try {
    GPIPE_CUDNN_CHECK(cudnnCreate(&st->handle));
    GPIPE_CUDNN_CHECK(cudnnSetStream(st->handle, cuda_stream()));
    GPIPE_CUDNN_CHECK(cudnnCreateTensorDescriptor(&st->x));
    GPIPE_CUDNN_CHECK(cudnnCreateTensorDescriptor(&st->y));
    GPIPE_CUDNN_CHECK(cudnnCreateTensorDescriptor(&st->bn));
    GPIPE_CUDNN_CHECK(cudnnCreateFilterDescriptor(&st->w));
    GPIPE_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&st->conv));
    GPIPE_CUDNN_CHECK(cudnnCreatePoolingDescriptor(&st->pool));
  } catch (...) {
    destroy(st);
    throw;
  }
  cudnn_ = st;
  return *st;
}

void CudaBackend::release_cudnn() noexcept {
  if (cudnn_ == nullptr) return;
  destroy(static_cast<CudnnState*>(cudnn_));
  cudnn_ = nullptr;
}

// ---- Convolution

void CudaBackend::conv2d(const Tensor& x, const Tensor& w, int stride, int pad, Tensor& y) {
  const ConvDims d = check_conv(x, w, stride, pad, "conv2d");
  const std::string because = conv_because(x, w, stride, pad);
  check_shape(y, x, {d.N, d.K, d.P, d.Q}, "conv2d", "output", because);
  check_on_device(x, "conv2d");
  check_on_device(w, "conv2d");
  check_on_device(y, "conv2d");
  if (d.N == 0) return;
  DeviceGuard guard(device_.index);
  if (x.numel() == 0) {  // H or W is 0: every tap falls in the padding
    GPIPE_CUDA_CHECK(cudaMemsetAsync(y.raw_data(), 0, y.nbytes(), cuda_stream()));
    return;
  }
  CudnnState& st = cudnn();
  set_conv(st, x, w, d, stride, pad, "conv2d");
  const ConvChoice c = forward_algo(st, conv_key(x, d, stride, pad), x.dtype(), because);
  Tensor ws = scratch(*this, c.bytes);
  const Blend b = blend(1.0, 0.0);
  GPIPE_CUDNN_CHECK(cudnnConvolutionForward(st.handle, b.alpha(x.dtype()), st.x, x.raw_data(), st.w, w.raw_data(),
                                            st.conv, static_cast<cudnnConvolutionFwdAlgo_t>(c.algo),
                                            c.bytes > 0 ? ws.raw_data() : nullptr, c.bytes, b.beta(x.dtype()), st.y,
                                            y.raw_data()));
}

void CudaBackend::conv2d_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int stride, int pad, Tensor& dx,
                                  Tensor& dw) {
  const ConvDims d = check_conv(x, w, stride, pad, "conv2d_backward");
  const std::string because = conv_because(x, w, stride, pad);
  check_shape(dy, x, {d.N, d.K, d.P, d.Q}, "conv2d_backward", "output gradient dy", because);
  const bool want_dw = dw.defined(), want_dx = dx.defined();
  if (want_dw) check_shape(dw, x, w.shape(), "conv2d_backward", "weight gradient dw", "(the weight's shape)");
  if (want_dx) check_shape(dx, x, x.shape(), "conv2d_backward", "input gradient dx", "(the input's shape)");
  check_on_device(dy, "conv2d_backward");
  check_on_device(x, "conv2d_backward");
  check_on_device(w, "conv2d_backward");
  if (want_dw) check_on_device(dw, "conv2d_backward");
  if (want_dx) check_on_device(dx, "conv2d_backward");
  if (d.N == 0) return;
  if (x.numel() == 0) return;  // H or W is 0: dw += 0, and dx has no elements
  DeviceGuard guard(device_.index);
  CudnnState& st = cudnn();
  set_conv(st, x, w, d, stride, pad, "conv2d_backward");
  const ConvKey key = conv_key(x, d, stride, pad);
  const DType t = x.dtype();
  // dw += the weight gradient (beta 1).
  ConvChoice cf, cd;
  size_t bytes = 0;
  if (want_dw) {
    cf = backward_filter_algo(st, key, t, because);
    bytes = cf.bytes;
  }
  if (want_dx) {
    cd = backward_data_algo(st, key, t, because);
    bytes = std::max(bytes, cd.bytes);
  }
  Tensor ws = scratch(*this, bytes);  // one workspace for both calls (they run in stream order)
  void* wsp = bytes > 0 ? ws.raw_data() : nullptr;
  const Blend accumulate = blend(1.0, 1.0), overwrite = blend(1.0, 0.0);
  if (want_dw) {
    GPIPE_CUDNN_CHECK(cudnnConvolutionBackwardFilter(st.handle, accumulate.alpha(t), st.x, x.raw_data(), st.y,
                                                     dy.raw_data(), st.conv,
                                                     static_cast<cudnnConvolutionBwdFilterAlgo_t>(cf.algo), wsp,
                                                     cf.bytes, accumulate.beta(t), st.w, dw.raw_data()));
  }
  if (!want_dx) return;
  GPIPE_CUDNN_CHECK(cudnnConvolutionBackwardData(st.handle, overwrite.alpha(t), st.w, w.raw_data(), st.y,
                                                 dy.raw_data(), st.conv,
                                                 static_cast<cudnnConvolutionBwdDataAlgo_t>(cd.algo), wsp, cd.bytes,
                                                 overwrite.beta(t), st.x, dx.raw_data()));
}

// ---- Per-channel bias

void CudaBackend::add_channel_bias(Tensor& y, const Tensor& bias) {
  ops::check_float(y, "add_channel_bias");
  if (y.dim() < 2) throw Error("add_channel_bias: output " + y.str() + " must be (N, K, ...)");
  check_per_channel(bias, y, "add_channel_bias", "bias");
  check_on_device(y, "add_channel_bias");
  check_on_device(bias, "add_channel_bias");
  const ChannelDims d = channel_dims(y);
  DeviceGuard guard(device_.index);
  dispatch_float(y, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda_conv::add_channel_bias(y.data<T>(), bias.data<T>(), d.N, d.C, d.E, cuda_stream());
  });
}

void CudaBackend::channel_bias_grad(const Tensor& dy, Tensor& db) {
  ops::check_float(dy, "channel_bias_grad");
  if (dy.dim() < 2) throw Error("channel_bias_grad: output gradient " + dy.str() + " must be (N, K, ...)");
  check_per_channel(db, dy, "channel_bias_grad", "bias gradient");
  check_on_device(dy, "channel_bias_grad");
  check_on_device(db, "channel_bias_grad");
  const ChannelDims d = channel_dims(dy);
  DeviceGuard guard(device_.index);
  Tensor ws = empty({cuda_conv::channel_reduction_workspace(d.N, d.C, d.E)}, DType::kF64);
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda_conv::channel_bias_grad(dy.data<T>(), db.data<T>(), d.N, d.C, d.E, ws.data<double>(), cuda_stream());
  });
}

// ---- Batch normalisation
//
// cuDNN's spatial batch normalisation (legacy API: cuDNN 9 marks it deprecated, which
// only warns under CUDNN_WARN_DEPRECATED, and still ships it, as it does the pooling
// and filter calls above). Its training forward saves, per channel, the batch mean and
// invstd = 1 / sqrt(var + eps) (biased var) for its backward; the contract keeps the
// biased variance itself, which BatchNorm2d folds into its running statistics at the
// end of the step. So:
//
//   batchnorm_train     cuDNN forward, running averages off (NULL: the layer keeps its
//                       own), saved mean -> mean, saved invstd -> var, then in place
//                       var = 1 / invstd^2 - eps (in double; clamped at 0)
//   batchnorm_backward  invstd = 1 / sqrt(var + eps) into scratch (in double, rounded
//                       to T), then cuDNN backward with (mean, invstd) as its saved
//                       statistics, so it does not recompute them from x: dx
//                       overwritten (alpha 1, beta 0), dgamma and dbeta accumulated
//                       (alpha 1, beta 1), as on the CPU
//   batchnorm_eval      cuDNN inference with the given mean and var
//
// Rounding: var comes back from cuDNN's invstd, rounded to T with some relative error
// d (at least half an ulp: 6e-8 for float32, 1.1e-16 for float64). 1 / invstd^2 - eps
// turns that into an absolute error of about 2 d (var + eps), i.e. 2 d (1 + eps / var)
// relative: a few ulps of var where var >> eps, and about 2 d eps absolute for a
// channel with (nearly) no variance (clamped at 0 if it goes negative). That is well
// inside the conformance tolerances (kernels/cuda_conv_test.cc), which are set by the
// reductions anyway: cuDNN sums in its own order and precision, and computes y from its
// unrounded statistics rather than, as the CPU reference does, from the stored T(mean)
// and T(var).
//
// Outputs may alias inputs (the old kernels allowed it, cuDNN does not document it):
// an output that overlaps an input is computed into scratch and copied, on the stream.

void CudaBackend::batchnorm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                                  Tensor& mean, Tensor& var) {
  check_batchnorm(x, gamma, &beta, eps, "batchnorm_train");
  check_shape(y, x, x.shape(), "batchnorm_train", "output", "(the input's shape)");
  check_per_channel(mean, x, "batchnorm_train", "mean");
  check_per_channel(var, x, "batchnorm_train", "var");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &gamma, &beta, &y, &mean, &var}) {
    check_on_device(*t, "batchnorm_train");
  }
  check_cudnn_eps(eps, "batchnorm_train");
  const ChannelDims d = channel_dims(x);
  if (x.numel() == 0) return;  // no channels (check_batchnorm refuses N H W == 0)
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  CudnnState& st = cudnn();
  set_batchnorm(st, x, "batchnorm_train");
  const DType t = x.dtype();
  Tensor out = overlaps(y, x) ? empty(y.shape(), t) : y;  // (N, C, H, W)
  const Blend b = blend(1.0, 0.0);
  GPIPE_CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
      st.handle, kBatchnormMode, b.alpha(t), b.beta(t), st.x, x.raw_data(), st.x, out.raw_data(), st.bn,
      gamma.raw_data(), beta.raw_data(), /*exponentialAverageFactor=*/1.0, /*resultRunningMean=*/nullptr,
      /*resultRunningVariance=*/nullptr, eps, /*resultSaveMean=*/mean.raw_data(),
      /*resultSaveInvVariance=*/var.raw_data()));
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda_conv::batchnorm_invstd_to_var(var.data<T>(), eps, d.C, s);
  });
  if (out.raw_data() != y.raw_data()) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(y.raw_data(), out.raw_data(), y.nbytes(), cudaMemcpyDeviceToDevice, s));
  }
}

void CudaBackend::batchnorm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                                 const Tensor& var, double eps, Tensor& y) {
  check_batchnorm(x, gamma, &beta, eps, "batchnorm_eval");
  check_shape(y, x, x.shape(), "batchnorm_eval", "output", "(the input's shape)");
  check_per_channel(mean, x, "batchnorm_eval", "mean");
  check_per_channel(var, x, "batchnorm_eval", "var");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &gamma, &beta, &mean, &var, &y}) {
    check_on_device(*t, "batchnorm_eval");
  }
  check_cudnn_eps(eps, "batchnorm_eval");
  if (x.numel() == 0) return;
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  CudnnState& st = cudnn();
  set_batchnorm(st, x, "batchnorm_eval");
  const DType t = x.dtype();
  Tensor out = overlaps(y, x) ? empty(y.shape(), t) : y;  // (N, C, H, W)
  const Blend b = blend(1.0, 0.0);
  GPIPE_CUDNN_CHECK(cudnnBatchNormalizationForwardInference(st.handle, kBatchnormMode, b.alpha(t), b.beta(t), st.x,
                                                            x.raw_data(), st.x, out.raw_data(), st.bn,
                                                            gamma.raw_data(), beta.raw_data(), mean.raw_data(),
                                                            var.raw_data(), eps));
  if (out.raw_data() != y.raw_data()) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(y.raw_data(), out.raw_data(), y.nbytes(), cudaMemcpyDeviceToDevice, s));
  }
}

void CudaBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                     const Tensor& var, double eps, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  check_batchnorm(x, gamma, nullptr, eps, "batchnorm_backward");
  check_shape(dy, x, x.shape(), "batchnorm_backward", "output gradient dy", "(the input's shape)");
  check_shape(dx, x, x.shape(), "batchnorm_backward", "input gradient dx", "(the input's shape)");
  check_per_channel(mean, x, "batchnorm_backward", "mean");
  check_per_channel(var, x, "batchnorm_backward", "var");
  check_per_channel(dgamma, x, "batchnorm_backward", "dgamma");
  check_per_channel(dbeta, x, "batchnorm_backward", "dbeta");
  for (const Tensor* t :
       std::initializer_list<const Tensor*>{&dy, &x, &gamma, &mean, &var, &dx, &dgamma, &dbeta}) {
    check_on_device(*t, "batchnorm_backward");
  }
  check_cudnn_eps(eps, "batchnorm_backward");
  const ChannelDims d = channel_dims(x);
  if (x.numel() == 0) return;  // no channels: dx is empty, dgamma and dbeta += nothing
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  CudnnState& st = cudnn();
  set_batchnorm(st, x, "batchnorm_backward");
  const DType t = x.dtype();
  Tensor invstd = empty({d.C}, t);  // (C): cuDNN's saved inverse standard deviation
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda_conv::batchnorm_var_to_invstd(var.data<T>(), eps, invstd.data<T>(), d.C, s);
  });
  Tensor out = overlaps(dx, dy) || overlaps(dx, x) ? empty(dx.shape(), t) : dx;  // (N, C, H, W)
  const Blend data = blend(1.0, 0.0), params = blend(1.0, 1.0);
  GPIPE_CUDNN_CHECK(cudnnBatchNormalizationBackward(
      st.handle, kBatchnormMode, data.alpha(t), data.beta(t), params.alpha(t), params.beta(t), st.x, x.raw_data(),
      st.x, dy.raw_data(), st.x, out.raw_data(), st.bn, gamma.raw_data(), dgamma.raw_data(), dbeta.raw_data(), eps,
      /*savedMean=*/mean.raw_data(), /*savedInvVariance=*/invstd.raw_data()));
  if (out.raw_data() != dx.raw_data()) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(dx.raw_data(), out.raw_data(), dx.nbytes(), cudaMemcpyDeviceToDevice, s));
  }
}

// ---- Pooling

void CudaBackend::maxpool2d(const Tensor& x, int kernel, int stride, int pad, Tensor& y, Tensor& argmax) {
  const PoolDims d = check_maxpool(x, kernel, stride, pad, "maxpool2d");
  const Shape out{d.N, d.C, d.P, d.Q};
  check_shape(y, x, out, "maxpool2d", "output", pool_because(x, kernel, stride, pad));
  if (!argmax.defined() || argmax.dtype() != DType::kI32 || argmax.shape() != out || !argmax.is_contiguous()) {
    throw Error("maxpool2d: argmax is " + str(argmax) + ", expected contiguous int32" + shape_str(out) + " " +
                pool_because(x, kernel, stride, pad));
  }
  check_on_device(x, "maxpool2d");
  check_on_device(y, "maxpool2d");
  check_on_device(argmax, "maxpool2d");
  DeviceGuard guard(device_.index);
  dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda_conv::maxpool2d(x.data<T>(), y.data<T>(), argmax.data<int32_t>(), d.N * d.C, d.H, d.W, d.P, d.Q, kernel,
                         stride, pad, cuda_stream());
  });
}

void CudaBackend::maxpool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) {
  check_4d(dy, "maxpool2d_backward", "output gradient dy");
  check_4d(dx, "maxpool2d_backward", "input gradient dx");
  if (dx.dtype() != dy.dtype() || dx.size(0) != dy.size(0) || dx.size(1) != dy.size(1)) {
    throw Error("maxpool2d_backward: output gradient " + dy.str() + " and input gradient " + dx.str() +
                " do not fit: they need the same dtype, batch and channels");
  }
  if (!argmax.defined() || argmax.dtype() != DType::kI32 || argmax.shape() != dy.shape() || !argmax.is_contiguous()) {
    throw Error("maxpool2d_backward: argmax " + str(argmax) + " must be contiguous int32 of dy's shape " +
                shape_str(dy.shape()));
  }
  check_on_device(dy, "maxpool2d_backward");
  check_on_device(argmax, "maxpool2d_backward");
  check_on_device(dx, "maxpool2d_backward");
  const int64_t planes = dy.size(0) * dy.size(1), PQ = dy.size(2) * dy.size(3), HW = dx.size(2) * dx.size(3);
  const int64_t count = planes * PQ;
  if (count > cuda::kMaxErrorIndex) {
    throw Error("maxpool2d_backward: " + dy.str() +
                " has too many elements for the CUDA argmax check (at most 2^32 - 2)");
  }
  DeviceGuard guard(device_.index);
  // The indices are checked as dx is written; a bad one is skipped here and reported by
  // the next wait, with the CPU's message (Error, as on the CPU).
  DeferredCheck check;
  check.op = "maxpool2d_backward";
  check.count = count;
  check.limit = HW;
  check.dtype = dx.dtype();
  check.shape = {dx.size(0), dx.size(1), dx.size(2), dx.size(3)};
  check.user_error = false;
  check.message = argmax_error;
  cuda::ErrorSlot* error = defer_check(check);
  dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda_conv::maxpool2d_backward(dy.data<T>(), argmax.data<int32_t>(), dx.data<T>(), planes, PQ, HW, error,
                                  cuda_stream());
  });
}

void CudaBackend::avgpool2d(const Tensor& x, int kernel, int stride, Tensor& y) {
  const PoolDims d = check_avgpool(x, kernel, stride, "avgpool2d");
  const Shape out{d.N, d.C, d.P, d.Q};
  check_shape(y, x, out, "avgpool2d", "output", pool_because(x, kernel, stride, 0));
  check_on_device(x, "avgpool2d");
  check_on_device(y, "avgpool2d");
  if (d.N * d.C == 0) return;  // H, W >= kernel >= 1 here
  DeviceGuard guard(device_.index);
  CudnnState& st = cudnn();
  set_tensor(st.x, x, x.shape(), "avgpool2d");
  set_tensor(st.y, y, out, "avgpool2d");
  GPIPE_CUDNN_CHECK(cudnnSetPooling2dDescriptor(st.pool, CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING,
                                                CUDNN_PROPAGATE_NAN, kernel, kernel, 0, 0, stride, stride));
  const Blend b = blend(1.0, 0.0);
  GPIPE_CUDNN_CHECK(cudnnPoolingForward(st.handle, st.pool, b.alpha(x.dtype()), st.x, x.raw_data(),
                                        b.beta(x.dtype()), st.y, y.raw_data()));
}

// dx is overwritten; input positions that no window covers (when the stride skips
// them) get 0. dx is cleared first and cuDNN adds into it (beta 1), so those positions
// are 0 however cuDNN treats them.
void CudaBackend::avgpool2d_backward(const Tensor& dy, int kernel, int stride, Tensor& dx) {
  const PoolDims d = check_avgpool(dx, kernel, stride, "avgpool2d_backward");
  const Shape out{d.N, d.C, d.P, d.Q};
  check_shape(dy, dx, out, "avgpool2d_backward", "output gradient dy", pool_because(dx, kernel, stride, 0));
  check_on_device(dy, "avgpool2d_backward");
  check_on_device(dx, "avgpool2d_backward");
  if (d.N * d.C == 0) return;
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  GPIPE_CUDA_CHECK(cudaMemsetAsync(dx.raw_data(), 0, dx.nbytes(), s));
  CudnnState& st = cudnn();
  set_tensor(st.x, dx, dx.shape(), "avgpool2d_backward");
  set_tensor(st.y, dy, out, "avgpool2d_backward");
  GPIPE_CUDNN_CHECK(cudnnSetPooling2dDescriptor(st.pool, CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING,
                                                CUDNN_PROPAGATE_NAN, kernel, kernel, 0, 0, stride, stride));
  const Blend b = blend(1.0, 1.0);
  // Average pooling's gradient depends on dy alone; cuDNN still takes the forward
  // input and output, which it does not read in this mode: dy and dx stand in for them.
  GPIPE_CUDNN_CHECK(cudnnPoolingBackward(st.handle, st.pool, b.alpha(dx.dtype()), st.y, dy.raw_data(), st.y,
                                         dy.raw_data(), st.x, dx.raw_data(), b.beta(dx.dtype()), st.x,
                                         dx.raw_data()));
}

}  // namespace gpipe
