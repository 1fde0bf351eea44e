#include "runtime/allocator.h"

#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "runtime/error.h"

#ifdef GPIPE_WITH_CUDA
#include "runtime/cuda_allocator.h"
#include "runtime/cuda_device.h"
#endif

namespace gpipe {

namespace {
constexpr size_t kAlignment = 64;   // cache line; enough for AVX-512 loads
constexpr size_t kGranule = 512;    // sizes are rounded to this
}  // namespace

size_t round_allocation(size_t bytes) {
  if (bytes == 0) bytes = 1;
  return (bytes + kGranule - 1) / kGranule * kGranule;
}

MemoryStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  MemoryStats s = stats_;
  s.reserved = s.in_use + s.cached;
  return s;
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.peak = stats_.in_use;
}

void Allocator::note_alloc(size_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.in_use += static_cast<int64_t>(bytes);
  if (stats_.in_use > stats_.peak) stats_.peak = stats_.in_use;
}

void Allocator::note_free(size_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.in_use -= static_cast<int64_t>(bytes);
}

void Allocator::note_cached(int64_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.cached = bytes;
}

void* CachingAllocator::allocate(size_t bytes) {
  const size_t size = round_allocation(bytes);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      p = it->second;
      free_.erase(it);
      std::lock_guard<std::mutex> slock(stats_mu_);
      stats_.cached -= static_cast<int64_t>(size);
    }
  }
  if (p == nullptr) p = allocate_block(size);
  if (p == nullptr) {
    release_cache();
    p = allocate_block(size);
  }
  if (p == nullptr) throw out_of_memory(size);
  note_alloc(size);
  return p;
}

void CachingAllocator::deallocate(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  const size_t size = round_allocation(bytes);
  note_free(size);
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace(size, ptr);
  std::lock_guard<std::mutex> slock(stats_mu_);
  stats_.cached += static_cast<int64_t>(size);
}

std::multimap<size_t, void*> CachingAllocator::take_cache() {
  std::multimap<size_t, void*> blocks;
  std::lock_guard<std::mutex> lock(mu_);
  blocks.swap(free_);
  std::lock_guard<std::mutex> slock(stats_mu_);
  stats_.cached = 0;
  return blocks;
}

void CachingAllocator::release_cache() {
  const std::multimap<size_t, void*> blocks = take_cache();
  if (!blocks.empty()) free_blocks(blocks);
}

CpuAllocator::~CpuAllocator() { free_blocks(take_cache()); }

void* CpuAllocator::allocate_block(size_t size) { return std::aligned_alloc(kAlignment, size); }

void CpuAllocator::free_blocks(const std::multimap<size_t, void*>& blocks) {
  for (const auto& kv : blocks) std::free(kv.second);
}

UserError CpuAllocator::out_of_memory(size_t size) const {
  return UserError("out of host memory allocating " + std::to_string(size) + " bytes on " + device_.str() +
                   "; reduce train.batch_size or raise pipeline.micro_batches");
}

Allocator& allocator_for(Device device) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Allocator>> cpu, cuda;
  std::lock_guard<std::mutex> lock(mu);
  auto& table = device.is_cpu() ? cpu : cuda;
  if (device.index < 0) throw UserError("negative device index in " + device.str());
  if (static_cast<size_t>(device.index) >= table.size()) table.resize(device.index + 1);
  auto& slot = table[device.index];
  if (!slot) {
    if (device.is_cpu()) {
      slot = std::make_unique<CpuAllocator>(device);
    } else {
#ifdef GPIPE_WITH_CUDA
      const int visible = cuda_runtime_device_count();
      if (device.index >= visible) {
        throw UserError("device " + device.str() + " requested, but " +
                        (visible == 0 ? std::string("no CUDA device is visible here; use cpu devices")
                                      : std::to_string(visible) + " CUDA devices are visible; use cuda:0..cuda:" +
                                            std::to_string(visible - 1) + " or check CUDA_VISIBLE_DEVICES"));
      }
      slot = make_cuda_allocator(device);
#else
      throw UserError("device " + device.str() +
                      " requested, but this build has no CUDA support; rebuild where nvcc exists "
                      "(./gpipe builds with CUDA automatically) or use cpu devices");
#endif
    }
  }
  return *slot;
}

}  // namespace gpipe
