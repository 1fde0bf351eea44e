// Which thread a GPU backend's deferred input error goes to (kernels/deferred_checks.h),
// on the host: two pipeline stages share a GPU and its backend, and the slots the
// device would have written are given here as read back. A stage must get its own bad
// batch's error, never its neighbour's, whichever of them waits first.
#include "kernels/deferred_checks.h"

#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include "runtime/error.h"

namespace gpipe {
namespace {

std::string label_message(const DeferredCheck& c, int64_t row, int32_t label, Device d) {
  return std::string(c.op) + ": label " + std::to_string(label) + " in row " + std::to_string(row) + " on " + d.str();
}

DeferredCheck check(const char* op, int64_t count, bool user_error = true) {
  DeferredCheck c;
  c.op = op;
  c.count = count;
  c.limit = 10;
  c.user_error = user_error;
  c.message = label_message;
  return c;
}

cuda::ErrorSlot flag(int64_t index, int32_t value) {
  return (static_cast<cuda::ErrorSlot>(index) << 32) | static_cast<uint32_t>(value);
}

// Two real threads' identities: stage A's and stage B's workers (both unjoined while
// their ids are taken, so the ids differ).
struct Stages {
  std::thread::id a, b;
  Stages() {
    std::thread ta([] {}), tb([] {});
    a = ta.get_id();
    b = tb.get_id();
    ta.join();
    tb.join();
  }
};

}  // namespace

TEST_CASE("a stage's wait throws its own flagged check, not the other stage's") {
  Stages s;
  const Device gpu = Device::cuda(0);
  DeferredChecks checks(8);
  CHECK(checks.add(check("softmax_xent", 4), s.a) == 0);
  CHECK(checks.add(check("embedding", 6), s.b) == 1);
  CHECK(checks.add(check("softmax_xent_backward", 4), s.a) == 2);
  // Only B's embedding flagged a bad value (index 5, value -3). A waits first.
  const std::vector<cuda::ErrorSlot> slots = {cuda::kNoError, flag(5, -3), cuda::kNoError};
  CHECK(checks.resolve(slots.data(), gpu));
  CHECK(checks.size() == 0);
  CHECK_NOTHROW(checks.throw_first(s.a));  // A's batch was fine
  CHECK_THROWS_WITH_AS(checks.throw_first(s.b), "embedding: label -3 in row 5 on cuda:0", UserError);
  CHECK_NOTHROW(checks.throw_first(s.b));  // reported once
}

TEST_CASE("a captured step's checks, taken out unread and put back before each replay, report its bad batch") {
  // CudaBackend::end_capture takes the capture's checks out (nothing ran); each replay
  // puts them back in the same slots, which its kernels flag; the wait then reads them.
  Stages s;
  const Device gpu = Device::cuda(0);
  DeferredChecks checks(8);
  checks.add(check("embedding", 6), s.a);
  checks.add(check("softmax_xent", 4), s.a);
  const std::vector<DeferredChecks::Queued> captured = checks.take_unread();
  CHECK(captured.size() == 2);
  CHECK(checks.size() == 0);
  for (int replay = 0; replay < 2; ++replay) {
    checks.put_back(captured);
    CHECK(checks.size() == 2);
    const std::vector<cuda::ErrorSlot> slots = {cuda::kNoError, replay == 1 ? flag(3, 11) : cuda::kNoError};
    CHECK(checks.resolve(slots.data(), gpu) == (replay == 1));
    if (replay == 0) {
      CHECK_NOTHROW(checks.throw_first(s.a));
    } else {
      CHECK_THROWS_WITH_AS(checks.throw_first(s.a), "softmax_xent: label 11 in row 3 on cuda:0", UserError);
    }
  }
  checks.add(check("embedding", 6), s.a);
  CHECK_THROWS_AS(checks.put_back(captured), Error);  // over a pending check: the slots would not match
}

TEST_CASE("a stage gets the first of its errors in queue order; Error stays Error") {
  Stages s;
  DeferredChecks checks(8);
  checks.add(check("maxpool2d_backward", 9, /*user_error=*/false), s.a);
  checks.add(check("softmax_xent", 9), s.a);
  checks.add(check("softmax_xent", 9), s.b);
  const std::vector<cuda::ErrorSlot> slots = {flag(7, 99), flag(2, 11), flag(0, 12)};
  CHECK(checks.resolve(slots.data(), Device::cuda(1)));
  try {
    checks.throw_first(s.a);
    FAIL("stage A's error was not thrown");
  } catch (const UserError&) {
    FAIL("an argmax error is an Error, not a UserError");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "maxpool2d_backward: label 99 in row 7 on cuda:1");
  }
  CHECK_NOTHROW(checks.throw_first(s.a));  // the later one followed from the first
  // B's error was kept through A's wait and a later clean read-back.
  checks.add(check("embedding", 3), s.b);
  const std::vector<cuda::ErrorSlot> clean = {cuda::kNoError};
  CHECK_FALSE(checks.resolve(clean.data(), Device::cuda(1)));
  CHECK_THROWS_WITH_AS(checks.throw_first(s.b), "softmax_xent: label 12 in row 0 on cuda:1", UserError);
}

TEST_CASE("capacity, and what a destructor logs") {
  Stages s;
  DeferredChecks checks(2);
  checks.add(check("softmax_xent", 4), s.a);
  checks.add(check("embedding", 4), s.b);
  CHECK(checks.full());
  CHECK_THROWS_AS(checks.add(check("embedding", 4), s.b), Error);
  const std::vector<cuda::ErrorSlot> slots = {cuda::kNoError, flag(1, 42)};
  const std::vector<std::string> logged = checks.drain(slots.data(), Device::cuda(0));
  CHECK(logged == std::vector<std::string>{"embedding: embedding: label 42 in row 1 on cuda:0"});
  CHECK(checks.size() == 0);
}

}  // namespace gpipe
