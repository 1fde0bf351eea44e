#include "kernels/op_log.h"

#include <algorithm>
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
  if (OpTimer* timer = OpTimer::on_this_thread()) {
    if (timer->before(op, &span_)) timer_ = timer;
  }
  if (alive.load(std::memory_order_relaxed) == nullptr) return;
  call_ = std::make_unique<OpLog::Call>();
  call_->thread = std::this_thread::get_id();
  call_->op = op;
  call_->returns = returns;
}

OpCall::~OpCall() {
  --depth;
  if (timer_ != nullptr) timer_->after(span_);
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

// ---- OpTimer

namespace {
thread_local OpTimer* thread_timer = nullptr;
}  // namespace

OpTimer::OpTimer(Device device, Stream& stream) : device_(device), stream_(stream) {}

OpTimer* OpTimer::on_this_thread() { return thread_timer; }

OpTimer::Scope::Scope(OpTimer* timer) : outer_(thread_timer) { thread_timer = timer; }
OpTimer::Scope::~Scope() { thread_timer = outer_; }

Event& OpTimer::next_event() {
  if (used_ == pool_.size()) pool_.push_back(make_event(device_));
  return *pool_[used_++];
}

bool OpTimer::before(const char* op, size_t* span) noexcept {
  if (failed_) return false;
  try {
    Event& e = next_event();
    e.record(stream_);
    *span = spans_.size();
    spans_.push_back({op, &e, nullptr});
    return true;
  } catch (...) {  // a device error: the op itself meets it, and the step reports it
    failed_ = true;
    return false;
  }
}

void OpTimer::after(size_t span) noexcept {
  if (failed_ || span >= spans_.size()) return;
  try {
    Event& e = next_event();
    e.record(stream_);
    spans_[span].end = &e;
  } catch (...) {
    failed_ = true;
  }
}

std::vector<OpTimer::Total> OpTimer::resolve() {
  std::vector<Total> out;
  if (failed_) {
    clear();
    return out;
  }
  for (const Span& s : spans_) {
    if (s.end == nullptr) continue;  // still open: an op the step left (none in a step that ended)
    auto it = std::find_if(out.begin(), out.end(), [&](const Total& t) { return t.op == s.op; });
    if (it == out.end()) it = out.insert(out.end(), Total{s.op, 0, 0.0});
    ++it->calls;
    it->ms += s.begin->elapsed_ms(*s.end);  // waits for both events (done: the stream has synchronised)
  }
  clear();
  return out;
}

void OpTimer::clear() {
  spans_.clear();
  used_ = 0;
  failed_ = false;
}

}  // namespace gpipe
