// Per-device memory. Each device has its own allocator with its own statistics, so a
// stage's peak memory can be read off its device. The CPU allocator caches freed
// blocks by size: a pipeline allocates the same shapes every micro-batch, and without
// a cache large blocks would be mmap'ed and page-faulted afresh each time. The CUDA
// allocator (cuda_runtime.cc) caches by stream, with the policy of block_pool.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/stream.h"

namespace gpipe {

struct MemoryStats {
  int64_t in_use = 0;    // bytes handed out and not yet returned
  int64_t peak = 0;      // largest in_use since the last reset_peak()
  int64_t cached = 0;    // bytes held in the cache, free for reuse (or waiting for a stream)
  int64_t reserved = 0;  // in_use + cached: what the device has given this allocator
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // A block for work queued on the device's compute stream (compute_stream_for).
  virtual void* allocate(size_t bytes) = 0;
  // A block for work queued on `stream` of this device: once freed, a CUDA allocator
  // hands it out again only for that stream. Host allocators ignore the stream.
  virtual void* allocate_for(size_t bytes, Stream& stream) { return allocate(bytes); }
  // Blocks may be returned from any thread.
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  // Work queued on `stream` (not the block's own) uses the block at `ptr`: once freed,
  // it is reused only after that work has finished (PyTorch's record_stream).
  virtual void record_stream(void* /*ptr*/, Stream& /*stream*/) {}
  virtual Device device() const = 0;
  // Whether its blocks hold data: false for the tensors of planning on shapes (ShapesOnly,
  // tensor.h), whose blocks are addresses that nothing maps.
  virtual bool has_data() const { return true; }
  MemoryStats stats() const;
  void reset_peak();
  // Returns every cached block to the system.
  virtual void release_cache() = 0;
  // A captured step (Backend::begin_capture on a GPU): from begin_private_pool to
  // end_private_pool, the blocks handed out for the compute stream come from the pool
  // named `key` (any distinct address), which no other request draws on; its blocks are
  // kept when freed, for the capture's replays, and release_cache leaves them alone
  // until release_private_pool(key) (the replays are over). No-ops on the host, whose
  // captured calls keep their own tensors.
  virtual void begin_private_pool(const void* /*key*/) {}
  // Another thread's requests drawn on the pool `key` another thread began, until this
  // thread's end_private_pool (the stages of one device captured together).
  virtual void join_private_pool(const void* /*key*/) {}
  virtual void end_private_pool() {}
  virtual void release_private_pool(const void* /*key*/) {}

 protected:
  void note_alloc(size_t bytes);
  void note_free(size_t bytes);
  void note_cached(int64_t bytes);
  mutable std::mutex stats_mu_;
  MemoryStats stats_;
};

// The size-keyed block cache of host memory (CpuAllocator): sizes are rounded
// with round_allocation(), and a freed block waits in a free list for the next request
// of the same rounded size. A request the device cannot meet releases the cache and
// tries once more before it fails.
class CachingAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) final;
  void deallocate(void* ptr, size_t bytes) final;
  Device device() const final { return device_; }
  void release_cache() final;

 protected:
  explicit CachingAllocator(Device device) : device_(device) {}
  // A fresh block of `size` bytes, or nullptr when the device is out of memory (other
  // failures throw).
  virtual void* allocate_block(size_t size) = 0;
  // Returns blocks taken out of the cache to the system.
  virtual void free_blocks(const std::multimap<size_t, void*>& blocks) = 0;
  // The error for a request that failed even after the cache was released.
  virtual UserError out_of_memory(size_t size) const = 0;
  // Empties the cache and hands its blocks to the caller (destructors free them).
  std::multimap<size_t, void*> take_cache();

  Device device_;

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // rounded size -> block
};

class CpuAllocator : public CachingAllocator {
 public:
  explicit CpuAllocator(Device device) : CachingAllocator(device) {}
  ~CpuAllocator() override;

 protected:
  void* allocate_block(size_t size) override;
  void free_blocks(const std::multimap<size_t, void*>& blocks) override;
  UserError out_of_memory(size_t size) const override;
};

// The allocator of a device; created on first use and alive for the process.
Allocator& allocator_for(Device device);

// Rounds a request up to the allocator's block granularity.
size_t round_allocation(size_t bytes);

}  // namespace gpipe
