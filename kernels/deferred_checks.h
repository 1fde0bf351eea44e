// The bookkeeping of a GPU backend's deferred input checks, as host code. What only the
// data can get wrong (a label, a token id, a max-pool argmax) is checked by the kernels
// that use it, which lower an error slot instead of stopping the host; the backend
// reads the slots back when it waits for its stream anyway (kernels/cuda_backend.cc,
// "Deferred input errors"). Two pipeline stages that share a GPU share its backend, so
// each check remembers the thread that queued it (a stage's worker), and an error is
// thrown only to that thread: a stage never reports another stage's bad batch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/device.h"
#include "runtime/dtype.h"

namespace gpipe {

namespace cuda {
// One device word per validating op call: kNoError, or (uint64(index) << 32) |
// uint32(value) of the smallest bad index (a 64-bit atomicMin keeps the smallest; the
// low half is that element's value). Indices must be at most kMaxErrorIndex, so that no
// flagged slot reads as kNoError.
using ErrorSlot = unsigned long long;
constexpr ErrorSlot kNoError = ~ErrorSlot(0);
constexpr int64_t kMaxErrorIndex = 0xFFFFFFFE;
inline int64_t error_index(ErrorSlot s) { return static_cast<int64_t>(s >> 32); }
inline int32_t error_value(ErrorSlot s) { return static_cast<int32_t>(static_cast<uint32_t>(s & 0xFFFFFFFFu)); }
}  // namespace cuda

// One op's check of user data, queued on the stream with the op's kernels and not yet
// read back: what its error message needs, kept on the host (no device access).
struct DeferredCheck {
  const char* op = "";  // the op that queued it
  int64_t count = 0;    // values checked; a flagged index is below this
  int64_t limit = 0;    // valid values are [0, limit): classes, vocabulary, or H W of a plane
  int64_t seq = 1;      // token ids: T, so that index p = b T + t
  DType dtype = DType::kF32;       // maxpool2d_backward: dx's dtype and shape, for
  std::array<int64_t, 4> shape{};  // the CPU's description of it
  bool user_error = true;          // thrown as UserError (labels, token ids) or Error (argmax)
  // The CPU reference's message for `value` at flat index `index` (`device`: the
  // backend's).
  std::string (*message)(const DeferredCheck& check, int64_t index, int32_t value, Device device) = nullptr;
};

class DeferredChecks {
 public:
  using Owner = std::thread::id;

  // At most `capacity` checks wait for one read-back (the device holds that many slots).
  explicit DeferredChecks(size_t capacity) : capacity_(capacity) { pending_.reserve(64); }

  // Registers the check of an op `owner` is queuing; returns its slot's index.
  size_t add(const DeferredCheck& check, Owner owner);
  // A captured step's checks (CudaBackend::begin_capture): every pending one, taken out
  // unread (the captured kernels have not run, their slots are untouched), and put back
  // in the same slots before each replay (which needs none pending).
  struct Queued {
    DeferredCheck check;
    Owner owner;
  };
  std::vector<Queued> take_unread();
  void put_back(const std::vector<Queued>& checks);
  size_t size() const { return pending_.size(); }
  bool full() const { return pending_.size() == capacity_; }

  // The slots of the pending checks, read back (slots[i] for the i-th): forgets them and
  // keeps the error of each flagged one for its owner (the first per owner only: an
  // owner's later errors follow from the first bad batch). Returns whether any slot was
  // flagged (the caller then resets the slots on the device).
  bool resolve(const cuda::ErrorSlot* slots, Device device);
  // Throws the oldest kept error of `caller`, if any (UserError or Error, as on the CPU).
  void throw_first(Owner caller);
  // Every error kept or still pending (slots read back) as messages, for a destructor
  // that must log instead of throwing; forgets them.
  std::vector<std::string> drain(const cuda::ErrorSlot* slots, Device device);

 private:
  struct Kept {
    Owner owner;
    std::string message;
    bool user_error;
  };
  size_t capacity_;
  std::vector<Queued> pending_;  // in queue order: slot i belongs to pending_[i]
  std::vector<Kept> kept_;        // oldest first, at most one per owner
};

}  // namespace gpipe
