// The caching policy of GPU memory (and of the pinned host buffers that stage copies to
// the GPU), apart from the device, so that it runs and is tested on the host. It
// follows PyTorch's CUDACachingAllocator:
//   * a block belongs to the stream it was allocated for; freed, it is reused at once
//     for that stream (later work on a stream runs after earlier work), never for
//     another. A block that other streams used too (record_stream) is reused only after
//     an event recorded on each of them at the free has completed;
//   * sizes are rounded to 512 B; requests up to 1 MiB are carved from 2 MiB segments,
//     up to 10 MiB from 20 MiB segments, larger ones get their own segment (rounded to
//     2 MiB). A free block larger than the request is split, and freed neighbours in a
//     segment coalesce again, so micro-batches of uneven sizes share the same memory;
//   * when the device is out of memory, the pool first waits for the device (every
//     queued kernel, every pending event), then frees the cached segments no block of
//     which is in use, then tries once more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace gpipe {

// A stream as the pool sees it: an identity it compares and hands to the backing to
// record events on (a cudaStream_t on the GPU; any distinct address in tests).
using StreamId = const void*;

// An event recorded on a stream: done() once the work queued there before it finished.
class PoolEvent {
 public:
  virtual ~PoolEvent() = default;
  virtual bool done() = 0;
};

// The memory the pool caches and the device it belongs to.
class PoolBacking {
 public:
  virtual ~PoolBacking() = default;
  // A new segment of `bytes`, or nullptr when out of memory (other failures throw).
  virtual void* allocate_segment(size_t bytes) = 0;
  virtual void free_segment(void* ptr, size_t bytes) = 0;
  // Returns once all work queued on the device, on every stream, has finished.
  virtual void synchronize() = 0;
  // An event after the work queued on `stream` so far.
  virtual std::unique_ptr<PoolEvent> record_event(StreamId stream) = 0;
};

struct PoolStats {
  int64_t allocated = 0;  // bytes in blocks handed out
  int64_t reserved = 0;   // bytes in segments taken from the backing
  int64_t segments = 0;
  int64_t pending = 0;    // blocks freed but waiting for another stream's event
};

class BlockPool {
 public:
  static constexpr size_t kMinBlock = 512;             // rounding and the smallest split-off block
  static constexpr size_t kSmallSize = 1 << 20;        // largest request from the small pool
  static constexpr size_t kSmallSegment = 2 << 20;     // segments of the small pool
  static constexpr size_t kLargeSegment = 20 << 20;    // segments for requests below kMinLargeAlloc
  static constexpr size_t kMinLargeAlloc = 10 << 20;   // from here, a segment of the request's own size
  static constexpr size_t kRoundLarge = 2 << 20;       // ... rounded up to this

  // `backing` must outlive the pool.
  explicit BlockPool(PoolBacking& backing);
  // Forgets the bookkeeping; segments are not freed (see release_cached).
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block of round_size(bytes) or more for work queued on `stream`, its size in
  // *size; nullptr when the backing has no memory left even after release_cached()
  // (or at once, without that wait for the device, when may_release is false: a
  // captured step's request, during which the device may not be waited for).
  void* allocate(size_t bytes, StreamId stream, size_t* size = nullptr, bool may_release = true);
  // Takes a block back (any thread) and returns its size. Throws Error for a pointer the
  // pool did not hand out.
  size_t free(void* ptr);
  // Work queued on `stream` uses the block: once freed, it waits for that work.
  void record_stream(void* ptr, StreamId stream);
  // Waits for the device, then frees every segment that is one free block, except
  // those of a held stream.
  void release_cached();
  // A stream whose free blocks stay cached (a captured step's private pool,
  // Allocator::begin_private_pool), until let go.
  void hold(StreamId stream);
  void let_go(StreamId stream);
  PoolStats stats() const;

  // The size a request is rounded to, and the segment allocated for a rounded size.
  static size_t round_size(size_t bytes);
  static size_t segment_size(size_t rounded);

 private:
  enum class State { kAllocated, kPending, kFree };
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;
    StreamId stream = nullptr;
    bool small = false;  // carved from a small-pool segment
    State state = State::kFree;
    Block* prev = nullptr;  // neighbours within the segment
    Block* next = nullptr;
    std::vector<StreamId> uses;  // other streams that used it (record_stream)
    int pending_events = 0;
  };
  // Free blocks ordered by stream, then size, then address: the first at or after
  // (stream, size) is the best fit.
  struct Order {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, Order>;

  FreeSet& pool_of(const Block* b) { return b->small ? small_ : large_; }
  Block* take_free(bool small, StreamId stream, size_t size);
  void maybe_split(Block* b, size_t size);
  void insert_free(Block* b);  // coalesces with free neighbours
  void process_events();       // blocks whose events completed become free
  void release_cached_locked();

  PoolBacking& backing_;
  mutable std::mutex mu_;
  FreeSet small_, large_;
  std::map<void*, Block*> active_;                         // handed out, by address
  std::set<StreamId> held_;                                // streams whose segments release_cached keeps
  std::deque<std::pair<std::unique_ptr<PoolEvent>, Block*>> events_;  // in recording order
  PoolStats stats_;
};

}  // namespace gpipe
