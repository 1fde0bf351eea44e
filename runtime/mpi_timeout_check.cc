// Run by mpi_timeout_test.sh under mpirun -np 2, with rank 1 stopped (kill -STOP): rank 0
// starts one blocking operation that needs rank 1 and must end the job when
// pipeline.timeout_s passes, saying what it waited for. Each rank first prints
// "mpi_timeout_check: rank R pid P ready".
//   mpi_timeout_check recv|flush|allreduce|gather|replica TIMEOUT_S
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/logging.h"
#include "runtime/mpi_transport.h"
#include "runtime/tensor.h"

using namespace gpipe;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  init_logging("info");
  const std::string mode = argc > 1 ? argv[1] : "";
  const double timeout_s = argc > 2 ? std::atof(argv[2]) : 2.0;
  MpiTransport tr(MPI_COMM_WORLD, timeout_s);
  MpiReplicaGroup group(MPI_COMM_WORLD, timeout_s);
  tr.set_step(12);
  std::printf("mpi_timeout_check: rank %d pid %d ready\n", tr.rank(), static_cast<int>(::getpid()));
  std::fflush(stdout);
  if (tr.rank() == 1) {
    for (;;) ::pause();  // stopped by the test; never takes part
  }
  if (mode == "recv") {
    tr.recv(0, 1, {MessageKind::kActivation, 3}, Device::cpu());
  } else if (mode == "flush") {
    // Large enough for a rendezvous send: it completes only when rank 1 receives.
    tr.send(0, 1, {MessageKind::kGradient, 5}, Tensor::zeros_cpu({1 << 20}, DType::kF32));
    tr.flush(0);
  } else if (mode == "allreduce") {
    tr.all_reduce_sum(0, 1.0);
  } else if (mode == "gather") {
    tr.gather_to_first(0, {1.0, 2.0});
  } else if (mode == "replica") {
    Tensor g = Tensor::zeros_cpu({1000}, DType::kF32);
    group.start_all_reduce_sum(g);
    group.wait_all();
  } else {
    std::fprintf(stderr, "mpi_timeout_check: unknown mode '%s'\n", mode.c_str());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  std::fprintf(stderr, "mpi_timeout_check: the %s finished without rank 1\n", mode.c_str());
  MPI_Abort(MPI_COMM_WORLD, 3);
  return 3;
}
