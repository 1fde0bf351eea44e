// Transport between GPU stages in different processes: NCCL moves each tensor GPU to
// GPU, MPI carries its small header (runtime/message_header.h), so shapes travel with
// the data. One stage per rank (stage k = rank k, as MpiTransport), one GPU per rank.
// Built only with --config=cuda.
//
// Nothing here makes the host wait for the GPU while a step runs. Two communication
// streams are ordered against the stage's compute stream with events (● record, ◆ wait):
//
//   compute ──F(m)──●──────F(m+1)─────────────────◆──F(m')──▶
//   send             ◆──ncclSend(m)──● sent        │          m kept alive until `sent`
//   recv    ──ncclRecv(m')───────────● arrived(m') ┘          no wait for compute
//
// send: the send stream waits for the work that produced the tensor, and the tensor
// stays in a pending list until its `sent` event has completed (polled on later calls,
// waited for in flush()), so its block is not recycled while NCCL still reads it.
// recv: the buffer is a block of the receive stream's own (the allocator reuses a
// block for another stream only after an event, runtime/block_pool.h), so the receive
// does not wait for the compute work queued before it (unless an attached group's
// collective was queued in between: see nccl_before/after, which chain every NCCL
// operation of this GPU, so a receive then follows the compute that collective waited
// for). Each receive records its own
// `arrived` event; the compute stream waits for it when the tensor is asked for, and
// the block is marked as used by the compute stream (record_stream), so it returns to
// the receive stream only once compute is done with it.
//
// Groups. An NCCL send blocks its stream until the peer receives, and NCCL runs one
// communicator's operations one after another, so two neighbours that each send before
// they receive (1F1B's steady state: stage k sends an activation and receives a
// gradient while stage k+1 sends that gradient and receives the activation) deadlock
// unless each puts its sends and receives in one ncclGroupStart/End, whose operations
// progress together (NCCL user guide, "Point-to-point communication"). So
// sends_wait_for_receiver() is true, the schedule is lowered and checked for a
// rendezvous transport (pipeline/schedule/schedule.h, CommModel::kRendezvous), and the executor
// brackets each run of consecutive sends and receives with begin_group/end_group. Inside
// a group NCCL only enqueues its operations at ncclGroupEnd, so:
//   - send() and recv() post their ncclSend/ncclRecv into the open group; the `sent` and
//     `arrived` events are recorded in end_group(), after ncclGroupEnd, and a tensor
//     recv() returned inside the group has the compute stream wait for its `arrived`
//     event there too, so no compute uses it before the group's transfers. The executor
//     runs no compute between begin_group and end_group.
//   - the shape header still travels by MPI: recv() waits on the host for the peer's
//     header before it can post the ncclRecv. That wait has buffered semantics (the
//     peer's MPI_Isend of the header is posted when its host reaches its send, whatever
//     its GPU does), so it cannot deadlock a schedule the checker's buffered model
//     accepts, and the host still never waits for a GPU.
//   - NCCL makes every stream of a group wait for all of them (one kernel), so a grouped
//     receive starts only once the work producing the grouped sends has finished.
//   - sent tensors stay in the pending list until their events, recorded after the
//     group's end, have completed.
// Outside a group (tied gradients, validation) each call is a group of its own.
//
// Deadlines. The host does wait for NCCL work in flush() (called by the executor before
// the stage's own host waits on its device: at the gradient norm, at the optimizer step
// and at the end of its program, so that the backend's synchronize() after it waits only
// for compute that no longer depends on a peer), in the start-up warm-up, and for the
// attached groups' collectives. None of these blocks: each polls its event and
// ncclCommGetAsyncError on the pipeline's and the attached groups' communicators until
// the work is done or pipeline.timeout_s passes (runtime/nccl_comm.h). A wait that
// cannot finish logs what it waited for (the message, its peer, the step), aborts every
// one of those communicators (ncclCommAbort: kernels waiting for a peer stop) and ends
// the job with MPI_Abort(kTimeoutExitCode). The MPI header waits use mpi_await, with the
// same deadline.
//
// NCCL connects two ranks lazily, on their first send/receive, and allocates its
// buffers then; the constructor exchanges a few bytes both ways with every peer this
// stage can talk to (its neighbours, and the first and last stages, which a tied
// embedding and head join), so that happens before training holds any activation.
//
// NCCL pairs the sends and receives of two ranks in the order they were posted, not by
// tag. recv() therefore takes the headers from `src` in arrival order and posts their
// receives in that order; a message that arrives before its recv() waits, already on
// the GPU, until it is asked for. Messages are still matched by kind and micro-batch.
// Like MpiTransport, one thread at a time calls it (MPI_THREAD_SERIALIZED), and a group
// is begun and ended by the same thread (NCCL's group state is per thread).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/message_header.h"
#include "runtime/mpi_transport.h"
#include "runtime/nccl_comm.h"
#include "runtime/stream.h"
#include "runtime/transport.h"

