// The NCCL helpers of nccl_comm.h. Every CUDA, NCCL and MPI call is checked; destructors
// and the abort path only log.
#include "runtime/nccl_comm.h"

#include <spdlog/spdlog.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "runtime/cuda_check.h"
#include "runtime/cuda_runtime.h"
#include "runtime/deadline.h"
#include "runtime/device_wait.h"
#include "runtime/error.h"
#include "runtime/mpi_check.h"

namespace gpipe {
namespace nccl_detail {

EventHandle::EventHandle(Device device) : device_(device) {
  DeviceGuard guard(device_.index);
  GPIPE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

EventHandle::~EventHandle() {
  if (event_ == nullptr) return;
  const cudaError_t e = cudaEventDestroy(event_);
  if (e != cudaSuccess && !is_teardown(e)) spdlog::warn("cudaEventDestroy failed: {}", cudaGetErrorString(e));
  if (e != cudaSuccess) cudaGetLastError();
}

std::unique_ptr<EventHandle> new_event(Device device) { return std::make_unique<EventHandle>(device); }

ncclComm_t make_nccl_comm(MPI_Comm comm, Device device, const char* owner) {
  GPIPE_CHECK(device.is_cuda(), std::string(owner) + " needs a CUDA device, not " + device.str());
  int rank = 0, size = 1;
  GPIPE_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  GPIPE_MPI_CHECK(MPI_Comm_size(comm, &size));
  // NCCL binds the communicator to the current device. Left set on purpose: this
  // thread's later CUDA calls then default to this rank's GPU instead of creating a
  // context on GPU 0.
  GPIPE_CUDA_CHECK(cudaSetDevice(device.index));
  ncclUniqueId id{};
  if (rank == 0) GPIPE_NCCL_CHECK(ncclGetUniqueId(&id));
  GPIPE_MPI_CHECK(MPI_Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, 0, comm));
  ncclComm_t nccl = nullptr;
  try {
    GPIPE_NCCL_CHECK(ncclCommInitRank(&nccl, size, id, rank));
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "; " + owner + " rank " + std::to_string(rank) + " of " +
                std::to_string(size) + " on " + device.str() +
                ": every rank needs its own GPU (NCCL refuses two ranks on one) and the nodes must reach each "
                "other (see NCCL_SOCKET_IFNAME in the README)");
  }
  return nccl;
}

void release_nccl_comm(ncclComm_t comm, bool abandon, const char* owner) noexcept {
  if (comm == nullptr) return;
  const ncclResult_t r = abandon ? ncclCommAbort(comm) : ncclCommDestroy(comm);
  if (r != ncclSuccess) {
    spdlog::warn("{}: {} failed: {}", owner, abandon ? "ncclCommAbort" : "ncclCommDestroy", ncclGetErrorString(r));
  }
}

void check_async_error(ncclComm_t comm, const char* owner) {
  ncclResult_t state = ncclSuccess;
  GPIPE_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
  if (state != ncclSuccess && state != ncclInProgress) {
    throw Error(error_location(__FILE__, __LINE__) + ": " + owner + ": NCCL reported an asynchronous error: " +
                ncclGetErrorString(state) + " (set NCCL_DEBUG=INFO for details)");
  }
}

void order_after(cudaStream_t waiter, cudaStream_t producer, const EventHandle& edge) {
  GPIPE_CUDA_CHECK(cudaEventRecord(edge.get(), producer));
  GPIPE_CUDA_CHECK(cudaStreamWaitEvent(waiter, edge.get(), 0));
}

void check_compute_stream(const Stream& compute, Device device, const char* owner) {
  GPIPE_CHECK(compute.device() == device && compute.native() != nullptr,
              std::string(owner) + " on " + device.str() + " needs that device's CUDA compute stream, not a stream of " +
                  compute.device().str());
}

void abort_comms(const std::vector<WatchedComm>& comms, const char* owner) noexcept {
  for (const WatchedComm& w : comms) {
    if (w.comm != nullptr) release_nccl_comm(std::exchange(*w.comm, nullptr), /*abandon=*/true, owner);
  }
}

namespace {

// The first watched communicator's asynchronous error, as "<name>: NCCL reported
// <error> (<NCCL's last message>)"; empty while there is none.
std::string async_failure(const std::vector<WatchedComm>& comms) {
  for (const WatchedComm& w : comms) {
    if (w.comm == nullptr || *w.comm == nullptr) continue;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(*w.comm, &state);
    if (r != ncclSuccess) {
      return w.name + ": ncclCommGetAsyncError itself failed: " + ncclGetErrorString(r);
    }
    // ncclInProgress: a non-blocking communicator still working (ours block).
    if (state != ncclSuccess && state != ncclInProgress) {
      const char* last = ncclGetLastError(*w.comm);
      return w.name + ": NCCL reported an asynchronous error: " + ncclGetErrorString(state) +
             (last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string());
    }
  }
  return {};
}

}  // namespace

void await_nccl_work(const std::vector<WatchedComm>& comms, const std::function<bool()>& done,
                     const WaitContext& ctx, const std::string& awaited) {
  const WaitResult r = poll_device_work(done, [&] { return async_failure(comms); }, Deadline(ctx.timeout_s));
  if (r.outcome == WaitOutcome::kDone) return;
  spdlog::error("{}", device_wait_message(r, ctx.waiter, awaited, ctx.timeout_s, ctx.step));
  spdlog::default_logger()->flush();
  // Kernels waiting for a peer that will never answer stop now; then the whole job ends,
  // the other replicas too, with the status a supervisor retries.
  abort_comms(comms, "await_nccl_work");
  MPI_Abort(MPI_COMM_WORLD, kTimeoutExitCode);
  std::abort();  // MPI_Abort does not return
}

}  // namespace nccl_detail
}  // namespace gpipe
