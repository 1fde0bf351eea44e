// A group of a stage's ranks on GPUs, one GPU per rank, summing device tensors with
// NCCL: the data-parallel replicas of a stage (gradient buckets, ZeRO-1's sharded state)
// and the tensor group of a stage's members (a split layer's sums, layers/tensor_parallel.h).
// Ordered against the stage's compute stream and its pipeline transport with events, so
// the host does not wait for the GPU. Built only with --config=cuda.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/mpi_transport.h"
#include "runtime/nccl_comm.h"
#include "runtime/stream.h"
#include "runtime/transport.h"

namespace gpipe {

class NcclTransport;

// ncclAllReduce of device tensors on a reduction stream ordered after the compute
// stream, and the compute stream ordered after the result (no host wait). Host tensors
// and scalars go through MPI, as MpiReplicaGroup. With the stage's pipeline transport
// given, each collective also comes after the pipeline's sends and receives queued
// before it and before those queued after it (NcclTransport::nccl_before/after). Every
// group attached to the transport does the same, so all of this GPU's NCCL work (the
// pipeline's, the replicas', the tensor group's) runs as one chain in program order:
// no two communicators' kernels at once on this GPU, and every rank orders them alike
// (NCCL user guide, "Using multiple NCCL communicators concurrently"). The group
// attaches itself to the transport, whose flush() then also waits for its collectives,
// and whose waits and aborts cover every attached communicator.
class NcclReplicaGroup : public ReplicaGroup {
 public:
  // comm: the group's ranks (not owned), in the order of their place in the group.
  // device, compute, timeout_s: as NcclTransport's. pipeline: this rank's
  // NcclTransport, or nullptr (not owned; outlives the group). what: the group in
  // messages, "the stage's replicas" or "the stage's tensor group".
  NcclReplicaGroup(MPI_Comm comm, Device device, Stream& compute, NcclTransport* pipeline = nullptr,
                   double timeout_s = kDefaultTimeoutS, std::string what = "the stage's replicas");
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
  // The compute stream waits for the started all-reduces; the host does not.
  void wait_all() override;
  void set_step(int64_t step) override;
  // Sharded optimizer state (ZeRO-1): ncclReduceScatter and ncclAllGather of device
  // tensors, each one call over the stage's whole flat buffer (so one operation, no
  // group to form), ordered as the all-reduce: on the reduction stream after the compute
  // stream and the pipeline's queued transfers, the compute stream waiting for the
  // result. The executor keeps both buffers for the run, so their blocks are never
  // recycled under NCCL. Host tensors go through MPI. Compiled, not yet run on a GPU.
  int rank() const override { return host_.rank(); }
  void reduce_scatter_sum(Tensor& full, Tensor& block) override;
  void all_gather(const Tensor& block, Tensor& full) override;
  // Host tensors, and tensors on this group's GPU (queued, the compute stream ordered
  // after the result).
  bool takes(Device device) const override { return device.is_cpu() || device == device_; }
  void await_device() override { await_reductions(); }
  // The host waits, under the deadline and watching every communicator of the pipeline
  // for asynchronous errors, until every collective queued so far on the device is
  // done; ends the job if it cannot finish (runtime/nccl_comm.h). The attached
  // transport's flush() calls it.
  void await_reductions();

 private:
  friend class NcclTransport;  // aborts this communicator with its own
  // This communicator, named for messages.
  nccl_detail::WatchedComm own() { return {&nccl_, "the NCCL communicator of " + what_}; }

  void enqueue(const Tensor& t);
  ncclDataType_t nccl_type(const Tensor& t) const;
  // Both sharded collectives: checks, the ordering before and after, the call itself.
  template <typename Call>
  void enqueue_sharded(const Tensor& a, const Tensor& b, Call call);
  std::vector<nccl_detail::WatchedComm> watched();
  cudaStream_t compute_stream() const { return static_cast<cudaStream_t>(compute_.native()); }
  cudaStream_t reduce_stream() const { return static_cast<cudaStream_t>(reduce_stream_->native()); }

  Device device_;
  Stream& compute_;
  NcclTransport* pipeline_;
  std::string what_;
  MpiReplicaGroup host_;
  double timeout_s_;
  int world_rank_ = 0;
  int64_t step_ = -1;
  ncclComm_t nccl_ = nullptr;
  std::unique_ptr<Stream> reduce_stream_;
  std::unique_ptr<nccl_detail::EventHandle> ready_, reduced_;
  // Recorded after each collective; `queued` of them since await_reductions() last ran.
  std::unique_ptr<nccl_detail::EventHandle> last_done_;
  int queued_ = 0;
  std::vector<Tensor> in_flight_;  // started on the device, not yet waited for
};

}  // namespace gpipe
