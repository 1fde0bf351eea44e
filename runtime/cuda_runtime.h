// The CUDA side of the runtime: allocator, streams, events, copies. Compiled only in
// CUDA builds (GPIPE_WITH_CUDA); the generic runtime calls into it through these. The
// device guard lives here too, so the runtime and the CUDA kernels share one copy.
#pragma once

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstddef>
#include <memory>

#include "runtime/allocator.h"
#include "runtime/cuda_check.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace gpipe {

// Errors that mean "the process is exiting and CUDA is already torn down": destructors
// of static objects (the allocator and backend registries) see these and stay quiet.
inline bool is_teardown(cudaError_t e) { return e == cudaErrorCudartUnloading || e == cudaErrorContextIsDestroyed; }

// Sets the current device for the scope and restores the previous one. The restore
// happens in a destructor, so it logs instead of throwing.
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

// cudaGetDeviceCount, with "no driver / no device" mapped to 0.
int cuda_runtime_device_count();
std::unique_ptr<Allocator> make_cuda_allocator(Device device);
std::unique_ptr<Stream> make_cuda_stream(Device device);
std::unique_ptr<Event> make_cuda_event(Device device);
// Synchronous copy between any two of host and CUDA devices.
void cuda_copy(const void* src, Device src_device, void* dst, Device dst_device, size_t bytes);

}  // namespace gpipe
