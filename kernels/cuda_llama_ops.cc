// The CUDA backend's LLaMA ops (kernels/backend.h): the CPU's argument checks
// (kernels/llama_checks.h), kernels in kernels/cuda_llama.cu. A file of its own, so that
// it merges apart from cuda_backend.cc.
#include <type_traits>

#include "kernels/cuda_backend.h"
#include "kernels/cuda_elementwise.h"
#include "kernels/cuda_llama.h"
#include "kernels/llama_checks.h"
#include "runtime/cuda_device.h"

namespace gpipe {

// 16-bit storage rotated as it is (NarrowOp::kRope), as the widening reference rounds.
void CudaBackend::rope_narrow(const Tensor& x, int heads, double base, double sign, Tensor& y, const char* op) {
  const ops::RopeDims d = ops::check_rope_dims(x, y, heads, base, op);
  check_on_device(x, op);
  check_on_device(y, op);
  DeviceGuard guard(device_.index);
  if (x.dtype() == DType::kBF16) {
    cuda::rope_narrow(x.data<BFloat16>(), y.data<BFloat16>(), d.batch, d.seq, heads, d.head_dim, base, sign,
                      cuda_stream());
  } else {
    cuda::rope_narrow(x.data<Half>(), y.data<Half>(), d.batch, d.seq, heads, d.head_dim, base, sign, cuda_stream());
  }
}

void CudaBackend::rope(const Tensor& x, int heads, double base, Tensor& y) {
  if (is_narrow(x.dtype())) return rope_narrow(x, heads, base, 1.0, y, "rope");
  const ops::RopeDims d = ops::check_rope(x, y, heads, base, "rope");
  check_on_device(x, "rope");
  check_on_device(y, "rope");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::rope(x.data<T>(), y.data<T>(), d.batch, d.seq, heads, d.head_dim, base, 1.0, cuda_stream());
  });
}

void CudaBackend::rope_backward(const Tensor& dy, int heads, double base, Tensor& dx) {
  if (is_narrow(dy.dtype())) return rope_narrow(dy, heads, base, -1.0, dx, "rope_backward");
  const ops::RopeDims d = ops::check_rope(dy, dx, heads, base, "rope_backward");
  check_on_device(dy, "rope_backward");
  check_on_device(dx, "rope_backward");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(dy, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::rope(dy.data<T>(), dx.data<T>(), d.batch, d.seq, heads, d.head_dim, base, -1.0, cuda_stream());
  });
}

void CudaBackend::pack_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& qkv) {
  const ops::PackDims d = ops::check_pack_qkv(q, k, v, qkv, heads, "pack_qkv");
  for (const Tensor* t : {&q, &k, &v}) check_on_device(*t, "pack_qkv");
  check_on_device(qkv, "pack_qkv");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(q, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::pack_qkv(q.data<T>(), k.data<T>(), v.data<T>(), qkv.data<T>(), d.batch * d.seq, d.heads, d.kv_heads,
                   d.head_dim, cuda_stream());
  });
}

void CudaBackend::pack_qkv_backward(const Tensor& dqkv, int heads, Tensor& dq, Tensor& dk, Tensor& dv) {
  const ops::PackDims d = ops::check_pack_qkv(dq, dk, dv, dqkv, heads, "pack_qkv_backward");
  check_on_device(dqkv, "pack_qkv_backward");
  for (const Tensor* t : {&dq, &dk, &dv}) check_on_device(*t, "pack_qkv_backward");
  DeviceGuard guard(device_.index);
  ops::dispatch_float(dqkv, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cuda::pack_qkv_backward(dqkv.data<T>(), dq.data<T>(), dk.data<T>(), dv.data<T>(), d.batch * d.seq, d.heads,
                            d.kv_heads, d.head_dim, cuda_stream());
  });
}

}  // namespace gpipe