namespace gpipe {

class NcclReplicaGroup;

// This process's rank among the processes of `comm` on its node (MPI_COMM_TYPE_SHARED),
// whatever the launcher: the usual way to give each process its own GPU. Collective.
int node_local_rank(MPI_Comm comm);

class NcclTransport : public Transport {
 public:
  // comm: the pipeline's ranks, rank k holding stage k (not owned; MPI initialised).
  // device: this rank's GPU. compute: the stream its stage's kernels run on (the CUDA
  // backend's, backend_for(device).stream()); must outlive the transport. timeout_s:
  // the deadline of every wait (pipeline.timeout_s; 0 = none). Creates the NCCL
  // communicator (collective over comm) and makes `device` the calling thread's
  // current device.
  NcclTransport(MPI_Comm comm, Device device, Stream& compute, double timeout_s = kDefaultTimeoutS);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  Device device() const { return device_; }

  void send(int src, int dst, const MessageTag& tag, const Tensor& t) override;
  // Returns once the receive is queued (inside a group: posted into it); the compute
  // stream waits for it (inside a group: from end_group on).
  Tensor recv(int dst, int src, const MessageTag& tag, Device device) override;
  // Host values over MPI (they are scalars; a GPU round trip would cost more).
  double all_reduce_sum(int stage, double value) override;
  std::vector<std::vector<double>> gather_to_first(int stage, const std::vector<double>& values) override;
  double clock_offset_to_first(int stage) override { return host_.clock_offset_to_first(stage); }
  // Waits, under the deadline, until every send has left its buffer, every receive
  // posted has arrived and the attached groups' collectives (the replicas', the tensor
  // group's) are done: the compute stream then depends on no peer. Not inside a group.
  void flush(int stage) override;
  // Logs, aborts the NCCL communicators (the attached groups' too: kernels waiting for a
  // peer stop), then ends the whole job with MPI_Abort, as MpiTransport does, so no rank
  // waits forever.
  void abort(const std::string& why) override;
  bool sends_wait_for_receiver() const override { return true; }
  // ncclGroupStart/End around the sends and receives in between (see above).
  void begin_group(int stage) override;
  void end_group(int stage) override;
  void set_step(int64_t step) override;

  // Ordering against the other NCCL communicators on this GPU (the attached
  // NcclReplicaGroups': the replicas', the tensor group's): two communicators' kernels in
  // flight at once, in no fixed order, can deadlock (NCCL user guide, "Using multiple
  // NCCL communicators concurrently"). So the other stream waits for the sends and
  // receives queued here so far (before), and the sends and receives queued here from
  // now on wait for the other stream's work so far (after). Called around each of a
  // group's collectives, in program order, the same on every rank: a group's
  // collective waits for the send stream, which waited for every earlier collective of
  // any group, so all of this GPU's NCCL work forms one chain.
  void nccl_before(cudaStream_t other);
  void nccl_after(cudaStream_t other);

  // The MPI tag a message's header travels with (tests inject headers with it).
  int mpi_tag(const MessageTag& tag) const { return host_.mpi_tag(tag); }
  // Sends not yet known to have left their buffers.
  size_t sends_in_flight() const { return pending_.size(); }
  // Receives posted and not yet known to have arrived and been handed out.
  size_t receives_in_flight() const { return receiving_.size(); }

