// Transport between GPU stages in different processes: NCCL moves each tensor GPU to
// GPU, MPI carries its small header (runtime/message_header.h), so shapes travel with
// the data. One stage per rank (stage k = rank k, as MpiTransport), one GPU per rank.
// Built only with --config=cuda.
//
// Nothing here makes the host wait for the GPU. Two communication streams are ordered
// against the stage's compute stream with events (● record, ◆ wait):
//
//   compute ──F(m)──●─────────────────────────────◆──F(m')──▶
//   send             ◆──ncclSend(m)──● sent        │          m kept alive until `sent`
//   recv    ◆──ncclRecv(m')──────────● received ───┘
//           └ after the compute work queued so far (the buffer may be a recycled block)
//
// send: the send stream waits for the work that produced the tensor, and the tensor
// stays in a pending list until its `sent` event has completed (polled on later calls,
// waited for in flush()), so its block is not recycled while NCCL still reads it.
// recv: the buffer comes from the caching allocator, whose blocks are only safe on the
// stream that last used them, so the recv stream first waits for the compute stream;
// then the compute stream waits for the receive, so everything the caller queues after
// (including the block's next use once the tensor is dropped) sees the data.
//
// NCCL pairs the sends and receives of two ranks in the order they were posted, not by
// tag. recv() therefore takes the headers from `src` in arrival order and posts their
// receives in that order; a message that arrives before its recv() waits, already on
// the GPU, until it is asked for. Messages are still matched by kind and micro-batch.
// NCCL sends block their stream until the peer receives: a schedule must not rely on
// buffered sends (GPipe does not: between neighbours, messages flow one way per phase).
// Like MpiTransport, one thread at a time calls it (MPI_THREAD_SERIALIZED).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/message_header.h"
#include "runtime/mpi_transport.h"
#include "runtime/stream.h"
#include "runtime/transport.h"

namespace gpipe {

// This process's rank among the processes of `comm` on its node (MPI_COMM_TYPE_SHARED),
// whatever the launcher: the usual way to give each process its own GPU. Collective.
int node_local_rank(MPI_Comm comm);

namespace nccl_detail {
// A cudaEvent_t without timing (cheaper to record and query), destroyed with its owner;
// destruction only logs.
class EventHandle {
 public:
  explicit EventHandle(Device device);
  ~EventHandle();
  EventHandle(const EventHandle&) = delete;
  EventHandle& operator=(const EventHandle&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  Device device_;
  cudaEvent_t event_ = nullptr;
};
}  // namespace nccl_detail

class NcclTransport : public Transport {
 public:
  // comm: the pipeline's ranks, rank k holding stage k (not owned; MPI initialised).
  // device: this rank's GPU. compute: the stream its stage's kernels run on (the CUDA
  // backend's, backend_for(device).stream()); must outlive the transport. Creates the
  // NCCL communicator (collective over comm) and makes `device` the calling thread's
  // current device.
  NcclTransport(MPI_Comm comm, Device device, Stream& compute);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  Device device() const { return device_; }

  void send(int src, int dst, const MessageTag& tag, const Tensor& t) override;
  // Returns once the receive is queued; the compute stream waits for it.
  Tensor recv(int dst, int src, const MessageTag& tag, Device device) override;
  // Host values over MPI (they are scalars; a GPU round trip would cost more).
  double all_reduce_sum(int stage, double value) override;
  std::vector<std::vector<double>> gather_to_first(int stage, const std::vector<double>& values) override;
  double clock_offset_to_first(int stage) override { return host_.clock_offset_to_first(stage); }
  // Waits until every send has left its buffer.
  void flush(int stage) override;
  // Logs, aborts the NCCL communicator (kernels waiting for a peer stop), then ends the
  // whole job with MPI_Abort, as MpiTransport does, so no rank waits forever.
  void abort(const std::string& why) override;

