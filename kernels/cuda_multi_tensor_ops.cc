// The CUDA backend's multi-tensor ops (kernels/backend.h, "Multi-tensor ops"): the
// single-tensor ops' checks on every tensor, then one launch over a table of the
// tensors (kernels/cuda_kernels.h, "Multi-tensor launches") that is built once per list
// of pointers and kept on the device. A file of its own, so that it merges apart from
// cuda_backend.cc.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <string>
#include <vector>

#include "kernels/cuda_backend.h"
#include "kernels/op_checks.h"
#include "kernels/step_scalars.h"
#include "kernels/transformer_checks.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_device.h"
#include "runtime/error.h"

namespace gpipe {

namespace {

// At most this many tables are kept; past it they are all freed (after a wait) and
// rebuilt as used. A run uses a handful: one per stage and op.
constexpr size_t kMaxMultiTables = 256;

void check_lengths(const std::vector<const std::vector<Tensor>*>& lists, const char* op) {
  for (const std::vector<Tensor>* l : lists) {
    if (l->size() != lists[0]->size()) {
      throw Error(std::string(op) + ": lists of " + std::to_string(lists[0]->size()) + " and " +
                  std::to_string(l->size()) + " tensors; each list needs one entry per tensor");
    }
  }
}

// Whether every tensor of `xs` has element type t.
bool all_of_type(const std::vector<Tensor>& xs, DType t) {
  for (const Tensor& x : xs) {
    if (x.dtype() != t) return false;
  }
  return true;
}

// The one float type (float32 or float64) that every defined tensor of the lists has, or
// kI32 (no such type) when they differ or hold another type.
DType common_float(const std::vector<const std::vector<Tensor>*>& lists) {
  if (lists[0]->empty()) return DType::kI32;
  const DType t = (*lists[0])[0].dtype();
  if (t != DType::kF32 && t != DType::kF64) return DType::kI32;
  for (const std::vector<Tensor>* l : lists) {
    for (const Tensor& x : *l) {
      if (x.defined() && x.dtype() != t) return DType::kI32;
    }
  }
  return t;
}

// Whether no two tensors of `xs` share an element. One launch updates every tensor at
// once, so a tensor listed twice (or two overlapping views) would be updated by two blocks
// at the same time, where the loop updates it twice in turn: such a list takes the loop.
bool disjoint(const std::vector<Tensor>& xs) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end) in bytes
  for (const Tensor& x : xs) {
    if (!x.defined() || x.numel() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(x.raw_data());
    spans.emplace_back(begin, begin + static_cast<uintptr_t>(x.nbytes()));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return false;
  }
  return true;
}

}  // namespace

cuda::MultiTensorTable CudaBackend::multi_table(const std::vector<const std::vector<Tensor>*>& lists, const char* op) {
  std::vector<std::vector<const void*>> ptrs(lists.size());
  std::vector<int64_t> numel;
  const size_t n = lists[0]->size();
  for (size_t t = 0; t < n; ++t) {
    const Tensor& first = (*lists[0])[t];
    if (first.numel() == 0) continue;
    numel.push_back(first.numel());
    for (size_t l = 0; l < lists.size(); ++l) {
      const Tensor& x = (*lists[l])[t];
      if (!x.defined()) {
        ptrs[l].push_back(nullptr);
        continue;
      }
      check_on_device(x, op);
      GPIPE_CHECK(x.is_contiguous(), std::string(op) + ": " + x.str() + " must be contiguous");
      ptrs[l].push_back(x.raw_data());
    }
  }
  std::vector<int64_t> image = cuda::multi_tensor_image(ptrs, numel);
  auto found = multi_tables_.find(image);
  if (found == multi_tables_.end()) {
    if (capture_) {  // its copy from the host would be read again at every replay
      throw CaptureError(std::string(op) + " on a list of tensors no step before the capture used");
    }
    if (multi_tables_.size() >= kMaxMultiTables) {
      GPIPE_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));  // no queued launch reads them any more
      release_multi_tables(true);
    }
    int64_t* device = nullptr;
    GPIPE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device), image.size() * sizeof(int64_t)));
    found = multi_tables_.emplace(std::move(image), device).first;
    // From the key itself, which lives as long as the table: the copy may finish later.
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(device, found->first.data(), found->first.size() * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, cuda_stream()));
  }
  if (capture_) note_captured_table(found->second);  // the graph's until it is destroyed
  return cuda::multi_tensor_view(found->second, found->first, static_cast<int>(lists.size()));
}

