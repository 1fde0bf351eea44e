// The CUDA side of the runtime: streams, events, copies and transfers between GPUs.
// Compiled only in CUDA builds (GPIPE_WITH_CUDA); the generic runtime calls into it
// through these. It builds on cuda_device.h (selector, guards, device count; included
// here, so the runtime and the CUDA kernels share one DeviceGuard) and the allocator's
// pinned staging (cuda_allocator.h); neither of those includes this file.
#pragma once

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstddef>
#include <memory>

#include "runtime/cuda_check.h"
#include "runtime/cuda_device.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace gpipe {

class Tensor;

std::unique_ptr<Stream> make_cuda_stream(Device device);
std::unique_ptr<Event> make_cuda_event(Device device);

// Copies `bytes` between any two of host memory and CUDA devices, ordered with the
// compute streams (compute_stream_for) as copy_tensor describes: host to device staged
// through pinned memory and not waited for, device to host waited for on the source's
// compute stream, device to device on the destination's compute stream after an event
// on the source's. For raw pointers the caller keeps `src` unchanged until the
// destination's compute stream has passed the copy (copy_tensor does it for tensors).
void cuda_copy(const void* src, Device src_device, void* dst, Device dst_device, size_t bytes);

// transfer_tensor between two GPUs (runtime/tensor.h).
Tensor cuda_transfer(const Tensor& src, Device device, Event* ready);

// Lets `device` read and write `peer`'s memory directly (cudaDeviceEnablePeerAccess,
// once per pair) where the hardware allows it; cudaMemcpyPeerAsync works either way,
// through host memory when it is not enabled. Selects `device` for the call.
void enable_peer_access(int device, int peer);

}  // namespace gpipe
