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
thread_local int depth = 0;           // OpCalls alive on this thread
thread_local bool inner_read = false;  // a call inside the outermost returned a value
}  // namespace

int64_t OpLog::calls_on_this_thread() { return calls; }

OpCall::OpCall(const char* op, bool returns) : outermost_(depth++ == 0) {
  if (!outermost_) {
    inner_read = inner_read || returns;
    return;
  }
  ++calls;
  inner_read = false;
  if (alive.load(std::memory_order_relaxed) == nullptr) return;
  call_ = std::make_unique<OpLog::Call>();
  call_->thread = std::this_thread::get_id();
  call_->op = op;
  call_->returns = returns;
}

OpCall::~OpCall() {
  --depth;
  if (call_ == nullptr) return;
  call_->returns = call_->returns || inner_read;
  OpLog::note(std::move(*call_));
}

void OpLog::note(Call call) {
  OpLog* log = alive.load();
  if (log == nullptr) return;
  std::lock_guard<std::mutex> lock(log->mu_);
  log->calls_.push_back(std::move(call));
}

}  // namespace gpipe
