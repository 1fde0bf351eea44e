// BlockPool: the policy described in block_pool.h. Every public call holds the pool's
// mutex, backing calls included (as PyTorch holds its allocator's lock around cudaMalloc).
#include "runtime/block_pool.h"

#include <algorithm>
#include <functional>
#include <sstream>

#include "runtime/error.h"

namespace gpipe {

bool BlockPool::Order::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return std::less<StreamId>()(a->stream, b->stream);
  if (a->size != b->size) return a->size < b->size;
  return std::less<void*>()(a->ptr, b->ptr);
}

size_t BlockPool::round_size(size_t bytes) {
  if (bytes < kMinBlock) return kMinBlock;
  return (bytes + kMinBlock - 1) / kMinBlock * kMinBlock;
}

size_t BlockPool::segment_size(size_t rounded) {
  if (rounded <= kSmallSize) return kSmallSegment;
  if (rounded < kMinLargeAlloc) return kLargeSegment;
  return (rounded + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

BlockPool::BlockPool(PoolBacking& backing) : backing_(backing) {}

BlockPool::~BlockPool() {
  std::set<Block*> all(small_.begin(), small_.end());
  all.insert(large_.begin(), large_.end());
  for (const auto& kv : active_) all.insert(kv.second);
  for (const auto& e : events_) all.insert(e.second);
  events_.clear();  // the events first: they may refer to the backing's resources
  for (Block* b : all) delete b;
}

void* BlockPool::allocate(size_t bytes, StreamId stream, size_t* size_out, bool may_release) {
  std::lock_guard<std::mutex> lock(mu_);
  process_events();
  const size_t size = round_size(bytes);
  const bool small = size <= kSmallSize;
  Block* b = take_free(small, stream, size);
  if (b == nullptr) {
    const size_t seg = segment_size(size);
    void* p = backing_.allocate_segment(seg);
    if (p == nullptr && may_release) {
      release_cached_locked();
      p = backing_.allocate_segment(seg);
    }
    if (p == nullptr) return nullptr;
    b = new Block;
    b->ptr = p;
    b->size = seg;
    b->stream = stream;
    b->small = small;
    stats_.reserved += static_cast<int64_t>(seg);
    ++stats_.segments;
  }
  b->state = State::kAllocated;  // before the split, so the rest does not merge back into it
  maybe_split(b, size);
  active_.emplace(b->ptr, b);
  stats_.allocated += static_cast<int64_t>(b->size);
  if (size_out != nullptr) *size_out = b->size;
  return b->ptr;
}

BlockPool::Block* BlockPool::take_free(bool small, StreamId stream, size_t size) {
  FreeSet& pool = small ? small_ : large_;
  Block key;
  key.stream = stream;
  key.size = size;
  key.ptr = nullptr;
  auto it = pool.lower_bound(&key);
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

// The rest of a larger free block becomes a free block of its own when it is worth
// keeping: any 512 B in the small pool; more than 1 MiB in the large pool (smaller
// leftovers stay with the block, as in PyTorch, to limit fragmentation).
void BlockPool::maybe_split(Block* b, size_t size) {
  const size_t rest = b->size - size;
  const bool split = b->small ? rest >= kMinBlock : rest > kSmallSize;
  if (!split) return;
  Block* r = new Block;
  r->ptr = static_cast<char*>(b->ptr) + size;
  r->size = rest;
  r->stream = b->stream;
  r->small = b->small;
  r->prev = b;
  r->next = b->next;
  if (b->next != nullptr) b->next->prev = r;
  b->next = r;
  b->size = size;
  insert_free(r);
}

size_t BlockPool::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(ptr);
  if (it == active_.end()) {
    std::ostringstream os;
    os << "BlockPool::free(" << ptr << "): not a block this pool handed out (freed twice, or another allocator's)";
    throw Error(os.str());
  }
  Block* b = it->second;
  active_.erase(it);
  const size_t size = b->size;
  stats_.allocated -= static_cast<int64_t>(size);
  if (b->uses.empty()) {
    insert_free(b);
    return size;
  }
  // Other streams may still read or write it: one event on each, and the block waits.
  b->state = State::kPending;
  ++stats_.pending;
  for (StreamId s : b->uses) {
    events_.emplace_back(backing_.record_event(s), b);
    ++b->pending_events;
  }
  b->uses.clear();
  return size;
}

void BlockPool::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = active_.find(ptr);
  if (it == active_.end()) throw Error("BlockPool::record_stream: not a block in use");
  Block* b = it->second;
  if (stream == b->stream) return;  // its own stream orders itself
  if (std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) b->uses.push_back(stream);
}

void BlockPool::insert_free(Block* b) {
  b->state = State::kFree;
  FreeSet& pool = pool_of(b);
  // All blocks of a segment share its stream, so neighbours merge freely.
  if (b->prev != nullptr && b->prev->state == State::kFree) {
    Block* p = b->prev;
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next != nullptr) b->next->prev = p;
    delete b;
    b = p;
  }
  if (b->next != nullptr && b->next->state == State::kFree) {
    Block* n = b->next;
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    delete n;
  }
  pool.insert(b);
}

void BlockPool::process_events() {
  for (auto it = events_.begin(); it != events_.end();) {
    if (!it->first->done()) {
      ++it;
      continue;
    }
    Block* b = it->second;
    it = events_.erase(it);
    if (--b->pending_events == 0) {
      --stats_.pending;
      insert_free(b);
    }
  }
}

void BlockPool::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void BlockPool::release_cached_locked() {
  // 1. Wait for the device. A cached block may still be in use by kernels queued on its
  // stream (its host owner let go once they were queued), and a pending block by
  // another stream; freeing either before they finish would be a use-after-free
  // (cudaFree "may" synchronize, it is not promised to).
  backing_.synchronize();
  // 2. Every event recorded before the wait has completed now.
  while (!events_.empty()) {
    Block* b = events_.front().second;
    events_.pop_front();
    if (--b->pending_events == 0) {
      --stats_.pending;
      insert_free(b);
    }
  }
  // 3. Free the segments that are a single free block.
  for (FreeSet* pool : {&small_, &large_}) {
    for (auto it = pool->begin(); it != pool->end();) {
      Block* b = *it;
      if (b->prev != nullptr || b->next != nullptr || held_.count(b->stream) != 0) {
        ++it;
        continue;
      }
      it = pool->erase(it);
      backing_.free_segment(b->ptr, b->size);
      stats_.reserved -= static_cast<int64_t>(b->size);
      --stats_.segments;
      delete b;
    }
  }
}

void BlockPool::hold(StreamId stream) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.insert(stream);
}

void BlockPool::let_go(StreamId stream) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.erase(stream);
}

PoolStats BlockPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace gpipe
