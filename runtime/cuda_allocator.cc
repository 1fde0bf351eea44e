// GPU memory and pinned staging memory: BlockPool (runtime/block_pool.h) over cudaMalloc
// and cudaHostAlloc, with events recorded on the streams that use a block. CUDA builds
// only. The pool decides; this file only talks to CUDA. It builds on cuda_device.h and
// never on cuda_runtime.h, whose copies use stage_to_device from here.
#include "runtime/cuda_allocator.h"

#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/block_pool.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_device.h"
#include "runtime/error.h"
#include "runtime/stream.h"

namespace gpipe {

namespace {

// Events without timing (cheaper to record and query), per device, reused.
class EventCache {
 public:
  cudaEvent_t take(int device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<cudaEvent_t>& spare = spare_[device];
      if (!spare.empty()) {
        cudaEvent_t e = spare.back();
        spare.pop_back();
        return e;
      }
    }
    DeviceGuard guard(device);
    cudaEvent_t e = nullptr;
    GPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void give(int device, cudaEvent_t e) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    spare_[device].push_back(e);  // the driver reclaims them at exit
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<cudaEvent_t>> spare_;
};

class CudaPoolEvent : public PoolEvent {
 public:
  CudaPoolEvent(cudaEvent_t e, int device, EventCache& cache) : event_(e), device_(device), cache_(cache) {}
  ~CudaPoolEvent() override { cache_.give(device_, event_); }
  bool done() override { return cuda_event_done(event_); }

 private:
  cudaEvent_t event_;
  int device_;
  EventCache& cache_;
};

// What both pools need from CUDA besides the memory itself.
class CudaBacking : public PoolBacking {
 public:
  explicit CudaBacking(Device device) : device_(device) {}

  // The device idle: every stream's kernels and copies, NCCL's included, so that no
  // cached block is still in use when its segment is freed (block_pool.h).
  void synchronize() override {
    DeviceGuard guard(device_.index);
    GPIPE_CUDA_CHECK(cudaDeviceSynchronize());
  }

  std::unique_ptr<PoolEvent> record_event(StreamId stream) override {
    auto s = static_cast<cudaStream_t>(const_cast<void*>(stream));
    int device = device_.index;  // a stream of another GPU records there (a peer copy's)
    GPIPE_CUDA_CHECK(cudaStreamGetDevice(s, &device));
    cudaEvent_t e = events_.take(device);
    auto event = std::make_unique<CudaPoolEvent>(e, device, events_);  // gives e back if the record fails
    DeviceGuard guard(device);
    GPIPE_CUDA_CHECK(cudaEventRecord(e, s));
    return event;
  }

 protected:
  Device device_;

 private:
  EventCache events_;
};

class DeviceMemory : public CudaBacking {
 public:
  using CudaBacking::CudaBacking;
  void* allocate_segment(size_t bytes) override {
    DeviceGuard guard(device_.index);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) return p;
    cudaGetLastError();  // clear it, or the next checked kernel launch would report it
    if (e == cudaErrorMemoryAllocation) return nullptr;
    throw Error(error_location(__FILE__, __LINE__) + ": cudaMalloc of " + std::to_string(bytes) + " bytes on " +
                device_.str() + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
  void free_segment(void* ptr, size_t) override {
    DeviceGuard guard(device_.index);
    GPIPE_CUDA_CHECK(cudaFree(ptr));
  }
};

// Pinned host memory that copies to `device` are staged through; portable, so the
// copy engines of any GPU read it.
class PinnedMemory : public CudaBacking {
 public:
  using CudaBacking::CudaBacking;
  void* allocate_segment(size_t bytes) override {
    DeviceGuard guard(device_.index);
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e == cudaSuccess) return p;
    cudaGetLastError();
    if (e == cudaErrorMemoryAllocation) return nullptr;
    throw Error(error_location(__FILE__, __LINE__) + ": cudaHostAlloc of " + std::to_string(bytes) +
                " bytes failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
  void free_segment(void* ptr, size_t) override {
    DeviceGuard guard(device_.index);
    GPIPE_CUDA_CHECK(cudaFreeHost(ptr));
  }
};

// The capture this thread runs (Allocator::begin_private_pool): its pool's key and device.
struct PrivatePool {
  const void* key = nullptr;
  int device = -1;
};
thread_local PrivatePool t_private;

// The device allocator: blocks belong to the stream they were allocated for (the
// device's compute stream unless allocate_for names another).
class CudaAllocator : public Allocator {
 public:
  explicit CudaAllocator(Device device) : device_(device), memory_(device), pool_(memory_) {}
  ~CudaAllocator() override {
    // At exit: give the cache back if CUDA is still there; the driver frees the rest.
    NoThrowDeviceGuard guard(device_.index, "~CudaAllocator");
    if (!guard.ok()) return;
    try {
      pool_.release_cached();
    } catch (const std::exception&) {
      cudaGetLastError();  // CUDA torn down already
    }
  }

  Device device() const override { return device_; }
  void* allocate(size_t bytes) override { return allocate_for(bytes, compute_stream_for(device_)); }

