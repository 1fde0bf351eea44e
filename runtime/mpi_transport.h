// Transport between processes over MPI point-to-point, one pipeline stage per rank of
// a communicator (stage k = rank k). A message is a small header (element type and
// shape) followed by the data, so shapes travel with the data and a receiver never
// has to guess a size. The MPI tag carries the message kind and micro-batch, so
// messages are matched by what they are, not by arrival order. Host tensors only:
// GPU stages will use NCCL.
#pragma once

#include <mpi.h>

#include <array>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "runtime/message_header.h"
#include "runtime/transport.h"

namespace gpipe {

class MpiTransport : public Transport {
 public:
  // comm: the pipeline's ranks, rank k holding stage k. Not owned; MPI must be
  // initialised (with MPI_THREAD_MULTIPLE if stages call from several threads).
  explicit MpiTransport(MPI_Comm comm);
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
  struct PendingSend {
    Tensor tensor;  // keeps the data alive until the send completes
    MessageHeader header{};
    std::array<MPI_Request, 2> requests{};
  };
  std::list<std::unique_ptr<PendingSend>> pending_;
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
};

// The replicas of a stage over MPI: MPI_Allreduce on host tensors, in place.
class MpiReplicaGroup : public ReplicaGroup {
 public:
  explicit MpiReplicaGroup(MPI_Comm comm);
  int size() const override { return size_; }
  void all_reduce_sum(Tensor& t) override;
  double all_reduce_sum(double value) override;
  void start_all_reduce_sum(Tensor& t) override;  // MPI_Iallreduce
  void progress() override;
  void wait_all() override;

 private:
  std::vector<MPI_Request> requests_;
  MPI_Comm comm_;
  int size_ = 1;
};

}  // namespace gpipe
