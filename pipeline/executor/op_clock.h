// Times of a stage's compute instructions as its device ran them. On a CPU the host's
// clock is the device's, so the executor's own timestamps stand; on a GPU a kernel
// launch returns long before the kernel ends, so the host times would show the launch,
// not the work. There, an event is recorded on the stage's stream before and after
// each compute instruction and read back once the stage has synchronised at the end
// of the step (no wait in between).
//
//   host    ─launch F0─launch F1─launch B1─ ... ─synchronize─ resolve()
//   stream   ●ref  ●F0 ─────● ●F1 ─────● ...
//   times   start(op) = host time of ref + elapsed(ref, ●before op), ...
//
// The reference event is recorded at the step's start, when the stream is idle (the
// previous step ended with a synchronize), so its device time is its host time.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/device.h"
#include "runtime/stream.h"

namespace gpipe {
namespace pipeline {

class OpClock {
 public:
  // Device times for `device`'s compute when it is not a CPU (or when forced, which
  // the tests use to run this path on CPU events); otherwise every call is a no-op.
  explicit OpClock(Device device, bool force = false);
  bool enabled() const { return enabled_; }

  // At the step's start: the reference, taken at host time `host_ms` (any clock).
  void start_step(Stream& stream, double host_ms);
  // Around compute instruction `index` of the stage's trace, or a tensor collective's
  // inside it (spans nest: after closes the innermost open one); returns nothing to wait for.
  void before(Stream& stream, size_t index);
  void after(Stream& stream, size_t index);
  // After the stage's stream has synchronised: (index, start_ms, end_ms) on the host
  // clock of start_step, for every instruction recorded this step.
  struct Span {
    size_t index;
    double start_ms, end_ms;
  };
  std::vector<Span> resolve();
  // A captured step (Backend::begin_capture): the spans its capture recorded, whose
  // events every replay records again, kept after the capture and set before each
  // replay's resolve (after start_step).
  using Spans = std::vector<std::pair<size_t, std::pair<Event*, Event*>>>;
  Spans spans() const { return spans_; }
  void set_spans(Spans spans) { spans_ = std::move(spans); }
  // Events recorded by a captured step's graph are its own: the events of later steps
  // not captured come after them in the pool (start_step's reuse begins there).
  void keep_captured_events() { kept_ = used_; }

 private:
  Event& next_event();
  bool enabled_ = false;
  Device device_;
  double host_ref_ms_ = 0;
  std::unique_ptr<Event> ref_;
  std::vector<std::unique_ptr<Event>> pool_;  // reused from step to step
  size_t used_ = 0;
  size_t kept_ = 0;  // pool_[0, kept_): a captured step's
  std::vector<std::pair<size_t, std::pair<Event*, Event*>>> spans_;  // index, (before, after)
};

}  // namespace pipeline
}  // namespace gpipe
