// What the backends of backend_for() are asked to do, call by call, while an OpLog is
// alive: each op's name, its tensors' types and shapes, its other arguments' values, and
// the calling thread. A stage whose training step calls the same ops with the same
// arguments at every step has no host value left inside the step: it can be captured
// once and replayed (a CUDA graph, issue 37 item 4). Tests check that, and count a
// step's op calls. Recorded by WideningBackend, which wraps every backend_for() backend.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/device.h"
#include "runtime/stream.h"

namespace gpipe {

class OpLog {
 public:
  struct Call {
    std::thread::id thread;
    std::string op;        // its name in kernels/backend_ops.inc
    std::string args;      // tensors as dtype[shape] (or "-" undefined), other values exactly
    bool returns = false;  // it returns a value to the host, which waits for the device for it
  };
  OpLog();  // one alive at a time
  ~OpLog();
  OpLog(const OpLog&) = delete;
  OpLog& operator=(const OpLog&) = delete;
  // The calls recorded since the last take(), in the order they were made.
  std::vector<Call> take();

  // The backend calls this thread has made so far (counted whether or not a log is
  // alive): the executor's measured ops per instruction (TimedOp::ops).
  static int64_t calls_on_this_thread();
  static void note(Call call);

 private:
  std::mutex mu_;
  std::vector<Call> calls_;
};

// One backend call as the OpLog and the count see it, for as long as it lives: only the
// outermost on its thread counts and is recorded (at its end), so that the calls an op
// makes inside (a composition of other ops, the copy of a host read) are part of it; it
// returns a value to the host if it or any call inside did. WideningBackend opens one
// per op, Backend::read_step_scalars and write_step_scalars one each.
class OpTimer;

class OpCall {
 public:
  OpCall(const char* op, bool returns);
  ~OpCall();
  OpCall(const OpCall&) = delete;
  OpCall& operator=(const OpCall&) = delete;
  // The outermost call with a log alive: its caller writes the arguments here.
  bool recording() const { return call_ != nullptr; }
  std::string& args() { return call_->args; }

 private:
  bool outermost_ = false;
  OpTimer* timer_ = nullptr;  // the OpTimer that recorded its start (its span: timer_->spans_[span_])
  size_t span_ = 0;
  std::unique_ptr<OpLog::Call> call_;  // made only while a log is alive: nothing else on the op's path
};

// Each op's time, op by op (trace.ops): while an OpTimer is set on a thread
// (OpTimer::Scope), every outermost backend call there (OpCall) records an event on the
// timer's stream before it and one after it. On a GPU the pair times the op's kernels on
// the device; on a CPU, whose ops run on the calling thread, the call itself. The events
// cost the host a record each, so a run that times its ops is one to read, not to time.
class OpTimer {
 public:
  OpTimer(Device device, Stream& stream);
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // One op's calls and milliseconds over the spans resolved.
  struct Total {
    std::string op;  // its name in kernels/backend_ops.inc (or read_step_scalars, write_step_scalars)
    int64_t calls = 0;
    double ms = 0;
  };
  // After the stream has synchronised: the ops recorded since the last resolve, in the
  // order each was first called; their events are reused by the next ones. An op that
  // threw is timed to where it stopped. Nothing when an event could not be recorded
  // (failed(): a device error, which the step reports on its own).
  std::vector<Total> resolve();
  bool failed() const { return failed_; }
  // Drops what was recorded (a step that failed before its resolve).
  void clear();

  // Sets the timer on this thread for the scope's life (nullptr: none), restoring the one before.
  class Scope {
   public:
    explicit Scope(OpTimer* timer);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    OpTimer* outer_;
  };

 private:
  friend class OpCall;
  static OpTimer* on_this_thread();
  // Never throw (OpCall's destructor calls after): a failure marks the timer failed.
  bool before(const char* op, size_t* span) noexcept;
  void after(size_t span) noexcept;
  Event& next_event();

  Device device_;
  Stream& stream_;
  struct Span {
    const char* op;  // a literal: OpCall's names are
    Event* begin;
    Event* end;  // nullptr until the op returns
  };
  std::vector<Span> spans_;
  std::vector<std::unique_ptr<Event>> pool_;  // reused from step to step
  size_t used_ = 0;
  bool failed_ = false;
};

}  // namespace gpipe
