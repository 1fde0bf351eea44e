// NcclReplicaGroup: the ordering is described in nccl_replica_group.h. Every CUDA, NCCL
// and MPI call is checked; the destructor only logs.
#include "runtime/nccl_replica_group.h"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "runtime/cuda_check.h"
#include "runtime/cuda_runtime.h"
#include "runtime/error.h"
#include "runtime/mpi_check.h"
#include "runtime/nccl_transport.h"

namespace gpipe {

using nccl_detail::new_event;
using nccl_detail::order_after;

NcclReplicaGroup::NcclReplicaGroup(MPI_Comm comm, Device device, Stream& compute, NcclTransport* pipeline,
                                   double timeout_s, std::string what)
    : device_(device),
      compute_(compute),
      pipeline_(pipeline),
      what_(std::move(what)),
      host_(comm, timeout_s),
      timeout_s_(timeout_s) {
  GPIPE_CHECK(pipeline == nullptr || pipeline->device() == device,
              "NcclReplicaGroup on " + device.str() + " ordered against a transport on " +
                  (pipeline ? pipeline->device().str() : std::string()));
  GPIPE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  nccl_detail::check_compute_stream(compute, device, "NcclReplicaGroup");
  nccl_ = nccl_detail::make_nccl_comm(comm, device, "NcclReplicaGroup");
  try {
    reduce_stream_ = make_stream(device_);
    ready_ = new_event(device_);
    reduced_ = new_event(device_);
    last_done_ = new_event(device_);
  } catch (...) {
    nccl_detail::release_nccl_comm(std::exchange(nccl_, nullptr), /*abandon=*/true, "NcclReplicaGroup");
    throw;
  }
  if (pipeline_ != nullptr) pipeline_->groups_.push_back(this);
}

NcclReplicaGroup::~NcclReplicaGroup() {
  if (pipeline_ != nullptr) {
    auto& groups = pipeline_->groups_;
    groups.erase(std::remove(groups.begin(), groups.end(), this), groups.end());
  }
  // Abandoned (aborted, not destroyed, which would wait for a peer that may be gone)
  // while a collective is still queued or unfinished.
  bool unfinished = !in_flight_.empty() || std::uncaught_exceptions() > 0;
  if (!unfinished && queued_ > 0 && nccl_ != nullptr) {
    DeviceGuard guard(device_.index);
    unfinished = !cuda_event_done(last_done_->get());
  }
  nccl_detail::release_nccl_comm(std::exchange(nccl_, nullptr), unfinished, "~NcclReplicaGroup");
}

std::vector<nccl_detail::WatchedComm> NcclReplicaGroup::watched() {
  // Attached: the pipeline's and every attached group's (this one's among them), all of
  // which a failure here stops.
  if (pipeline_ != nullptr) return pipeline_->watched();
  return {own()};
}

void NcclReplicaGroup::set_step(int64_t step) {
  step_ = step;
  host_.set_step(step);
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
  GPIPE_CHECK(nccl_ != nullptr, "NcclReplicaGroup: the communicator was aborted");
  nccl_detail::check_async_error(nccl_, "NcclReplicaGroup");
  if (t.numel() == 0) return;
  // After the pipeline's sends and receives queued so far, and before those queued from
  // now: the two communicators never have kernels on this GPU at once.
  if (pipeline_ != nullptr) pipeline_->nccl_before(reduce_stream());
  // In place, so the reduction must not start before the kernels that wrote `t`.
  order_after(reduce_stream(), compute_stream(), *ready_);
  GPIPE_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()), type, ncclSum, nccl_,
                                 reduce_stream()));
  GPIPE_CUDA_CHECK(cudaEventRecord(last_done_->get(), reduce_stream()));
  ++queued_;
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
  nccl_detail::check_async_error(nccl_, "NcclReplicaGroup");  // the GPU needs no help to progress
}

void NcclReplicaGroup::wait_all() {
  host_.wait_all();
  if (in_flight_.empty()) return;
  DeviceGuard guard(device_.index);
  order_after(compute_stream(), reduce_stream(), *reduced_);
  in_flight_.clear();
}

ncclDataType_t NcclReplicaGroup::nccl_type(const Tensor& t) const {
  if (t.dtype() == DType::kF64) return ncclFloat64;
  if (t.dtype() != DType::kF32) throw Error("NcclReplicaGroup: cannot reduce " + t.str() + "; float32 and float64 only");
  return ncclFloat32;
}

template <typename Call>
void NcclReplicaGroup::enqueue_sharded(const Tensor& a, const Tensor& b, Call call) {
  for (const Tensor* t : {&a, &b}) {
    GPIPE_CHECK(t->device() == device_ && t->is_contiguous(),
                "NcclReplicaGroup on " + device_.str() + " shards contiguous tensors on that device, not " + t->str());
  }
  GPIPE_CHECK(nccl_ != nullptr, "NcclReplicaGroup: the communicator was aborted");
  nccl_detail::check_async_error(nccl_, "NcclReplicaGroup");
  DeviceGuard guard(device_.index);
  if (pipeline_ != nullptr) pipeline_->nccl_before(reduce_stream());
  order_after(reduce_stream(), compute_stream(), *ready_);
  call();
  GPIPE_CUDA_CHECK(cudaEventRecord(last_done_->get(), reduce_stream()));
  ++queued_;
  if (pipeline_ != nullptr) pipeline_->nccl_after(reduce_stream());
  order_after(compute_stream(), reduce_stream(), *reduced_);
}

void NcclReplicaGroup::reduce_scatter_sum(Tensor& full, Tensor& block) {
  if (full.device().is_cpu()) {
    host_.reduce_scatter_sum(full, block);
    return;
  }
  GPIPE_CHECK(full.dtype() == block.dtype() && full.numel() == block.numel() * size(),
              "reduce_scatter_sum: " + full.str() + " is not " + std::to_string(size()) + " blocks of " + block.str());
  const ncclDataType_t type = nccl_type(full);
  enqueue_sharded(full, block, [&] {
    GPIPE_NCCL_CHECK(ncclReduceScatter(full.raw_data(), block.raw_data(), static_cast<size_t>(block.numel()), type,
                                       ncclSum, nccl_, reduce_stream()));
  });
}

void NcclReplicaGroup::all_gather(const Tensor& block, Tensor& full) {
  if (full.device().is_cpu()) {
    host_.all_gather(block, full);
    return;
  }
  GPIPE_CHECK(full.dtype() == block.dtype() && full.numel() == block.numel() * size(),
              "all_gather: " + full.str() + " is not " + std::to_string(size()) + " blocks of " + block.str());
  const ncclDataType_t type = nccl_type(full);
  enqueue_sharded(block, full, [&] {
    GPIPE_NCCL_CHECK(ncclAllGather(block.raw_data(), full.raw_data(), static_cast<size_t>(block.numel()), type, nccl_,
                                   reduce_stream()));
  });
}

void NcclReplicaGroup::await_reductions() {
  if (queued_ == 0) return;
  DeviceGuard guard(device_.index);
  // The reduction stream runs in order: its last all-reduce done means all are.
  nccl_detail::await_nccl_work(
      watched(), [&] { return cuda_event_done(last_done_->get()); },
      {"rank " + std::to_string(world_rank_), timeout_s_, step_},
      "the last of " + std::to_string(queued_) + " collective(s) over " + what_ + " (" + std::to_string(size()) +
          " ranks; ncclAllReduce, ncclReduceScatter or ncclAllGather)");
  queued_ = 0;
}

}  // namespace gpipe
