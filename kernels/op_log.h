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
  std::unique_ptr<OpLog::Call> call_;  // made only while a log is alive: nothing else on the op's path
};

}  // namespace gpipe
