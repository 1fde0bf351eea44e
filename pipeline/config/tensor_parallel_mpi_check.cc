// Tensor parallelism across processes (issue 38): under `mpirun -np T`, every rank builds
// the GPT and the LLaMA test configs whole and as its member of a tensor group of T
// (layers::ModelSpec::member), runs the unpartitioned reference (forward_backward) on both,
// the member's sums going over MPI (GroupCollectives over an MpiReplicaGroup), and checks,
// in float64 with dropout on, that the member's loss is the whole model's and that each of
// its parameters' gradients is its block of the whole one's, to 1e-12. Prints
// "tensor_parallel_mpi_check: rank R of T ok" per rank; exits non-zero on any mismatch.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "layers/registry.h"
#include "layers/sequential.h"
#include "layers/tensor_parallel.h"
#include "pipeline/config/config.h"
#include "runtime/mpi_transport.h"
#include "tests/tensor_group.h"
#include "tests/testing.h"

using namespace gpipe;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::fprintf(stderr, "tensor_parallel_mpi_check: rank %d: %s\n", rank, what.c_str());
    ++failures;
  }
}

void check(const char* name, const char* text, layers::TensorCollectives& group) {
  const int rank = group.rank(), T = group.size();
  Backend& be = backend_for(Device::cpu());
  const pipeline::Config config = pipeline::parse_config(text, std::string(name) + ".yaml");
  const Tensor x = testing::random_labels(3 * 6, 16, 1).reshape({3, 6});
  const Tensor targets = testing::random_labels(3 * 6, 16, 2).reshape({3, 6});
  layers::ForwardArgs args;
  args.step = 5;
  auto whole = layers::build_model(config.model);
  const double scale = 1.0 / static_cast<double>(whole->loss().counted_targets(targets));
  const double want = whole->forward_backward(be, x, targets, scale, args);
  whole->sum_tied_gradients(be);
  layers::ModelSpec spec = config.model;
  spec.member = {rank, T};
  auto mine = layers::build_model(spec);
  mine->set_collectives(&group);
  const double got = mine->forward_backward(be, x, targets, scale, args);
  mine->sum_tied_gradients(be);
  expect(std::abs(got - want) <= 1e-12 * std::abs(want), std::string(name) + ": loss " + std::to_string(got) +
                                                             ", whole " + std::to_string(want), rank);
  const auto wp = whole->named_parameters();
  const auto mp = mine->named_parameters();
  expect(wp.size() == mp.size(), std::string(name) + ": other parameters", rank);
  for (size_t i = 0; i < wp.size() && i < mp.size(); ++i) {
    const layers::Parameter& p = *mp[i].second;
    const std::vector<double> g = testing::to_doubles(p.grad);
    const std::vector<double> w =
        p.shard_dim < 0 ? testing::to_doubles(wp[i].second->grad)
                        : testing::block_of(wp[i].second->grad, p.shard_dim, p.shard_rank, p.shard_count,
                                            p.shard_groups);
    const testing::CloseReport c = testing::compare(g, w, 1e-12, 1e-12);
    expect(g.size() == w.size() && c.ok, std::string(name) + ": " + mp[i].first + "'s gradient: " + c.detail, rank);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    MpiReplicaGroup mpi(MPI_COMM_WORLD, 60.0);
    layers::GroupCollectives group(mpi);
    check("gpt", testing::kTensorParallelGpt, group);
    check("llama", testing::kTensorParallelLlama, group);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tensor_parallel_mpi_check: rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (failures == 0) std::printf("tensor_parallel_mpi_check: rank %d of %d ok\n", rank, size);
  std::fflush(stdout);
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
