// pipeline.capture with K > 1 stages that this process runs on one device
// (Executor::CaptureGroup): their training step captured together and replayed with one
// launch (a CUDA graph on a GPU; the calls themselves on the CPU).
//
// The stages share the device's backend and its stream and take turns on it, so the ops
// they queue during a step are one sequence on that stream, in an order that already
// respects what each hands the next (a receive queues its work after the send's). The
// capture keeps that sequence:
//
//   group_begin   every stage has written its step's scalars and fixed buffers (outside
//                 the capture); stage 0 begins the capture, the others join it
//                 (Backend::join_capture: on a GPU their blocks come from its pool)
//   ...programs   as op by op; NORM sums on the device (sum_group_norm), no stage waits
//   group_end     every stage out of its program; stage 0 ends the capture and replays it
//                 once for the step; a stage whose part could not be captured stopped the
//                 others (transport abort, taken back with recover) and every stage runs
//                 the step again op by op, never capturing again
//   replay_group  a later step: scalars and buffers written by each stage, stage 0's one
//                 replay, each stage's wait, scalars and times read back
//
// Every stage's thread arrives at the group's rounds (CaptureGroup::arrive) at the same
// points, whatever happens in between, so that none waits for a stage that is not coming.
//
// On the CPU stage 0's thread runs every stage's calls at a replay, their FrozenWeights
// windows (Executor::set_frozen) included: the windows of the stages still computing stay
// open on it while another stage's optimizer step writes its parameters. That is safe
// because no call after a stage's optimizer step in the same step reads that stage's
// weights, and every window is closed at the replay's end (or reset on its failure), which
// frees the packed copies before the next step.
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/op_log.h"
#include "kernels/step_scalars.h"
#include "pipeline/executor/executor.h"
#include "pipeline/executor/stage_runtime.h"
#include "runtime/error.h"
#include "runtime/heartbeat.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

void Executor::group_begin(StageRuntime& rt, const std::exception_ptr& failed) {
  CaptureGroup& g = *capture_group_;
  const int k = rt.index;
  std::string failure;
  if (failed) {
    try {
      std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      failure = "stage " + std::to_string(k) + " failed: " + e.what();
    }
  }
  // Every stage's scalars and buffers are written: from here on nothing runs.
  const std::string first = g.arrive(failure);
  if (k == 0) {
    g.ops.reset();
    g.capture_failure.clear();
    if (first.empty()) {
      try {
        rt.backend->begin_capture();
      } catch (const std::exception& e) {  // any failure: no capture (an error that stays shows op by op)
        rt.backend->abort_capture();
        g.capture_failure = e.what();
        if (g.capture_failure.empty()) g.capture_failure = "begin_capture failed";
      }
    }
  }
  g.arrive();  // stage 0 began (or could not)
  if (!first.empty()) {  // a stage failed before the capture: the step fails, nothing began
    rt.capturing = false;
    if (failed) std::rethrow_exception(failed);
    throw Aborted(first);
  }
  if (!g.capture_failure.empty()) {
    // Nothing was captured: this step and every later one run op by op.
    if (k == 0) {
      spdlog::warn("stages 0 to {}: their training step could not be captured ({}); the run goes on without capture",
                   schedule_.num_stages - 1, g.capture_failure);
    }
    rt.capturing = false;
    rt.capture_failed = true;
    return;
  }
  if (k != 0) rt.backend->join_capture();  // a CaptureError stops the others (run_program)
}

