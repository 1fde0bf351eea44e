// NcclTransport and NcclReplicaGroup across two MPI ranks with a GPU each (run under
// mpirun -np 2 by nccl_transport_test.sh): tensors and their shapes arrive intact both
// ways, out-of-order messages are matched by kind and micro-batch, a grouped exchange
// in both directions completes, bad messages raise errors that name them without
// hanging either rank, replicas sum, reduce-scatter and all-gather device tensors, and
// a second group attached to the same transport (a stage's tensor group) does the same
// interleaved with the pipeline's transfers and the replicas' sums (compiled only so
// far: no two-GPU machine has run this file). Every test case
// is collective: both ranks run them all, in order. With fewer than two visible GPUs it
// prints the skip marker and passes.
//   nccl_transport_check                         the test cases
//   nccl_transport_check --stuck=send|recv|replica|tensor
//       rank 1 stops taking part (alive, posting nothing more); rank 0's wait on NCCL
//       work must end the job after pipeline.timeout_s (2 s) with what it waited for
//       and exit status kTimeoutExitCode
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "runtime/cuda_check.h"
#include "runtime/device.h"
#include "runtime/device_binding.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/nccl_replica_group.h"
#include "runtime/nccl_transport.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"
#include "tests/testing.h"

namespace gpipe {
namespace {

struct World {
  int rank = 0;
  Device device;
  Stream* compute = nullptr;  // the device's compute stream, as the CUDA backend's
  std::unique_ptr<NcclTransport> transport;
  std::unique_ptr<NcclReplicaGroup> replicas;
  std::unique_ptr<NcclReplicaGroup> tensor;  // a second group on the same transport
};

World& world() {
  static World w;
  return w;
}

cudaStream_t compute_stream() { return static_cast<cudaStream_t>(world().compute->native()); }

// Host tensor with element i = base + i / 4 (exact in float32 for the sizes used here).
Tensor pattern(const Shape& shape, DType dtype, double base) {
  Tensor t = Tensor::empty(shape, dtype, Device::cpu());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = base + static_cast<double>(i) / 4;
    if (dtype == DType::kF32) {
      t.data<float>()[i] = static_cast<float>(v);
    } else {
      t.data<double>()[i] = v;
    }
  }
  return t;
}

std::vector<double> values(const Tensor& host) {
  std::vector<double> out(host.numel());
  for (int64_t i = 0; i < host.numel(); ++i) {
    out[i] = host.dtype() == DType::kF32 ? host.data<float>()[i] : host.data<double>()[i];
  }
  return out;
}

// Queued on the compute stream and not waited for: a send must order itself after it.
Tensor to_device(const Tensor& host) {
  Tensor d = Tensor::empty(host.shape(), host.dtype(), world().device);
  if (host.nbytes() > 0) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(d.raw_data(), host.raw_data(), host.nbytes(), cudaMemcpyHostToDevice,
                                     compute_stream()));
  }
  return d;
}

// Read on the compute stream: correct only if that stream waits for the receive.
std::vector<double> device_values(const Tensor& d) {
  Tensor host = Tensor::empty(d.shape(), d.dtype(), Device::cpu());
  if (d.nbytes() > 0) {
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(host.raw_data(), d.raw_data(), d.nbytes(), cudaMemcpyDeviceToHost,
                                     compute_stream()));
  }
  GPIPE_CUDA_CHECK(cudaStreamSynchronize(compute_stream()));
  return values(host);
}

constexpr MessageKind kAct = MessageKind::kActivation;
constexpr MessageKind kGrad = MessageKind::kGradient;

TEST_CASE("float32 and float64 tensors of several shapes travel both ways") {
  World& w = world();
  NcclTransport& tr = *w.transport;
  const std::vector<Shape> shapes = {{1}, {3, 5}, {2, 3, 4}, {0, 7}, {513, 1027}};
  int m = 0;
  for (DType dt : {DType::kF32, DType::kF64}) {
    for (const Shape& s : shapes) {
      CAPTURE(m);
      if (w.rank == 0) {
        // The sent tensor is a temporary: the transport must keep it alive.
        tr.send(0, 1, {kAct, m}, to_device(pattern(s, dt, m)));
        Tensor g = tr.recv(0, 1, {kGrad, m}, w.device);
        CHECK(g.shape() == s);
        CHECK(g.dtype() == dt);
        CHECK(device_values(g) == values(pattern(s, dt, -m)));
      } else {
        Tensor a = tr.recv(1, 0, {kAct, m}, w.device);
        CHECK(a.shape() == s);
        CHECK(a.dtype() == dt);
        CHECK(a.device() == w.device);
        CHECK(device_values(a) == values(pattern(s, dt, m)));
        tr.send(1, 0, {kGrad, m}, to_device(pattern(s, dt, -m)));
      }
      ++m;
    }
  }
  tr.flush(w.rank);
  CHECK(tr.sends_in_flight() == 0);
}

