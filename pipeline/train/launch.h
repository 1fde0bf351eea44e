// How a process takes part in a training job (alone, or as one of the processes of
// mpirun), for the parts of a run that depend on it (the trainer, checkpoints, the run's
// artifacts, the profile) without depending on the trainer.
#pragma once

#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

// Alone (all stages as threads), or as rank `rank` of `size` processes that each run
// one stage, connected by `transport`.
struct Launch {
  int rank = 0;  // this process's stage: its rank within its pipeline
  int size = 1;  // processes per pipeline (K when size > 1)
  Transport* transport = nullptr;  // required when size > 1 (MpiTransport, or NcclTransport for GPU stages)
  int replica = 0;                 // which data-parallel replica this process belongs to
  ReplicaGroup* replicas = nullptr;  // the same stage in the other replicas; required when D > 1
};

}  // namespace pipeline
}  // namespace gpipe
