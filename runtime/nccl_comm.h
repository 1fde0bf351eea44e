// What NcclTransport and NcclReplicaGroup share: creating and releasing an NCCL
// communicator, events, ordering one stream after another, and the host wait on NCCL
// work that never blocks: it polls the work, the communicators' asynchronous errors
// and pipeline.timeout_s, and when the work cannot finish it aborts the rank's
// communicators and ends the job. Built only with --config=cuda.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/stream.h"

namespace gpipe {
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

std::unique_ptr<EventHandle> new_event(Device device);

// An NCCL communicator over the ranks of `comm` on `device`; collective over comm. Leaves
// `device` current on the calling thread.
ncclComm_t make_nccl_comm(MPI_Comm comm, Device device, const char* owner);
// Without throwing. Destroying waits until every peer is quiescent too, so when they may
// never get there (an exception on its way to MPI_Abort, messages still in flight) the
// communicator is aborted instead.
void release_nccl_comm(ncclComm_t comm, bool abandon, const char* owner) noexcept;
// Throws Error when NCCL found a failure in the background (a peer or the network went
// away).
void check_async_error(ncclComm_t comm, const char* owner);

// Work queued on `waiter` from now on starts after the work queued on `producer` so far;
// the host does not wait.
void order_after(cudaStream_t waiter, cudaStream_t producer, const EventHandle& edge);
void check_compute_stream(const Stream& compute, Device device, const char* owner);

// A communicator a wait watches for asynchronous errors and aborts when it fails, by
// address, so that aborting it leaves nullptr behind (a null slot is skipped). name:
// "the pipeline's communicator".
struct WatchedComm {
  ncclComm_t* comm;
  std::string name;
};

// Aborts every watched communicator (kernels waiting for a peer stop) without throwing.
void abort_comms(const std::vector<WatchedComm>& comms, const char* owner) noexcept;

// What a wait is, for its message if it fails: "rank 3 (stage 1)" waited for `awaited`
// ("the gradient of micro-batch 2 from rank 2 (ncclRecv)") at `step` (< 0: unknown).
struct WaitContext {
  std::string waiter;
  double timeout_s;
  int64_t step;
};

// Polls done() (a cudaEventQuery, say) until it holds, watching `comms` for asynchronous
// errors, with the deadline ctx.timeout_s (poll_device_work). When the work cannot
// finish (an asynchronous error, or the deadline passed): logs what it waited for,
// aborts every watched communicator, and ends the whole job with
// MPI_Abort(MPI_COMM_WORLD, kTimeoutExitCode), so that a supervisor can restart it.
// Returns only once done() held.
void await_nccl_work(const std::vector<WatchedComm>& comms, const std::function<bool()>& done,
                     const WaitContext& ctx, const std::string& awaited);

}  // namespace nccl_detail
}  // namespace gpipe