TEST_CASE("messages sent out of order are matched by kind and micro-batch") {
  World& w = world();
  NcclTransport& tr = *w.transport;
  if (w.rank == 0) {
    tr.send(0, 1, {kAct, 101}, to_device(pattern({2, 3}, DType::kF32, 7)));
    tr.send(0, 1, {kAct, 100}, to_device(pattern({4}, DType::kF64, 5)));
  } else {
    Tensor a100 = tr.recv(1, 0, {kAct, 100}, w.device);  // 101 arrives first and waits
    Tensor a101 = tr.recv(1, 0, {kAct, 101}, w.device);
    CHECK(a100.shape() == Shape{4});
    CHECK(device_values(a100) == values(pattern({4}, DType::kF64, 5)));
    CHECK(a101.shape() == Shape{2, 3});
    CHECK(device_values(a101) == values(pattern({2, 3}, DType::kF32, 7)));
  }
  tr.flush(w.rank);
}

TEST_CASE("a grouped exchange in both directions completes (each rank sends before it receives)") {
  // Both ranks send first, as neighbours do in 1F1B's steady state. A send this large
  // completes only once its receiver takes it, and NCCL runs one communicator's
  // operations in order: without the group each rank's send would wait for a receive
  // the peer posts only after its own send.
  World& w = world();
  NcclTransport& tr = *w.transport;
  const int me = w.rank, peer = 1 - w.rank;
  CHECK(tr.sends_wait_for_receiver());
  const Shape big{8 << 20};  // (8 Mi) float32: 32 MiB, far above NCCL's staging buffers
  const MessageKind out = me == 0 ? kAct : kGrad, in = me == 0 ? kGrad : kAct;
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    tr.begin_group(me);
    tr.send(me, peer, {out, 200 + round}, to_device(pattern(big, DType::kF32, 1000 * me + round)));
    Tensor got = tr.recv(me, peer, {in, 200 + round}, w.device);
    tr.end_group(me);
    // Read on the compute stream, which waits for the group's transfers from end_group.
    CHECK(got.shape() == big);
    CHECK(device_values(got) == values(pattern(big, DType::kF32, 1000 * peer + round)));
  }
  // Several messages each way in one group, received in another order than sent: the
  // first receive takes the earlier header and parks its message.
  tr.begin_group(me);
  tr.send(me, peer, {out, 210}, to_device(pattern({3, 4}, DType::kF64, 10 + me)));
  tr.send(me, peer, {out, 211}, to_device(pattern({5}, DType::kF32, 20 + me)));
  Tensor second = tr.recv(me, peer, {in, 211}, w.device);
  Tensor first = tr.recv(me, peer, {in, 210}, w.device);
  tr.end_group(me);
  CHECK(device_values(first) == values(pattern({3, 4}, DType::kF64, 10 + peer)));
  CHECK(device_values(second) == values(pattern({5}, DType::kF32, 20 + peer)));
  tr.flush(me);
  CHECK(tr.sends_in_flight() == 0);
  CHECK(tr.receives_in_flight() == 0);
  // Misuse is refused, naming the stage.
  CHECK_THROWS_WITH_AS(tr.end_group(me), doctest::Contains("has no group open"), Error);
  tr.begin_group(me);
  CHECK_THROWS_WITH_AS(tr.begin_group(me), doctest::Contains("groups do not nest"), Error);
  CHECK_THROWS_WITH_AS(tr.flush(me), doctest::Contains("inside the open group"), Error);
  tr.end_group(me);
}