bool Executor::group_end(StageRuntime& rt, const std::string& failure, int64_t capture_calls0, int64_t* replayed) {
  CaptureGroup& g = *capture_group_;
  const int k = rt.index;
  const int64_t captured_calls = OpLog::calls_on_this_thread() - capture_calls0;
  if (k != 0) rt.backend->leave_capture();
  const std::string first = g.arrive(failure);  // every stage is out of its program
  if (k == 0) {
    g.capture_failure = first;
    g.ops.reset();
    if (first.empty()) {
      try {
        g.ops = rt.backend->end_capture();
        g.nodes = g.ops->nodes();
      } catch (const std::exception& e) {  // any failure: the step runs again op by op
        g.ops.reset();
        rt.backend->abort_capture();
        g.capture_failure = e.what();
        if (g.capture_failure.empty()) g.capture_failure = "end_capture failed";
      }
    } else {
      rt.backend->abort_capture();  // nothing captured has run
      transport_.recover(kGroupCaptureStopped);  // an abort for anything else stands
    }
  }
  g.arrive();  // stage 0's verdict
  rt.capturing = false;
  if (!g.capture_failure.empty()) {
    rt.capture_error = g.capture_failure;  // run_stage runs the step again, op by op
    return false;
  }
  keep_capture(rt, captured_calls);
  rt.captured->nodes = captured_calls;  // this stage's share of the one capture
  rt.trace.captured_nodes = rt.captured->nodes;
  std::string replay_failure;
  if (k == 0) {
    rt.captured->ops = std::move(g.ops);
    spdlog::info("stages 0 to {}: captured their training step on {} together ({} ops); later steps replay it",
                 schedule_.num_stages - 1, rt.device.str(), g.nodes);
    const int64_t replay0 = OpLog::calls_on_this_thread();
    try {
      rt.captured->ops->replay();
    } catch (const std::exception& e) {
      // The step's ops ran (on the CPU) up to one that failed: a failure of the step. A
      // FrozenWeights window a stage's replayed ops opened was opened on this thread.
      for (auto& other : runtimes_) other->frozen.reset();
      replay_failure = blame_replay(*rt.captured->ops, e);
    }
    *replayed = OpLog::calls_on_this_thread() - replay0;  // on the CPU, each captured op called again
  }
  const std::string after = g.arrive(replay_failure);  // the replay queued (run, on the CPU)
  if (!after.empty()) {
    // The stage whose call failed fails with its error (run_program's failure); the others stop.
    if (rt.error) std::rethrow_exception(std::exchange(rt.error, nullptr));
    throw Aborted(after);
  }
  return true;
}

// A replay of the stages captured together that threw on stage 0's thread (the CPU runs
// the calls there): the error goes to the stage whose call failed (CapturedOps::failed_stage;
// stage 0 where not known), as the step op by op would have reported it, and the others stop
// with the returned reason. The other stages wait at their round meanwhile.
std::string Executor::blame_replay(const CapturedOps& ops, const std::exception& e) {
  const int who = ops.failed_stage() >= 0 && ops.failed_stage() < schedule_.num_stages ? ops.failed_stage() : 0;
  StageRuntime& failed = *runtimes_[static_cast<size_t>(who)];
  failed.error = std::current_exception();
  failed.error_text = e.what();
  return "stage " + std::to_string(who) + " failed in the replay of the step captured together: " + e.what();
}

// What a replay needs of the capture just ended (rt.captured, but its ops and nodes): this
// stage's trace, its clock's spans (their events the capture's), its losses, and what its
// thread called inside the capture (`captured_calls`) outside its instructions.
void Executor::keep_capture(StageRuntime& rt, int64_t captured_calls) {
  auto cap = std::make_unique<StageRuntime::Captured>();
  cap->trace = rt.trace;
  cap->spans = rt.clock->spans();
  rt.clock->keep_captured_events();
  for (const MicroBatch& mb : rt.mbs[schedule_.chunk_of_cell(schedule_.num_cells() - 1)]) cap->losses.push_back(mb.loss);
  int64_t instructions = 0;
  for (const TimedOp& op : rt.trace.ops) {
    if (!is_tensor_collective(op.op)) instructions += op.ops;
  }
  cap->other_ops_inside = captured_calls - instructions;
  rt.captured = std::move(cap);
}