  // The MPI tag a message's header travels with (tests inject headers with it).
  int mpi_tag(const MessageTag& tag) const { return host_.mpi_tag(tag); }
  // Sends not yet known to have left their buffers.
  size_t sends_in_flight() const { return pending_.size(); }

 private:
  struct PendingSend {
    Tensor tensor;                                  // alive until NCCL has read it
    MessageHeader header{};                         // alive until MPI has sent it
    MPI_Request request = MPI_REQUEST_NULL;         // the header's MPI_Isend
    std::unique_ptr<nccl_detail::EventHandle> sent;  // recorded after ncclSend; none for 0 bytes
  };
  void check_open() const;  // throws Aborted after abort()
  void check_stage(int stage, const char* what) const;
  // Forgets the sends that have completed (all of them, waiting, with wait).
  void retire_sends(bool wait);
  // Receives the next header `src` sent and queues its data's receive into early_.
  void receive_next(int src, const MessageTag& wanted);
  cudaStream_t compute_stream() const { return static_cast<cudaStream_t>(compute_.native()); }
  cudaStream_t send_stream() const { return static_cast<cudaStream_t>(send_stream_->native()); }
  cudaStream_t recv_stream() const { return static_cast<cudaStream_t>(recv_stream_->native()); }

  MPI_Comm comm_;
  Device device_;
  Stream& compute_;
  MpiTransport host_;  // the tags and the host-side collectives
  int rank_ = 0, size_ = 1;
  ncclComm_t nccl_ = nullptr;
  std::unique_ptr<Stream> send_stream_, recv_stream_;
  // Reused for each "this stream after that one" edge: a wait takes the event's state
  // at the time of the call, so re-recording it later is safe.
  std::unique_ptr<nccl_detail::EventHandle> send_ready_, recv_ready_, received_;
  std::vector<std::unique_ptr<nccl_detail::EventHandle>> spare_events_;
  std::deque<std::unique_ptr<PendingSend>> pending_;  // in posting order
  std::map<std::pair<int, int>, Tensor> early_;       // (src, MPI tag) -> queued, not yet asked for
  mutable std::mutex abort_mu_;
  std::atomic<bool> aborted_{false};
  std::string why_;
};

// The replicas of a stage on GPUs: ncclAllReduce of device tensors on a reduction
// stream ordered after the compute stream, and the compute stream ordered after the
// result (no host wait). Host tensors and scalars go through MPI, as MpiReplicaGroup.
class NcclReplicaGroup : public ReplicaGroup {
 public:
  // comm: the stage's replicas (not owned). device, compute: as NcclTransport's.
  NcclReplicaGroup(MPI_Comm comm, Device device, Stream& compute);
  ~NcclReplicaGroup() override;
  NcclReplicaGroup(const NcclReplicaGroup&) = delete;
  NcclReplicaGroup& operator=(const NcclReplicaGroup&) = delete;

  int size() const override { return host_.size(); }
  // In place; float32 or float64. On the device it returns once queued, with the
  // compute stream waiting for the result.
  void all_reduce_sum(Tensor& t) override;
  double all_reduce_sum(double value) override;
  // On the device: queued at once, the compute stream waits only in wait_all().
  void start_all_reduce_sum(Tensor& t) override;
  void progress() override;
  void wait_all() override;

 private:
  void enqueue(const Tensor& t);
  cudaStream_t compute_stream() const { return static_cast<cudaStream_t>(compute_.native()); }
  cudaStream_t reduce_stream() const { return static_cast<cudaStream_t>(reduce_stream_->native()); }

  Device device_;
  Stream& compute_;
  MpiReplicaGroup host_;
  ncclComm_t nccl_ = nullptr;
  std::unique_ptr<Stream> reduce_stream_;
  std::unique_ptr<nccl_detail::EventHandle> ready_, reduced_;
  std::vector<Tensor> in_flight_;  // started on the device, not yet waited for
};

}  // namespace gpipe
