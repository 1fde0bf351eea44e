// The GPU allocator's policy (runtime/block_pool.h) on host memory: a backing that
// hands out real host segments up to a capacity, streams that are plain objects, and
// events whose completion the test decides, as a GPU would by finishing work. What is
// checked: a block goes to another stream only after the event of its last use there
// has completed; size classes, splitting and coalescing keep uneven micro-batches in
// one segment; and out of memory, the pool waits for the device before it frees.
#include "runtime/block_pool.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "runtime/error.h"

namespace gpipe {
namespace {

struct HostEvent : PoolEvent {
  explicit HostEvent(std::shared_ptr<bool> flag) : flag_(std::move(flag)) {}
  bool done() override { return *flag_; }
  std::shared_ptr<bool> flag_;
};

// Host memory with a capacity; every call is logged so the order can be checked.
class HostBacking : public PoolBacking {
 public:
  explicit HostBacking(size_t capacity) : capacity_(capacity) {}
  void* allocate_segment(size_t bytes) override {
    if (used_ + bytes > capacity_) {
      log.push_back("allocate " + std::to_string(bytes) + " failed");
      return nullptr;
    }
    used_ += bytes;
    log.push_back("allocate " + std::to_string(bytes));
    return std::malloc(bytes);
  }
  void free_segment(void* ptr, size_t bytes) override {
    used_ -= bytes;
    log.push_back("free " + std::to_string(bytes));
    std::free(ptr);
  }
  // The device finishes all queued work: every event recorded so far completes.
  void synchronize() override {
    log.push_back("synchronize");
    for (auto& f : events) *f = true;
  }
  std::unique_ptr<PoolEvent> record_event(StreamId) override {
    events.push_back(std::make_shared<bool>(false));
    log.push_back("event");
    return std::make_unique<HostEvent>(events.back());
  }
  // The work before the last recorded event finishes.
  void complete_last_event() { *events.back() = true; }

  std::vector<std::string> log;
  std::vector<std::shared_ptr<bool>> events;

