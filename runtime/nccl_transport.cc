// NcclTransport and NcclReplicaGroup: the stream and event protocol is described in
// nccl_transport.h. Every CUDA, NCCL and MPI call is checked; destructors only log.
#include "runtime/nccl_transport.h"

#include <spdlog/spdlog.h>

#include <exception>
#include <set>
#include <string>
#include <utility>

#include "runtime/cuda_check.h"
#include "runtime/cuda_runtime.h"
#include "runtime/error.h"
#include "runtime/mpi_check.h"

namespace gpipe {

namespace {

// An NCCL communicator over the ranks of `comm` on `device`; collective over comm.
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

// Without throwing. Destroying waits until every peer is quiescent too, so when they
// may never get there (an exception on its way to MPI_Abort, messages still in
// flight) the communicator is aborted instead.
void release_nccl_comm(ncclComm_t comm, bool abandon, const char* owner) noexcept {
  if (comm == nullptr) return;
  const ncclResult_t r = abandon ? ncclCommAbort(comm) : ncclCommDestroy(comm);
  if (r != ncclSuccess) {
    spdlog::warn("{}: {} failed: {}", owner, abandon ? "ncclCommAbort" : "ncclCommDestroy", ncclGetErrorString(r));
  }
}

// A failure NCCL found in the background (a peer or the network went away).
void check_async_error(ncclComm_t comm, const char* owner) {
  ncclResult_t state = ncclSuccess;
  GPIPE_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
  if (state != ncclSuccess && state != ncclInProgress) {
    throw Error(error_location(__FILE__, __LINE__) + ": " + owner + ": NCCL reported an asynchronous error: " +
                ncclGetErrorString(state) + " (set NCCL_DEBUG=INFO for details)");
  }
}

// Runs one NCCL call inside ncclGroupStart/End. The group is closed even when the call
// fails, so NCCL's group depth stays balanced for the next call.
template <typename Call>
void in_group(Call call) {
  GPIPE_NCCL_CHECK(ncclGroupStart());
  try {
    call();
  } catch (...) {
    const ncclResult_t r = ncclGroupEnd();
    if (r != ncclSuccess) spdlog::debug("ncclGroupEnd after a failed call: {}", ncclGetErrorString(r));
    throw;
  }
  GPIPE_NCCL_CHECK(ncclGroupEnd());
}

// Work queued on `waiter` from now on starts after the work queued on `producer` so
// far; the host does not wait.
void order_after(cudaStream_t waiter, cudaStream_t producer, const nccl_detail::EventHandle& edge) {
  GPIPE_CUDA_CHECK(cudaEventRecord(edge.get(), producer));
  GPIPE_CUDA_CHECK(cudaStreamWaitEvent(waiter, edge.get(), 0));
}

void check_compute_stream(const Stream& compute, Device device, const char* owner) {
  GPIPE_CHECK(compute.device() == device && compute.native() != nullptr,
              std::string(owner) + " on " + device.str() + " needs that device's CUDA compute stream, not a stream of " +
                  compute.device().str());
}

std::unique_ptr<nccl_detail::EventHandle> new_event(Device device) {
  return std::make_unique<nccl_detail::EventHandle>(device);
}

}  // namespace

int node_local_rank(MPI_Comm comm) {
  int rank = 0;
  GPIPE_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_Comm node = MPI_COMM_NULL;
  GPIPE_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  int local = 0;
  GPIPE_MPI_CHECK(MPI_Comm_rank(node, &local));
  GPIPE_MPI_CHECK(MPI_Comm_free(&node));
  return local;
}

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

}  // namespace nccl_detail

// ---------------------------------------------------------------------------------
// NcclTransport

NcclTransport::NcclTransport(MPI_Comm comm, Device device, Stream& compute)
    : comm_(comm), device_(device), compute_(compute), host_(comm) {
  rank_ = host_.rank();
  size_ = host_.size();
  check_compute_stream(compute, device, "NcclTransport");
  nccl_ = make_nccl_comm(comm, device, "NcclTransport");
  try {
    send_stream_ = make_stream(device_);
    recv_stream_ = make_stream(device_);
    send_ready_ = new_event(device_);
    edge_ = new_event(device_);
    warm_up();
  } catch (...) {
    release_nccl_comm(std::exchange(nccl_, nullptr), /*abandon=*/true, "NcclTransport");
    throw;
  }
}