// A step's instructions timed by the device (the clock's spans). In a replay of stages
// captured together (`replayed_together`) a send or receive, which the host does not do
// there (the stream orders the hand-over), takes no time, at the end of the stage's
// instruction before it (or the start of the first one after it); elsewhere it keeps its
// host times.
void Executor::place_device_times(StageTrace& trace, const std::vector<OpClock::Span>& spans, bool replayed_together) {
  std::vector<char> clocked(trace.ops.size(), 0);
  for (const OpClock::Span& span : spans) {
    trace.ops[span.index].start_ms = span.start_ms;
    trace.ops[span.index].end_ms = span.end_ms;
    clocked[span.index] = 1;
  }
  if (!replayed_together) return;
  double at = -1;
  for (size_t i = 0; i < trace.ops.size() && at < 0; ++i) {
    if (clocked[i]) at = trace.ops[i].start_ms;
  }
  if (at < 0) return;  // nothing timed (a step that failed half-way)
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (clocked[i]) {
      at = trace.ops[i].end_ms;
    } else {
      trace.ops[i].start_ms = trace.ops[i].end_ms = at;
    }
  }
}

void Executor::replay_group(StageRuntime& rt) {
  CaptureGroup& g = *capture_group_;
  const int k = rt.index;
  StageRuntime::Captured& cap = *rt.captured;
  const int64_t calls0 = begin_replay(rt);
  auto fail = [&](const std::exception& e) {
    rt.error = std::current_exception();
    rt.error_text = e.what();
    return "stage " + std::to_string(k) + " failed: " + rt.error_text;
  };
  std::string failure;
  try {
    auto turn = device_turn(k);
    load_replay(rt);
  } catch (const std::exception& e) {
    failure = fail(e);
  }
  const std::string before = g.arrive(failure);  // every stage's scalars and buffers written
  int64_t replayed = 0;
  if (k == 0 && before.empty()) {
    const int64_t replay0 = OpLog::calls_on_this_thread();
    try {
      cap.ops->replay();
    } catch (const std::exception& e) {
      for (auto& other : runtimes_) other->frozen.reset();  // opened on this thread (group_end)
      failure = blame_replay(*cap.ops, e);
    }
    replayed = OpLog::calls_on_this_thread() - replay0;
  }
  const std::string after = g.arrive(k == 0 ? failure : std::string());  // the replay queued (run, on the CPU)
  const std::string& why = !before.empty() ? before : after;
  if (!why.empty()) {
    if (!rt.error) {  // stopped by another stage's failure
      rt.error = std::make_exception_ptr(Aborted(why));
      rt.error_is_abort = true;
      rt.error_text = why;
    }
    return;
  }
  try {
    {
      // The stages share the backend, whose waits read and clear its checks: one at a time.
      auto turn = device_turn(k);
      rt.backend->synchronize();
      read_step_scalars(rt);
    }
    end_replay(rt, calls0, replayed);
  } catch (const std::exception& e) {
    fail(e);
  }
}

// NORM of stages captured together: each stage's squares into its own norm_part, then,
// once every stage has queued that (the transport's all-reduce as the host's barrier),
// each stage's norm slot the parts' sum in stage order, as the host sums them otherwise
// (InProcessTransport::all_reduce_sum): the same bits, with nothing read back.
void Executor::sum_group_norm(StageRuntime& rt, const std::vector<Tensor>& grads) {
  const int k = rt.index;
  {
    auto turn = device_turn(k);
    const size_t slot = rt.trace.ops.size() - 1;  // run_program's, reserved for this instruction
    rt.clock->before(rt.backend->stream(), slot);
    rt.backend->sum_squares_all_to(grads, rt.norm_part);
    rt.clock->after(rt.backend->stream(), slot);
  }
  transport_.all_reduce_sum(k, 0.0);
  auto turn = device_turn(k);
  Tensor total = rt.scalars.narrow_rows(kStepNormSquared, 1);
  for (int j = 0; j < schedule_.num_stages; ++j) {
    const Tensor part = runtimes_[static_cast<size_t>(j)]->norm_part.narrow_rows(kStepNormSquared, 1);
    if (j == 0) {
      rt.backend->copy(part, total);
    } else {
      rt.backend->axpy(1.0, part, total);
    }
  }
}

}  // namespace pipeline
}  // namespace gpipe