 private:
  size_t capacity_;
  size_t used_ = 0;
};

constexpr size_t kMiB = 1 << 20;
int compute_stream, recv_stream;  // two distinct objects: two streams
const StreamId kCompute = &compute_stream;
const StreamId kRecv = &recv_stream;

}  // namespace

TEST_CASE("sizes round to 512 B and map to 2 MiB, 20 MiB or their own segments") {
  CHECK(BlockPool::round_size(0) == 512);
  CHECK(BlockPool::round_size(1) == 512);
  CHECK(BlockPool::round_size(512) == 512);
  CHECK(BlockPool::round_size(513) == 1024);
  CHECK(BlockPool::segment_size(512) == 2 * kMiB);
  CHECK(BlockPool::segment_size(kMiB) == 2 * kMiB);
  CHECK(BlockPool::segment_size(kMiB + 512) == 20 * kMiB);
  CHECK(BlockPool::segment_size(10 * kMiB - 512) == 20 * kMiB);
  CHECK(BlockPool::segment_size(10 * kMiB) == 10 * kMiB);
  CHECK(BlockPool::segment_size(11 * kMiB) == 12 * kMiB);
}

TEST_CASE("a block freed on its own stream is reused there at once, and never by another stream") {
  HostBacking backing(64 * kMiB);
  BlockPool pool(backing);
  void* a = pool.allocate(1000, kCompute);
  CHECK(pool.free(a) == 1024);
  CHECK(pool.allocate(1000, kCompute) == a);  // later work on the stream runs after earlier work
  void* other = pool.allocate(1000, kRecv);   // a free block of the compute stream is not taken
  CHECK(other != a);
  CHECK(pool.stats().segments == 2);
  CHECK(backing.events.empty());  // no event is needed for either
}

TEST_CASE("a block another stream used is reused only after the event recorded at its free completes") {
  HostBacking backing(64 * kMiB);
  BlockPool pool(backing);
  // A receive buffer: allocated for the receive stream, then read by compute.
  void* buf = pool.allocate(3 * kMiB, kRecv);
  pool.record_stream(buf, kCompute);
  pool.free(buf);  // the host let go; compute may still be reading it
  REQUIRE(backing.events.size() == 1);
  CHECK(pool.stats().pending == 1);
  void* next = pool.allocate(3 * kMiB, kRecv);
  CHECK(next != buf);  // compute has not passed the event: the block waits
  pool.free(next);
  backing.complete_last_event();
  CHECK(pool.allocate(3 * kMiB, kRecv) == buf);  // now it is the receive stream's again
  CHECK(pool.stats().pending == 0);
  // Recording the block's own stream adds no event.
  void* c = pool.allocate(4096, kCompute);
  pool.record_stream(c, kCompute);
  pool.free(c);
  CHECK(backing.events.size() == 1);
}

TEST_CASE("uneven micro-batches and recomputation share one segment: splits and coalescing") {
  HostBacking backing(256 * kMiB);
  BlockPool pool(backing);
  // Four activations of two sizes (10 samples into 4 micro-batches: 3 3 2 2), with a
  // recomputed one in between, for several steps: the sizes differ by less than the
  // exact-size cache could share.
  const size_t big = 3 * 700 * 1024, small = 2 * 700 * 1024;
  int64_t reserved_after_first = 0;
  for (int step = 0; step < 8; ++step) {
    std::vector<void*> live;
    for (size_t s : {big, big, small, small}) live.push_back(pool.allocate(s, kCompute));
    void* recompute = pool.allocate(big + 4096, kCompute);
    pool.free(recompute);
    for (void* p : live) pool.free(p);
    if (step == 0) reserved_after_first = pool.stats().reserved;
    CHECK(pool.stats().allocated == 0);
    CHECK(pool.stats().reserved == reserved_after_first);
  }
  CHECK(reserved_after_first == static_cast<int64_t>(20 * kMiB));  // one large segment held them all
  // Freed blocks coalesced back into the whole segment, so one request of 18 MiB fits.
  void* whole = pool.allocate(18 * kMiB, kCompute);
  CHECK(pool.stats().segments == 1);
  pool.free(whole);
}

TEST_CASE("out of memory: the pool waits for the device, then frees cached segments, then retries") {
  HostBacking backing(40 * kMiB);
  BlockPool pool(backing);
  // A 20 MiB segment cached for the receive stream, its last use (by compute) pending.
  void* a = pool.allocate(15 * kMiB, kRecv);  // its own 16 MiB segment
  pool.record_stream(a, kCompute);
  pool.free(a);
  void* b = pool.allocate(3 * kMiB, kCompute);  // a 20 MiB segment, split
  pool.free(b);                                 // cached, possibly still in use by queued kernels
  backing.log.clear();
  // 30 MiB for compute: no free block of that stream fits, and the device is full.
  void* c = pool.allocate(30 * kMiB, kCompute);
  REQUIRE(c != nullptr);
  // No segment is freed before the device is idle; both cached segments are freed.
  REQUIRE(backing.log.size() == 5);
  CHECK(backing.log[0] == "allocate 31457280 failed");
  CHECK(backing.log[1] == "synchronize");
  std::vector<std::string> freed = {backing.log[2], backing.log[3]};
  std::sort(freed.begin(), freed.end());
  CHECK(freed == std::vector<std::string>{"free 16777216", "free 20971520"});
  CHECK(backing.log[4] == "allocate 31457280");
  CHECK(pool.stats().pending == 0);
  CHECK(pool.stats().reserved == static_cast<int64_t>(30 * kMiB));
  // Nothing left to free: the request fails (the caller raises the error), after a wait.
  backing.log.clear();
  CHECK(pool.allocate(30 * kMiB, kRecv) == nullptr);
  CHECK(backing.log == std::vector<std::string>{"allocate 31457280 failed", "synchronize", "allocate 31457280 failed"});
  pool.free(c);
}

TEST_CASE("a segment with a block in use is not freed by release_cached") {
  HostBacking backing(64 * kMiB);
  BlockPool pool(backing);
  void* in_use = pool.allocate(1024, kCompute);
  void* cached = pool.allocate(1024, kCompute);  // same 2 MiB segment
  pool.free(cached);
  pool.release_cached();
  CHECK(pool.stats().segments == 1);
  pool.free(in_use);
  pool.release_cached();
  CHECK(pool.stats().segments == 0);
  CHECK(pool.stats().reserved == 0);
}

TEST_CASE("a captured step's private pool: its blocks go to its own requests only, and stay cached while held") {
  // Allocator::begin_private_pool: a capture's requests name a key of their own, so no
  // other stream's request takes its freed blocks, which its graph still uses at each
  // replay; release_cached (out of memory elsewhere) leaves them until let go.
  HostBacking backing(64 * kMiB);
  BlockPool pool(backing);
  int private_key = 0;
  const StreamId kCapture = &private_key;
  pool.hold(kCapture);
  void* a = pool.allocate(4096, kCapture);
  pool.free(a);  // the capture's temporary, freed inside it
  CHECK(pool.allocate(4096, kCompute) != a);  // the compute stream's own request: another block
  CHECK(pool.allocate(4096, kCapture) == a);  // the capture's next request reuses it, in capture order
  pool.free(a);
  pool.release_cached();
  CHECK(pool.stats().segments == 2);  // the compute stream's (in use) and the held one
  pool.let_go(kCapture);  // the graph is gone
  pool.release_cached();
  CHECK(pool.stats().segments == 1);
}

TEST_CASE("freeing a pointer twice is an Error that says so") {
  HostBacking backing(8 * kMiB);
  BlockPool pool(backing);
  void* p = pool.allocate(100, kCompute);
  pool.free(p);
  CHECK_THROWS_WITH_AS(pool.free(p), doctest::Contains("not a block this pool handed out"), Error);
}

}  // namespace gpipe
