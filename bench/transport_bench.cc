// Point-to-point sweep of a Transport in the manner of nccl-tests: sizes from 4 KB to
// 256 MB, warm-up, many iterations, ping-pong between stage 0 and stage 1, one-way
// latency and bandwidth, and a check of the data that arrived.
//
//   transport_bench            two threads of one process, the in-process transport
//   mpirun -np 2 transport_bench   two processes, MpiTransport
// Prints one JSON line per size (from stage 0).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "runtime/mpi_transport.h"

using namespace gpipe;

namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Stage `me` of the ping-pong for one size; stage 0 returns the timing.
nlohmann::json ping_pong(Transport& tr, int me, int64_t bytes, const char* name) {
  const int64_t n = bytes / 4;
  const int warmup = 5;
  const int iters = static_cast<int>(std::max<int64_t>(5, std::min<int64_t>(1000, (int64_t{1} << 31) / bytes)));
  Tensor msg = Tensor::empty({n}, DType::kF32, Device::cpu());
  for (int64_t i = 0; i < n; ++i) msg.data<float>()[i] = static_cast<float>(i % 1021);
  double t0 = 0;
  Tensor back;
  for (int it = 0; it < warmup + iters; ++it) {
    if (it == warmup) t0 = now_s();
    if (me == 0) {
      tr.send(0, 1, {MessageKind::kActivation, it}, msg);
      back = tr.recv(0, 1, {MessageKind::kGradient, it}, Device::cpu());
    } else {
      Tensor got = tr.recv(1, 0, {MessageKind::kActivation, it}, Device::cpu());
      tr.send(1, 0, {MessageKind::kGradient, it}, got);
    }
  }
  const double one_way = (now_s() - t0) / iters / 2;
  bool ok = true;  // the data that made the round trip, checked outside the timing
  if (me == 0) {
    const float* p = back.data<float>();
    for (int64_t i = 0; i < n; ++i) ok = ok && p[i] == static_cast<float>(i % 1021);
  }
  return {{"bench", "transport"}, {"transport", name}, {"bytes", bytes}, {"iterations", iters},
          {"latency_us", one_way * 1e6}, {"bandwidth_GBps", bytes / one_way / 1e9}, {"data_ok", ok}};
}

}  // namespace

int main(int argc, char** argv) {
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
  std::vector<int64_t> sizes;
  for (int64_t b = 4 << 10; b <= (int64_t{256} << 20); b *= 4) sizes.push_back(b);
  try {
    if (under_mpi) {
      MPI_Init(&argc, &argv);
      MpiTransport tr(MPI_COMM_WORLD);
      if (tr.size() != 2) throw UserError("run with mpirun -np 2");
      for (int64_t b : sizes) {
        auto j = ping_pong(tr, tr.rank(), b, "mpi");
        if (tr.rank() == 0) std::printf("%s\n", j.dump().c_str());
      }
      MPI_Finalize();
    } else {
      for (int64_t b : sizes) {
        InProcessTransport tr(2);
        std::thread peer([&] { ping_pong(tr, 1, b, "in_process"); });
        auto j = ping_pong(tr, 0, b, "in_process");
        peer.join();
        std::printf("%s\n", j.dump().c_str());
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "transport_bench: %s\n", e.what());
    return 1;
  }
}