void CudaBackend::release_multi_tables(bool keep_captured) noexcept {
  for (auto it = multi_tables_.begin(); it != multi_tables_.end();) {
    if (keep_captured && captured_tables_.count(it->second) != 0) {  // a captured graph reads it
      ++it;
      continue;
    }
    const cudaError_t e = cudaFree(it->second);
    if (e != cudaSuccess) spdlog::warn("cudaFree failed: {}", cudaGetErrorString(e));
    it = multi_tables_.erase(it);
  }
}

// One launch over every tensor (then one block over the partial sums), one copy back
// and one wait: a stage's gradient norm waits for its device once.
double CudaBackend::sum_squares_all(const std::vector<Tensor>& xs) {
  const DType t = common_float({&xs});
  if (t == DType::kI32) return Backend::sum_squares_all(xs);  // sum_squares's errors, or another type
  DeviceGuard guard(device_.index);
  const cuda::MultiTensorTable tab = multi_table({&xs}, "sum_squares_all");
  if (tab.tensors == 0) return 0.0;
  Tensor work = empty({cuda::multi_sum_squares_workspace(tab) + 1}, DType::kF64);  // partial sums, the total
  double* total = work.data<double>() + work.numel() - 1;
  cudaStream_t s = cuda_stream();
  cuda::multi_sum_squares(tab, t, work.data<double>(), total, s);
  auto* host = static_cast<double*>(host_staging_);
  GPIPE_CUDA_CHECK(cudaMemcpyAsync(host, total, sizeof(double), cudaMemcpyDeviceToHost, s));
  wait();  // and report what earlier ops flagged
  return *host;
}

// The step's scalars as a kernel reads them: on this device, float64, kStepScalarCount.
const double* CudaBackend::step_scalars_on_device(const Tensor& scalars, const char* op) const {
  check_step_scalars(scalars, device_, op);
  return scalars.data<double>();
}

// A loss's factor as the kernels take it: the value, or its slot in the step's scalars.
cuda::LossScaleArg CudaBackend::loss_scale_arg(const LossScale& scale, const char* op) const {
  if (!scale.from_device()) return cuda::LossScaleArg(scale.value);
  return cuda::LossScaleArg(scale.value, step_scalars_on_device(scale.scalars, op) + kStepLossScale);
}

void CudaBackend::sgd_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                               const std::vector<Tensor>& bufs, const SgdParams& p, const Tensor& scalars) {
  const std::vector<const std::vector<Tensor>*> lists{&params, &grads, &bufs};
  check_lengths(lists, "sgd_step_all");
  const double* step = step_scalars_on_device(scalars, "sgd_step_all");
  if (params.empty()) return;  // no fallback that reads the scalars back
  const DType t = common_float(lists);
  if (t == DType::kI32 || !disjoint(params)) return Backend::sgd_step_all(params, grads, bufs, p, scalars);
  const bool momentum = p.momentum != 0.0;
  for (size_t i = 0; i < params.size(); ++i) {  // sgd_step's checks
    ops::check_float(params[i], "sgd_step");
    ops::check_same(params[i], grads[i], "sgd_step");
    if (momentum) ops::check_same(params[i], bufs[i], "sgd_step");
  }
  DeviceGuard guard(device_.index);
  // Without momentum the buffers are not read: their list holds null pointers.
  const std::vector<Tensor> none(params.size());
  const cuda::MultiTensorTable tab = multi_table({&params, &grads, momentum ? &bufs : &none}, "sgd_step_all");
  cuda::multi_sgd_step(tab, t, p.momentum, p.weight_decay, p.nesterov, step, cuda_stream());
}

void CudaBackend::adam_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                const std::vector<Tensor>& m, const std::vector<Tensor>& v, const AdamParams& p,
                                const Tensor& scalars) {
  const std::vector<const std::vector<Tensor>*> lists{&params, &grads, &m, &v};
  check_lengths(lists, "adam_step_all");
  const double* step = step_scalars_on_device(scalars, "adam_step_all");
  if (params.empty()) return;  // no fallback that reads the scalars back
  const DType t = common_float(lists);
  if (t == DType::kI32 || !disjoint(params)) return Backend::adam_step_all(params, grads, m, v, p, scalars);
  // adam_step's checks (a step count of 1 stands for the device's, which the host wrote).
  for (size_t i = 0; i < params.size(); ++i) ops::check_adam(params[i], grads[i], m[i], v[i], 1);
  DeviceGuard guard(device_.index);
  const cuda::MultiTensorTable tab = multi_table(lists, "adam_step_all");
  cuda::multi_adam_step(tab, t, p.beta1, p.beta2, p.eps, p.weight_decay, p.decoupled, step, cuda_stream());
}