TEST_CASE("a message that cannot travel raises an error naming it, and nothing hangs") {
  World& w = world();
  NcclTransport& tr = *w.transport;
  const int me = w.rank, peer = 1 - w.rank;
  // Refused before anything is sent.
  CHECK_THROWS_WITH_AS(tr.send(me, peer, {kAct, 40}, Tensor::empty({1, 1, 1, 1, 1, 1, 1, 1, 2}, DType::kF32, w.device)),
                       doctest::Contains("activation of micro-batch 40"), Error);
  CHECK_THROWS_WITH_AS(tr.send(me, peer, {kAct, 40}, pattern({3}, DType::kF32, 0)),
                       doctest::Contains("activation of micro-batch 40"), Error);
  CHECK_THROWS_AS(tr.recv(me, peer, {kGrad, 40}, Device::cpu()), Error);

  // Headers that announce no valid size: refused on arrival, before any NCCL receive is
  // posted, so neither rank is left with a transfer the other never matches.
  struct Bad {
    int micro_batch;
    std::vector<int64_t> words;
  };
  const std::vector<Bad> bad = {
      {41, {0, 12}},                        // 12 dimensions
      {42, {1, 2, 3, -4}},                  // a negative size
      {43, {9, 1, 3}},                      // no such element type
      {44, {0, 2, 1LL << 40, 1LL << 40}},   // more elements than fit anywhere
  };
  for (const Bad& b : bad) {
    CAPTURE(b.micro_batch);
    if (w.rank == 0) {
      MessageHeader h{};
      for (size_t i = 0; i < b.words.size(); ++i) h[i] = b.words[i];
      REQUIRE(MPI_Send(h.data(), kMessageHeaderWords, MPI_INT64_T, 1, tr.mpi_tag({kAct, b.micro_batch}),
                       MPI_COMM_WORLD) == MPI_SUCCESS);
    } else {
      CHECK_THROWS_WITH_AS(tr.recv(1, 0, {kAct, b.micro_batch}, w.device),
                           doctest::Contains(("activation of micro-batch " + std::to_string(b.micro_batch)).c_str()), Error);
    }
  }
  // The transport still works afterwards.
  if (w.rank == 0) {
    tr.send(0, 1, {kAct, 45}, to_device(pattern({6}, DType::kF32, 1)));
  } else {
    CHECK(device_values(tr.recv(1, 0, {kAct, 45}, w.device)) == values(pattern({6}, DType::kF32, 1)));
  }
  tr.flush(w.rank);
}

TEST_CASE("host collectives over the stages") {
  World& w = world();
  NcclTransport& tr = *w.transport;
  CHECK(tr.all_reduce_sum(w.rank, w.rank + 1.0) == 3.0);
  const auto gathered = tr.gather_to_first(w.rank, {static_cast<double>(w.rank), 2.0 * w.rank});
  if (w.rank == 0) {
    CHECK(gathered == std::vector<std::vector<double>>{{0, 0}, {1, 2}});
  } else {
    CHECK(gathered.empty());
  }
}

TEST_CASE("a replica group sums device tensors in place") {
  World& w = world();
  NcclReplicaGroup& g = *w.replicas;
  CHECK(g.size() == 2);
  for (DType dt : {DType::kF32, DType::kF64}) {
    // Rank r holds base r + 1: the sum is pattern(1) + pattern(2) = 3 + i / 2.
    auto expected = [&](const Shape& s) {
      std::vector<double> want = values(pattern(s, dt, 1));
      const std::vector<double> other = values(pattern(s, dt, 2));
      for (size_t i = 0; i < want.size(); ++i) want[i] += other[i];
      return want;
    };
    Tensor t = to_device(pattern({1000}, dt, w.rank + 1));
    g.all_reduce_sum(t);
    CHECK(device_values(t) == expected({1000}));

    Tensor a = to_device(pattern({257}, dt, w.rank + 1));
    Tensor b = to_device(pattern({3, 7}, dt, w.rank + 1));
    g.start_all_reduce_sum(a);
    g.start_all_reduce_sum(b);
    g.progress();
    g.wait_all();
    CHECK(device_values(a) == expected({257}));
    CHECK(device_values(b) == expected({3, 7}));
  }
  Tensor host = pattern({5}, DType::kF64, w.rank);
  g.all_reduce_sum(host);
  CHECK(values(host) == std::vector<double>{1, 1.5, 2, 2.5, 3});
  CHECK(g.all_reduce_sum(w.rank + 0.5) == 2.0);
  Tensor ints = to_device(Tensor::from_vector<int32_t>({1, 2}, {2}));
  CHECK_THROWS_AS(g.all_reduce_sum(ints), Error);
}