NcclTransport::~NcclTransport() {
  // Receives queued for messages nobody asked for, or sends not finished: the job is
  // ending without the flush() that waits for them, and a peer may never take part.
  bool in_flight = !early_.empty();  // receives queued for messages nobody asked for
  bool header_in_flight = false;
  for (const auto& p : pending_) {
    int done = 0;
    if (MPI_Test(&p->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = 0;
    header_in_flight = header_in_flight || !done;
    if (!done || (p->sent && cudaEventQuery(p->sent->get()) != cudaSuccess)) in_flight = true;
  }
  cudaGetLastError();  // a NotReady from the queries above is not an error
  if (in_flight) {
    spdlog::warn("NcclTransport: {} sends and {} receives still in flight at shutdown; abandoning them",
                 pending_.size(), early_.size());
  }
  // Aborting stops the NCCL kernels, so the tensors are freed after it safely.
  release_nccl_comm(std::exchange(nccl_, nullptr), aborted_ || in_flight || std::uncaught_exceptions() > 0,
                    "~NcclTransport");
  // MPI may still read a header: leak those entries rather than free them under it.
  if (header_in_flight) {
    for (auto& p : pending_) p.release();
  }
}

void NcclTransport::check_open() const {
  if (!aborted_) return;
  std::lock_guard<std::mutex> lock(abort_mu_);
  throw Aborted(why_);
}

void NcclTransport::check_stage(int stage, const char* what) const {
  if (stage < 0 || stage >= size_) {
    throw Error(std::string(what) + " stage " + std::to_string(stage) + " outside the " + std::to_string(size_) +
                " ranks of the pipeline");
  }
}

void NcclTransport::send(int src, int dst, const MessageTag& tag, const Tensor& t) {
  check_open();
  check_stage(dst, "send to");
  GPIPE_CHECK(src == rank_, "rank " + std::to_string(rank_) + " sending as stage " + std::to_string(src));
  GPIPE_CHECK(t.device() == device_, "NcclTransport on " + device_.str() + " sends tensors on that device; the " +
                                         tag_str(tag) + " is " + t.str());
  GPIPE_CHECK(t.is_contiguous(), "NcclTransport sends contiguous tensors; the " + tag_str(tag) + " is not");
  auto p = std::make_unique<PendingSend>();
  p->header = encode_header(t, tag);
  p->tensor = t;
  const int mtag = host_.mpi_tag(tag);
  DeviceGuard guard(device_.index);
  retire_sends(/*wait=*/false);
  PendingSend& sending = *p;
  pending_.push_back(std::move(p));  // owns the header buffer from the moment MPI has it
  // Non-blocking: MPI_Send may wait for the receiver to post its receive.
  GPIPE_MPI_CHECK(MPI_Isend(sending.header.data(), kMessageHeaderWords, MPI_INT64_T, dst, mtag, comm_,
                            &sending.request));
  if (t.nbytes() == 0) return;  // the receiver skips the data too
  order_after(send_stream(), compute_stream(), *send_ready_);
  post([&] { GPIPE_NCCL_CHECK(ncclSend(t.raw_data(), t.nbytes(), ncclUint8, dst, nccl_, send_stream())); });
  sending.sent = take_event();
  GPIPE_CUDA_CHECK(cudaEventRecord(sending.sent->get(), send_stream()));
}

void NcclTransport::retire_sends(bool wait) {
  check_async_error(nccl_, "NcclTransport");
  while (!pending_.empty()) {
    PendingSend& p = *pending_.front();
    if (wait) {
      GPIPE_MPI_CHECK(MPI_Wait(&p.request, MPI_STATUS_IGNORE));
      if (p.sent) GPIPE_CUDA_CHECK(cudaEventSynchronize(p.sent->get()));
    } else {
      int done = 0;
      GPIPE_MPI_CHECK(MPI_Test(&p.request, &done, MPI_STATUS_IGNORE));
      // The send stream finishes in order: one not done means none after it is.
      if (!done || (p.sent && !cuda_event_done(p.sent->get()))) return;
    }
    if (p.sent) spare_events_.push_back(std::move(p.sent));
    pending_.pop_front();  // drops the tensor: its block may be reused now
  }
}

Tensor NcclTransport::recv(int dst, int src, const MessageTag& tag, Device device) {
  check_open();
  check_stage(src, "receive from");
  GPIPE_CHECK(dst == rank_, "rank " + std::to_string(rank_) + " receiving as stage " + std::to_string(dst));
  GPIPE_CHECK(device == device_,
              "NcclTransport on " + device_.str() + " receives onto that device, not " + device.str());
  const std::pair<int, int> key{src, host_.mpi_tag(tag)};
  DeviceGuard guard(device_.index);
  retire_sends(/*wait=*/false);
  auto it = early_.find(key);
  while (it == early_.end()) {
    receive_next(src, tag);
    it = early_.find(key);
  }
  Arrival a = std::move(it->second);
  early_.erase(it);
  if (a.arrived) {
    // This message's receive only (not the later ones already posted), and the block
    // returns to the receive stream only once the compute work queued from now is done.
    GPIPE_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), a.arrived->get(), 0));
    spare_events_.push_back(std::move(a.arrived));  // the wait took the event's state
    record_stream(a.tensor, compute_);
  }
  return a.tensor;
}

