// Per-device memory. Each device has its own allocator with its own statistics, so a
// stage's peak memory can be read off its device. The CPU allocator caches freed
// blocks by size: a pipeline allocates the same shapes every micro-batch, and without
// a cache large blocks would be mmap'ed and page-faulted afresh each time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "runtime/device.h"

namespace gpipe {

struct MemoryStats {
  int64_t in_use = 0;  // bytes handed out and not yet returned
  int64_t peak = 0;    // largest in_use since the last reset_peak()
  int64_t cached = 0;  // bytes held in the cache, free for reuse
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  // Blocks may be returned from any thread.
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  virtual Device device() const = 0;
  MemoryStats stats() const;
  void reset_peak();
  // Returns every cached block to the system.
  virtual void release_cache() = 0;

 protected:
  void note_alloc(size_t bytes);
  void note_free(size_t bytes);
  mutable std::mutex stats_mu_;
  MemoryStats stats_;
};

class CpuAllocator : public Allocator {
 public:
  explicit CpuAllocator(Device device) : device_(device) {}
  ~CpuAllocator() override;
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) override;
  Device device() const override { return device_; }
  void release_cache() override;

 private:
  Device device_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // rounded size -> block
};

// The allocator of a device; created on first use and alive for the process.
Allocator& allocator_for(Device device);

// Rounds a request up to the allocator's block granularity.
size_t round_allocation(size_t bytes);

}  // namespace gpipe
