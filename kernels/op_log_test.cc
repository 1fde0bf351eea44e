// trace.ops's timer and the op count (kernels/op_log.h): while an OpTimer is set on a thread,
// each outermost backend call there is one span, from its start to its end, with the calls
// made inside it part of it; the spans are summed by op name, in the order each op was first
// called. The times are checked from below only: an op that sleeps at least d is timed at
// least d (sleep_for and the CPU's events both keep the steady clock), whatever the machine.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "kernels/op_log.h"
#include "runtime/stream.h"

using namespace gpipe;
using namespace std::chrono_literals;

namespace {

// One backend call of `ms` milliseconds or more, as WideningBackend opens one per op.
void call(const char* op, std::chrono::milliseconds ms) {
  OpCall c(op, false);
  std::this_thread::sleep_for(ms);
}

}  // namespace

TEST_CASE("an OpTimer times each outermost call from its start to its end, summed by op, inner calls part of it") {
  CpuStream stream(Device::cpu());
  OpTimer timer(Device::cpu(), stream);
  const int64_t calls_before = OpLog::calls_on_this_thread();
  call("untimed_before", 1ms);  // no timer set on this thread yet
  {
    OpTimer::Scope scope(&timer);
    {
      OpCall outer("slow", false);
      std::this_thread::sleep_for(20ms);
      call("inner", 10ms);  // inside "slow": part of its span, neither timed nor counted apart
    }
    call("quick", 0ms);
    {
      OpTimer::Scope none(nullptr);  // a scope without a timer, inside one
      call("untimed_inside", 1ms);
    }
    call("slow", 5ms);  // the outer scope's timer again
  }
  call("untimed_after", 1ms);
  stream.synchronize();
  // Every outermost call is counted, timed or not; the one inside "slow" is not.
  CHECK(OpLog::calls_on_this_thread() - calls_before == 6);

  const std::vector<OpTimer::Total> totals = timer.resolve();
  REQUIRE(totals.size() == 2);
  CHECK(totals[0].op == std::string("slow"));  // the order each op was first called in
  CHECK(totals[0].calls == 2);
  CHECK(totals[0].ms >= 35.0);  // 20 + 10 inside + 5: a span closed at its start would be ~0
  CHECK(totals[1].op == std::string("quick"));
  CHECK(totals[1].calls == 1);
  CHECK(totals[1].ms >= 0.0);
  CHECK_FALSE(timer.failed());
  // What was resolved is gone, and the timer records the next step's calls anew.
  CHECK(timer.resolve().empty());
  {
    OpTimer::Scope scope(&timer);
    call("next", 2ms);
  }
  const std::vector<OpTimer::Total> next = timer.resolve();
  REQUIRE(next.size() == 1);
  CHECK(next[0].op == std::string("next"));
  CHECK(next[0].calls == 1);
  CHECK(next[0].ms >= 2.0);
}

TEST_CASE("an OpLog records each outermost call once, at its end, with what was asked inside") {
  OpLog log;
  {
    OpCall outer("outer", false);
    REQUIRE(outer.recording());
    outer.args() = "f32[2]";
    OpCall inner("read", true);  // returns a value to the host: so does the outer call
    CHECK_FALSE(inner.recording());
  }
  { OpCall plain("plain", false); }
  const std::vector<OpLog::Call> calls = log.take();
  REQUIRE(calls.size() == 2);
  CHECK(calls[0].op == "outer");
  CHECK(calls[0].args == "f32[2]");
  CHECK(calls[0].returns);
  CHECK((calls[0].thread == std::this_thread::get_id()));
  CHECK(calls[1].op == "plain");
  CHECK_FALSE(calls[1].returns);
  CHECK(log.take().empty());
}
