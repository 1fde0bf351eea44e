// The polling of host waits on device work (runtime/device_wait.h), on the host: which
// outcome each combination of "done", "failed" and "deadline passed" gives, and the
// message each names. The callables stand in for cudaEventQuery and
// ncclCommGetAsyncError; the NCCL transport's real waits are checked under mpirun on
// two GPUs (runtime/nccl_transport_test). No wall time is asserted.
#include "runtime/device_wait.h"

#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <thread>

#include "runtime/error.h"

using namespace gpipe;

namespace {
const char* const kAwaited = "the activation of micro-batch 3 to rank 1 to be received (ncclSend)";
}

TEST_CASE("device wait: work that finishes is done, after as many polls as it took") {
  int polls = 0, asked = 0;
  const WaitResult r = poll_device_work([&] { return ++polls == 3; }, [&] { ++asked; return std::string(); },
                                       Deadline(30));
  CHECK(r.outcome == WaitOutcome::kDone);
  CHECK(r.failure.empty());
  CHECK(polls == 3);
  CHECK(asked == 3);  // the failure check runs on every poll, not only at the end
}

TEST_CASE("device wait: an asynchronous error ends the wait with the library's reason") {
  int polls = 0;
  const WaitResult r = poll_device_work(
      [&] { return false; },
      [&] { return ++polls < 4 ? std::string() : std::string("NCCL reported ncclRemoteError: peer closed"); },
      Deadline(30));
  CHECK(r.outcome == WaitOutcome::kFailed);
  CHECK(r.failure == "NCCL reported ncclRemoteError: peer closed");
  CHECK(polls == 4);
  const std::string m = device_wait_message(r, "rank 0 (stage 0)", kAwaited, 30, 12);
  CHECK(m.find(std::string("rank 0 (stage 0) waited for ") + kAwaited + " at step 12, but NCCL reported "
               "ncclRemoteError: peer closed") != std::string::npos);
  CHECK(m.find("NCCL_DEBUG=INFO") != std::string::npos);
}

TEST_CASE("device wait: an error wins over work that looks complete") {
  // After an asynchronous error nothing NCCL queued can be trusted, finished or not.
  int done_asked = 0;
  const WaitResult r = poll_device_work([&] { ++done_asked; return true; },
                                       [] { return std::string("NCCL reported ncclSystemError"); }, Deadline(30));
  CHECK(r.outcome == WaitOutcome::kFailed);
  CHECK(done_asked == 0);
}

TEST_CASE("device wait: work that never finishes times out with what it waited for") {
  int polls = 0;
  const WaitResult r = poll_device_work([&] { ++polls; return false; }, [] { return std::string(); },
                                       Deadline(0.02));
  CHECK(r.outcome == WaitOutcome::kTimedOut);
  CHECK(r.failure.empty());
  CHECK(polls >= 1);
  const std::string m = device_wait_message(r, "rank 0 (stage 0)", kAwaited, 0.02, 7);
  CHECK(m == timeout_message("rank 0 (stage 0)", kAwaited, 0.02, 7));
  CHECK(m.find(std::string("rank 0 (stage 0) waited 0.02 s for ") + kAwaited + " at step 7; pipeline.timeout_s is "
               "0.02") != std::string::npos);
}

TEST_CASE("device wait: without a deadline it waits as long as the work takes") {
  int polls = 0;
  const WaitResult r = poll_device_work([&] { return ++polls == 2000; }, [] { return std::string(); }, Deadline(0));
  CHECK(r.outcome == WaitOutcome::kDone);
  CHECK(polls == 2000);
}

TEST_CASE("device wait: work already done is done even when the deadline has passed") {
  const Deadline passed(1e-6);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  REQUIRE(passed.expired());
  const WaitResult r = poll_device_work([] { return true; }, [] { return std::string(); }, passed);
  CHECK(r.outcome == WaitOutcome::kDone);
}

TEST_CASE("device wait: there is no message for a wait that ended in time") {
  CHECK_THROWS_AS(device_wait_message(WaitResult{}, "rank 0", kAwaited, 1, 0), Error);
}
