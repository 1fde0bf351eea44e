// NcclTransport: the stream, event, group and deadline protocol is described in
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
#include "runtime/nccl_replica_group.h"

namespace gpipe {

using nccl_detail::new_event;
using nccl_detail::order_after;

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

NcclTransport::NcclTransport(MPI_Comm comm, Device device, Stream& compute, double timeout_s)
    : comm_(comm), device_(device), compute_(compute), host_(comm, timeout_s), timeout_s_(timeout_s) {
  rank_ = host_.rank();
  size_ = host_.size();
  GPIPE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  nccl_detail::check_compute_stream(compute, device, "NcclTransport");
  nccl_ = nccl_detail::make_nccl_comm(comm, device, "NcclTransport");
  try {
    send_stream_ = make_stream(device_);
    recv_stream_ = make_stream(device_);
    send_ready_ = new_event(device_);
    edge_ = new_event(device_);
    warm_up();
  } catch (...) {
    nccl_detail::release_nccl_comm(std::exchange(nccl_, nullptr), /*abandon=*/true, "NcclTransport");
    throw;
  }
}

NcclTransport::~NcclTransport() {
  // Receives or sends not finished: the job is ending without the flush() that waits
  // for them, and a peer may never take part.
  bool in_flight = !early_.empty() || in_group_;  // receives queued for messages nobody asked for
  bool header_in_flight = false;
  for (const auto& p : pending_) {
    int done = 0;
    if (MPI_Test(&p->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = 0;
    header_in_flight = header_in_flight || !done;
    if (!done || (p->sent && (!p->recorded || cudaEventQuery(p->sent->get()) != cudaSuccess))) in_flight = true;
  }
  for (const auto& r : receiving_) {
    if (!r->recorded || cudaEventQuery(r->arrived->get()) != cudaSuccess) in_flight = true;
  }
  cudaGetLastError();  // a NotReady from the queries above is not an error
  if (in_flight) {
    spdlog::warn("NcclTransport: {} sends and {} receives still in flight at shutdown; abandoning them",
                 pending_.size(), receiving_.size());
  }
  // Aborting stops the NCCL kernels, so the tensors are freed after it safely.
  nccl_detail::release_nccl_comm(std::exchange(nccl_, nullptr),
                                 aborted_ || in_flight || std::uncaught_exceptions() > 0, "~NcclTransport");
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

std::vector<nccl_detail::WatchedComm> NcclTransport::watched() {
  std::vector<nccl_detail::WatchedComm> out{{&nccl_, "the pipeline's NCCL communicator"}};
  for (NcclReplicaGroup* g : groups_) out.push_back(g->own());
  return out;
}

nccl_detail::WaitContext NcclTransport::wait_context() const {
  return {"rank " + std::to_string(world_rank_) + " (stage " + std::to_string(rank_) + ")", timeout_s_, step_};
}

void NcclTransport::await(const std::function<bool()>& done, const std::string& awaited) {
  nccl_detail::await_nccl_work(watched(), done, wait_context(), awaited);
}

void NcclTransport::set_step(int64_t step) {
  step_ = step;
  host_.set_step(step);
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
  p->what = "the " + tag_str(tag) + " to rank " + std::to_string(dst);
  const int mtag = host_.mpi_tag(tag);
  DeviceGuard guard(device_.index);
  retire_sends(/*wait=*/false);
  PendingSend& sending = *p;
  pending_.push_back(std::move(p));  // owns the header buffer from the moment MPI has it
  // Non-blocking, and posted at once even inside a group: the receiver's host waits for
  // it before it can post its receive.
  GPIPE_MPI_CHECK(MPI_Isend(sending.header.data(), kMessageHeaderWords, MPI_INT64_T, dst, mtag, comm_,
                            &sending.request));
  if (t.nbytes() == 0) return;  // the receiver skips the data too
  order_after(send_stream(), compute_stream(), *send_ready_);
  post([&] { GPIPE_NCCL_CHECK(ncclSend(t.raw_data(), t.nbytes(), ncclUint8, dst, nccl_, send_stream())); });
  sending.sent = take_event();
  if (in_group_) {
    group_sends_.push_back(&sending);  // NCCL enqueues it at the group's end
  } else {
    record_sent(sending);
  }
}

void NcclTransport::record_sent(PendingSend& p) {
  GPIPE_CUDA_CHECK(cudaEventRecord(p.sent->get(), send_stream()));
  p.recorded = true;
}

void NcclTransport::record_arrived(PostedRecv& r) {
  GPIPE_CUDA_CHECK(cudaEventRecord(r.arrived->get(), recv_stream()));
  r.recorded = true;
}

void NcclTransport::retire_sends(bool wait) {
  nccl_detail::check_async_error(nccl_, "NcclTransport");
  while (!pending_.empty()) {
    PendingSend& p = *pending_.front();
    if (wait) {
      mpi_await(1, &p.request, nullptr, timeout_s_, wait_context().waiter, p.what + " (its header, MPI_Isend)",
                step_);
      if (p.sent) await([&] { return cuda_event_done(p.sent->get()); }, p.what + " to be received (ncclSend)");
    } else {
      int done = 0;
      GPIPE_MPI_CHECK(MPI_Test(&p.request, &done, MPI_STATUS_IGNORE));
      // The send stream finishes in order: one not done means none after it is. An
      // event not yet recorded (its group is open) says nothing yet.
      if (!done || (p.sent && (!p.recorded || !cuda_event_done(p.sent->get())))) return;
    }
    if (p.sent) spare_events_.push_back(std::move(p.sent));
    pending_.pop_front();  // drops the tensor: its block may be reused now
  }
}

void NcclTransport::retire_receives(bool wait) {
  for (auto it = receiving_.begin(); it != receiving_.end();) {
    PostedRecv& r = **it;
    if (wait) {
      await([&] { return cuda_event_done(r.arrived->get()); }, r.what + " (ncclRecv)");
    } else if (!r.recorded || !cuda_event_done(r.arrived->get())) {
      ++it;
      continue;
    }
    // One nobody asked for yet keeps its entry: its Arrival in early_ points at it.
    if (!r.taken) {
      ++it;
      continue;
    }
    spare_events_.push_back(std::move(r.arrived));
    it = receiving_.erase(it);
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
  retire_receives(/*wait=*/false);
  auto it = early_.find(key);
  while (it == early_.end()) {
    receive_next(src, tag);
    it = early_.find(key);
  }
  Arrival a = std::move(it->second);
  early_.erase(it);
  if (a.posted != nullptr) {
    PostedRecv& r = *a.posted;
    r.taken = true;
    if (r.recorded) {
      // This message's receive only (not the later ones already posted).
      GPIPE_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), r.arrived->get(), 0));
    } else {
      group_taken_.push_back(&r);  // posted into the open group: compute waits after its end
    }
    // The block returns to the receive stream only once the compute work queued from
    // now on is done with it.
    record_stream(a.tensor, compute_);
  }
  return a.tensor;
}

void NcclTransport::receive_next(int src, const MessageTag& wanted) {
  MessageHeader header{};
  MPI_Status status;
  MPI_Request request = MPI_REQUEST_NULL;
  GPIPE_MPI_CHECK(MPI_Irecv(header.data(), kMessageHeaderWords, MPI_INT64_T, src, MPI_ANY_TAG, comm_, &request));
  // A host wait on the peer's host only (its MPI_Isend is posted when it reaches its
  // send), never on a GPU, so it has the buffered semantics the checker proves.
  mpi_await(1, &request, &status, timeout_s_, wait_context().waiter,
            "the " + tag_str(wanted) + " from rank " + std::to_string(src) + " (its header, MPI_Irecv)", step_);
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
    auto r = std::make_unique<PostedRecv>();
    r->arrived = take_event();
    r->what = what;
    if (in_group_) {
      group_recvs_.push_back(r.get());  // NCCL enqueues it at the group's end
    } else {
      record_arrived(*r);
    }
    a.posted = r.get();
    receiving_.push_back(std::move(r));
  }
  early_.emplace(key, std::move(a));
}

void NcclTransport::post(const std::function<void()>& calls) {
  if (in_group_) {
    calls();  // enqueued by end_group's ncclGroupEnd
    return;
  }
  // A group of its own, closed even when a call fails, so NCCL's group depth stays
  // balanced for the next call.
  GPIPE_NCCL_CHECK(ncclGroupStart());
  try {
    calls();
  } catch (...) {
    const ncclResult_t r = ncclGroupEnd();
    if (r != ncclSuccess) spdlog::debug("ncclGroupEnd after a failed call: {}", ncclGetErrorString(r));
    throw;
  }
  GPIPE_NCCL_CHECK(ncclGroupEnd());
}

void NcclTransport::begin_group(int stage) {
  check_open();
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " grouping as stage " + std::to_string(stage));
  GPIPE_CHECK(!in_group_, "NcclTransport::begin_group: stage " + std::to_string(stage) +
                              " already has a group open; groups do not nest");
  GPIPE_NCCL_CHECK(ncclGroupStart());
  in_group_ = true;
}