void CudaBackend::scale_all(const std::vector<Tensor>& xs, double alpha) {
  if (alpha == 0.0) return fill_all(xs, 0.0);  // as scale(): 0 clears, NaN and infinities too
  const DType t = common_float({&xs});
  if (t == DType::kI32 || !disjoint(xs)) return Backend::scale_all(xs, alpha);
  for (const Tensor& x : xs) ops::check_float(x, "scale");
  DeviceGuard guard(device_.index);
  cuda::multi_scale(multi_table({&xs}, "scale_all"), t, alpha, /*fill=*/false, cuda_stream());
}

void CudaBackend::scale_all_by(const std::vector<Tensor>& xs, const Tensor& scalars) {
  const double* step = step_scalars_on_device(scalars, "scale_all_by");
  if (xs.empty()) return;  // nothing to scale: no fallback that reads the scalars back
  const DType t = common_float({&xs});
  if (t == DType::kI32 || !disjoint(xs)) return Backend::scale_all_by(xs, scalars);
  for (const Tensor& x : xs) ops::check_float(x, "scale");
  DeviceGuard guard(device_.index);
  cuda::multi_scale_by(multi_table({&xs}, "scale_all_by"), t, step, cuda_stream());
}

// The norm's sum as sum_squares_all's, written into the step's scalars: no copy back, no wait.
void CudaBackend::sum_squares_all_to(const std::vector<Tensor>& xs, Tensor& scalars) {
  double* step = const_cast<double*>(step_scalars_on_device(scalars, "sum_squares_all_to"));
  const DType t = xs.empty() ? DType::kF32 : common_float({&xs});
  if (t == DType::kI32) return Backend::sum_squares_all_to(xs, scalars);  // sum_squares's errors, or another type
  DeviceGuard guard(device_.index);
  cudaStream_t s = cuda_stream();
  const cuda::MultiTensorTable tab =
      xs.empty() ? cuda::MultiTensorTable{} : multi_table({&xs}, "sum_squares_all_to");
  if (tab.tensors == 0) {
    GPIPE_CUDA_CHECK(cudaMemsetAsync(step + kStepNormSquared, 0, sizeof(double), s));  // +0.0: all bits 0
    return;
  }
  Tensor work = empty({cuda::multi_sum_squares_workspace(tab)}, DType::kF64);  // partial sums
  cuda::multi_sum_squares(tab, t, work.data<double>(), step + kStepNormSquared, s);
}

// Every error slot is read: a flagged one is this step's bad data (or a stage's that
// shares this GPU, whose step fails too), reported at the next wait.
void CudaBackend::step_grad_scale(Tensor& scalars, double max_norm, bool skip_nonfinite) {
  double* step = const_cast<double*>(step_scalars_on_device(scalars, "step_grad_scale"));
  DeviceGuard guard(device_.index);
  cuda::step_grad_scale(step, max_norm, skip_nonfinite, slots_,
                        static_cast<int64_t>(kMaxDeferredChecks), cuda_stream());
}

void CudaBackend::fill_all(const std::vector<Tensor>& xs, double value) {
  const DType t = common_float({&xs});
  if (t == DType::kI32) return Backend::fill_all(xs, value);
  for (const Tensor& x : xs) ops::check_float(x, "fill");
  DeviceGuard guard(device_.index);
  cuda::multi_scale(multi_table({&xs}, "fill_all"), t, value, /*fill=*/true, cuda_stream());
}

void CudaBackend::cast_all(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts) {
  const std::vector<const std::vector<Tensor>*> lists{&srcs, &dsts};
  check_lengths(lists, "cast_all");
  if (srcs.empty()) return;
  const DType from = srcs[0].dtype(), to = dsts[0].dtype();
  if (!cuda::multi_cast_supported(from, to) || !all_of_type(srcs, from) || !all_of_type(dsts, to) ||
      !disjoint(dsts)) {
    return Backend::cast_all(srcs, dsts);
  }
  for (size_t i = 0; i < srcs.size(); ++i) ops::check_cast(srcs[i], dsts[i]);
  DeviceGuard guard(device_.index);
  cuda::multi_cast(multi_table(lists, "cast_all"), from, to, cuda_stream());
}

}  // namespace gpipe
