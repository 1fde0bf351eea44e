// The CUDA backend's fused ops (Backend::rmsnorm, rmsnorm_backward and its _add, rmsnorm_weight_grad,
// swiglu, swiglu_backward): the checks of kernels/row_checks.h, one kernel of
// kernels/cuda_elementwise.cu each (the weight gradient: its terms, then bias_grad's fixed-order
// column sums). A file of its own, so that it merges apart from cuda_backend.cc.
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "kernels/cuda_backend.h"
#include "kernels/cuda_elementwise.h"
#include "kernels/cuda_kernels.h"
#include "kernels/row_checks.h"
#include "runtime/cuda_device.h"

namespace gpipe {

using ops::dispatch_storage;

void CudaBackend::rmsnorm(const Tensor& x, const Tensor& g, double eps, Tensor& y, Tensor& rstd) {
  const ops::RowView d = ops::check_fused(x, {&y}, &g, &rstd, nullptr, "rmsnorm");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&x, &g, &y, &rstd}) {
    check_on_device(*t, "rmsnorm");
  }
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    using M = cuda::Master<S>;
    cuda::rmsnorm(x.data<S>(), g.data<S>(), eps, y.data<S>(), rstd.data<M>(), d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                                   Tensor& dx) {
  const ops::RowView d = ops::check_fused(x, {&dy, &dx}, &g, &rstd, nullptr, "rmsnorm_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dy, &x, &g, &rstd, &dx}) {
    check_on_device(*t, "rmsnorm_backward");
  }
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    using M = cuda::Master<S>;
    const S* no_residual = nullptr;
    cuda::rmsnorm_backward(dy.data<S>(), x.data<S>(), g.data<S>(), rstd.data<M>(), no_residual, dx.data<S>(), d.rows,
                           d.cols, cuda_stream());
  });
}

void CudaBackend::rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                                       const Tensor& residual, Tensor& dx) {
  const ops::RowView d = ops::check_fused(x, {&dy, &residual, &dx}, &g, &rstd, nullptr, "rmsnorm_backward_add");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dy, &x, &g, &rstd, &residual, &dx}) {
    check_on_device(*t, "rmsnorm_backward_add");
  }
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    using M = cuda::Master<S>;
    cuda::rmsnorm_backward(dy.data<S>(), x.data<S>(), g.data<S>(), rstd.data<M>(), residual.data<S>(), dx.data<S>(),
                           d.rows, d.cols, cuda_stream());
  });
}

void CudaBackend::rmsnorm_weight_grad(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dg) {
  const ops::RowView d = ops::check_fused(x, {&dy}, nullptr, &rstd, &dg, "rmsnorm_weight_grad");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dy, &x, &rstd, &dg}) {
    check_on_device(*t, "rmsnorm_weight_grad");
  }
  // bias_grad of the terms dy * xhat, each made where it is added: the same sums, in the
  // same order, without a (rows, cols) temporary.
  Tensor work = empty({std::max<int64_t>(cuda::bias_grad_workspace(d.rows, d.cols), 1)}, DType::kF64);
  DeviceGuard guard(device_.index);
  dispatch_storage(x, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    using M = cuda::Master<S>;
    cuda::rmsnorm_weight_grad(dy.data<S>(), x.data<S>(), rstd.data<M>(), dg.data<M>(), d.rows, d.cols,
                              work.data<double>(), cuda_stream());
  });
}

void CudaBackend::swiglu(const Tensor& a, const Tensor& b, Tensor& y) {
  ops::check_fused(a, {&b, &y}, nullptr, nullptr, nullptr, "swiglu");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&a, &b, &y}) {
    check_on_device(*t, "swiglu");
  }
  DeviceGuard guard(device_.index);
  dispatch_storage(a, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    cuda::swiglu(a.data<S>(), b.data<S>(), y.data<S>(), a.numel(), cuda_stream());
  });
}

void CudaBackend::swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) {
  ops::check_fused(a, {&dy, &b, &da, &db}, nullptr, nullptr, nullptr, "swiglu_backward");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dy, &a, &b, &da, &db}) {
    check_on_device(*t, "swiglu_backward");
  }
  DeviceGuard guard(device_.index);
  dispatch_storage(a, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    cuda::swiglu_backward(dy.data<S>(), a.data<S>(), b.data<S>(), da.data<S>(), db.data<S>(), a.numel(),
                          cuda_stream());
  });
}

}  // namespace gpipe