TEST_CASE("a replica group reduce-scatters and all-gathers device tensors (sharded optimizer state)") {
  World& w = world();
  NcclReplicaGroup& g = *w.replicas;
  CHECK(g.rank() == w.rank);  // the group is MPI_COMM_WORLD's two ranks
  for (DType dt : {DType::kF32, DType::kF64}) {
    // Two blocks of 5; rank r gives pattern(r + 1) and keeps block r of the sum.
    Tensor full = to_device(pattern({10}, dt, w.rank + 1));
    Tensor block = to_device(pattern({5}, dt, 0));
    g.reduce_scatter_sum(full, block);
    std::vector<double> sum = values(pattern({10}, dt, 1));
    const std::vector<double> other = values(pattern({10}, dt, 2));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += other[i];
    CHECK(device_values(block) == std::vector<double>(sum.begin() + 5 * w.rank, sum.begin() + 5 * w.rank + 5));
    // Block r of the gathered tensor is rank r's.
    Tensor mine = to_device(pattern({5}, dt, w.rank + 1));
    Tensor gathered = to_device(pattern({10}, dt, 0));
    g.all_gather(mine, gathered);
    std::vector<double> want = values(pattern({5}, dt, 1));
    const std::vector<double> second = values(pattern({5}, dt, 2));
    want.insert(want.end(), second.begin(), second.end());
    CHECK(device_values(gathered) == want);
  }
  Tensor wrong = to_device(pattern({9}, DType::kF64, 1));
  Tensor five = to_device(pattern({5}, DType::kF64, 1));
  CHECK_THROWS_AS(g.reduce_scatter_sum(wrong, five), Error);  // 9 is not 2 blocks of 5
}

TEST_CASE("a tensor group beside the replicas: both groups' collectives and the pipeline's transfers in one chain") {
  World& w = world();
  NcclTransport& tr = *w.transport;
  NcclReplicaGroup& g = *w.tensor;
  CHECK(g.takes(w.device));
  CHECK(g.takes(Device::cpu()));
  CHECK_FALSE(g.takes(Device::cuda(w.device.index + 1)));
  CHECK(g.rank() == w.rank);
  for (DType dt : {DType::kF32, DType::kF64}) {
    // Program order, the same on both ranks: a transfer each way, a tensor-group sum, a
    // replica sum started, a tensor-group all-gather and reduce-scatter, the replica
    // sum waited for. Each NCCL call comes after the ones queued before it.
    Tensor sent = to_device(pattern({64}, dt, 10 + w.rank));
    if (w.rank == 0) {
      tr.send(0, 1, {kAct, 40}, sent);
    } else {
      tr.send(1, 0, {kGrad, 40}, sent);
    }
    Tensor got = w.rank == 0 ? tr.recv(0, 1, {kGrad, 40}, w.device) : tr.recv(1, 0, {kAct, 40}, w.device);
    Tensor t = to_device(pattern({1000}, dt, w.rank + 1));
    g.all_reduce_sum(t);
    Tensor r = to_device(pattern({300}, dt, 3 * w.rank));
    w.replicas->start_all_reduce_sum(r);
    Tensor mine = to_device(pattern({6}, dt, w.rank + 1));
    Tensor gathered = to_device(pattern({12}, dt, 0));
    g.all_gather(mine, gathered);
    Tensor full = to_device(pattern({12}, dt, w.rank + 1));
    Tensor block = to_device(pattern({6}, dt, 0));
    g.reduce_scatter_sum(full, block);
    w.replicas->wait_all();
    tr.flush(w.rank);  // waits for both groups' collectives too

    CHECK(device_values(got) == values(pattern({64}, dt, 10 + (1 - w.rank))));
    auto sum_of = [&](const Shape& s, double b0, double b1) {
      std::vector<double> want = values(pattern(s, dt, b0));
      const std::vector<double> other = values(pattern(s, dt, b1));
      for (size_t i = 0; i < want.size(); ++i) want[i] += other[i];
      return want;
    };
    CHECK(device_values(t) == sum_of({1000}, 1, 2));
    CHECK(device_values(r) == sum_of({300}, 0, 3));
    std::vector<double> want = values(pattern({6}, dt, 1));
    const std::vector<double> second = values(pattern({6}, dt, 2));
    want.insert(want.end(), second.begin(), second.end());
    CHECK(device_values(gathered) == want);
    const std::vector<double> sum = sum_of({12}, 1, 2);
    CHECK(device_values(block) == std::vector<double>(sum.begin() + 6 * w.rank, sum.begin() + 6 * w.rank + 6));
  }
  CHECK(tr.sends_in_flight() == 0);
  CHECK(tr.receives_in_flight() == 0);
}

