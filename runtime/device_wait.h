// Waiting on the host for device work that depends on other ranks (NCCL), without
// blocking: a blocked cudaEventSynchronize never returns when a peer is stuck or gone,
// and an NCCL operation that hit an asynchronous error never completes (NCCL user guide,
// "Error handling and communicator abort"). So the waiter polls three things until one
// answers: is the work done, has the library reported a failure, has the deadline
// (pipeline.timeout_s) passed. The polling is here, over callables, so that its logic is
// tested on the host; runtime/nccl_comm.cc plugs in cudaEventQuery and
// ncclCommGetAsyncError, and ends the job when the answer is not "done".
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "runtime/deadline.h"

namespace gpipe {

enum class WaitOutcome { kDone, kFailed, kTimedOut };

struct WaitResult {
  WaitOutcome outcome = WaitOutcome::kDone;
  std::string failure;  // kFailed: what the library reported
};

// Polls until done() holds (kDone), failed() returns a reason (kFailed, with it) or the
// deadline passes (kTimedOut). failed() is asked first on every poll: after an
// asynchronous error nothing can be assumed about the operations queued, even those
// that look complete. Work that is done when first asked is done, even past the
// deadline. Sleeps between polls as poll_until() does.
WaitResult poll_device_work(const std::function<bool()>& done, const std::function<std::string()>& failed,
                            const Deadline& deadline);

// The log line of a wait that did not end in kDone: timeout_message() for kTimedOut,
// and for kFailed "`waiter` waited for `awaited` at step N, but ... reported: <failure>"
// with what to do. `step` < 0: unknown.
std::string device_wait_message(const WaitResult& result, const std::string& waiter, const std::string& awaited,
                                double timeout_s, int64_t step);

}  // namespace gpipe