 private:
  friend class NcclReplicaGroup;  // attaches itself; its waits watch every communicator here

  struct PendingSend {
    Tensor tensor;                                   // alive until NCCL has read it
    MessageHeader header{};                          // alive until MPI has sent it
    MPI_Request request = MPI_REQUEST_NULL;          // the header's MPI_Isend
    std::unique_ptr<nccl_detail::EventHandle> sent;  // after its ncclSend; none for 0 bytes
    bool recorded = false;                           // `sent` recorded (inside a group: at its end)
    std::string what;                                // "the activation of micro-batch 3 to rank 1"
  };
  struct PostedRecv {
    std::unique_ptr<nccl_detail::EventHandle> arrived;  // after its ncclRecv
    bool recorded = false;                              // `arrived` recorded (inside a group: at its end)
    bool taken = false;                                 // handed out by recv()
    std::string what;                                   // "the gradient of micro-batch 2 from rank 2"
  };
  struct Arrival {
    Tensor tensor;                  // a block of the receive stream
    PostedRecv* posted = nullptr;   // in receiving_; none for 0 bytes
  };

  void check_open() const;  // throws Aborted after abort()
  void check_stage(int stage, const char* what) const;
  // Forgets the sends and receives that have completed (with wait: waits for all of
  // them under the deadline first; a receive nobody asked for is waited for but kept).
  void retire_sends(bool wait);
  void retire_receives(bool wait);
  // Receives the next header `src` sent and queues its data's receive into early_.
  void receive_next(int src, const MessageTag& wanted);
  // NCCL calls: inside the open group, or in a group of their own.
  void post(const std::function<void()>& calls);
  void record_sent(PendingSend& p);
  void record_arrived(PostedRecv& r);
  // A few bytes both ways with each peer this stage talks to (see above).
  void warm_up();
  std::unique_ptr<nccl_detail::EventHandle> take_event();
  // The communicators a wait watches and aborts: this one and the attached groups'.
  std::vector<nccl_detail::WatchedComm> watched();
  nccl_detail::WaitContext wait_context() const;
  // await_nccl_work for `done`, naming `awaited` if it cannot finish.
  void await(const std::function<bool()>& done, const std::string& awaited);
  cudaStream_t compute_stream() const { return static_cast<cudaStream_t>(compute_.native()); }
  cudaStream_t send_stream() const { return static_cast<cudaStream_t>(send_stream_->native()); }
  cudaStream_t recv_stream() const { return static_cast<cudaStream_t>(recv_stream_->native()); }

  MPI_Comm comm_;
  Device device_;
  Stream& compute_;
  MpiTransport host_;  // the tags and the host-side collectives
  double timeout_s_;
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  int64_t step_ = -1;
  ncclComm_t nccl_ = nullptr;
  std::vector<NcclReplicaGroup*> groups_;  // attached: the stage's replicas, its tensor group
  std::unique_ptr<Stream> send_stream_, recv_stream_;
  // Reused for each "this stream after that one" edge: a wait takes the event's state
  // at the time of the call, so re-recording it later is safe.
  std::unique_ptr<nccl_detail::EventHandle> send_ready_, edge_;
  std::vector<std::unique_ptr<nccl_detail::EventHandle>> spare_events_;
  std::deque<std::unique_ptr<PendingSend>> pending_;    // in posting order
  std::deque<std::unique_ptr<PostedRecv>> receiving_;   // in posting order
  std::map<std::pair<int, int>, Arrival> early_;  // (src, MPI tag) -> queued, not yet asked for
  // The open group: its operations' events are recorded at its end, and the compute
  // stream waits then for the receives handed out inside it.
  bool in_group_ = false;
  std::vector<PendingSend*> group_sends_;
  std::vector<PostedRecv*> group_recvs_, group_taken_;
  mutable std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::string why_;
};

}  // namespace gpipe
