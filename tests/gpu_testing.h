// Helpers of the CPU-vs-CUDA conformance tests: the two backends, copies to and from the
// GPU, tolerances per dtype, and a main() that reports the binary skipped where no GPU
// is visible. Shared by every GPU test binary so they compare alike.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "kernels/backend.h"
#include "runtime/device.h"
#include "runtime/tensor.h"
#include "tests/testing.h"

namespace gpipe {
namespace gpu_testing {

inline const Device kGpu = Device::cuda(0);
inline const DType kFloatTypes[] = {DType::kF32, DType::kF64};

inline Backend& gpu() { return backend_for(kGpu); }
inline Backend& cpu() { return backend_for(Device::cpu()); }

// A device copy of a host tensor.
inline Tensor to_gpu(const Tensor& host) {
  Tensor d = gpu().empty(host.shape(), host.dtype());
  gpu().copy(host, d);
  return d;
}

// A separate host copy (so the CPU op does not change the input the GPU op gets).
inline Tensor clone(const Tensor& host) {
  Tensor c = Tensor::empty(host.shape(), host.dtype(), Device::cpu());
  copy_tensor(host, c);
  return c;
}

struct Tol {
  double rtol, atol;
};
// Elementwise ops: the same formula in the same precision; only the libm differs
// (CUDA's erf/exp are within 2 ulp, as is glibc) and nvcc may fuse a * b + c.
inline Tol elementwise_tol(DType t) { return t == DType::kF32 ? Tol{1e-5, 1e-6} : Tol{1e-12, 1e-14}; }
// Sums of `terms` values add in another order on the GPU (cuBLAS/cuDNN tiles and our
// trees vs. BLAS and loops), so the allowed error grows with the number of terms.
inline Tol reduction_tol(DType t, int64_t terms) {
  return t == DType::kF32 ? Tol{1e-4, 1e-5 + 2e-7 * static_cast<double>(terms)}
                          : Tol{1e-10, 1e-12 + 1e-14 * static_cast<double>(terms)};
}

// Runs the doctest cases, or prints the skip marker (counted by ./gpipe test) and
// passes where no GPU is visible.
inline int run_gpu_tests(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    testing::report_skipped("no CUDA device visible");
    return 0;
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}

}  // namespace gpu_testing
}  // namespace gpipe

#define EXPECT_CLOSE_TOL(a, b, tol) GPIPE_EXPECT_CLOSE(a, b, (tol).rtol, (tol).atol)
