// Test program for checkpoint_kill_test.sh: saves checkpoints of a small two-stage state
// in a loop (steps 1, 2, ...; keep 2), through the async writer, printing "saved step N"
// once each is complete, until it is killed. Every value is a function of the step, so
// checkpoint_verify can check a loaded checkpoint bit for bit.
//   checkpoint_crash_writer DIR [MAX_STEPS]
#include <cstdio>
#include <cstdlib>

#include "pipeline/checkpoint/checkpoint_crash_state.h"
#include "pipeline/checkpoint/checkpoint_writer.h"
#include "runtime/logging.h"

int main(int argc, char** argv) {
  using namespace gpipe::pipeline;
  if (argc < 2) {
    std::fprintf(stderr, "usage: checkpoint_crash_writer DIR [MAX_STEPS]\n");
    return 2;
  }
  gpipe::init_logging("info");
  const long max_steps = argc > 2 ? std::atol(argv[2]) : 1000000;
  try {
    AsyncCheckpointWriter writer(CheckpointStore(argv[1], /*keep=*/2));
    for (long step = 1; step <= max_steps; ++step) {
      writer.save(step, crash_test_shards(step), crash_test_state(step));
      writer.wait();
      std::printf("saved step %ld\n", step);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_crash_writer: %s\n", e.what());
    return 1;
  }
  return 0;
}
