// The CUDA side of the runtime: the device selector and guard, the stream-aware device
// allocator, streams, events, pinned staging and copies. Compiled only in CUDA builds
// (GPIPE_WITH_CUDA); the generic runtime calls into it through these. The device guard
// lives here too, so the runtime and the CUDA kernels share one copy.
#pragma once

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstddef>
#include <memory>

#include "runtime/allocator.h"
#include "runtime/cuda_check.h"
#include "runtime/device.h"
#include "runtime/device_binding.h"
#include "runtime/stream.h"

namespace gpipe {

class Tensor;

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
std::unique_ptr<Allocator> make_cuda_allocator(Device device);
std::unique_ptr<Stream> make_cuda_stream(Device device);
std::unique_ptr<Event> make_cuda_event(Device device);

// Whether the work recorded before `event` has finished; throws on a CUDA error
// (cudaErrorNotReady is an answer, not an error, and is not left behind).
bool cuda_event_done(cudaEvent_t event);

// Copies `bytes` between any two of host memory and CUDA devices, ordered with the
// compute streams (compute_stream_for) as copy_tensor describes: host to device staged
// through pinned memory and not waited for, device to host waited for on the source's
// compute stream, device to device on the destination's compute stream after an event
// on the source's. For raw pointers the caller keeps `src` unchanged until the
// destination's compute stream has passed the copy (copy_tensor does it for tensors).
void cuda_copy(const void* src, Device src_device, void* dst, Device dst_device, size_t bytes);

// Queues a copy of pageable host memory `src` to device memory `dst` on `stream` (of
// `device`) without waiting: the bytes are copied into a pinned buffer now, which is
// reused once an event says the copy has finished. `src` may change on return.
void stage_to_device(const void* src, void* dst, size_t bytes, Device device, cudaStream_t stream);

// transfer_tensor between two GPUs (runtime/tensor.h).
Tensor cuda_transfer(const Tensor& src, Device device, Event* ready);

// Lets `device` read and write `peer`'s memory directly (cudaDeviceEnablePeerAccess,
// once per pair) where the hardware allows it; cudaMemcpyPeerAsync works either way,
// through host memory when it is not enabled. Selects `device` for the call.
void enable_peer_access(int device, int peer);

}  // namespace gpipe
