// Tests for devices, tensors, the CPU allocator, events, the in-process transport and
// the MPI check macro.
#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "runtime/allocator.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"
#include "runtime/mpi_check.h"
#include "runtime/philox.h"
#include "runtime/random.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

using namespace gpipe;

TEST_CASE("devices parse and print") {
  CHECK(parse_device("cpu") == Device::cpu(0));
  CHECK(parse_device("cuda:3") == Device::cuda(3));
  CHECK(parse_device("cpu:1").str() == "cpu:1");
  CHECK_THROWS_AS(parse_device("tpu:0"), UserError);
  CHECK_THROWS_AS(parse_device("cuda:x"), UserError);
}

TEST_CASE("stages on one device of one process take turns on it; across processes none do") {
  const std::vector<Device> d = {Device::cpu(0), Device::cuda(0), Device::cpu(0), Device::cpu(1), Device::cuda(0)};
  CHECK(device_turns(d, true) == std::vector<int>{0, 1, 0, 3, 1});
  CHECK(device_turns(d, false) == std::vector<int>{0, 1, 2, 3, 4});
  CHECK(device_turns({}, true).empty());
}

TEST_CASE("tensor shapes, views and copies") {
  Tensor t = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK(t.numel() == 6);
  CHECK(t.nbytes() == 24);
  CHECK(t.is_contiguous());
  CHECK(t.str() == "float32(3, 2) on cpu:0");
  Tensor rows = t.narrow_rows(1, 2);
  CHECK(rows.shape() == Shape{2, 2});
  CHECK(rows.storage_id() == t.storage_id());
  CHECK(rows.to_vector<float>() == std::vector<float>{3, 4, 5, 6});
  CHECK(t.reshape({6}).shape() == Shape{6});
  CHECK_THROWS_AS(t.reshape({4}), UserError);
  CHECK_THROWS_AS(t.data<double>(), Error);
  Tensor c = Tensor::empty({2, 2}, DType::kF32, Device::cpu());
  copy_tensor(rows, c);
  CHECK(c.to_vector<float>() == std::vector<float>{3, 4, 5, 6});
  CHECK(c.storage_id() != rows.storage_id());
}

TEST_CASE("CPU allocator counts, caches and reuses blocks") {
  Allocator& a = allocator_for(Device::cpu(7));
  const auto before = a.stats();
  void* p = a.allocate(1000);
  CHECK(a.stats().in_use == before.in_use + static_cast<int64_t>(round_allocation(1000)));
  a.deallocate(p, 1000);
  CHECK(a.stats().in_use == before.in_use);
  CHECK(a.stats().cached >= static_cast<int64_t>(round_allocation(1000)));
  void* q = a.allocate(900);  // same rounded size: served from the cache
  CHECK(q == p);
  a.deallocate(q, 900);
  a.release_cache();
  CHECK(a.stats().cached == 0);
  CHECK(a.stats().peak >= static_cast<int64_t>(round_allocation(1000)));
}

TEST_CASE("CPU events measure elapsed time") {
  CpuStream s(Device::cpu());
  CpuEvent a, b;
  a.record(s);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  b.record(s);
  CHECK(a.elapsed_ms(b) >= 1.0);
}

TEST_CASE("a CUDA device this machine does not have is a clear error") {
  // cuda:N with N = the number of visible GPUs never exists: without CUDA support or a
  // GPU that is cuda:0, on a machine with GPUs the first index past them. So the test
  // runs everywhere and has one answer: an error that names the device.
  const int missing = cuda_device_count();
  const std::string name = Device::cuda(missing).str();
  CHECK_THROWS_WITH_AS(Tensor::empty({4}, DType::kF32, Device::cuda(missing)),
                       doctest::Contains(("device " + name + " requested").c_str()), UserError);
  // Still refused the second time (the failed attempt must not leave a half-made allocator).
  CHECK_THROWS_WITH_AS(Tensor::empty({4}, DType::kF32, Device::cuda(missing)), doctest::Contains(name.c_str()), UserError);
}

TEST_CASE("in-process transport hands tensors over without copying") {
  InProcessTransport tr(2);
  Tensor t = Tensor::from_vector<float>({1, 2}, {2});
  std::thread sender([&] { tr.send(0, 1, {MessageKind::kActivation, 3}, t); });
  Tensor r = tr.recv(1, 0, {MessageKind::kActivation, 3}, Device::cpu(1));
  sender.join();
  CHECK(r.storage_id() == t.storage_id());
  CHECK(tr.pending() == 0);
}

