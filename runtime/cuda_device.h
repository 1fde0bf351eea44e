// The CUDA device selector and guards, the device count and check, and the event
// query. The lowest CUDA layer of the runtime: cuda_allocator.h and cuda_runtime.h build
// on it, it includes neither. Compiled only in CUDA builds (GPIPE_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "runtime/device.h"
#include "runtime/device_binding.h"

namespace gpipe {

// Errors that mean "the process is exiting and CUDA is already torn down": destructors
// of static objects (the allocator and backend registries) see these and stay quiet.
inline bool is_teardown(cudaError_t e) { return e == cudaErrorCudartUnloading || e == cudaErrorContextIsDestroyed; }

// The CUDA runtime's DeviceSelector (device_binding.h): has_context asks the driver
// for the device's primary context state; where that driver entry point is missing it
// answers false, so a guard then never restores.
DeviceSelector& cuda_device_selector();

// Makes `index` the current device for the scope, by the rule of device_binding.h: a
// no-op in a thread already bound to it; the previous device is restored only if it
// has a context. Throws if the device cannot be selected; the restore only logs.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) : scope_(cuda_device_selector(), index) {}

 private:
  ScopedDevice scope_;
};

// For destructors: DeviceGuard's rule without throwing. ok() is false when the device
// could not be selected (the caller then skips its cleanup: at process exit the CUDA
// runtime may already be unloaded, and the driver reclaims everything anyway).
class NoThrowDeviceGuard {
 public:
  NoThrowDeviceGuard(int index, const char* what);
  bool ok() const { return scope_ != nullptr; }

 private:
  std::unique_ptr<ScopedDevice> scope_;
};

// cudaGetDeviceCount, with "no driver / no device" mapped to 0.
int cuda_runtime_device_count();
// Throws UserError (naming `what`) unless `device` is a visible CUDA device.
void check_cuda_device(Device device, const char* what);

// Whether the work recorded before `event` has finished; throws on a CUDA error
// (cudaErrorNotReady is an answer, not an error, and is not left behind).
bool cuda_event_done(cudaEvent_t event);

}  // namespace gpipe
