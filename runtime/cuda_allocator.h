// The stream-aware CUDA device allocator and pinned host staging (cuda_allocator.cc),
// over runtime/block_pool.h. Builds on cuda_device.h only; cuda_runtime.cc's copies
// use the staging. Compiled only in CUDA builds (GPIPE_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "runtime/allocator.h"
#include "runtime/device.h"

namespace gpipe {

// The caching allocator of `device` (allocator.cc's allocator_for creates one per device).
std::unique_ptr<Allocator> make_cuda_allocator(Device device);

// Queues a copy of pageable host memory `src` to device memory `dst` on `stream` (of
// `device`) without waiting: the bytes are copied into a pinned buffer now, which is
// reused once an event says the copy has finished. `src` may change on return.
void stage_to_device(const void* src, void* dst, size_t bytes, Device device, cudaStream_t stream);

}  // namespace gpipe