  void* allocate_for(size_t bytes, Stream& stream) override {
    GPIPE_CHECK(stream.device() == device_ && stream.native() != nullptr,
                "the allocator of " + device_.str() + " asked for a block for a stream of " + stream.device().str());
    // A captured step's blocks (begin_private_pool, on the capturing thread) are its
    // pool's: kept for its replays, reused only by its own requests, in the order the
    // capture made them, which its graph keeps (one stream, one chain of nodes).
    const bool captured = t_private.key != nullptr && t_private.device == device_.index &&
                          stream.native() == compute_stream_for(device_).native();
    size_t size = 0;
    // No wait for the device while capturing (it would end the capture): out of memory
    // fails the capture instead, and the step runs op by op, with the whole cache.
    void* p = pool_.allocate(bytes, captured ? t_private.key : stream.native(), &size, !captured);
    if (p == nullptr && captured) {
      throw CaptureError("out of GPU memory on " + device_.str() + " capturing a step (" +
                         std::to_string(BlockPool::round_size(bytes)) + " bytes more)");
    }
    if (p == nullptr) throw out_of_memory(BlockPool::round_size(bytes));
    note_alloc(size);
    note_pool();
    return p;
  }

  void deallocate(void* ptr, size_t) override {
    if (ptr == nullptr) return;
    try {  // called from destructors: log, never throw
      note_free(pool_.free(ptr));
      note_pool();
    } catch (const std::exception& e) {
      spdlog::error("freeing GPU memory on {}: {}", device_.str(), e.what());
    }
  }

  void record_stream(void* ptr, Stream& stream) override {
    GPIPE_CHECK(stream.native() != nullptr, "record_stream on a host stream");
    pool_.record_stream(ptr, stream.native());
  }

  void release_cache() override {
    pool_.release_cached();
    note_pool();
  }

  void begin_private_pool(const void* key) override {
    GPIPE_CHECK(key != nullptr && t_private.key == nullptr, "this thread is already capturing a step");
    pool_.hold(key);
    t_private = {key, device_.index};
  }
  void join_private_pool(const void* key) override {
    GPIPE_CHECK(key != nullptr && t_private.key == nullptr, "this thread is already capturing a step");
    t_private = {key, device_.index};  // held by the thread that began it
  }
  void end_private_pool() override { t_private = {}; }
  void release_private_pool(const void* key) override { pool_.let_go(key); }

 private:
  void note_pool() {
    const PoolStats s = pool_.stats();
    note_cached(s.reserved - s.allocated);
  }

  UserError out_of_memory(size_t size) const {
    const MemoryStats s = stats();
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
    return UserError("out of GPU memory on " + device_.str() + " allocating " + std::to_string(size) + " bytes (" +
                     std::to_string(s.in_use) + " bytes in use by this process's tensors, " +
                     std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
                     " bytes free on the device); lower train.batch_size, or raise pipeline.micro_batches "
                     "or pipeline.partitions so each stage holds less");
  }

  Device device_;
  DeviceMemory memory_;
  BlockPool pool_;  // after memory_: destroyed first
};

struct Staging {
  explicit Staging(Device device) : memory(device), pool(memory) {}
  PinnedMemory memory;
  BlockPool pool;
};

// Never destroyed: copies may be in flight at exit.
Staging& staging_for(Device device) {
  static std::mutex mu;
  static auto* table = new std::map<int, Staging*>;
  std::lock_guard<std::mutex> lock(mu);
  Staging*& slot = (*table)[device.index];
  if (slot == nullptr) slot = new Staging(device);
  return *slot;
}

}  // namespace

std::unique_ptr<Allocator> make_cuda_allocator(Device device) {
  check_cuda_device(device, "CUDA allocator");
  return std::make_unique<CudaAllocator>(device);
}

void stage_to_device(const void* src, void* dst, size_t bytes, Device device, cudaStream_t stream) {
  if (bytes == 0) return;
  // A captured copy would read the pinned block at every replay, long after it went back
  // to the staging pool for other copies.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GPIPE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    throw Error("a copy from host memory to " + device.str() + " inside a captured step: a step that reads new "
                "host data at each replay cannot be captured");
  }
  Staging& st = staging_for(device);
  // Staging blocks belong to no stream: each is reused only after the event of its copy.
  static const char host_side = 0;
  void* pinned = st.pool.allocate(bytes, &host_side);
  if (pinned == nullptr) {
    throw UserError("out of pinned host memory staging " + std::to_string(bytes) + " bytes for " + device.str() +
                    "; lower train.batch_size or free host memory");
  }
  std::memcpy(pinned, src, bytes);
  try {
    DeviceGuard guard(device.index);
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(dst, pinned, bytes, cudaMemcpyHostToDevice, stream));
    st.pool.record_stream(pinned, stream);
  } catch (...) {
    st.pool.free(pinned);  // nothing was queued from it
    throw;
  }
  st.pool.free(pinned);
}

}  // namespace gpipe
