// Exercises MpiTransport across two ranks (run under mpirun -np 2 by
// mpi_transport_test.sh): tensors and their shapes arrive intact, messages are matched
// by kind and micro-batch whatever the order they were sent in, all_reduce_sum sums
// over the ranks, and two processes of one machine share one clock (offset 0). Prints "mpi_transport_check: rank R ok" per rank; exits non-zero on
// any mismatch.
#include <mpi.h>

#include <cstdio>
#include <vector>

#include "runtime/error.h"
#include "runtime/mpi_transport.h"
#include "runtime/tensor.h"

using namespace gpipe;

namespace {
int failures = 0;
void expect(bool ok, const char* what, int rank) {
  if (!ok) {
    std::fprintf(stderr, "mpi_transport_check: rank %d: %s\n", rank, what);
    ++failures;
  }
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    MpiTransport tr(MPI_COMM_WORLD);
    const int r = tr.rank();
    if (tr.size() != 2) {
      std::fprintf(stderr, "mpi_transport_check: run with 2 ranks\n");
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (r == 0) {
      // Sent out of order: micro-batch 1 first, then 0, then a 3-D int tensor.
      tr.send(0, 1, {MessageKind::kActivation, 1}, Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
      tr.send(0, 1, {MessageKind::kActivation, 0}, Tensor::from_vector<double>({-1.5}, {1}));
      tr.send(0, 1, {MessageKind::kActivation, 2}, Tensor::from_vector<int32_t>({7, 8, 9, 10}, {1, 2, 2}));
      Tensor g = tr.recv(0, 1, {MessageKind::kGradient, 0}, Device::cpu());
      expect(g.shape() == Shape{3} && g.to_vector<float>() == std::vector<float>{0.5f, 0.25f, 0.125f},
             "gradient of micro-batch 0", r);
    } else {
      Tensor a0 = tr.recv(1, 0, {MessageKind::kActivation, 0}, Device::cpu());
      expect(a0.dtype() == DType::kF64 && a0.to_vector<double>() == std::vector<double>{-1.5}, "activation 0", r);
      Tensor a1 = tr.recv(1, 0, {MessageKind::kActivation, 1}, Device::cpu());
      expect(a1.shape() == Shape{2, 3} && a1.to_vector<float>()[5] == 6.0f, "activation 1", r);
      Tensor a2 = tr.recv(1, 0, {MessageKind::kActivation, 2}, Device::cpu());
      expect(a2.shape() == Shape{1, 2, 2} && a2.to_vector<int32_t>()[3] == 10, "activation 2", r);
      tr.send(1, 0, {MessageKind::kGradient, 0}, Tensor::from_vector<float>({0.5f, 0.25f, 0.125f}, {3}));
    }
    const double total = tr.all_reduce_sum(r, r + 1.0);
    expect(total == 3.0, "all_reduce_sum", r);
    // Both ranks run on this machine: one monotonic clock, so the offset is exactly 0,
    // not a round trip's estimate.
    const double offset = tr.clock_offset_to_first(r);
    if (offset != 0.0) std::fprintf(stderr, "mpi_transport_check: rank %d: clock offset %.9f ms\n", r, offset);
    expect(offset == 0.0, "the clock offset between two processes of one machine", r);
    bool threw = false;
    try {
      tr.mpi_tag({MessageKind::kGradient, -1});
    } catch (const Error&) {
      threw = true;
    }
    expect(threw, "a negative micro-batch is refused", r);
    if (failures == 0) std::printf("mpi_transport_check: rank %d ok\n", r);
    rc = failures == 0 ? 0 : 1;
  }
  MPI_Finalize();
  return rc;
}
