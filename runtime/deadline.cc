#include "runtime/deadline.h"

#include <cmath>
#include <sstream>
#include <thread>

#include "runtime/error.h"

namespace gpipe {

Deadline::Deadline(double timeout_s) : timeout_s_(timeout_s), none_(timeout_s == 0) {
  if (!(timeout_s >= 0) || !std::isfinite(timeout_s)) {
    throw UserError("pipeline.timeout_s is " + std::to_string(timeout_s) +
                    "; use a number of seconds > 0, or 0 for no deadline");
  }
  if (!none_) {
    when_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  }
}

bool poll_until(const std::function<bool()>& done, const Deadline& deadline) {
  const auto start = Deadline::Clock::now();
  for (;;) {
    if (done()) return true;
    const auto now = Deadline::Clock::now();
    if (!deadline.none() && now >= deadline.when()) return false;
    // The first milliseconds: as eager as a blocking MPI call (which spins in its
    // progress loop). Then short sleeps, so a long wait does not burn a core.
    if (now - start >= std::chrono::milliseconds(5)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::string timeout_message(const std::string& waiter, const std::string& awaited, double timeout_s, int64_t step) {
  std::ostringstream os;
  os << waiter << " waited " << timeout_s << " s for " << awaited;
  if (step >= 0) os << " at step " << step;
  os << "; pipeline.timeout_s is " << timeout_s
     << ": a peer is stuck, stopped, dead or deadlocked. If a step can legitimately take longer (a slow first "
        "step, a large synchronous checkpoint), raise pipeline.timeout_s (0 = no deadline)";
  return os.str();
}

}  // namespace gpipe
