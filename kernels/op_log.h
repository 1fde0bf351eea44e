// What the backends of backend_for() are asked to do, call by call, while an OpLog is
// alive: each op's name, its tensors' types and shapes, its other arguments' values, and
// the calling thread. A stage whose training step calls the same ops with the same
// arguments at every step has no host value left inside the step: it can be captured
// once and replayed (a CUDA graph, issue 37 item 4). Tests check that, and count a
// step's op calls. Recorded by WideningBackend, which wraps every backend_for() backend.
#pragma once

#include <cstdint>
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

  // WideningBackend's side: counts the call, and whether a log is alive (one atomic
  // load); a call to record.
  static bool counted();
  static void note(Call call);

 private:
  std::mutex mu_;
  std::vector<Call> calls_;
};

}  // namespace gpipe