void NcclTransport::end_group(int stage) {
  check_open();
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " grouping as stage " + std::to_string(stage));
  GPIPE_CHECK(in_group_, "NcclTransport::end_group: stage " + std::to_string(stage) + " has no group open");
  in_group_ = false;
  const std::vector<PendingSend*> sends = std::exchange(group_sends_, {});
  const std::vector<PostedRecv*> recvs = std::exchange(group_recvs_, {});
  const std::vector<PostedRecv*> taken = std::exchange(group_taken_, {});
  DeviceGuard guard(device_.index);
  GPIPE_NCCL_CHECK(ncclGroupEnd());  // enqueues the group's sends and receives, as one kernel
  // After the enqueue, so the events mark the end of the transfers; each receive's block
  // is handed to compute only behind its own event.
  for (PendingSend* p : sends) record_sent(*p);
  for (PostedRecv* r : recvs) record_arrived(*r);
  for (PostedRecv* r : taken) GPIPE_CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), r->arrived->get(), 0));
}

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
  std::string names;
  // Both directions of every pair in one group, so neither rank waits for the other.
  post([&] {
    int i = 0;
    for (int p : peers) {
      GPIPE_NCCL_CHECK(ncclSend(words + 2 * i, sizeof(int32_t), ncclUint8, p, nccl_, send_stream()));
      GPIPE_NCCL_CHECK(ncclRecv(words + 2 * i + 1, sizeof(int32_t), ncclUint8, p, nccl_, send_stream()));
      names += (i++ > 0 ? ", " : "") + std::to_string(p);
    }
  });
  // Once, at start-up: NCCL's connection buffers exist when this returns.
  auto done = take_event();
  GPIPE_CUDA_CHECK(cudaEventRecord(done->get(), send_stream()));
  await([&] { return cuda_event_done(done->get()); },
        "the start-up exchange with rank(s) " + names + " (ncclSend/ncclRecv; NCCL connects the ranks)");
  spare_events_.push_back(std::move(done));
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
  GPIPE_CHECK(!in_group_, "NcclTransport::flush inside the open group of stage " + std::to_string(stage) +
                              ": its operations are enqueued only by end_group");
  DeviceGuard guard(device_.index);
  retire_sends(/*wait=*/true);
  retire_receives(/*wait=*/true);
  for (NcclReplicaGroup* g : groups_) g->await_reductions();
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
  nccl_detail::abort_comms(watched(), "NcclTransport::abort");
  MPI_Abort(MPI_COMM_WORLD, 1);  // the whole job: other replicas too
}

}  // namespace gpipe
