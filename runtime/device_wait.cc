#include "runtime/device_wait.h"

#include <sstream>

#include "runtime/error.h"

namespace gpipe {

WaitResult poll_device_work(const std::function<bool()>& done, const std::function<std::string()>& failed,
                            const Deadline& deadline) {
  WaitResult result;
  const bool ended = poll_until(
      [&] {
        result.failure = failed();
        if (!result.failure.empty()) return true;
        return done();
      },
      deadline);
  if (!ended) {
    result.outcome = WaitOutcome::kTimedOut;
  } else if (!result.failure.empty()) {
    result.outcome = WaitOutcome::kFailed;
  }
  return result;
}

std::string device_wait_message(const WaitResult& result, const std::string& waiter, const std::string& awaited,
                                double timeout_s, int64_t step) {
  switch (result.outcome) {
    case WaitOutcome::kDone:
      throw Error("device_wait_message: the wait for " + awaited + " ended in time; there is nothing to report");
    case WaitOutcome::kTimedOut:
      return timeout_message(waiter, awaited, timeout_s, step);
    case WaitOutcome::kFailed:
      break;
  }
  std::ostringstream os;
  os << waiter << " waited for " << awaited;
  if (step >= 0) os << " at step " << step;
  os << ", but " << result.failure
     << ": a peer or the network between the ranks failed, so the operation can never complete (set "
        "NCCL_DEBUG=INFO for NCCL's own account; a supervisor may restart the job from its last checkpoint)";
  return os.str();
}

}  // namespace gpipe
