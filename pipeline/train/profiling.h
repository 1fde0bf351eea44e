// `gpipe profile`: measuring the model's layers and the transports into the profile file
// (pipeline.profile) that the planner, the sweep and `auto` choices read. In pipeline/train
// because it runs the model on the config's data; the command line calls it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <vector>

#include "pipeline/config/config.h"
#include "pipeline/train/launch.h"

namespace gpipe {
namespace pipeline {

struct ProfileOptions {
  std::vector<int64_t> micro_batches;  // sizes to measure; empty: the config's
  bool sweep = false;                  // every size the sweep tries (batch / M for M = 1, 2, 4, ...)
  int warmup = 3, repeats = 10;
  double min_seconds = 3;  // per size and concurrency: repetitions go on at least this long
  // Stages computing at once while measuring (each a copy of the model on its own core);
  // empty: 1 and, on CPUs, every core.
  std::vector<int> concurrency;
};

// `gpipe profile`: measures every layer at each size on the config's first device (on
// CPUs alone and with every core running a copy, as K stages do), and the in-process
// transport, and stores them in pipeline.profile. Under mpirun
// (`launch.size` > 1, CPU stages) it measures the MPI transport between ranks 0 and 1
// instead. Returns the exit status.
int profile_command(const Config& config, const ProfileOptions& options, const Launch& launch, std::ostream& out);

}  // namespace pipeline
}  // namespace gpipe
