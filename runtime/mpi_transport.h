// Transport between processes over MPI point-to-point, one pipeline stage per rank of
// a communicator (stage k = rank k). A message is a small header (element type and
// shape) followed by the data, so shapes travel with the data and a receiver never
// has to guess a size. The MPI tag carries the message kind and micro-batch, so
// messages are matched by what they are, not by arrival order. Host tensors only:
// GPU stages use NCCL.
//
// Every wait (receives, the completion of sends in flush, the collectives) polls its
// requests until they finish or pipeline.timeout_s passes; then the rank logs what it
// waited for and ends the whole job (MPI_Abort on MPI_COMM_WORLD, exit status
// kTimeoutExitCode), so a stuck peer never hangs the job and a supervisor can restart it.
#pragma once

#include <mpi.h>

#include <array>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/message_header.h"
#include "runtime/transport.h"

namespace gpipe {

class MpiTransport : public Transport {
 public:
  // comm: the pipeline's ranks, rank k holding stage k. Not owned; MPI must be
  // initialised (with MPI_THREAD_MULTIPLE if stages call from several threads).
  // timeout_s: the deadline of every wait (0 = none).
  explicit MpiTransport(MPI_Comm comm, double timeout_s = kDefaultTimeoutS);
  // The step the stage is in, for the message of an expired wait.
  void set_step(int64_t step) override { step_ = step; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  void send(int src, int dst, const MessageTag& tag, const Tensor& t) override;
  Tensor recv(int dst, int src, const MessageTag& tag, Device device) override;
  double all_reduce_sum(int stage, double value) override;
  std::vector<std::vector<double>> gather_to_first(int stage, const std::vector<double>& values) override;
  void flush(int stage) override;
  // Ping-pongs on a duplicate of the communicator (so no message of the pipeline can
  // match them), rank 0 with each rank in turn.
  double clock_offset_to_first(int stage) override;
  // A failed rank cannot wake its peers' blocking receives one by one: it ends the
  // whole job (MPI_Abort), after logging why, so no rank waits forever.
  void abort(const std::string& why) override;

  // The tag of a message; throws if the micro-batch index does not fit MPI's tags.
  int mpi_tag(const MessageTag& tag) const;

 private:
  void check_stage(int stage, const char* what) const;
  // Forgets the sends MPI has finished (all of them, waiting, with wait).
  void reap_sends(bool wait);
  // Waits for `requests` under the deadline; on expiry logs `awaited` and ends the job.
  void await(int n, MPI_Request* requests, MPI_Status* statuses, const std::string& awaited);
  struct PendingSend {
    Tensor tensor;  // keeps the data alive until the send completes
    MessageHeader header{};
    std::array<MPI_Request, 2> requests{};
    std::string what;  // "the activation of micro-batch 3 to rank 1", for a timeout
  };
  std::list<std::unique_ptr<PendingSend>> pending_;
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1, tag_ub_ = 32767, world_rank_ = 0;
  double timeout_s_;
  int64_t step_ = -1;
};

// The replicas of a stage over MPI: all-reduces of host tensors, in place, with the
// same deadline as MpiTransport.
class MpiReplicaGroup : public ReplicaGroup {
 public:
  explicit MpiReplicaGroup(MPI_Comm comm, double timeout_s = kDefaultTimeoutS);
  void set_step(int64_t step) override { step_ = step; }
  int size() const override { return size_; }
  void all_reduce_sum(Tensor& t) override;
  double all_reduce_sum(double value) override;
  void start_all_reduce_sum(Tensor& t) override;  // MPI_Iallreduce
  void progress() override;
  void wait_all() override;
  int rank() const override { return rank_; }
  void reduce_scatter_sum(Tensor& full, Tensor& block) override;  // MPI_Ireduce_scatter_block
  void all_gather(const Tensor& block, Tensor& full) override;     // MPI_Iallgather

 private:
  void await(int n, MPI_Request* requests, const std::string& awaited);
  std::vector<MPI_Request> requests_;
  MPI_Comm comm_;
  int size_ = 1, rank_ = 0, world_rank_ = 0;
  double timeout_s_;
  int64_t step_ = -1;
};

// Polls `requests` (MPI_Testall) until they finish or `timeout_s` passes; then logs
// "`waiter` waited ... for `awaited`" and calls MPI_Abort(MPI_COMM_WORLD,
// kTimeoutExitCode). Shared by MpiTransport, MpiReplicaGroup and checks.
void mpi_await(int n, MPI_Request* requests, MPI_Status* statuses, double timeout_s, const std::string& waiter,
               const std::string& awaited, int64_t step);

}  // namespace gpipe