void NcclTransport::receive_next(int src, const MessageTag& wanted) {
  MessageHeader header{};
  MPI_Status status;
  GPIPE_MPI_CHECK(MPI_Recv(header.data(), kMessageHeaderWords, MPI_INT64_T, src, MPI_ANY_TAG, comm_, &status));
  const bool is_wanted = status.MPI_TAG == host_.mpi_tag(wanted);
  const std::string what = is_wanted ? "the " + tag_str(wanted) + " from rank " + std::to_string(src)
                                     : "a message from rank " + std::to_string(src) + " (MPI tag " +
                                           std::to_string(status.MPI_TAG) + ") that came while waiting for the " +
                                           tag_str(wanted);
  int words = 0;
  GPIPE_MPI_CHECK(MPI_Get_count(&status, MPI_INT64_T, &words));
  if (words != kMessageHeaderWords) {
    throw Error("malformed message header for " + what + ": " + std::to_string(words) + " words instead of " +
                std::to_string(kMessageHeaderWords));
  }
  const MessageLayout layout = decode_header(header, what);
  const std::pair<int, int> key{src, status.MPI_TAG};
  if (early_.count(key) != 0) {
    throw Error("rank " + std::to_string(src) + " sent " + what + " twice before the first was received");
  }
  // (the sender's shape) A block of the receive stream: free of any compute work.
  Arrival a;
  a.tensor = Tensor::empty(layout.shape, layout.dtype, device_, recv_stream_.get());
  if (a.tensor.nbytes() > 0) {
    Tensor& t = a.tensor;
    post([&] { GPIPE_NCCL_CHECK(ncclRecv(t.raw_data(), t.nbytes(), ncclUint8, src, nccl_, recv_stream())); });
    a.arrived = take_event();
    GPIPE_CUDA_CHECK(cudaEventRecord(a.arrived->get(), recv_stream()));
  }
  early_.emplace(key, std::move(a));
}

void NcclTransport::post(const std::function<void()>& calls) { in_group(calls); }

std::unique_ptr<nccl_detail::EventHandle> NcclTransport::take_event() {
  if (spare_events_.empty()) return new_event(device_);
  auto e = std::move(spare_events_.back());
  spare_events_.pop_back();
  return e;
}

void NcclTransport::warm_up() {
  std::set<int> peers;
  if (rank_ > 0) peers.insert(rank_ - 1);
  if (rank_ + 1 < size_) peers.insert(rank_ + 1);
  if (size_ > 2 && rank_ == 0) peers.insert(size_ - 1);  // a head tied to the embedding
  if (size_ > 2 && rank_ == size_ - 1) peers.insert(0);
  if (peers.empty()) return;
  DeviceGuard guard(device_.index);
  // (2 peers) words: one sent to and one received from each peer
  Tensor buf = Tensor::empty({2 * static_cast<int64_t>(peers.size())}, DType::kI32, device_, send_stream_.get());
  GPIPE_CUDA_CHECK(cudaMemsetAsync(buf.raw_data(), 0, buf.nbytes(), send_stream()));
  auto* words = buf.data<int32_t>();
  // Both directions of every pair in one group, so neither rank waits for the other.
  post([&] {
    int i = 0;
    for (int p : peers) {
      GPIPE_NCCL_CHECK(ncclSend(words + 2 * i, sizeof(int32_t), ncclUint8, p, nccl_, send_stream()));
      GPIPE_NCCL_CHECK(ncclRecv(words + 2 * i + 1, sizeof(int32_t), ncclUint8, p, nccl_, send_stream()));
      ++i;
    }
  });
  // Once, at start-up: NCCL's connection buffers exist when this returns.
  GPIPE_CUDA_CHECK(cudaStreamSynchronize(send_stream()));
}

void NcclTransport::nccl_before(cudaStream_t other) {
  DeviceGuard guard(device_.index);
  order_after(other, send_stream(), *edge_);
  order_after(other, recv_stream(), *edge_);
}

void NcclTransport::nccl_after(cudaStream_t other) {
  DeviceGuard guard(device_.index);
  order_after(send_stream(), other, *edge_);
  order_after(recv_stream(), other, *edge_);
}

