// Deadlines for the transports' blocking waits (pipeline.timeout_s): a rank or stage
// whose peer is stuck (a hung process, a kill -STOP, a deadlock) gives up after a while
// and says what it waited for, instead of hanging the job forever.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace gpipe {

// A sensible deadline for real jobs: far above any one message or reduction, so only a
// stuck peer reaches it. Tests set a few seconds; 0 means no deadline.
constexpr double kDefaultTimeoutS = 600;
// The exit status of a job ended by a transport deadline (sysexits' EX_TEMPFAIL: a
// supervisor may retry it).
constexpr int kTimeoutExitCode = 75;

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  // From now; timeout_s == 0: never. Throws Error for a negative or non-finite value.
  explicit Deadline(double timeout_s);
  bool none() const { return none_; }
  bool expired() const { return !none_ && Clock::now() >= when_; }
  Clock::time_point when() const { return when_; }
  double timeout_s() const { return timeout_s_; }

 private:
  double timeout_s_;
  bool none_;
  Clock::time_point when_;
};

// Calls `done` until it returns true (then returns true) or the deadline passes (then
// returns false). Polls eagerly at first, for latency, then sleeps briefly between
// polls so a long wait does not burn a core.
bool poll_until(const std::function<bool()>& done, const Deadline& deadline);

// cv.wait(lock, pred) with the deadline; false when it expired with pred still false.
template <typename Pred>
bool wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, const Deadline& deadline,
                Pred pred) {
  if (deadline.none()) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_until(lock, deadline.when(), pred);
}

// "rank 1 (stage 1) waited 5 s for the activation of micro-batch 3 from rank 0 at step
// 12; pipeline.timeout_s is 5: ..." with what to do about it. `step` < 0: unknown.
std::string timeout_message(const std::string& waiter, const std::string& awaited, double timeout_s, int64_t step);

}  // namespace gpipe
