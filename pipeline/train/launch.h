// How a process takes part in a training job (alone, or as one of the processes of
// mpirun), for the parts of a run that depend on it (the trainer, checkpoints, the run's
// artifacts, the profile) without depending on the trainer.
#pragma once

#include "pipeline/planning/plan.h"
#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

// Alone (all stages as threads), or as rank `rank` of `size` processes that each run
// one stage, connected by `transport` (or threads standing for them: `threads`); the
// job's processes are laid out as Plan::ranks says (RankLayout).
struct Launch {
  int rank = 0;  // this process's stage: its rank within its pipeline
  int size = 1;  // processes per pipeline (K when size > 1)
  Transport* transport = nullptr;  // required when size > 1 (MpiTransport, or NcclTransport for GPU stages)
  int replica = 0;                 // which data-parallel replica this process belongs to
  ReplicaGroup* replicas = nullptr;  // the same stage in the other replicas; required when D > 1
  // Tensor parallelism (pipeline.tensor_parallel = T > 1): this process is member `member`
  // of its stage's tensor group of T processes, `tensor_group` (required when T > 1; over
  // MPI between CPU stages, NCCL between GPU stages).
  int member = 0;
  int tensor = 1;
  ReplicaGroup* tensor_group = nullptr;
  // The job's ranks are threads of one process (train without mpirun at T > 1): the
  // transport and the groups are in-process, and the planner prices them so.
  bool threads = false;

  int replica_count() const { return replicas != nullptr ? replicas->size() : 1; }
  // The job's rank layout (Plan::ranks) as this launch joined it, and this process's rank in it.
  RankLayout layout() const { return {size, tensor, replica_count()}; }
  int world_rank() const { return layout().rank({rank, member, replica}); }
  // The job's first process: it claims the run's directories, writes the reports and the
  // checkpoint's index.
  bool first() const { return rank == 0 && replica == 0 && member == 0; }
};

}  // namespace pipeline
}  // namespace gpipe
