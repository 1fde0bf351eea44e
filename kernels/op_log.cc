#include "kernels/op_log.h"

#include <atomic>
#include <utility>

#include "runtime/error.h"

namespace gpipe {

namespace {
std::atomic<OpLog*> alive{nullptr};
}  // namespace

OpLog::OpLog() {
  OpLog* none = nullptr;
  GPIPE_CHECK(alive.compare_exchange_strong(none, this), "two OpLogs alive at once");
}

OpLog::~OpLog() { alive.store(nullptr); }

std::vector<OpLog::Call> OpLog::take() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(calls_, {});
}

namespace {
thread_local int64_t calls = 0;
}  // namespace

int64_t OpLog::calls_on_this_thread() { return calls; }

bool OpLog::counted() {
  ++calls;
  return alive.load(std::memory_order_relaxed) != nullptr;
}

void OpLog::note(Call call) {
  OpLog* log = alive.load();
  if (log == nullptr) return;
  std::lock_guard<std::mutex> lock(log->mu_);
  log->calls_.push_back(std::move(call));
}

}  // namespace gpipe
