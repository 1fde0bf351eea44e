// How a process joins a multi-process run. Under mpirun (or a PMI launcher such as
// Slurm's srun), MPI lives as long as the process; the P = K x T x D ranks (Plan::ranks)
// split into one communicator per pipeline (its K stages), one per stage and member (its
// D replicas) and one per stage of a replica (its tensor group of T members), and the
// rank's stage talks through MPI (CPU stages) or NCCL (GPU stages in a CUDA build).
#pragma once

#include <mpi.h>

#include <memory>

#include "pipeline/config/config.h"
#include "pipeline/train/launch.h"
#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

// Started by mpirun (OpenMPI) or a PMI launcher?
bool launched_by_mpi();

class MpiLaunch {
 public:
  // MPI_Init_thread (MPI_THREAD_SERIALIZED: the stage threads call MPI).
  MpiLaunch(int* argc, char*** argv);
  // Frees the transports, then the communicators, then MPI_Finalize.
  ~MpiLaunch();
  MpiLaunch(const MpiLaunch&) = delete;
  MpiLaunch& operator=(const MpiLaunch&) = delete;

  int rank() const { return rank_; }  // in MPI_COMM_WORLD
  int size() const { return size_; }

  // This rank's part in `config`'s job, as Plan::ranks lays it out. Checks
  // the process count, splits the communicators, resolves the stage's device (written
  // back into config.pipeline.devices, so the trainer uses exactly that GPU) and
  // creates the transports, which live as long as this object. Call once.
  Launch join(Config& config);

  // Ends every rank with `code` when there are several (MPI_Abort), so that a mistake
  // seen by one rank does not leave the others waiting. Returns `code` otherwise.
  int abort(int code);

 private:
  int rank_ = 0, size_ = 1;
  MPI_Comm pipeline_ = MPI_COMM_NULL, replicas_ = MPI_COMM_NULL, tensor_ = MPI_COMM_NULL;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ReplicaGroup> replica_group_, tensor_group_;
};

}  // namespace pipeline
}  // namespace gpipe
