// The CUDA side of the runtime: allocator, streams, events, copies. Compiled only in
// CUDA builds (GPIPE_WITH_CUDA); the generic runtime calls into it through these.
#pragma once

#include <cstddef>
#include <memory>

#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace gpipe {

// cudaGetDeviceCount, with "no driver / no device" mapped to 0.
int cuda_runtime_device_count();
std::unique_ptr<Allocator> make_cuda_allocator(Device device);
std::unique_ptr<Stream> make_cuda_stream(Device device);
std::unique_ptr<Event> make_cuda_event(Device device);
// Synchronous copy between any two of host and CUDA devices.
void cuda_copy(const void* src, Device src_device, void* dst, Device dst_device, size_t bytes);

}  // namespace gpipe
