// How boundary activations and their gradients travel between neighbouring stages.
// One interface, several implementations: threads in one process (InProcessTransport,
// here), MPI between CPU processes and NCCL between GPUs (later). The executor only
// sees this interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace gpipe {

// kTiedGradient: a tied weight's gradient between the stages holding its copies,
// numbered by tie. (Validation's forwards send kActivation: evaluation is a
// forward-only program of the same schedule.)
enum class MessageKind { kActivation, kGradient, kTiedGradient };
constexpr int kMessageKinds = 3;

// cell: the model cell the message is for (its receiver), which tells apart the
// messages of one micro-batch between two stages that hold several cells each
// (interleaved schedules).
struct MessageTag {
  MessageKind kind;
  int micro_batch;
  int cell = 0;
};
constexpr int kMaxCells = 256;  // cells a tag can name

std::string tag_str(const MessageTag& tag);  // "activation of micro-batch 3 (cell 2)"

class Transport {
 public:
  virtual ~Transport() = default;
  // Hands `t` to stage `dst`. Does not wait for the receiver; the sender must not
  // write to `t` afterwards.
  virtual void send(int src, int dst, const MessageTag& tag, const Tensor& t) = 0;
  // Returns the matching send's tensor on `device`: once it has arrived, or, on a GPU
  // transport, once its arrival is ordered before everything later queued on the
  // device's compute stream. Throws Aborted once abort() has been called, so a failed
  // stage never leaves its neighbours waiting.
  virtual Tensor recv(int dst, int src, const MessageTag& tag, Device device) = 0;
  // Collective over all stages: every stage calls it once with its value and all get
  // the sum (e.g. squared gradient norms for clipping by the global norm). Throws
  // Aborted once abort() has been called.
  virtual double all_reduce_sum(int stage, double value) = 0;
  // Collective over all stages: stage 0 gets every stage's `values`, in stage order;
  // the others get an empty list. Multi-process runs gather their reports with it.
  virtual std::vector<std::vector<double>> gather_to_first(int stage, const std::vector<double>& values) = 0;
  // Collective over all stages: this stage's clock minus stage 0's, in milliseconds of
  // std::chrono::steady_clock (time since its epoch), so that timings taken in several
  // processes can be put on one clock. Measured with a few ping-pongs between stage 0
  // and each stage, keeping the one with the shortest round trip (the offset is then
  // known to within half of it). Stages of one process, and processes of one kernel boot
  // and time namespace, share one clock: exactly 0, not measured.
  virtual double clock_offset_to_first(int /*stage*/) { return 0.0; }
  // Waits until every send this stage started has left its buffer (a non-blocking
  // transport finishes its sends here; the others return at once), and on a GPU
  // transport until every transfer it queued is done, under its deadline, so that a
  // host wait on the compute stream after it waits for no peer. Called before a stage's
  // host waits for its device: at its gradient norm (on a GPU), at its optimizer step and
  // at the end of its program.
  virtual void flush(int /*stage*/) {}
  // Wakes every waiting receiver with Aborted(why). Idempotent.
  virtual void abort(const std::string& why) = 0;
  // Takes the transport back into use after abort(why), its messages and collectives in
  // flight dropped, when `why` is what it was aborted for and it can (InProcessTransport:
  // stages that captured their step together and stopped it when one of them could not,
  // all of them out of their sends, receives and collectives). Returns whether it did;
  // an abort for another reason stands.
  virtual bool recover(const std::string& /*why*/) { return false; }
  // Whether a send completes only once its receiver has reached it (NCCL), rather than
  // at once (in-process hand-over, MPI_Isend): the schedule checker models which.
  virtual bool sends_wait_for_receiver() const { return false; }
  // The sends and receives a stage posts between these two calls progress together
  // (ncclGroupStart/End), as a rendezvous transport needs for messages in both
  // directions at once. No-ops for the others.
  virtual void begin_group(int /*stage*/) {}
  virtual void end_group(int /*stage*/) {}
  // The training step under way, named when a wait times out.
  virtual void set_step(int64_t /*step*/) {}
};

// The data-parallel replicas of one stage (the same stage in every replica of the
// pipeline): sums over them, for averaging gradients after accumulation and the loss.
class ReplicaGroup {
 public:
  virtual ~ReplicaGroup() = default;
  virtual int size() const = 0;
  // In place, over every replica; all replicas call it with tensors of the same shape.
  virtual void all_reduce_sum(Tensor& t) = 0;
  virtual double all_reduce_sum(double value) = 0;
  // Starts summing `t` in place and returns at once; `t` must stay untouched until
  // wait_all(). Every replica starts the same reductions in the same order. The
  // default is the blocking all_reduce_sum.
  virtual void start_all_reduce_sum(Tensor& t) { all_reduce_sum(t); }
  // Lets started reductions advance (MPI progresses non-blocking collectives only
  // inside MPI calls); called between layers' backward passes.
  virtual void progress() {}
  // Returns once every started reduction has finished.
  virtual void wait_all() {}
  // The training step under way, named when a wait times out.
  virtual void set_step(int64_t /*step*/) {}

  // Sharded optimizer state (ZeRO-1). This replica's place in the group, 0 .. size()-1:
  // the block of a reduce-scatter it keeps and of an all-gather it gives.
  virtual int rank() const;
  // `full` holds size() blocks of block.numel() elements each (contiguous); on return
  // `block` holds the sum over the replicas of their block rank() of `full`
  // (MPI_Reduce_scatter_block, ncclReduceScatter). `full` is left as it was, or used as
  // scratch (unspecified afterwards). The default all-reduces a copy of `full`.
  virtual void reduce_scatter_sum(Tensor& full, Tensor& block);
  // The reverse: block r of `full` gets replica r's `block` (MPI_Allgather,
  // ncclAllGather). The default all-reduces `full` zeroed but for its own block, which
  // is exact: every element is one replica's value plus zeros. `block` may lie inside
  // `full` only as its own block rank() (in place, as MPI_IN_PLACE), nowhere else.
  virtual void all_gather(const Tensor& block, Tensor& full);

  // Whether the tensor collectives above take tensors on `device` where they are,
  // queued in order with that device's compute stream, no host copy and no host wait:
  // every group takes host tensors, an NCCL group its GPU's (NcclReplicaGroup). A
  // tensor group's sums move a tensor on any other device through host memory
  // (layers::GroupCollectives).
  virtual bool takes(Device device) const { return device.is_cpu(); }
  // Waits on the host, under the group's deadline, until every collective it queued on a
  // device is done (an NCCL group's; the others finish theirs before returning): before
  // the host reads a result back in the middle of a step.
  virtual void await_device() {}
};

}  // namespace gpipe