double NcclTransport::all_reduce_sum(int stage, double value) {
  check_open();
  return host_.all_reduce_sum(stage, value);
}

std::vector<std::vector<double>> NcclTransport::gather_to_first(int stage, const std::vector<double>& values) {
  check_open();
  return host_.gather_to_first(stage, values);
}

void NcclTransport::flush(int stage) {
  check_open();
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " flushing as stage " + std::to_string(stage));
  DeviceGuard guard(device_.index);
  retire_sends(/*wait=*/true);
}

void NcclTransport::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (aborted_) return;
    why_ = why;
    aborted_ = true;
  }
  spdlog::error("rank {} ends the job: {}", rank_, why);
  // Kernels waiting for a peer that will never answer stop now instead of holding the
  // GPU until MPI_Abort ends the process.
  release_nccl_comm(std::exchange(nccl_, nullptr), /*abandon=*/true, "NcclTransport::abort");
  MPI_Abort(MPI_COMM_WORLD, 1);  // the whole job: other replicas too
}

// ---------------------------------------------------------------------------------
// NcclReplicaGroup

NcclReplicaGroup::NcclReplicaGroup(MPI_Comm comm, Device device, Stream& compute, NcclTransport* pipeline)
    : device_(device), compute_(compute), pipeline_(pipeline), host_(comm) {
  GPIPE_CHECK(pipeline == nullptr || pipeline->device() == device,
              "NcclReplicaGroup on " + device.str() + " ordered against a transport on " +
                  (pipeline ? pipeline->device().str() : std::string()));
  check_compute_stream(compute, device, "NcclReplicaGroup");
  nccl_ = make_nccl_comm(comm, device, "NcclReplicaGroup");
  try {
    reduce_stream_ = make_stream(device_);
    ready_ = new_event(device_);
    reduced_ = new_event(device_);
  } catch (...) {
    release_nccl_comm(std::exchange(nccl_, nullptr), /*abandon=*/true, "NcclReplicaGroup");
    throw;
  }
}

NcclReplicaGroup::~NcclReplicaGroup() {
  release_nccl_comm(std::exchange(nccl_, nullptr), !in_flight_.empty() || std::uncaught_exceptions() > 0,
                    "~NcclReplicaGroup");
}

void NcclReplicaGroup::enqueue(const Tensor& t) {
  GPIPE_CHECK(t.device() == device_, "NcclReplicaGroup on " + device_.str() + " reduces tensors on that device, not " +
                                         t.str());
  GPIPE_CHECK(t.is_contiguous(), "NcclReplicaGroup reduces contiguous tensors");
  ncclDataType_t type = ncclFloat32;
  if (t.dtype() == DType::kF64) {
    type = ncclFloat64;
  } else if (t.dtype() != DType::kF32) {
    throw Error("NcclReplicaGroup: cannot reduce " + t.str() + "; float32 and float64 only");
  }
  check_async_error(nccl_, "NcclReplicaGroup");
  if (t.numel() == 0) return;
  // After the pipeline's sends and receives queued so far, and before those queued from
  // now: the two communicators never have kernels on this GPU at once.
  if (pipeline_ != nullptr) pipeline_->nccl_before(reduce_stream());
  // In place, so the reduction must not start before the kernels that wrote `t`.
  order_after(reduce_stream(), compute_stream(), *ready_);
  GPIPE_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()), type, ncclSum, nccl_,
                                 reduce_stream()));
  if (pipeline_ != nullptr) pipeline_->nccl_after(reduce_stream());
}

void NcclReplicaGroup::all_reduce_sum(Tensor& t) {
  if (t.device().is_cpu()) {
    host_.all_reduce_sum(t);
    return;
  }
  DeviceGuard guard(device_.index);
  enqueue(t);
  order_after(compute_stream(), reduce_stream(), *reduced_);
}

double NcclReplicaGroup::all_reduce_sum(double value) { return host_.all_reduce_sum(value); }

void NcclReplicaGroup::start_all_reduce_sum(Tensor& t) {
  if (t.device().is_cpu()) {
    host_.start_all_reduce_sum(t);
    return;
  }
  DeviceGuard guard(device_.index);
  enqueue(t);
  in_flight_.push_back(t);  // its block must not be recycled before the compute stream waits
}

void NcclReplicaGroup::progress() {
  host_.progress();
  check_async_error(nccl_, "NcclReplicaGroup");  // the GPU needs no help to progress
}

void NcclReplicaGroup::wait_all() {
  host_.wait_all();
  if (in_flight_.empty()) return;
  DeviceGuard guard(device_.index);
  order_after(compute_stream(), reduce_stream(), *reduced_);
  in_flight_.clear();
}

}  // namespace gpipe