// Run with --stuck=MODE: rank 1 stops taking part, rank 0 waits on NCCL work that
// needs it. Returns only if rank 0's wait ended without it (a failure).
int run_stuck(const std::string& mode) {
  World& w = world();
  NcclTransport& tr = *w.transport;
  tr.set_step(12);
  w.replicas->set_step(12);
  w.tensor->set_step(12);
  std::printf("nccl_transport_check: rank %d pid %d ready\n", w.rank, static_cast<int>(::getpid()));
  std::fflush(stdout);
  if (w.rank == 1) {
    if (mode == "recv") {
      // A header announcing data that never follows.
      MessageHeader h = encode_header(Tensor::empty({1024}, DType::kF32, Device::cpu()), {kAct, 4});
      MPI_Send(h.data(), kMessageHeaderWords, MPI_INT64_T, 0, tr.mpi_tag({kAct, 4}), MPI_COMM_WORLD);
    }
    for (;;) ::pause();  // alive, posting nothing; ended by rank 0's MPI_Abort
  }
  if (mode == "send") {
    // (8 Mi) float32: completes only once rank 1 receives it.
    tr.send(0, 1, {kAct, 3}, to_device(pattern({8 << 20}, DType::kF32, 0)));
    tr.flush(0);
  } else if (mode == "recv") {
    tr.recv(0, 1, {kAct, 4}, w.device);
    tr.flush(0);
  } else if (mode == "replica") {
    Tensor g = to_device(pattern({1000}, DType::kF32, 0));
    w.replicas->start_all_reduce_sum(g);
    w.replicas->wait_all();
    tr.flush(0);
  } else if (mode == "tensor") {
    // A tensor group's sum as a split layer queues it: the host goes on, the transport's
    // flush waits for it.
    Tensor t = to_device(pattern({1000}, DType::kF32, 0));
    w.tensor->all_reduce_sum(t);
    tr.flush(0);
  } else {
    std::fprintf(stderr, "nccl_transport_check: unknown --stuck mode '%s' (send, recv, replica or tensor)\n",
                 mode.c_str());
    return 2;
  }
  std::fprintf(stderr, "nccl_transport_check: the stuck %s finished without rank 1\n", mode.c_str());
  return 3;
}

}  // namespace
}  // namespace gpipe

int main(int argc, char** argv) {
  using namespace gpipe;
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    std::fprintf(stderr, "nccl_transport_check: run with 2 ranks (mpirun -np 2)\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  std::string stuck;
  double timeout_s = kDefaultTimeoutS;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--stuck=", 0) == 0) {
      stuck = a.substr(8);
      timeout_s = 2;
    }
  }
  init_logging("info");
  int rc = 0;
  const int gpus = cuda_device_count();
  if (gpus < 2) {
    // One node: both ranks see the same count, so both skip.
    if (rank == 0) testing::report_skipped("needs 2 GPUs, one per rank; " + std::to_string(gpus) + " visible");
  } else {
    try {
      World& w = world();
      w.rank = rank;
      w.device = Device::cuda(node_local_rank(MPI_COMM_WORLD) % gpus);
      bind_thread_to_device(w.device);  // before any CUDA call, as gpipe's main does
      w.compute = &compute_stream_for(w.device);
      w.transport = std::make_unique<NcclTransport>(MPI_COMM_WORLD, w.device, *w.compute, timeout_s);
      // Its all-reduces ordered against the transport's sends and receives.
      w.replicas =
          std::make_unique<NcclReplicaGroup>(MPI_COMM_WORLD, w.device, *w.compute, w.transport.get(), timeout_s);
      // A second group attached to the same transport, as a stage's tensor group is.
      w.tensor = std::make_unique<NcclReplicaGroup>(MPI_COMM_WORLD, w.device, *w.compute, w.transport.get(),
                                                    timeout_s, "the stage's tensor group");
      if (!stuck.empty()) {
        rc = run_stuck(stuck);
        MPI_Abort(MPI_COMM_WORLD, rc);
      }
      doctest::Context context;
      context.applyCommandLine(argc, argv);
      rc = context.run();
      w.tensor.reset();
      w.replicas.reset();
      w.transport.reset();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "nccl_transport_check: rank %d: %s\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rc == 0) std::printf("nccl_transport_check: rank %d ok\n", rank);
  }
  MPI_Finalize();
  return rc;
}