TEST_CASE("messages are matched by kind and micro-batch, not by arrival order") {
  InProcessTransport tr(2);
  tr.send(1, 0, {MessageKind::kGradient, 1}, Tensor::from_vector<float>({1}, {1}));
  tr.send(1, 0, {MessageKind::kGradient, 0}, Tensor::from_vector<float>({0}, {1}));
  CHECK(tr.recv(0, 1, {MessageKind::kGradient, 0}, Device::cpu()).to_vector<float>()[0] == 0.0f);
  CHECK(tr.recv(0, 1, {MessageKind::kGradient, 1}, Device::cpu()).to_vector<float>()[0] == 1.0f);
  // The same key twice among one executor's stages: a schedule's bug, refused.
  CHECK_THROWS_AS(
      [&] {
        tr.send(0, 1, {MessageKind::kActivation, 0}, Tensor::from_vector<float>({1}, {1}));
        tr.send(0, 1, {MessageKind::kActivation, 0}, Tensor::from_vector<float>({1}, {1}));
      }(),
      Error);
  // Between separate executors (ranks as threads): a stage a program ahead of its
  // neighbour sends the same key again, and they wait in sending order, as MPI's do.
  InProcessTransport ranks(2, kDefaultTimeoutS, /*ordered_repeats=*/true);
  for (float v : {5.0f, 6.0f, 7.0f}) {
    ranks.send(0, 1, {MessageKind::kActivation, 0}, Tensor::from_vector<float>({v}, {1}));
  }
  for (float v : {5.0f, 6.0f, 7.0f}) {
    CHECK(ranks.recv(1, 0, {MessageKind::kActivation, 0}, Device::cpu()).to_vector<float>()[0] == v);
  }
  CHECK(ranks.pending() == 0);
}

TEST_CASE("abort wakes a blocked receiver") {
  InProcessTransport tr(2);
  std::atomic<bool> got_abort{false};
  std::thread waiter([&] {
    try {
      tr.recv(1, 0, {MessageKind::kActivation, 0}, Device::cpu());
    } catch (const Aborted& e) {
      got_abort = std::string(e.what()).find("stage 0 failed") != std::string::npos;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  tr.abort("stage 0 failed");
  waiter.join();
  CHECK(got_abort);
  CHECK_THROWS_AS(tr.send(0, 1, {MessageKind::kActivation, 1}, Tensor::from_vector<float>({1}, {1})), Aborted);
}

TEST_CASE("MPI check macro names the call and MPI's message") {
  try {
    GPIPE_MPI_CHECK(MPI_ERR_COUNT);
    FAIL("no throw");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("MPI_ERR_COUNT") != std::string::npos);
    CHECK(msg.find("runtime_test.cc") != std::string::npos);
  }
}

TEST_CASE("the generator is deterministic and roughly uniform") {
  Rng a(42), b(42);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const double u = a.uniform();
    CHECK(u == b.uniform());
    sum += u;
  }
  CHECK(sum / 10000 == doctest::Approx(0.5).epsilon(0.02));
}

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors") {
  const Philox4x32 zero = philox4x32_10({{0, 0, 0, 0}}, 0, 0);
  CHECK(zero.v[0] == 0x6627e8d5u);
  CHECK(zero.v[1] == 0xe169c58du);
  CHECK(zero.v[2] == 0xbc57ac4cu);
  CHECK(zero.v[3] == 0x9b00dbd8u);
  const Philox4x32 ones = philox4x32_10({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  CHECK(ones.v[0] == 0x408f276du);
  CHECK(ones.v[1] == 0x41c83b0eu);
  CHECK(ones.v[2] == 0xa20bc7c6u);
  CHECK(ones.v[3] == 0x6d5451fdu);
  const Philox4x32 pi = philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  CHECK(pi.v[0] == 0xd16cfe09u);
  CHECK(pi.v[1] == 0x94fdccebu);
  CHECK(pi.v[2] == 0x5001e420u);
  CHECK(pi.v[3] == 0x24126ea1u);
  // Uniforms depend only on (key, sample, element).
  CHECK(philox_uniform(7, 3, 11) == philox_uniform(7, 3, 11));
  CHECK(philox_uniform(7, 3, 11) != philox_uniform(7, 4, 11));
  double sum = 0;
  for (int i = 0; i < 4000; ++i) sum += philox_uniform(1, i / 4, i % 4);
  CHECK(sum / 4000 == doctest::Approx(0.5).epsilon(0.03));
}

TEST_CASE("all_reduce_sum adds in stage order, whatever order the stages arrive in") {
  // (1 + 1e16) - 1e16 = 0 in doubles, (1e16 - 1e16) + 1 = 1: stages 1, 2, 0 arrive in
  // that order (each a little after the previous), and the total is stage 0's + stage
  // 1's + stage 2's all the same, as MpiTransport's.
  InProcessTransport tr(3);
  const double value[3] = {1.0, 1e16, -1e16};
  std::vector<double> got(3, -1);
  std::vector<std::thread> ts;
  for (int k : {1, 2, 0}) {
    ts.emplace_back([&, k] { got[k] = tr.all_reduce_sum(k, value[k]); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& t : ts) t.join();
  for (int k = 0; k < 3; ++k) CHECK(got[k] == (1.0 + 1e16) - 1e16);
}

TEST_CASE("all_reduce_sum gives every stage the total, round after round") {
  InProcessTransport tr(3);
  std::vector<double> got(3);
  for (int round = 0; round < 3; ++round) {
    std::vector<std::thread> ts;
    for (int k = 0; k < 3; ++k) ts.emplace_back([&, k] { got[k] = tr.all_reduce_sum(k, k + 1.0 + round); });
    for (auto& t : ts) t.join();
    for (int k = 0; k < 3; ++k) CHECK(got[k] == 6.0 + 3 * round);
  }
  std::thread waiter([&] { CHECK_THROWS_AS(tr.all_reduce_sum(0, 1.0), Aborted); });
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  tr.abort("stage 2 failed");
  waiter.join();
}
