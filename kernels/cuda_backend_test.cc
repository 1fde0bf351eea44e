// Conformance of the CUDA backend with the CPU reference: every Backend op runs on
// cuda:0 and on cpu:0 with the same random inputs and the results are compared, for
// float32 and float64, at odd sizes (the ops the CPU computes in the same order, such
// as embedding and dropout, bit for bit). Also covers the CUDA runtime pieces (allocator,
// streams, events, copies). Without a visible GPU it prints the skip marker and passes.
#include "tests/gpu_testing.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_kernels.h"
#include "kernels/widening_backend.h"
#include "runtime/allocator.h"
#include "runtime/cuda_runtime.h"
#include "runtime/device.h"
#include "runtime/bf16.h"
#include "runtime/error.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"
#include "tests/testing.h"

namespace gpipe {
namespace {

using testing::random_labels;
using testing::random_tensor;
using testing::to_doubles;

using namespace gpu_testing;

// Holds a stream at the point where it is created until release(): a host function
// queued there waits for a flag (it makes no CUDA call, as cudaLaunchHostFunc requires).
// So a test can tell "returned without waiting for the stream" from "waited", without
// timing anything: a call that waits for the held stream could only return after the
// release. A watchdog releases the stream after a minute, so such a wrong wait fails a
// check instead of hanging the test.
class StreamGate {
 public:
  explicit StreamGate(Stream& s) : stream_(static_cast<cudaStream_t>(s.native())) {
    GPIPE_CUDA_CHECK(cudaLaunchHostFunc(stream_, &StreamGate::hold, this));
    watchdog_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(60), [this] { return released_; })) {
        by_watchdog_ = true;
        released_ = true;
        cv_.notify_all();
      }
    });
  }
  ~StreamGate() {
    release();
    // hold() may still be leaving its wait on CUDA's callback thread: the stream is done
    // only once it has returned, so that it never touches a destroyed mutex (an H200 run
    // aborted with EINVAL when this waited for the watchdog alone).
    cudaStreamSynchronize(stream_);
    watchdog_.join();
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  bool released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }

 private:
  static void CUDART_CB hold(void* self) {
    auto* g = static_cast<StreamGate*>(self);
    std::unique_lock<std::mutex> lock(g->mu_);
    g->cv_.wait(lock, [g] { return g->released_; });
  }
  cudaStream_t stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false, by_watchdog_ = false;
  std::thread watchdog_;
};

// Host tensor of `shape` with every element = value (NaN allowed).
Tensor host_full(const Shape& shape, DType dt, double value) {
  Tensor t = Tensor::empty(shape, dt, Device::cpu());
  cpu().fill(t, value);
  return t;
}

bool all_finite(const Tensor& t) {
  for (double v : to_doubles(t)) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------
// Runtime

TEST_CASE("the CUDA runtime sees the device") {
  CHECK(cuda_device_count() >= 1);
  CHECK(cuda_runtime_device_count() == cuda_device_count());
  CHECK(gpu().device() == kGpu);
  CHECK(gpu().stream().native() != nullptr);
}

TEST_CASE("allocator: stats, cache reuse, release_cache") {
  Allocator& al = allocator_for(kGpu);
  CHECK(al.device() == kGpu);
  al.release_cache();
  const MemoryStats before = al.stats();
  CHECK(before.cached == 0);

  const size_t bytes = 1000;
  const int64_t rounded = static_cast<int64_t>(round_allocation(bytes));
  void* p = al.allocate(bytes);
  REQUIRE(p != nullptr);
  MemoryStats s = al.stats();
  CHECK(s.in_use == before.in_use + rounded);
  CHECK(s.peak >= s.in_use);
  // The block was carved from a 2 MiB segment (runtime/block_pool.h); the rest is cached.
  CHECK(s.reserved == s.in_use + s.cached);
  CHECK(s.reserved >= before.reserved + (2 << 20));

  // The block is usable device memory.
  std::vector<float> in(250), out(250, 0.0f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * 0.5f;
  cuda_copy(in.data(), Device::cpu(), p, kGpu, bytes);
  cuda_copy(p, kGpu, out.data(), Device::cpu(), bytes);
  CHECK(out == in);

  const int64_t reserved = s.reserved;
  al.deallocate(p, bytes);
  s = al.stats();
  CHECK(s.in_use == before.in_use);
  CHECK(s.cached == reserved - s.in_use);

  void* q = al.allocate(bytes);  // the same stream: the freed block at once
  CHECK(q == p);
  s = al.stats();
  CHECK(s.reserved == reserved);
  CHECK(s.in_use == before.in_use + rounded);
  al.deallocate(q, bytes);

  al.reset_peak();
  CHECK(al.stats().peak == al.stats().in_use);
  al.release_cache();
  CHECK(al.stats().cached == 0);
  al.deallocate(nullptr, 0);  // no-op
}

TEST_CASE("allocator: out of memory is a UserError naming the device and the fix, and CUDA keeps working") {
  Allocator& al = allocator_for(kGpu);
  const size_t huge = size_t(1) << 50;  // 1 PiB
  const int64_t in_use = al.stats().in_use;
  bool thrown = false;
  try {
    al.allocate(huge);
  } catch (const UserError& e) {
    thrown = true;
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find("cuda:0") != std::string::npos);
    CHECK(msg.find(std::to_string(round_allocation(huge))) != std::string::npos);
    CHECK(msg.find("train.batch_size") != std::string::npos);
    CHECK(msg.find("pipeline.micro_batches") != std::string::npos);
    CHECK(msg.find("pipeline.partitions") != std::string::npos);
  }
  CHECK(thrown);
  CHECK(al.stats().in_use == in_use);
  // The failed cudaMalloc must not linger as the "last error" of the next launch check.
  Tensor t = gpu().empty({1000}, DType::kF32);
  gpu().fill(t, 2.5);
  gpu().scale(t, 2.0);
  CHECK(to_doubles(t) == std::vector<double>(1000, 5.0));
}

TEST_CASE("allocator: a block another stream used returns to its own stream only after that stream's work") {
  Allocator& al = allocator_for(kGpu);
  auto receive = make_stream(kGpu);  // e.g. the NCCL receive stream
  Stream& compute = gpu().stream();
  const size_t bytes = 3 << 20;
  // A cached block for compute first: nothing below may need cudaMalloc (or, failing it,
  // a device-wide wait) while the gate holds the stream.
  al.deallocate(al.allocate(bytes), bytes);
  void* p = al.allocate_for(bytes, *receive);
  {
    StreamGate gate(compute);  // compute has not reached its use of the block yet
    al.record_stream(p, compute);
    al.deallocate(p, bytes);
    void* q = al.allocate_for(bytes, *receive);
    CHECK(q != p);  // not handed out while compute may still use it
    al.deallocate(q, bytes);
    void* c = al.allocate(bytes);  // nor to another stream, ever
    CHECK(c != p);
    al.deallocate(c, bytes);
    CHECK_FALSE(gate.released());
  }
  compute.synchronize();
  void* r = al.allocate_for(bytes, *receive);
  CHECK(r == p);  // compute passed the event: the receive stream's again
  al.deallocate(r, bytes);
}

TEST_CASE("a copy from the host returns without waiting for the stream and keeps the values it was given") {
  for (int via_copy_tensor = 0; via_copy_tensor < 2; ++via_copy_tensor) {
    CAPTURE(via_copy_tensor);
    Tensor host = random_tensor({100000}, DType::kF32, 5);
    const std::vector<double> want = to_doubles(host);
    Tensor dev = gpu().empty(host.shape(), DType::kF32);
    // A pinned staging block of this size cached first (cudaHostAlloc might wait for the
    // device), free again once the stream is idle.
    gpu().copy(host, dev);
    gpu().synchronize();
    bool returned_while_held = false;
    {
      StreamGate gate(gpu().stream());  // the stream the copy is queued on
      if (via_copy_tensor) {
        copy_tensor(host, dev);
      } else {
        gpu().copy(host, dev);
      }
      returned_while_held = !gate.released();
      cpu().fill(host, -1.0);  // the source may change at once: the copy took its bytes
    }
    CHECK(returned_while_held);
    CHECK(to_doubles(dev) == want);
  }
}

TEST_CASE("two stages sharing the backend each get their own deferred label error") {
  Tensor logits = to_gpu(random_tensor({4, 5}, DType::kF32, 9));
  Tensor probs = gpu().empty({4, 5}, DType::kF32), loss = gpu().empty({1}, DType::kF32);
  Tensor bad = to_gpu(Tensor::from_vector<int32_t>({0, 7, 1, 2}, {4}));  // 7 is outside [0, 5)
  std::promise<void> queued, b_waited;
  std::future<void> queued_f = queued.get_future(), b_waited_f = b_waited.get_future();
  std::string error_a = "none", error_b = "none";
  // Stage A queues the bad batch; stage B waits for the GPU first; then A waits.
  std::thread a([&] {
    gpu().softmax_xent(logits, bad, 1.0, -100, probs, loss);
    queued.set_value();
    b_waited_f.wait();
    try {
      gpu().synchronize();
    } catch (const UserError& e) {
      error_a = e.what();
    }
  });
  std::thread b([&] {
    queued_f.wait();
    try {
      gpu().synchronize();
    } catch (const std::exception& e) {
      error_b = e.what();
    }
    b_waited.set_value();
  });
  a.join();
  b.join();
  CHECK(error_b == "none");  // A's bad batch is not B's error
  CHECK(error_a.find("label 7 in row 1") != std::string::npos);
}

TEST_CASE("stream and event: timing is non-negative, waits do not fail") {
  auto stream = make_stream(kGpu);
  CHECK(stream->device() == kGpu);
  CHECK(stream->native() != nullptr);
  CHECK(stream->native() != gpu().stream().native());
  auto start = make_event(kGpu);
  auto stop = make_event(kGpu);

  Tensor big = gpu().empty({1 << 22}, DType::kF32);
  start->record(gpu().stream());
  gpu().fill(big, 1.0);
  gpu().scale(big, 3.0);
  stop->record(gpu().stream());
  stream->wait(*stop);  // the other stream orders itself after the backend's work
  stream->synchronize();
  stop->synchronize();
  const double ms = start->elapsed_ms(*stop);
  CHECK(ms >= 0.0);
  CHECK(std::isfinite(ms));
  gpu().synchronize();

  // An event recorded on the second stream, waited for by the backend's stream.
  auto mark = make_event(kGpu);
  mark->record(*stream);
  gpu().stream().wait(*mark);
  gpu().synchronize();

  CpuEvent cpu_event;
  CHECK_THROWS_AS(stream->wait(cpu_event), Error);
  CpuStream cpu_stream(Device::cpu());
  CHECK_THROWS_AS(mark->record(cpu_stream), Error);
}

TEST_CASE("cuda_copy and copy_tensor round trips are exact") {
  const int64_t n = 12345;
  Tensor host = random_tensor({n}, DType::kF64, 7);
  Allocator& al = allocator_for(kGpu);
  const size_t bytes = host.nbytes();
  void* d1 = al.allocate(bytes);
  void* d2 = al.allocate(bytes);
  cuda_copy(host.raw_data(), Device::cpu(), d1, kGpu, bytes);
  cuda_copy(d1, kGpu, d2, kGpu, bytes);
  Tensor back = Tensor::empty({n}, DType::kF64, Device::cpu());
  cuda_copy(d2, kGpu, back.raw_data(), Device::cpu(), bytes);
  CHECK(to_doubles(back) == to_doubles(host));
  al.deallocate(d1, bytes);
  al.deallocate(d2, bytes);

  Tensor dev = Tensor::empty({n}, DType::kF64, kGpu);
  copy_tensor(host, dev);
  Tensor dev2 = Tensor::empty({n}, DType::kF64, kGpu);
  copy_tensor(dev, dev2);
  Tensor back2 = Tensor::empty({n}, DType::kF64, Device::cpu());
  copy_tensor(dev2, back2);
  CHECK(to_doubles(back2) == to_doubles(host));
}

TEST_CASE("copy_tensor waits for work queued on the backend's non-blocking stream") {
  const int64_t n = (int64_t(1) << 24) + 77;
  Tensor t = gpu().empty({n}, DType::kF32);
  gpu().fill(t, 1.0);
  for (int i = 0; i < 8; ++i) gpu().axpy(1.0, t, t);  // 256 when done, no synchronize
  Tensor host = Tensor::empty({n}, DType::kF32, Device::cpu());
  copy_tensor(t, host);
  const float* p = host.data<float>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += p[i] != 256.0f;
  CHECK(wrong == 0);
}

TEST_CASE("backend copy: host to device, device to device, device to host") {
  for (DType dt : kFloatTypes) {
    Tensor host = random_tensor({257, 129}, dt, 11);
    Tensor d1 = gpu().empty(host.shape(), dt);
    Tensor d2 = gpu().empty(host.shape(), dt);
    gpu().copy(host, d1);
    gpu().copy(d1, d2);
    Tensor back = Tensor::empty(host.shape(), dt, Device::cpu());
    gpu().copy(d2, back);
    CHECK(to_doubles(back) == to_doubles(host));
    Tensor host2 = Tensor::empty(host.shape(), dt, Device::cpu());
    gpu().copy(host, host2);
    CHECK(to_doubles(host2) == to_doubles(host));
  }
  Tensor empty_host = Tensor::empty({0, 3}, DType::kF32, Device::cpu());
  Tensor empty_dev = gpu().empty({0, 3}, DType::kF32);
  gpu().copy(empty_host, empty_dev);
}

TEST_CASE("transpose_blocks on the GPU equals the CPU's bit for bit, any element type") {
  const int64_t cases[][3] = {{16, 2, 257}, {4, 4096, 1}, {2, 3, 5}, {1, 3, 4}, {4, 1, 2}};
  for (DType dt : {DType::kF64, DType::kF32, DType::kBF16, DType::kI32}) {
    for (const auto& c : cases) {
      const int64_t rows = c[0], cols = c[1], block = c[2];
      INFO(dtype_name(dt) << " " << rows << " x " << cols << " blocks of " << block);
      Tensor host = Tensor::empty({rows * cols * block}, dt, Device::cpu());
      auto* bytes = static_cast<uint8_t*>(host.raw_data());
      for (size_t i = 0; i < host.nbytes(); ++i) bytes[i] = static_cast<uint8_t>((i * 37 + 11) % 251);
      Tensor want = Tensor::empty({cols, rows, block}, dt, Device::cpu());
      backend_for(Device::cpu()).transpose_blocks(host, rows, cols, want);
      Tensor src = gpu().empty(host.shape(), dt), dst = gpu().empty(want.shape(), dt);
      gpu().copy(host, src);
      gpu().transpose_blocks(src, rows, cols, dst);
      Tensor got = Tensor::empty(want.shape(), dt, Device::cpu());
      gpu().copy(dst, got);
      CHECK(std::memcmp(got.raw_data(), want.raw_data(), want.nbytes()) == 0);
    }
  }
}

TEST_CASE("item reads one element of each dtype") {
  Tensor f = gpu().empty({1}, DType::kF32);
  gpu().fill(f, 1.25);
  CHECK(gpu().item(f) == 1.25);
  Tensor d = gpu().empty({1, 1}, DType::kF64);
  gpu().fill(d, -3.5);
  CHECK(gpu().item(d) == -3.5);
  Tensor i = gpu().empty({1}, DType::kI32);
  gpu().fill(i, 7.0);
  CHECK(gpu().item(i) == 7.0);
  Tensor h = Tensor::from_vector<double>({4.75}, {1});
  CHECK(gpu().item(h) == 4.75);
  Tensor two = gpu().empty({2}, DType::kF32);
  CHECK_THROWS_AS(gpu().item(two), Error);
}

TEST_CASE("operands on the wrong device and bfloat16 are rejected, not crashed on") {
  Tensor host = random_tensor({4, 5}, DType::kF32, 3);
  Tensor dev = gpu().empty({4, 5}, DType::kF32);
  CHECK_THROWS_AS(gpu().relu(host, dev), Error);
  CHECK_THROWS_AS(gpu().relu(dev, host), Error);
  Tensor c = gpu().empty({4, 4}, DType::kF32);
  CHECK_THROWS_AS(gpu().matmul(host, false, dev, true, c, 1.0, 0.0), Error);
  Tensor bf = Tensor::empty({4}, DType::kBF16, kGpu);
  Backend& bare = static_cast<WideningBackend&>(gpu()).inner();  // the CUDA backend itself: float32 and float64
  CHECK_THROWS_AS(bare.fill(bf, 1.0), Error);
  CHECK_THROWS_AS(bare.scale(bf, 2.0), Error);
  // The backend is still usable.
  gpu().relu(dev, dev);
  gpu().synchronize();
}

TEST_CASE("bfloat16 operands on the GPU: computed in float32, rounded once, as on the CPU") {
  Tensor bf = Tensor::empty({4}, DType::kBF16, kGpu);
  gpu().fill(bf, 1.5);
  gpu().scale(bf, 2.0);
  CHECK(to_doubles(bf) == std::vector<double>(4, 3.0));
  // A product: the CPU's and the GPU's float32 sums differ in order, so the rounded
  // results may differ by one bfloat16 step (2^-8 relative) where a sum lands near a tie.
  const Tensor a = random_tensor({16, 32}, DType::kBF16, 31), b = random_tensor({32, 8}, DType::kBF16, 32);
  Tensor c_cpu = Tensor::empty({16, 8}, DType::kBF16, Device::cpu());
  backend_for(Device::cpu()).matmul(a, false, b, false, c_cpu, 1.0, 0.0);
  Tensor c_gpu = gpu().empty({16, 8}, DType::kBF16);
  gpu().matmul(to_gpu(a), false, to_gpu(b), false, c_gpu, 1.0, 0.0);
  GPIPE_EXPECT_CLOSE(c_gpu, c_cpu, std::ldexp(1.0, -7), 1e-6);
}

// The ops the CUDA backend computes on 16-bit operands itself (computes_narrow:
// cublasGemmEx with float32 compute; kernels templated on the storage type), called on
// the bare backend so that nothing is widened around them, against the CPU reference,
// which widens (kernels/widening_backend.h). Both compute in float32 and round once on
// store, so what may differ is float32's own: the order of a product's sums, and the
// CPU's approximate erf (fast_erff, within 1.5e-7) against CUDA's erff, which the rounding
// to 16 bits hides except near a tie, where the results differ by a step of the 16-bit
// type (u = 2^-8 for bfloat16, 2^-11 for float16).
TEST_CASE("16-bit products and elementwise ops on the GPU itself equal the widened CPU reference") {
  Backend& bare = static_cast<WideningBackend&>(gpu()).inner();
  Backend& cpu = backend_for(Device::cpu());
  uint64_t seed = 700;
  for (DType t : {DType::kBF16, DType::kF16}) {
    CAPTURE(dtype_name(t));
    const double step = std::ldexp(1.0, t == DType::kBF16 ? -7 : -10);  // two units of rounding
    for (Backend::NarrowOp op : {Backend::NarrowOp::kMatmul, Backend::NarrowOp::kAddBias, Backend::NarrowOp::kRelu,
                                 Backend::NarrowOp::kReluBackward, Backend::NarrowOp::kGelu,
                                 Backend::NarrowOp::kGeluBackward}) {
      CHECK(bare.computes_narrow(op, t));
    }
    CHECK_FALSE(bare.computes_narrow(Backend::NarrowOp::kMatmul, DType::kF32));
    // Products: every transpose, beta 0 and 1/2, c in the 16-bit type and in float32
    // (a weight gradient accumulated in float32 from 16-bit activations).
    for (DType ct : {t, DType::kF32}) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          for (double beta : {0.0, 0.5}) {
            CAPTURE(dtype_name(ct));
            CAPTURE(ta);
            CAPTURE(tb);
            CAPTURE(beta);
            const int64_t m = 37, n = 19, k = 67;  // and below a long k, where cuBLAS may split K
            const Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, t, ++seed);
            const Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, t, ++seed);
            const Tensor c0 = random_tensor({m, n}, ct, ++seed);
            Tensor c_cpu = Tensor::empty({m, n}, ct, Device::cpu());
            cpu.copy(c0, c_cpu);
            cpu.matmul(a, ta, b, tb, c_cpu, -0.75, beta);
            Tensor c_gpu = to_gpu(c0);
            bare.matmul(to_gpu(a), ta, to_gpu(b), tb, c_gpu, -0.75, beta);
            // The float32 sums' own difference, |c| <= k here: k 2^-24 per element.
            GPIPE_EXPECT_CLOSE(c_gpu, c_cpu, ct == DType::kF32 ? 1e-5 : step, 1e-4);
          }
        }
      }
    }
    // A long, thin product (cuBLAS's split-K territory): the partial sums must stay float32
    // (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION); in 16 bits they would lose
    // digits of sums of 8192 terms far beyond two steps.
    {
      const Tensor a = random_tensor({8, 8192}, t, ++seed), b = random_tensor({8192, 8}, t, ++seed);
      Tensor c_cpu = Tensor::empty({8, 8}, t, Device::cpu());
      cpu.matmul(a, false, b, false, c_cpu, 1.0, 0.0);
      Tensor c_gpu = bare.empty({8, 8}, t);
      bare.matmul(to_gpu(a), false, to_gpu(b), false, c_gpu, 1.0, 0.0);
      GPIPE_EXPECT_CLOSE(c_gpu, c_cpu, step, 1e-3);
    }
    // Mixed 16-bit and float32 inputs are not cuBLAS's: the bare backend refuses them,
    // the wrapped one widens them.
    {
      const Tensor a = to_gpu(random_tensor({4, 8}, t, ++seed));
      const Tensor b = to_gpu(random_tensor({8, 3}, DType::kF32, ++seed));
      Tensor c = gpu().empty({4, 3}, t);
      CHECK_THROWS_AS(bare.matmul(a, false, b, false, c, 1.0, 0.0), Error);
      gpu().matmul(a, false, b, false, c, 1.0, 0.0);
      gpu().synchronize();
    }
    // Elementwise: relu and add_bias are exact in float32 (a max, one sum of two 16-bit
    // values), so they equal the reference bit for bit; gelu's erf may differ in
    // float32's last bit.
    const Tensor x = random_tensor({33, 70}, t, ++seed, -4.0, 4.0);
    const Tensor dy = random_tensor({33, 70}, t, ++seed);
    const Tensor bias = random_tensor({70}, t, ++seed);
    auto both = [&](auto&& f) {  // f(backend, x, dy, out) on each side; returns (gpu, cpu)
      Tensor out_cpu = Tensor::empty(x.shape(), t, Device::cpu());
      f(cpu, x, dy, out_cpu);
      Tensor out_gpu = bare.empty(x.shape(), t);
      f(bare, to_gpu(x), to_gpu(dy), out_gpu);
      return std::make_pair(to_doubles(out_gpu), to_doubles(out_cpu));
    };
    const auto relu = both([](Backend& be, const Tensor& x, const Tensor&, Tensor& y) { be.relu(x, y); });
    CHECK(relu.first == relu.second);
    const auto relu_back = both(
        [](Backend& be, const Tensor& x, const Tensor& dy, Tensor& dx) { be.relu_backward(x, dy, dx); });
    CHECK(relu_back.first == relu_back.second);
    const auto biased = both([&](Backend& be, const Tensor& x, const Tensor&, Tensor& y) {
      be.copy(x, y);
      be.add_bias(y, be.device().is_cpu() ? bias : to_gpu(bias));
    });
    CHECK(biased.first == biased.second);
    const auto gelu = both([](Backend& be, const Tensor& x, const Tensor&, Tensor& y) { be.gelu(x, y); });
    GPIPE_EXPECT_CLOSE(gelu.first, gelu.second, step, 1e-6);
    const auto gelu_back = both(
        [](Backend& be, const Tensor& x, const Tensor& dy, Tensor& dx) { be.gelu_backward(x, dy, dx); });
    GPIPE_EXPECT_CLOSE(gelu_back.first, gelu_back.second, step, 1e-6);
  }
}

// ---------------------------------------------------------------------------------
// Ops against the CPU reference

// u cast to `to` on the host (backend_for(cpu)'s cast: widened exactly, or rounded once to
// nearest even): the float32 operands of a reference, or its result in the 16-bit type.
Tensor on_host_as(const Tensor& u, DType to) {
  Tensor out = Tensor::empty(u.shape(), to, Device::cpu());
  backend_for(Device::cpu()).cast(u, out);
  return out;
}

// Each element of a 16-bit GPU result within a step of the type (and 1e-3) of one of two
// references: rounded once, or rounded as the CPU's 16-bit composition rounds (the product,
// then the sum). At most five elements named.
void check_near_either(const Tensor& got_gpu, const Tensor& once, const Tensor& twice, double step) {
  const std::vector<double> got = to_doubles(got_gpu), a = to_doubles(once), b = to_doubles(twice);
  int off = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    auto near = [&](double want) { return std::fabs(got[e] - want) <= 1e-3 + step * std::fabs(want); };
    if (!near(a[e]) && !near(b[e]) && off++ < 5) {
      INFO("element " << e << ": " << got[e] << ", rounded once " << a[e] << ", twice " << b[e]);
      CHECK(false);
    }
  }
  CHECK(off == 0);
}

// A linear layer's product with its bias in one cuBLASLt call each way (issue 37 item 5:
// the BIAS epilogue forward, BGRADB's column sums in W), called on the bare backend for
// the 16-bit types (nothing widened around it), against the CPU: its float32 product and
// bias on the widened operands, rounded once as the epilogue rounds (the CPU's 16-bit
// composition rounds the product, then the sum, and a bias that cancels the product
// leaves that first rounding larger than a step of the result), and its matmul and
// bias_grad for W. Aligned and odd sizes, and operands one row into their allocation
// (down to 2-byte alignment: cuBLASLt must not assume 256); W adds into gradients that
// hold values. float32: the sums' order and the bias's one rounding; 16-bit: under a
// step of the type. The aligned sizes must have gone through cuBLASLt (its call count),
// not the composition it falls back to.
TEST_CASE("linear_bias and linear_weight_grad (cuBLASLt's epilogues) equal the CPU's matmul, add_bias and bias_grad") {
  Backend& bare = static_cast<WideningBackend&>(gpu()).inner();
  Backend& cpu_be = backend_for(Device::cpu());  // widening: the 16-bit reference
  uint64_t seed = 9100;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    if (t != DType::kF32) CHECK(bare.computes_narrow(Backend::NarrowOp::kLinear, t));
    const double step = t == DType::kF32 ? 1e-5 : std::ldexp(1.0, t == DType::kBF16 ? -7 : -10);
    struct Size {
      int64_t r, k, n;
      int64_t offset;  // rows of x and dy skipped: a view that starts off the allocation's alignment
    };
    for (const Size& z : {Size{64, 96, 48, 0}, Size{37, 67, 19, 0}, Size{33, 40, 24, 1}, Size{33, 41, 23, 1},
                          Size{2048, 64, 32, 0}}) {
      CAPTURE(dtype_name(t));
      CAPTURE(z.r);
      CAPTURE(z.k);
      CAPTURE(z.n);
      CAPTURE(z.offset);
      const Tensor x_all = random_tensor({z.r + z.offset, z.k}, t, ++seed);
      const Tensor dy_all = random_tensor({z.r + z.offset, z.n}, t, ++seed);
      const Tensor w = random_tensor({z.n, z.k}, t, ++seed), bias = random_tensor({z.n}, t, ++seed);
      const Tensor dw0 = random_tensor({z.n, z.k}, DType::kF32, ++seed), db0 = random_tensor({z.n}, DType::kF32, ++seed);
      const Tensor x = x_all.narrow_rows(z.offset, z.r), dy = dy_all.narrow_rows(z.offset, z.r);
      const Tensor x_gpu_all = to_gpu(x_all), dy_gpu_all = to_gpu(dy_all);
      const Tensor x_gpu = x_gpu_all.narrow_rows(z.offset, z.r), dy_gpu = dy_gpu_all.narrow_rows(z.offset, z.r);
      const bool aligned = z.offset == 0 && z.k % 8 == 0 && z.n % 8 == 0;
      const int64_t calls_before = cuda_cublaslt_calls();
      // Forward: the reference in float32 on the widened operands, rounded once.
      auto wide = [](const Tensor& u) { return on_host_as(u, DType::kF32); };
      Tensor y_wide = Tensor::empty({z.r, z.n}, DType::kF32, Device::cpu());
      cpu_be.linear_bias(wide(x), wide(w), wide(bias), y_wide);
      const Tensor y_cpu = on_host_as(y_wide, t);
      Tensor y_gpu = bare.empty({z.r, z.n}, t);
      bare.linear_bias(x_gpu, to_gpu(w), to_gpu(bias), y_gpu);
      if (t == DType::kF32) {
        GPIPE_EXPECT_CLOSE(y_gpu, y_cpu, step, 1e-5);
      } else {
        // cuBLASLt may round the product to the 16-bit type before its epilogue adds the
        // bias: on an H200, for operands whose rows are not a multiple of 16 bytes, one
        // element of a product that the bias cancelled came out 0 where rounding once gives
        // -0.0013. Each element within a step of rounding once, or of the CPU's 16-bit
        // composition, which rounds the product and then the sum.
        Tensor y_twice = Tensor::empty({z.r, z.n}, t, Device::cpu());
        cpu_be.linear_bias(x, w, bias, y_twice);
        check_near_either(y_gpu, y_cpu, y_twice, step);
        if (aligned) GPIPE_EXPECT_CLOSE(y_gpu, y_cpu, step, 1e-3);  // one rounding where cuBLASLt takes the epilogue
      }
      // W, into float32 gradients (a 16-bit model's masters; a float32 model's own).
      Tensor dw_cpu = clone(dw0), db_cpu = clone(db0);
      Tensor dw_gpu = to_gpu(dw0), db_gpu = to_gpu(db0);
      cpu_be.linear_weight_grad(dy, x, dw_cpu, db_cpu);
      bare.linear_weight_grad(dy_gpu, x_gpu, dw_gpu, db_gpu);
      // float32 sums of R products or values of |.| <= 1: R 2^-24 each, far under 1e-5 of R.
      GPIPE_EXPECT_CLOSE(dw_gpu, dw_cpu, 1e-5, 1e-5 * static_cast<double>(z.r));
      GPIPE_EXPECT_CLOSE(db_gpu, db_cpu, 1e-5, 1e-5 * static_cast<double>(z.r));
      if (aligned) CHECK(cuda_cublaslt_calls() == calls_before + 2);
    }
  }
  // float64 and a mixed call are the composition's: float64 computed, mixed types refused
  // by matmul's check, not by a cuBLASLt error.
  const Tensor x = random_tensor({5, 4}, DType::kF64, 1), w = random_tensor({3, 4}, DType::kF64, 2);
  const Tensor bias = random_tensor({3}, DType::kF64, 3);
  Tensor y_cpu = Tensor::empty({5, 3}, DType::kF64, Device::cpu()), y_gpu = gpu().empty({5, 3}, DType::kF64);
  cpu().linear_bias(x, w, bias, y_cpu);
  gpu().linear_bias(to_gpu(x), to_gpu(w), to_gpu(bias), y_gpu);
  GPIPE_EXPECT_CLOSE(y_gpu, y_cpu, 1e-12, 1e-12);
  Tensor y32 = gpu().empty({5, 3}, DType::kF32);
  CHECK_THROWS_AS(bare.linear_bias(to_gpu(x), to_gpu(w), to_gpu(bias), y32), Error);
}

// A residual block's sums in the product (linear_residual: cuBLASLt with the residual as
// C; linear_input_grad_add: cuBLAS with beta 1), against the CPU's composition on the
// same values: float32 to its sums' order; 16-bit within a step of the type of the sum
// rounded once (or, for linear_residual on shapes cuBLASLt may round the product first,
// of the CPU's 16-bit composition, which rounds the product and then the sum).
TEST_CASE("linear_residual and linear_input_grad_add equal the CPU's product then axpy") {
  Backend& bare = static_cast<WideningBackend&>(gpu()).inner();
  Backend& cpu_be = backend_for(Device::cpu());
  uint64_t seed = 9300;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const double step = t == DType::kF32 ? 1e-5 : std::ldexp(1.0, t == DType::kBF16 ? -7 : -10);
    struct Size {
      int64_t r, k, n, offset;
    };
    // {33, 40, 19, 1}: x's rows stay 16-byte aligned one row in, the residual's (19 elements) do not.
    for (const Size& z : {Size{64, 96, 48, 0}, Size{37, 67, 19, 0}, Size{33, 40, 24, 1}, Size{33, 40, 19, 1},
                          Size{2048, 64, 32, 0}}) {
      CAPTURE(dtype_name(t));
      CAPTURE(z.r);
      CAPTURE(z.k);
      CAPTURE(z.n);
      CAPTURE(z.offset);
      const Tensor x_all = random_tensor({z.r + z.offset, z.k}, t, ++seed);
      const Tensor x = x_all.narrow_rows(z.offset, z.r);
      const Tensor w = random_tensor({z.n, z.k}, t, ++seed), res_all = random_tensor({z.r + z.offset, z.n}, t, ++seed);
      const Tensor res = res_all.narrow_rows(z.offset, z.r);
      const Tensor dy = random_tensor({z.r, z.n}, t, ++seed), dx0 = random_tensor({z.r, z.k}, t, ++seed);
      const Tensor x_gpu_all = to_gpu(x_all), x_gpu = x_gpu_all.narrow_rows(z.offset, z.r);
      const bool aligned = z.offset == 0 && z.k % 8 == 0 && z.n % 8 == 0;
      auto wide = [](const Tensor& u) { return on_host_as(u, DType::kF32); };
      auto rounded = [&](const Tensor& u) { return on_host_as(u, t); };
      const int64_t calls_before = cuda_cublaslt_calls();
      // y = x w^T + residual.
      Tensor y_wide = Tensor::empty({z.r, z.n}, DType::kF32, Device::cpu());
      cpu_be.linear_residual(wide(x), wide(w), wide(res), y_wide);
      const Tensor y_once = rounded(y_wide);
      Tensor y_twice = Tensor::empty({z.r, z.n}, t, Device::cpu());
      cpu_be.linear_residual(x, w, res, y_twice);
      // An aligned residual of the same shape first, then the residual one row into its
      // allocation: an algorithm kept for one alignment is not reused for the other.
      const Tensor res_gpu_all = to_gpu(res_all), res_gpu = res_gpu_all.narrow_rows(z.offset, z.r);
      Tensor y_first = bare.empty({z.r, z.n}, t), y_gpu = bare.empty({z.r, z.n}, t);
      bare.linear_residual(x_gpu, to_gpu(w), to_gpu(res), y_first);
      bare.linear_residual(x_gpu, to_gpu(w), res_gpu, y_gpu);
      if (t == DType::kF32) GPIPE_EXPECT_CLOSE(y_first, y_once, step, 1e-5);
      else check_near_either(y_first, y_once, y_twice, step);
      if (t == DType::kF32) {
        GPIPE_EXPECT_CLOSE(y_gpu, y_once, step, 1e-5);
      } else {
        check_near_either(y_gpu, y_once, y_twice, step);
        if (aligned) GPIPE_EXPECT_CLOSE(y_gpu, y_once, step, 1e-3);
      }
      if (aligned) CHECK(cuda_cublaslt_calls() == calls_before + 2);
      // dx += dy w.
      Tensor dx_wide = wide(dx0);
      cpu_be.linear_input_grad_add(wide(dy), wide(w), dx_wide);
      const Tensor dx_once = rounded(dx_wide);
      Tensor dx_twice = clone(dx0);
      cpu_be.linear_input_grad_add(dy, w, dx_twice);
      Tensor dx_gpu = to_gpu(dx0);
      bare.linear_input_grad_add(to_gpu(dy), to_gpu(w), dx_gpu);
      if (t == DType::kF32) {
        GPIPE_EXPECT_CLOSE(dx_gpu, dx_once, step, 1e-5);
      } else {
        GPIPE_EXPECT_CLOSE(dx_gpu, dx_once, step, 1e-3);  // beta 1: one rounding
      }
    }
  }
}

TEST_CASE("matmul: all transposes, odd sizes, alpha and beta") {
  struct Dims {
    int64_t m, n, k;
  };
  const Dims dims[] = {{1, 1, 1}, {3, 5, 7}, {257, 129, 65}, {1000, 10, 33}, {64, 1, 300}, {2, 513, 1}};
  uint64_t seed = 100;
  for (DType dt : kFloatTypes) {
    for (const Dims& d : dims) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          for (double beta : {0.0, 0.5}) {
            const double alpha = ta ? -0.75 : 1.0;
            CAPTURE(dtype_name(dt));
            CAPTURE(d.m);
            CAPTURE(d.n);
            CAPTURE(d.k);
            CAPTURE(ta);
            CAPTURE(tb);
            CAPTURE(beta);
            const Shape sa = ta ? Shape{d.k, d.m} : Shape{d.m, d.k};
            const Shape sb = tb ? Shape{d.n, d.k} : Shape{d.k, d.n};
            Tensor a = random_tensor(sa, dt, seed++);
            Tensor b = random_tensor(sb, dt, seed++);
            Tensor c0 = random_tensor({d.m, d.n}, dt, seed++);
            Tensor c_cpu = clone(c0);
            Tensor c_gpu = to_gpu(c0);
            cpu().matmul(a, ta, b, tb, c_cpu, alpha, beta);
            gpu().matmul(to_gpu(a), ta, to_gpu(b), tb, c_gpu, alpha, beta);
            EXPECT_CLOSE_TOL(c_gpu, c_cpu, reduction_tol(dt, d.k));
          }
        }
      }
    }
  }
}

TEST_CASE("matmul: beta == 0 ignores NaN in c; k == 0 scales c by beta") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    Tensor a = random_tensor({6, 4}, dt, 1), b = random_tensor({4, 3}, dt, 2);
    Tensor c_gpu = to_gpu(host_full({6, 3}, dt, std::nan("")));
    Tensor c_cpu = host_full({6, 3}, dt, std::nan(""));
    gpu().matmul(to_gpu(a), false, to_gpu(b), false, c_gpu, 1.0, 0.0);
    cpu().matmul(a, false, b, false, c_cpu, 1.0, 0.0);
    CHECK(all_finite(c_gpu));
    EXPECT_CLOSE_TOL(c_gpu, c_cpu, reduction_tol(dt, 4));

    Tensor a0 = Tensor::empty({5, 0}, dt, Device::cpu()), b0 = Tensor::empty({0, 3}, dt, Device::cpu());
    Tensor c0 = random_tensor({5, 3}, dt, 3);
    for (double beta : {0.5, 0.0}) {
      CAPTURE(beta);
      Tensor cc = clone(c0), cg = to_gpu(c0);
      cpu().matmul(a0, false, b0, false, cc, 1.0, beta);
      gpu().matmul(to_gpu(a0), false, to_gpu(b0), false, cg, 1.0, beta);
      GPIPE_EXPECT_CLOSE(cg, cc, 0.0, 0.0);
    }
    Tensor nan_c = to_gpu(host_full({5, 3}, dt, std::nan("")));
    gpu().matmul(to_gpu(a0), false, to_gpu(b0), false, nan_c, 1.0, 0.0);
    CHECK(to_doubles(nan_c) == std::vector<double>(15, 0.0));

    // m == 0 or n == 0: nothing to do, no error.
    Tensor e = gpu().empty({0, 3}, dt);
    gpu().matmul(gpu().empty({0, 4}, dt), false, to_gpu(b), false, e, 1.0, 0.0);
  }
}

const Shape kMatrixShapes[] = {{1, 1}, {3, 5}, {257, 129}, {1000, 10}, {2, 1000}, {600001, 3}};

TEST_CASE("add_bias") {
  uint64_t seed = 200;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kMatrixShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor y = random_tensor(s, dt, seed++);
      Tensor bias = random_tensor({s[1]}, dt, seed++);
      Tensor y_cpu = clone(y), y_gpu = to_gpu(y);
      cpu().add_bias(y_cpu, bias);
      gpu().add_bias(y_gpu, to_gpu(bias));
      EXPECT_CLOSE_TOL(y_gpu, y_cpu, elementwise_tol(dt));
    }
  }
}

TEST_CASE("bias_grad with beta 0 (NaN in db ignored), 1 and 0.5") {
  uint64_t seed = 300;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kMatrixShapes) {
      for (double beta : {0.0, 1.0, 0.5}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(beta);
        Tensor dy = random_tensor(s, dt, seed++);
        Tensor db0 = beta == 0.0 ? host_full({s[1]}, dt, std::nan("")) : random_tensor({s[1]}, dt, seed++);
        Tensor db_cpu = clone(db0), db_gpu = to_gpu(db0);
        cpu().bias_grad(dy, db_cpu, beta);
        gpu().bias_grad(to_gpu(dy), db_gpu, beta);
        CHECK(all_finite(db_gpu));
        EXPECT_CLOSE_TOL(db_gpu, db_cpu, reduction_tol(dt, s[0]));
      }
    }
  }
  // No rows: db = beta * db.
  Tensor db = random_tensor({4}, DType::kF64, 5);
  Tensor db_cpu = clone(db), db_gpu = to_gpu(db);
  cpu().bias_grad(Tensor::empty({0, 4}, DType::kF64, Device::cpu()), db_cpu, 0.5);
  gpu().bias_grad(gpu().empty({0, 4}, DType::kF64), db_gpu, 0.5);
  GPIPE_EXPECT_CLOSE(db_gpu, db_cpu, 0.0, 0.0);
}

TEST_CASE("bias_grad of tall matrices (rows split over many blocks) matches the CPU") {
  uint64_t seed = 350;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : {Shape{5000, 70}, Shape{65, 33}, Shape{70001, 3}, Shape{1, 1}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor dy = random_tensor(s, dt, seed++);
      Tensor db0 = random_tensor({s[1]}, dt, seed++);
      Tensor db_cpu = clone(db0), db_gpu = to_gpu(db0);
      cpu().bias_grad(dy, db_cpu, 1.0);
      gpu().bias_grad(to_gpu(dy), db_gpu, 1.0);
      EXPECT_CLOSE_TOL(db_gpu, db_cpu, reduction_tol(dt, s[0]));
      // Deterministic: the chunks depend on the shape alone.
      Tensor again = to_gpu(db0);
      gpu().bias_grad(to_gpu(dy), again, 1.0);
      CHECK(to_doubles(again) == to_doubles(db_gpu));
    }
  }
}

TEST_CASE("argmax_correct counts on the device what the CPU counts (ties, ignored rows, bad labels)") {
  uint64_t seed = 360;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : {Shape{7, 5}, Shape{33, 50000}, Shape{1000, 3}, Shape{4, 1}}) {
      for (bool tied : {false, true}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(tied);
        Tensor logits = random_tensor(s, dt, seed++);
        if (tied) {  // few distinct values: the first maximum must win, as on the CPU
          for (int64_t i = 0; i < logits.numel(); ++i) {
            const double v = static_cast<double>((i * 7919) % 5);
            if (dt == DType::kF32) {
              logits.data<float>()[i] = static_cast<float>(v);
            } else {
              logits.data<double>()[i] = v;
            }
          }
        }
        // Labels in [-1, C + 1): -1 is ignored, C is outside the classes.
        Tensor labels = random_labels(s[0], static_cast<int>(s[1]) + 2, seed++);
        for (int64_t r = 0; r < s[0]; ++r) labels.data<int32_t>()[r] -= 1;
        // A row whose argmax is its label, so the count is not trivially 0.
        labels.data<int32_t>()[0] = static_cast<int32_t>(0);
        const int64_t want = cpu().argmax_correct(logits, labels, -1);
        CHECK(gpu().argmax_correct(to_gpu(logits), to_gpu(labels), -1) == want);
        CHECK(gpu().argmax_correct(to_gpu(logits), to_gpu(labels), -100) ==
              cpu().argmax_correct(logits, labels, -100));
      }
    }
  }
  Tensor none = gpu().empty({0, 4}, DType::kF32);
  CHECK(gpu().argmax_correct(none, gpu().empty({0}, DType::kI32), -100) == 0);
}

const Shape kVectorShapes[] = {{1}, {15}, {257, 129}, {1000, 10}, {(int64_t(1) << 24) + 77}};

TEST_CASE("relu and relu_backward") {
  uint64_t seed = 400;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kVectorShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor x = random_tensor(s, dt, seed++);
      Tensor dy = random_tensor(s, dt, seed++);
      Tensor y_cpu = Tensor::empty(s, dt, Device::cpu()), y_gpu = gpu().empty(s, dt);
      cpu().relu(x, y_cpu);
      gpu().relu(to_gpu(x), y_gpu);
      GPIPE_EXPECT_CLOSE(y_gpu, y_cpu, 0.0, 0.0);
      Tensor dx_cpu = Tensor::empty(s, dt, Device::cpu()), dx_gpu = gpu().empty(s, dt);
      cpu().relu_backward(y_cpu, dy, dx_cpu);
      gpu().relu_backward(y_gpu, to_gpu(dy), dx_gpu);
      GPIPE_EXPECT_CLOSE(dx_gpu, dx_cpu, 0.0, 0.0);
    }
  }
  // In place.
  Tensor x = random_tensor({1000}, DType::kF32, 9);
  Tensor ref = Tensor::empty({1000}, DType::kF32, Device::cpu());
  cpu().relu(x, ref);
  Tensor xg = to_gpu(x);
  gpu().relu(xg, xg);
  GPIPE_EXPECT_CLOSE(xg, ref, 0.0, 0.0);
}

TEST_CASE("gelu and gelu_backward (exact erf form)") {
  uint64_t seed = 500;
  const Shape shapes[] = {{1}, {15}, {257, 129}, {1000, 10}, {100003}};
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor x = random_tensor(s, dt, seed++, -6.0, 6.0);
      Tensor dy = random_tensor(s, dt, seed++);
      Tensor y_cpu = Tensor::empty(s, dt, Device::cpu()), y_gpu = gpu().empty(s, dt);
      cpu().gelu(x, y_cpu);
      gpu().gelu(to_gpu(x), y_gpu);
      EXPECT_CLOSE_TOL(y_gpu, y_cpu, elementwise_tol(dt));
      Tensor dx_cpu = Tensor::empty(s, dt, Device::cpu()), dx_gpu = gpu().empty(s, dt);
      cpu().gelu_backward(x, dy, dx_cpu);
      gpu().gelu_backward(to_gpu(x), to_gpu(dy), dx_gpu);
      EXPECT_CLOSE_TOL(dx_gpu, dx_cpu, elementwise_tol(dt));
    }
  }
}

// Labels for `rows` rows of `classes` classes, with every 7th row (from row 2) set to
// ignore_index.
Tensor labels_with_ignored(int64_t rows, int classes, int ignore_index, uint64_t seed) {
  Tensor labels = random_labels(rows, classes, seed);
  int32_t* p = labels.data<int32_t>();
  for (int64_t r = 2; r < rows; r += 7) p[r] = ignore_index;
  return labels;
}

TEST_CASE("softmax_xent forward and backward, with ignore_index rows") {
  const Shape shapes[] = {{1, 1}, {3, 5}, {257, 129}, {1000, 10}, {4, 5000}, {2, 1}};
  uint64_t seed = 600;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      for (int ignore_index : {-100, 2}) {
        for (double range : {5.0, 80.0}) {
          CAPTURE(dtype_name(dt));
          CAPTURE(shape_str(s));
          CAPTURE(ignore_index);
          CAPTURE(range);
          const int64_t rows = s[0], cols = s[1];
          if (ignore_index >= cols) continue;  // ignore_index 2 needs a class 2 to be meaningful
          Tensor logits = random_tensor(s, dt, seed++, -range, range);
          Tensor labels = labels_with_ignored(rows, static_cast<int>(cols), ignore_index, seed++);
          const double scale = 1.0 / static_cast<double>(rows);

          Tensor probs_cpu = Tensor::empty(s, dt, Device::cpu()), loss_cpu = Tensor::empty({1}, dt, Device::cpu());
          cpu().softmax_xent(logits, labels, scale, ignore_index, probs_cpu, loss_cpu);
          Tensor probs_gpu = gpu().empty(s, dt), loss_gpu = gpu().empty({1}, dt);
          Tensor labels_gpu = to_gpu(labels);
          gpu().softmax_xent(to_gpu(logits), labels_gpu, scale, ignore_index, probs_gpu, loss_gpu);
          // exp times 1 / (a sum of `cols` terms, added in another order): a small relative error
          const Tol probs_tol = dt == DType::kF32 ? Tol{1e-4, 1e-7} : Tol{1e-10, 1e-15};
          EXPECT_CLOSE_TOL(probs_gpu, probs_cpu, probs_tol);
          const Tol loss_tol = dt == DType::kF32 ? Tol{1e-5, 1e-5} : Tol{1e-11, 1e-12};
          EXPECT_CLOSE_TOL(std::vector<double>{gpu().item(loss_gpu)}, std::vector<double>{cpu().item(loss_cpu)},
                           loss_tol);

          // Backward from the same probabilities on both sides.
          for (double bscale : {scale, 1.0}) {
            Tensor d_cpu = Tensor::empty(s, dt, Device::cpu()), d_gpu = gpu().empty(s, dt);
            cpu().softmax_xent_backward(probs_cpu, labels, bscale, ignore_index, d_cpu);
            gpu().softmax_xent_backward(to_gpu(probs_cpu), labels_gpu, bscale, ignore_index, d_gpu);
            EXPECT_CLOSE_TOL(d_gpu, d_cpu, elementwise_tol(dt));
          }
        }
      }
    }
  }
}

// The vocabulary-parallel steps on one member's columns [first, first + cols) of a
// vocabulary of `parts` x cols, against the CPU: the sums (the row maxima given, as the
// group's all-reduce leaves them), the loss and lse from them, and the backward.
TEST_CASE("softmax_xent_slice's three steps equal the CPU's, with ignore_index rows") {
  const Shape shapes[] = {{1, 1}, {3, 5}, {257, 129}, {4, 5000}};
  uint64_t seed = 650;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      for (int64_t member : {0, 2}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(member);
        const int64_t rows = s[0], cols = s[1], vocab = 3 * cols, first = member * cols;
        Tensor logits = random_tensor(s, dt, seed++, -20.0, 20.0);
        Tensor labels = labels_with_ignored(rows, static_cast<int>(vocab), -100, seed++);
        Tensor rowmax = random_tensor({rows}, dt, seed++, 20.0, 21.0);  // at least every logit here
        Tensor sums_c = Tensor::empty({2 * rows}, dt, Device::cpu()), sums_g = gpu().empty({2 * rows}, dt);
        cpu().softmax_xent_slice_sums(logits, labels, first, vocab, -100, rowmax, sums_c);
        const Tensor labels_g = to_gpu(labels), logits_g = to_gpu(logits), rowmax_g = to_gpu(rowmax);
        gpu().softmax_xent_slice_sums(logits_g, labels_g, first, vocab, -100, rowmax_g, sums_g);
        const Tol sum_tol = dt == DType::kF32 ? Tol{1e-5, 1e-30} : Tol{1e-12, 1e-300};
        EXPECT_CLOSE_TOL(sums_g, sums_c, sum_tol);
        Tensor lse_c = Tensor::empty({rows}, dt, Device::cpu()), loss_c = Tensor::empty({1}, dt, Device::cpu());
        Tensor lse_g = gpu().empty({rows}, dt), loss_g = gpu().empty({1}, dt);
        cpu().softmax_xent_slice_loss(sums_c, rowmax, labels, -100, 0.5, lse_c, loss_c);
        gpu().softmax_xent_slice_loss(to_gpu(sums_c), rowmax_g, labels_g, -100, 0.5, lse_g, loss_g);
        EXPECT_CLOSE_TOL(lse_g, lse_c, elementwise_tol(dt));
        const Tol loss_tol = dt == DType::kF32 ? Tol{1e-5, 1e-5} : Tol{1e-11, 1e-12};
        EXPECT_CLOSE_TOL(std::vector<double>{gpu().item(loss_g)}, std::vector<double>{cpu().item(loss_c)}, loss_tol);
        Tensor d_c = Tensor::empty(s, dt, Device::cpu()), d_g = gpu().empty(s, dt);
        cpu().softmax_xent_slice_backward(logits, labels, first, -100, lse_c, 0.5, d_c);
        gpu().softmax_xent_slice_backward(logits_g, labels_g, first, -100, to_gpu(lse_c), 0.5, d_g);
        EXPECT_CLOSE_TOL(d_g, d_c, elementwise_tol(dt));
      }
    }
  }
}

TEST_CASE("first_column_equal finds the first column holding each row's value, as the CPU does") {
  uint64_t seed = 680;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : {Shape{1, 1}, Shape{5, 7}, Shape{33, 4097}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor logits = random_tensor(s, dt, seed++);
      Tensor value = Tensor::empty({s[0]}, dt, Device::cpu());
      cpu().reduce_rows(Reduce::kMax, logits, value);
      if (s[0] > 1) {  // a row whose value no column holds
        Tensor first_row = value.narrow_rows(0, 1);
        cpu().fill(first_row, 9.0);
      }
      Tensor i_c = Tensor::empty({s[0]}, dt, Device::cpu()), i_g = gpu().empty({s[0]}, dt);
      cpu().first_column_equal(logits, value, 100, 12345, i_c);
      gpu().first_column_equal(to_gpu(logits), to_gpu(value), 100, 12345, i_g);
      CHECK(to_doubles(i_g) == to_doubles(i_c));
    }
  }
}

TEST_CASE("softmax_xent with no rows writes a zero loss") {
  for (DType dt : kFloatTypes) {
    Tensor logits = gpu().empty({0, 5}, dt), probs = gpu().empty({0, 5}, dt);
    Tensor labels = gpu().empty({0}, DType::kI32);
    Tensor loss = to_gpu(host_full({1}, dt, std::nan("")));
    gpu().softmax_xent(logits, labels, 1.0, -100, probs, loss);
    CHECK(gpu().item(loss) == 0.0);
    Tensor d = gpu().empty({0, 5}, dt);
    gpu().softmax_xent_backward(probs, labels, 1.0, -100, d);
  }
}

// The message of the UserError `call` throws, or "" when it throws none.
template <typename F>
std::string user_error_of(F&& call) {
  try {
    call();
  } catch (const UserError& e) {
    return e.what();
  }
  return std::string();
}

// Bad labels, token ids and argmax indices are found on the device and reported at the
// backend's next wait (kernels/cuda_backend.h): the op itself returns without waiting.
TEST_CASE("an out-of-range label is a UserError with the CPU backend's message, at the next synchronize") {
  for (DType dt : kFloatTypes) {
    const Shape s{8, 5};
    Tensor logits = random_tensor(s, dt, 700);
    for (int bad : {5, -3, 1000}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(bad);
      std::vector<int32_t> lv = {0, 1, -100, bad, 4, -7, 2, 3};  // rows 3 and 5 are bad; row 3 is reported
      Tensor labels = Tensor::from_vector(lv, {8});
      Tensor labels_gpu = to_gpu(labels);
      Tensor logits_gpu = to_gpu(logits);

      Tensor probs_cpu = Tensor::empty(s, dt, Device::cpu()), loss_cpu = Tensor::empty({1}, dt, Device::cpu());
      const std::string cpu_msg =
          user_error_of([&] { cpu().softmax_xent(logits, labels, 1.0, -100, probs_cpu, loss_cpu); });
      Tensor probs_gpu = gpu().empty(s, dt), loss_gpu = gpu().empty({1}, dt);
      CHECK_NOTHROW(gpu().softmax_xent(logits_gpu, labels_gpu, 1.0, -100, probs_gpu, loss_gpu));
      const std::string gpu_msg = user_error_of([&] { gpu().synchronize(); });
      CHECK(!cpu_msg.empty());
      CHECK(gpu_msg == cpu_msg);
      CHECK(gpu_msg.find("row 3") != std::string::npos);
      CHECK_NOTHROW(gpu().synchronize());  // reported once

      // item() waits too, and reports it before returning the (garbage) loss.
      CHECK_NOTHROW(gpu().softmax_xent(logits_gpu, labels_gpu, 1.0, -100, probs_gpu, loss_gpu));
      CHECK(user_error_of([&] { gpu().item(loss_gpu); }) == cpu_msg);

      Tensor probs = random_tensor(s, dt, 701, 0.0, 1.0);
      Tensor probs_g = to_gpu(probs);
      Tensor d_cpu = Tensor::empty(s, dt, Device::cpu()), d_gpu = gpu().empty(s, dt);
      const std::string cpu_bmsg = user_error_of([&] { cpu().softmax_xent_backward(probs, labels, 1.0, -100, d_cpu); });
      CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, labels_gpu, 1.0, -100, d_gpu));
      // A copy to the host waits, so it reports the error instead of handing back garbage.
      Tensor d_host = Tensor::empty(s, dt, Device::cpu());
      const std::string gpu_bmsg = user_error_of([&] { gpu().copy(d_gpu, d_host); });
      CHECK(!cpu_bmsg.empty());
      CHECK(gpu_bmsg == cpu_bmsg);
    }
  }
  // The backend is fine afterwards.
  Tensor ok_labels = to_gpu(Tensor::from_vector<int32_t>({1, 0}, {2}));
  Tensor logits = to_gpu(random_tensor({2, 3}, DType::kF32, 702));
  Tensor probs = gpu().empty({2, 3}, DType::kF32), loss = gpu().empty({1}, DType::kF32);
  gpu().softmax_xent(logits, ok_labels, 0.5, -100, probs, loss);
  CHECK(std::isfinite(gpu().item(loss)));
}

TEST_CASE("deferred errors: the first bad op is reported, once, at any wait; more ops than slots still work") {
  const DType dt = DType::kF32;
  // Rows of 3 classes: row 1 of bad1 holds 7, row 0 of bad2 holds 9.
  Tensor good = Tensor::from_vector<int32_t>({0, 2}, {2});
  Tensor bad1 = Tensor::from_vector<int32_t>({0, 7}, {2});
  Tensor bad2 = Tensor::from_vector<int32_t>({9, 0}, {2});
  Tensor probs = random_tensor({2, 3}, dt, 710, 0.0, 1.0);
  Tensor d_cpu = Tensor::empty({2, 3}, dt, Device::cpu());
  const std::string msg1 = user_error_of([&] { cpu().softmax_xent_backward(probs, bad1, 1.0, -100, d_cpu); });
  const std::string msg2 = user_error_of([&] { cpu().softmax_xent_backward(probs, bad2, 1.0, -100, d_cpu); });
  REQUIRE(!msg1.empty());
  REQUIRE(!msg2.empty());
  REQUIRE(msg1 != msg2);
  Tensor good_g = to_gpu(good), bad1_g = to_gpu(bad1), bad2_g = to_gpu(bad2), probs_g = to_gpu(probs);
  Tensor d = gpu().empty({2, 3}, dt);

  SUBCASE("the first of two bad ops wins, whatever the kinds") {
    Tensor ids = to_gpu(Tensor::from_vector<int32_t>({0, 5}, {1, 2}));  // (b=0, t=1) is outside [0, 4)
    Tensor table = to_gpu(random_tensor({4, 3}, dt, 711));
    Tensor out = gpu().empty({1, 2, 3}, dt);
    Tensor table_c = random_tensor({4, 3}, dt, 711), out_c = Tensor::empty({1, 2, 3}, dt, Device::cpu());
    const std::string token_msg = user_error_of([&] {
      cpu().embedding(Tensor::from_vector<int32_t>({0, 5}, {1, 2}), table_c, Tensor(), out_c);
    });
    REQUIRE(!token_msg.empty());
    CHECK_NOTHROW(gpu().embedding(ids, table, Tensor(), out));
    CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, bad1_g, 1.0, -100, d));
    CHECK(user_error_of([&] { gpu().synchronize(); }) == token_msg);
    CHECK_NOTHROW(gpu().synchronize());

    CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, good_g, 1.0, -100, d));
    CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, bad2_g, 1.0, -100, d));
    CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, bad1_g, 1.0, -100, d));
    CHECK(user_error_of([&] { gpu().synchronize(); }) == msg2);
  }

  SUBCASE("sum_squares waits, so it reports") {
    CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, bad1_g, 1.0, -100, d));
    CHECK(user_error_of([&] { gpu().sum_squares(d); }) == msg1);
    CHECK(std::isfinite(gpu().sum_squares(d)));
  }

  SUBCASE("thousands of checks between waits: each error is reported exactly once") {
    std::vector<std::string> reported;
    for (int i = 0; i < 3000; ++i) {
      const Tensor& labels = i == 5 ? bad1_g : good_g;
      const std::string m = user_error_of([&] { gpu().softmax_xent_backward(probs_g, labels, 1.0, -100, d); });
      if (!m.empty()) reported.push_back(m);
    }
    const std::string last = user_error_of([&] { gpu().synchronize(); });
    if (!last.empty()) reported.push_back(last);
    CHECK(reported == std::vector<std::string>{msg1});

    CHECK_NOTHROW(gpu().softmax_xent_backward(probs_g, bad2_g, 1.0, -100, d));
    CHECK(user_error_of([&] { gpu().synchronize(); }) == msg2);
  }
  // Nothing is left behind for the next test.
  CHECK_NOTHROW(gpu().synchronize());
}

TEST_CASE("fill: float32, float64 and int32 (truncating like the CPU)") {
  for (DType dt : {DType::kF32, DType::kF64, DType::kI32}) {
    for (const Shape& s : {Shape{1}, Shape{3, 5}, Shape{100003}}) {
      for (double v : {0.0, -0.0, 0.37, 3.7, -2.5, 1e6}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(v);
        Tensor c = Tensor::empty(s, dt, Device::cpu()), g = gpu().empty(s, dt);
        cpu().fill(c, v);
        gpu().fill(g, v);
        CHECK(to_doubles(g) == to_doubles(c));
      }
    }
  }
  Tensor z = gpu().zeros({7, 3}, DType::kF64);
  CHECK(to_doubles(z) == std::vector<double>(21, 0.0));
}

TEST_CASE("scale: 0 clears NaN, other factors multiply") {
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kVectorShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor g = to_gpu(host_full(s, dt, std::nan("")));
      gpu().scale(g, 0.0);
      CHECK(to_doubles(g) == std::vector<double>(static_cast<size_t>(shape_numel(s)), 0.0));
      Tensor x = random_tensor(s, dt, 800);
      Tensor xc = clone(x), xg = to_gpu(x);
      cpu().scale(xc, -1.7);
      gpu().scale(xg, -1.7);
      EXPECT_CLOSE_TOL(xg, xc, elementwise_tol(dt));
    }
  }
}

TEST_CASE("axpy") {
  uint64_t seed = 900;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kVectorShapes) {
      for (double alpha : {1.0, -0.3}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(alpha);
        Tensor x = random_tensor(s, dt, seed++), y = random_tensor(s, dt, seed++);
        Tensor yc = clone(y), yg = to_gpu(y);
        cpu().axpy(alpha, x, yc);
        gpu().axpy(alpha, to_gpu(x), yg);
        EXPECT_CLOSE_TOL(yg, yc, elementwise_tol(dt));
      }
    }
  }
}

TEST_CASE("sgd_step: plain, momentum, nesterov, weight decay, first and later steps") {
  const SgdParams configs[] = {
      {0.1, 0.0, 0.0, false},
      {0.1, 0.0, 0.01, false},
      {0.05, 0.9, 0.0, false},
      {0.05, 0.9, 1e-4, false},
      {0.05, 0.9, 0.0, true},
      {0.02, 0.8, 0.01, true},
  };
  const Shape shapes[] = {{1}, {1000}, {257, 129}};
  uint64_t seed = 1000;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      for (const SgdParams& p : configs) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(p.lr);
        CAPTURE(p.momentum);
        CAPTURE(p.weight_decay);
        CAPTURE(p.nesterov);
        Tensor w = random_tensor(s, dt, seed++);
        Tensor wc = clone(w), wg = to_gpu(w);
        Tensor bc, bg;  // undefined when there is no momentum
        if (p.momentum != 0.0) {
          Tensor b0 = random_tensor(s, dt, seed++);  // garbage: the first step must overwrite it
          bc = clone(b0);
          bg = to_gpu(b0);
        }
        for (int step = 0; step < 3; ++step) {
          CAPTURE(step);
          Tensor grad = random_tensor(s, dt, seed++);
          cpu().sgd_step(wc, grad, bc, p, step == 0);
          gpu().sgd_step(wg, to_gpu(grad), bg, p, step == 0);
          EXPECT_CLOSE_TOL(wg, wc, elementwise_tol(dt));
          if (p.momentum != 0.0) EXPECT_CLOSE_TOL(bg, bc, elementwise_tol(dt));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------
// Adam and the gradient norm

TEST_CASE("adam_step: Adam and AdamW, decoupled or not, over several steps") {
  struct Config {
    double lr, beta1, beta2, eps, weight_decay;
    bool decoupled;
  };
  const Config configs[] = {
      {1e-3, 0.9, 0.999, 1e-8, 0.0, false},  {1e-2, 0.9, 0.999, 1e-8, 0.01, false},
      {1e-2, 0.9, 0.999, 1e-8, 0.1, true},   {3e-3, 0.9, 0.999, 1e-8, 0.0, true},
      {5e-3, 0.8, 0.99, 1e-6, 0.05, true},   {5e-3, 0.8, 0.99, 1e-6, 0.05, false},
  };
  const Shape shapes[] = {{1}, {1000}, {257, 129}};
  // One step is elementwise, but nvcc may fuse a * b + c, and the error of a step
  // carries into the next.
  auto tol = [](DType t) { return t == DType::kF32 ? Tol{1e-5, 1e-6} : Tol{1e-12, 1e-14}; };
  uint64_t seed = 1100;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      for (const Config& c : configs) {
        CAPTURE(dtype_name(dt));
        CAPTURE(shape_str(s));
        CAPTURE(c.lr);
        CAPTURE(c.weight_decay);
        CAPTURE(c.decoupled);
        AdamParams p;
        p.lr = c.lr;
        p.beta1 = c.beta1;
        p.beta2 = c.beta2;
        p.eps = c.eps;
        p.weight_decay = c.weight_decay;
        p.decoupled = c.decoupled;
        Tensor w = random_tensor(s, dt, seed++);
        Tensor wc = clone(w), wg = to_gpu(w);
        Tensor mc = host_full(s, dt, 0.0), vc = host_full(s, dt, 0.0);
        Tensor mg = gpu().zeros(s, dt), vg = gpu().zeros(s, dt);
        for (int64_t step = 1; step <= 4; ++step) {
          CAPTURE(step);
          Tensor grad = random_tensor(s, dt, seed++);
          cpu().adam_step(wc, grad, mc, vc, p, step);
          gpu().adam_step(wg, to_gpu(grad), mg, vg, p, step);
          EXPECT_CLOSE_TOL(mg, mc, tol(dt));
          EXPECT_CLOSE_TOL(vg, vc, tol(dt));
          EXPECT_CLOSE_TOL(wg, wc, tol(dt));
        }
      }
    }
  }
  Tensor w = gpu().zeros({3}, DType::kF32), g = gpu().zeros({3}, DType::kF32);
  Tensor m = gpu().zeros({3}, DType::kF32), v = gpu().zeros({3}, DType::kF32);
  CHECK_THROWS_AS(gpu().adam_step(w, g, m, v, AdamParams{}, 0), Error);
}

TEST_CASE("sum_squares: double accumulation, deterministic, empty is 0") {
  uint64_t seed = 1200;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kVectorShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor x = random_tensor(s, dt, seed++);
      const double want = cpu().sum_squares(x);
      Tensor xg = to_gpu(x);
      const double got = gpu().sum_squares(xg);
      // Every square is exact in double; only the order of the additions differs.
      CHECK(got == doctest::Approx(want).epsilon(1e-10));
      CHECK(gpu().sum_squares(xg) == got);  // bit for bit the same on a second run
    }
    CHECK(gpu().sum_squares(gpu().empty({0, 4}, dt)) == 0.0);
  }
  // Over several tensors at once (one wait): the CPU's sum, and the same on a second run.
  std::vector<Tensor> on_cpu, on_gpu;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kVectorShapes) {
      on_cpu.push_back(random_tensor(s, dt, seed++));
      on_gpu.push_back(to_gpu(on_cpu.back()));
    }
  }
  on_gpu.push_back(gpu().empty({0, 4}, DType::kF32));
  const double all = gpu().sum_squares_all(on_gpu);
  CHECK(all == doctest::Approx(cpu().sum_squares_all(on_cpu)).epsilon(1e-10));
  CHECK(gpu().sum_squares_all(on_gpu) == all);
  CHECK(gpu().sum_squares_all({}) == 0.0);
}

// ---------------------------------------------------------------------------------
// Multi-tensor ops: one launch over many tensors against the single-tensor op on each

// Tensors of every size class of the table: empty (left out of it), one element, inside
// one chunk, a chunk and a little, several chunks, and a matrix.
std::vector<Tensor> multi_tensors(DType dt, uint64_t& seed) {
  const Shape shapes[] = {{0},    {1}, {1000}, {cuda::kMultiTensorChunk + 7}, {3, cuda::kMultiTensorChunk + 1},
                          {257, 129}};
  std::vector<Tensor> out;
  for (const Shape& s : shapes) out.push_back(to_gpu(random_tensor(s, dt, seed++)));
  return out;
}

// Device copies of device tensors.
std::vector<Tensor> copies(const std::vector<Tensor>& xs) {
  std::vector<Tensor> out;
  for (const Tensor& x : xs) {
    out.push_back(gpu().empty(x.shape(), x.dtype()));
    gpu().copy(x, out.back());
  }
  return out;
}

std::vector<Tensor> zeros_of(const std::vector<Tensor>& xs) {
  std::vector<Tensor> out;
  for (const Tensor& x : xs) out.push_back(gpu().zeros(x.shape(), x.dtype()));
  return out;
}

void check_bitwise(const std::vector<Tensor>& got, const std::vector<Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(to_doubles(got[i]) == to_doubles(want[i]));
  }
}

TEST_CASE("multi-tensor adam_step_all and sgd_step_all equal the single-tensor steps bit for bit") {
  uint64_t seed = 1250;
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    for (bool decoupled : {false, true}) {
      CAPTURE(decoupled);
      AdamParams p;
      p.lr = 3e-3;
      p.weight_decay = 0.05;
      p.decoupled = decoupled;
      std::vector<Tensor> w = multi_tensors(dt, seed), m = zeros_of(w), v = zeros_of(w);
      std::vector<Tensor> w1 = copies(w), m1 = zeros_of(w), v1 = zeros_of(w);
      for (int64_t step = 1; step <= 3; ++step) {
        const std::vector<Tensor> g = multi_tensors(dt, seed);
        gpu().adam_step_all(w, g, m, v, p, gpu().step_scalars(adam_step_scalars(p, step)));
        for (size_t i = 0; i < w.size(); ++i) gpu().adam_step(w1[i], g[i], m1[i], v1[i], p, step);
      }
      check_bitwise(w, w1);
      check_bitwise(m, m1);
      check_bitwise(v, v1);
    }
    for (double momentum : {0.0, 0.9}) {
      for (bool nesterov : {false, true}) {
        if (nesterov && momentum == 0.0) continue;
        CAPTURE(momentum);
        CAPTURE(nesterov);
        SgdParams p;
        p.lr = 0.05;
        p.momentum = momentum;
        p.nesterov = nesterov;
        p.weight_decay = 0.01;
        std::vector<Tensor> w = multi_tensors(dt, seed), w1 = copies(w);
        std::vector<Tensor> b = momentum != 0.0 ? zeros_of(w) : std::vector<Tensor>(w.size());
        std::vector<Tensor> b1 = momentum != 0.0 ? zeros_of(w) : std::vector<Tensor>(w.size());
        for (int step = 0; step < 3; ++step) {
          const std::vector<Tensor> g = multi_tensors(dt, seed);
          gpu().sgd_step_all(w, g, b, p, gpu().step_scalars(sgd_step_scalars(p, step + 1)));
          for (size_t i = 0; i < w.size(); ++i) gpu().sgd_step(w1[i], g[i], b1[i], p, step == 0);
        }
        check_bitwise(w, w1);
        if (momentum != 0.0) check_bitwise(b, b1);
      }
    }
  }
  // Tensors of two types in one call take the loop, with the same results.
  std::vector<Tensor> w = multi_tensors(DType::kF32, seed), w64 = multi_tensors(DType::kF64, seed);
  w.insert(w.end(), w64.begin(), w64.end());
  std::vector<Tensor> w1 = copies(w), g = copies(w), m = zeros_of(w), v = zeros_of(w), m1 = zeros_of(w),
                      v1 = zeros_of(w);
  const Tensor first = gpu().step_scalars(adam_step_scalars(AdamParams{}, 1));
  gpu().adam_step_all(w, g, m, v, AdamParams{}, first);
  for (size_t i = 0; i < w.size(); ++i) gpu().adam_step(w1[i], g[i], m1[i], v1[i], AdamParams{}, 1);
  check_bitwise(w, w1);
  // The same tensor twice takes the loop: scaled twice in turn, not by two blocks at once.
  Tensor twice = to_gpu(random_tensor({1000}, DType::kF32, seed++));
  std::vector<Tensor> twice1 = copies({twice});
  gpu().scale_all({twice, twice}, 0.5);
  gpu().scale(twice1[0], 0.5);
  gpu().scale(twice1[0], 0.5);
  check_bitwise({twice}, twice1);
  // Lists of different lengths, and scalars that are not a step's, are errors.
  CHECK_THROWS_AS(gpu().adam_step_all(w, g, m, {}, AdamParams{}, first), Error);
  CHECK_THROWS_AS(gpu().adam_step_all(w1, g, m1, v1, AdamParams{}, gpu().zeros({3}, DType::kF64)), Error);
}

TEST_CASE("multi-tensor scale_all, fill_all, cast_all and sum_squares_all equal their single-tensor ops") {
  uint64_t seed = 1270;
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    std::vector<Tensor> x = multi_tensors(dt, seed), x1 = copies(x);
    gpu().scale_all(x, 0.37);
    for (Tensor& t : x1) gpu().scale(t, 0.37);
    check_bitwise(x, x1);
    // The same lists again: the kept table, the same results.
    gpu().scale_all(x, -1.5);
    for (Tensor& t : x1) gpu().scale(t, -1.5);
    check_bitwise(x, x1);

    std::vector<Tensor> on_cpu;
    for (const Tensor& t : x) on_cpu.push_back(clone(t));
    const double all = gpu().sum_squares_all(x);
    CHECK(all == doctest::Approx(cpu().sum_squares_all(on_cpu)).epsilon(1e-10));
    CHECK(gpu().sum_squares_all(x) == all);  // a fixed order: the same bits again

    gpu().fill_all(x, 2.5);
    for (const Tensor& t : x) CHECK(to_doubles(t) == std::vector<double>(static_cast<size_t>(t.numel()), 2.5));
    // A factor of 0 clears, NaN included, as scale() does.
    gpu().fill_all(x, std::nan(""));
    gpu().scale_all(x, 0.0);
    for (const Tensor& t : x) CHECK(to_doubles(t) == std::vector<double>(static_cast<size_t>(t.numel()), 0.0));
  }
  // float32 masters into bfloat16 and float16 working copies, rounded as cast() rounds.
  for (DType narrow : {DType::kBF16, DType::kF16}) {
    CAPTURE(dtype_name(narrow));
    const std::vector<Tensor> masters = multi_tensors(DType::kF32, seed);
    std::vector<Tensor> work, work1;
    for (const Tensor& t : masters) {
      work.push_back(gpu().empty(t.shape(), narrow));
      work1.push_back(gpu().empty(t.shape(), narrow));
    }
    gpu().cast_all(masters, work);
    for (size_t i = 0; i < masters.size(); ++i) gpu().cast(masters[i], work1[i]);
    check_bitwise(work, work1);
  }
  CHECK(gpu().sum_squares_all({gpu().empty({0}, DType::kF32)}) == 0.0);
}

TEST_CASE("the step's scalars on the GPU: the norm, the clip's scale and the skip equal the CPU's bit for bit") {
  uint64_t seed = 1320;
  // The norm left on the device is sum_squares_all's, bit for bit.
  for (DType dt : kFloatTypes) {
    const std::vector<Tensor> x = multi_tensors(dt, seed);
    Tensor scalars = gpu().step_scalars(initial_step_scalars());
    gpu().sum_squares_all_to(x, scalars);
    CHECK(gpu().read_step_scalars(scalars)[kStepNormSquared] == gpu().sum_squares_all(x));
    gpu().sum_squares_all_to({}, scalars);
    CHECK(gpu().read_step_scalars(scalars)[kStepNormSquared] == 0.0);
  }
  // step_grad_scale: no norm, a norm below and above the clip, an overflow with and
  // without loss scaling; then scale_all_by and an Adam step that reads the skip.
  const double inf = std::numeric_limits<double>::infinity();
  for (double norm_squared : {-1.0, 0.25, 9.0, 1e6, inf, std::nan("")}) {
    for (double max_norm : {0.0, 1.0}) {
      for (double inv_scale : {1.0, 1.0 / 1024, 0.3}) {  // 0.3: the product inexact (the FMA)
        for (bool skip_nonfinite : {false, true}) {
          CAPTURE(norm_squared);
          CAPTURE(max_norm);
          CAPTURE(inv_scale);
          CAPTURE(skip_nonfinite);
          StepScalarValues v = adam_step_scalars(AdamParams{}, 3);
          v[kStepNormSquared] = norm_squared;
          v[kStepUnscale] = inv_scale;
          Tensor host = cpu().step_scalars(v), dev = gpu().step_scalars(v);
          cpu().step_grad_scale(host, max_norm, skip_nonfinite);
          gpu().step_grad_scale(dev, max_norm, skip_nonfinite);
          const StepScalarValues want = cpu().read_step_scalars(host), got = gpu().read_step_scalars(dev);
          CHECK(got[kStepGradScale] == want[kStepGradScale]);
          CHECK(got[kStepSkip] == want[kStepSkip]);
          std::vector<Tensor> g = multi_tensors(DType::kF32, seed), g1 = copies(g);
          gpu().scale_all_by(g, dev);
          if (want[kStepSkip] == 0 && want[kStepGradScale] != 1.0) gpu().scale_all(g1, want[kStepGradScale]);
          check_bitwise(g, g1);
          std::vector<Tensor> w = multi_tensors(DType::kF32, seed), w1 = copies(w), m = zeros_of(w), vv = zeros_of(w);
          gpu().adam_step_all(w, g, m, vv, AdamParams{}, dev);
          if (want[kStepSkip] != 0) check_bitwise(w, w1);  // a skipped step changes nothing
        }
      }
    }
  }
  // Bad data an op flagged since the last wait skips the step on the device; the error
  // comes at the wait.
  Tensor ids = to_gpu(Tensor::from_vector<int32_t>({0, 5}, {1, 2}));  // 5 is outside [0, 4)
  Tensor table = to_gpu(random_tensor({4, 3}, DType::kF32, seed++)), out = gpu().empty({1, 2, 3}, DType::kF32);
  Tensor dev = gpu().step_scalars(adam_step_scalars(AdamParams{}, 1));
  gpu().embedding(ids, table, Tensor(), out);
  gpu().step_grad_scale(dev, 0.0, false);
  std::vector<Tensor> w = multi_tensors(DType::kF32, seed), w1 = copies(w), m = zeros_of(w), vv = zeros_of(w);
  gpu().adam_step_all(w, copies(w), m, vv, AdamParams{}, dev);
  CHECK_THROWS_AS(gpu().synchronize(), UserError);
  check_bitwise(w, w1);
  CHECK(gpu().read_step_scalars(dev)[kStepSkip] == 1.0);
}

// ---------------------------------------------------------------------------------
// Transformer ops

// Token ids (B, T) uniform in [0, V).
Tensor random_ids(int64_t B, int64_t T, int V, uint64_t seed) { return random_labels(B * T, V, seed).reshape({B, T}); }

struct EmbeddingDims {
  int64_t B, T, V, C;
};
// Small vocabularies make ids repeat (the backward's accumulation order matters); the
// last shape has three ids for 4096 positions, so each id has a long run.
const EmbeddingDims kEmbeddingDims[] = {{1, 1, 1, 1},    {3, 7, 11, 5},    {2, 33, 1000, 65},
                                        {4, 128, 50, 768}, {8, 512, 3, 33}, {2, 5, 600, 4097}};

TEST_CASE("embedding forward equals the CPU bit for bit; backward to rounding (exactly within a segment)") {
  uint64_t seed = 1300;
  for (DType dt : kFloatTypes) {
    for (const EmbeddingDims& d : kEmbeddingDims) {
      for (bool with_pos : {true, false}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(d.B);
        CAPTURE(d.T);
        CAPTURE(d.V);
        CAPTURE(d.C);
        CAPTURE(with_pos);
        const int64_t P = d.T + 3;  // longer than the sequence: rows >= T are left alone
        Tensor ids = random_ids(d.B, d.T, static_cast<int>(d.V), seed++);
        Tensor table = random_tensor({d.V, d.C}, dt, seed++);
        Tensor pos = with_pos ? random_tensor({P, d.C}, dt, seed++) : Tensor();
        Tensor ids_g = to_gpu(ids);
        Tensor pos_g = with_pos ? to_gpu(pos) : Tensor();

        Tensor out_c = Tensor::empty({d.B, d.T, d.C}, dt, Device::cpu()), out_g = gpu().empty({d.B, d.T, d.C}, dt);
        cpu().embedding(ids, table, pos, out_c);
        gpu().embedding(ids_g, to_gpu(table), pos_g, out_g);
        CHECK(to_doubles(out_g) == to_doubles(out_c));

        // Backward adds into non-zero gradients. An id whose sorted entries fall in one
        // 32-entry segment adds in the CPU's (b, t) order; a frequent id (V = 3 here,
        // thousands of rows) is summed per segment: float rounding, still deterministic.
        Tensor dout = random_tensor({d.B, d.T, d.C}, dt, seed++);
        Tensor dtable0 = random_tensor({d.V, d.C}, dt, seed++);
        Tensor dpos0 = with_pos ? random_tensor({P, d.C}, dt, seed++) : Tensor();
        Tensor dtable_c = clone(dtable0), dtable_g = to_gpu(dtable0);
        Tensor dpos_c = with_pos ? clone(dpos0) : Tensor(), dpos_g = with_pos ? to_gpu(dpos0) : Tensor();
        Tensor dout_g = to_gpu(dout);
        cpu().embedding_backward(ids, dout, dtable_c, dpos_c);
        gpu().embedding_backward(ids_g, dout_g, dtable_g, dpos_g);
        if (d.B * d.T <= 32) {
          CHECK(to_doubles(dtable_g) == to_doubles(dtable_c));
        } else {
          EXPECT_CLOSE_TOL(dtable_g, dtable_c, reduction_tol(dt, d.B * d.T));
        }
        if (with_pos) CHECK(to_doubles(dpos_g) == to_doubles(dpos_c));

        // Deterministic: the same accumulation from the same start gives the same bits.
        Tensor dtable_again = to_gpu(dtable0), dpos_again = with_pos ? to_gpu(dpos0) : Tensor();
        gpu().embedding_backward(ids_g, dout_g, dtable_again, dpos_again);
        CHECK(to_doubles(dtable_again) == to_doubles(dtable_g));
        if (with_pos) CHECK(to_doubles(dpos_again) == to_doubles(dpos_g));
      }
    }
  }
}

// A vocabulary-parallel share (embedding_slice): the ids in rows [first, first + rows)
// looked up, zeros for the rest; the backward adds only into those rows.
TEST_CASE("embedding_slice equals the CPU: forward bit for bit, backward to rounding (exactly within a segment)") {
  uint64_t seed = 1400;
  for (DType dt : kFloatTypes) {
    for (const EmbeddingDims& d : kEmbeddingDims) {
      const int64_t parts = d.V >= 4 ? 4 : 1;
      const int64_t rows = d.V / parts;
      for (int64_t first = 0; first + rows <= d.V; first += rows) {
        CAPTURE(dtype_name(dt));
        CAPTURE(d.V);
        CAPTURE(first);
        Tensor ids = random_ids(d.B, d.T, static_cast<int>(d.V), seed++);
        Tensor table = random_tensor({rows, d.C}, dt, seed++);
        Tensor ids_g = to_gpu(ids);
        Tensor out_c = Tensor::empty({d.B, d.T, d.C}, dt, Device::cpu()), out_g = gpu().empty({d.B, d.T, d.C}, dt);
        cpu().embedding_slice(ids, table, first, d.V, out_c);
        gpu().embedding_slice(ids_g, to_gpu(table), first, d.V, out_g);
        CHECK(to_doubles(out_g) == to_doubles(out_c));
        Tensor dout = random_tensor({d.B, d.T, d.C}, dt, seed++);
        Tensor dtable0 = random_tensor({rows, d.C}, dt, seed++);
        Tensor dtable_c = clone(dtable0), dtable_g = to_gpu(dtable0);
        cpu().embedding_slice_backward(ids, dout, first, d.V, dtable_c);
        gpu().embedding_slice_backward(ids_g, to_gpu(dout), first, d.V, dtable_g);
        if (d.B * d.T <= 32) {
          CHECK(to_doubles(dtable_g) == to_doubles(dtable_c));
        } else {
          EXPECT_CLOSE_TOL(dtable_g, dtable_c, reduction_tol(dt, d.B * d.T));
        }
      }
    }
  }
}

TEST_CASE("a token id outside the vocabulary is a UserError with the CPU's message, at the next synchronize") {
  const int64_t B = 3, T = 4, V = 5, C = 6;
  for (DType dt : kFloatTypes) {
    for (int bad : {5, -1, 1000}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(bad);
      // Bad ids at (1, 2) and (2, 0); (b=1, t=2) is reported.
      std::vector<int32_t> v = {0, 1, 2, 3, 4, 0, bad, 1, -7, 2, 3, 4};
      Tensor ids = Tensor::from_vector(v, {B, T});
      Tensor ids_g = to_gpu(ids);
      Tensor table = random_tensor({V, C}, dt, 1400);
      Tensor table_g = to_gpu(table);
      // What the kernels do with the bad positions until the error is reported: skip
      // them. The ids with those positions pointed at row 0, and no gradient there.
      std::vector<int32_t> v_ok = v;
      std::vector<bool> is_bad(v.size());
      for (size_t p = 0; p < v.size(); ++p) {
        is_bad[p] = v[p] < 0 || v[p] >= V;
        if (is_bad[p]) v_ok[p] = 0;
      }
      Tensor ids_ok = Tensor::from_vector(v_ok, {B, T});

      Tensor out_c = Tensor::empty({B, T, C}, dt, Device::cpu());
      Tensor out_g = to_gpu(host_full({B, T, C}, dt, 7.0));
      const std::string cpu_msg = user_error_of([&] { cpu().embedding(ids, table, Tensor(), out_c); });
      CHECK_NOTHROW(gpu().embedding(ids_g, table_g, Tensor(), out_g));
      const std::string gpu_msg = user_error_of([&] { gpu().synchronize(); });
      CHECK(!cpu_msg.empty());
      CHECK(gpu_msg == cpu_msg);
      CHECK(gpu_msg.find("(b=1, t=2)") != std::string::npos);
      // Good positions hold their table rows, bad ones zeros (nothing read out of bounds).
      cpu().embedding(ids_ok, table, Tensor(), out_c);
      std::vector<double> want = to_doubles(out_c);
      for (size_t p = 0; p < v.size(); ++p) {
        for (int64_t c = 0; c < C; ++c) {
          if (is_bad[p]) want[p * C + c] = 0.0;
        }
      }
      CHECK(to_doubles(out_g) == want);

      Tensor dout = random_tensor({B, T, C}, dt, 1401);
      Tensor dtable0 = random_tensor({V, C}, dt, 1402);
      Tensor dtable_c = clone(dtable0), dtable_g = to_gpu(dtable0), none;
      Tensor dout_g = to_gpu(dout);
      const std::string cpu_bmsg = user_error_of([&] { cpu().embedding_backward(ids, dout, dtable_c, none); });
      CHECK_NOTHROW(gpu().embedding_backward(ids_g, dout_g, dtable_g, none));
      const std::string gpu_bmsg = user_error_of([&] { gpu().synchronize(); });
      CHECK(!cpu_bmsg.empty());
      CHECK(gpu_bmsg == cpu_bmsg);
      // The good positions' gradients were added, the bad ones' skipped: the CPU's
      // result with those rows of dout zeroed (adding +0 changes no value).
      Tensor dout_ok = clone(dout);
      for (size_t p = 0; p < v.size(); ++p) {
        if (!is_bad[p]) continue;
        for (int64_t c = 0; c < C; ++c) {
          if (dt == DType::kF32) {
            dout_ok.data<float>()[p * C + c] = 0.0f;
          } else {
            dout_ok.data<double>()[p * C + c] = 0.0;
          }
        }
      }
      Tensor dtable_want = clone(dtable0);
      cpu().embedding_backward(ids_ok, dout_ok, dtable_want, none);
      CHECK(to_doubles(dtable_g) == to_doubles(dtable_want));
    }
  }
  // The backend is fine afterwards.
  Tensor ids = to_gpu(Tensor::from_vector<int32_t>({1, 0}, {1, 2}));
  Tensor table = to_gpu(random_tensor({2, 3}, DType::kF32, 1403));
  Tensor out = gpu().empty({1, 2, 3}, DType::kF32);
  gpu().embedding(ids, table, Tensor(), out);
  CHECK(all_finite(out));
  // Ids on the host are a programming error, not a crash.
  CHECK_THROWS_AS(gpu().embedding(Tensor::from_vector<int32_t>({1, 0}, {1, 2}), table, Tensor(), out), Error);
}

TEST_CASE("layernorm forward and backward, 2-D and 3-D, up to 4096 channels") {
  const Shape shapes[] = {{1, 1}, {3, 5}, {257, 129}, {64, 768}, {5, 4096}, {1000, 10}, {2, 3, 7}, {130, 1}};
  uint64_t seed = 1500;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      const int64_t C = s.back(), R = shape_numel(s) / C;
      Tensor x = random_tensor(s, dt, seed++, -2.0, 3.0);
      Tensor gamma = random_tensor({C}, dt, seed++, 0.5, 1.5), beta = random_tensor({C}, dt, seed++);
      const double eps = 1e-5;
      Tensor y_c = Tensor::empty(s, dt, Device::cpu()), mean_c = Tensor::empty({R}, dt, Device::cpu()),
             rstd_c = Tensor::empty({R}, dt, Device::cpu());
      cpu().layernorm(x, gamma, beta, eps, y_c, mean_c, rstd_c);
      Tensor x_g = to_gpu(x), gamma_g = to_gpu(gamma);
      Tensor y_g = gpu().empty(s, dt), mean_g = gpu().empty({R}, dt), rstd_g = gpu().empty({R}, dt);
      gpu().layernorm(x_g, gamma_g, to_gpu(beta), eps, y_g, mean_g, rstd_g);
      // Statistics in double on both sides, rounded once: only the summation order differs.
      EXPECT_CLOSE_TOL(mean_g, mean_c, reduction_tol(dt, C));
      EXPECT_CLOSE_TOL(rstd_g, rstd_c, reduction_tol(dt, C));
      EXPECT_CLOSE_TOL(y_g, y_c, reduction_tol(dt, C));

      // Backward from the CPU's statistics on both sides; dgamma and dbeta accumulate.
      Tensor dy = random_tensor(s, dt, seed++);
      Tensor dgamma0 = random_tensor({C}, dt, seed++), dbeta0 = random_tensor({C}, dt, seed++);
      Tensor dx_c = Tensor::empty(s, dt, Device::cpu()), dgamma_c = clone(dgamma0), dbeta_c = clone(dbeta0);
      cpu().layernorm_backward(dy, x, gamma, mean_c, rstd_c, dx_c, dgamma_c, dbeta_c);
      Tensor dx_g = to_gpu(host_full(s, dt, std::nan(""))), dgamma_g = to_gpu(dgamma0), dbeta_g = to_gpu(dbeta0);
      gpu().layernorm_backward(to_gpu(dy), x_g, gamma_g, to_gpu(mean_c), to_gpu(rstd_c), dx_g, dgamma_g, dbeta_g);
      CHECK(all_finite(dx_g));
      EXPECT_CLOSE_TOL(dx_g, dx_c, reduction_tol(dt, C));
      EXPECT_CLOSE_TOL(dgamma_g, dgamma_c, reduction_tol(dt, R));
      EXPECT_CLOSE_TOL(dbeta_g, dbeta_c, reduction_tol(dt, R));
    }
  }
  // Many rows: the dgamma/dbeta reduction uses its full grid of row chunks.
  Tensor x = random_tensor({70001, 3}, DType::kF64, 1510), dy = random_tensor({70001, 3}, DType::kF64, 1511);
  Tensor gamma = random_tensor({3}, DType::kF64, 1512), beta = random_tensor({3}, DType::kF64, 1513);
  Tensor y = Tensor::empty({70001, 3}, DType::kF64, Device::cpu());
  Tensor mean = Tensor::empty({70001}, DType::kF64, Device::cpu());
  Tensor rstd = Tensor::empty({70001}, DType::kF64, Device::cpu());
  cpu().layernorm(x, gamma, beta, 1e-5, y, mean, rstd);
  Tensor dx_c = Tensor::empty({70001, 3}, DType::kF64, Device::cpu());
  Tensor dg_c = host_full({3}, DType::kF64, 0.0), db_c = host_full({3}, DType::kF64, 0.0);
  cpu().layernorm_backward(dy, x, gamma, mean, rstd, dx_c, dg_c, db_c);
  Tensor dx_g = gpu().empty({70001, 3}, DType::kF64), dg_g = gpu().zeros({3}, DType::kF64),
         db_g = gpu().zeros({3}, DType::kF64);
  gpu().layernorm_backward(to_gpu(dy), to_gpu(x), to_gpu(gamma), to_gpu(mean), to_gpu(rstd), dx_g, dg_g, db_g);
  EXPECT_CLOSE_TOL(dx_g, dx_c, reduction_tol(DType::kF64, 3));
  EXPECT_CLOSE_TOL(dg_g, dg_c, reduction_tol(DType::kF64, 70001));
  EXPECT_CLOSE_TOL(db_g, db_c, reduction_tol(DType::kF64, 70001));
}

struct AttentionDims {
  int64_t B, T, C, H;
};
const AttentionDims kAttentionDims[] = {{1, 1, 4, 1},  {2, 5, 12, 3},   {3, 17, 32, 4},
                                        {2, 64, 96, 2}, {1, 130, 64, 1}, {1, 1024, 32, 2}};

TEST_CASE("attention forward and backward (strided-batched cuBLAS, causal softmax), up to T = 1024") {
  uint64_t seed = 1600;
  for (DType dt : kFloatTypes) {
    for (const AttentionDims& d : kAttentionDims) {
      for (double range : {1.0, 4.0}) {  // 4: peaked softmax rows
        CAPTURE(dtype_name(dt));
        CAPTURE(d.B);
        CAPTURE(d.T);
        CAPTURE(d.C);
        CAPTURE(d.H);
        CAPTURE(range);
        const int64_t B = d.B, T = d.T, C = d.C, H = d.H, D = C / H;
        const int heads = static_cast<int>(H);
        Tensor qkv = random_tensor({B, T, 3 * C}, dt, seed++, -range, range);
        Tensor probs_c = Tensor::empty({B, H, T, T}, dt, Device::cpu());
        Tensor out_c = Tensor::empty({B, T, C}, dt, Device::cpu());
        cpu().attention(qkv, heads, probs_c, out_c);
        Tensor qkv_g = to_gpu(qkv);
        Tensor probs_g = to_gpu(host_full({B, H, T, T}, dt, std::nan(""))), out_g = gpu().empty({B, T, C}, dt);
        gpu().attention(qkv_g, heads, probs_g, out_g);
        // Scores are dot products of D terms; each output sums T products.
        EXPECT_CLOSE_TOL(probs_g, probs_c, reduction_tol(dt, D));
        EXPECT_CLOSE_TOL(out_g, out_c, reduction_tol(dt, T + D));
        // The causal mask is exact zeros (the NaN the buffer held is gone).
        const std::vector<double> pg = to_doubles(probs_g);
        int64_t unmasked = 0;
        for (int64_t bh = 0; bh < B * H; ++bh)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t s = t + 1; s < T; ++s) unmasked += pg[(bh * T + t) * T + s] != 0.0;
        CHECK(unmasked == 0);

        // Backward from the same probabilities on both sides; dqkv is overwritten.
        Tensor dout = random_tensor({B, T, C}, dt, seed++);
        Tensor dqkv_c = Tensor::empty({B, T, 3 * C}, dt, Device::cpu());
        cpu().attention_backward(dout, qkv, probs_c, heads, dqkv_c);
        Tensor dqkv_g = to_gpu(host_full({B, T, 3 * C}, dt, std::nan("")));
        gpu().attention_backward(to_gpu(dout), qkv_g, to_gpu(probs_c), heads, dqkv_g);
        CHECK(all_finite(dqkv_g));
        EXPECT_CLOSE_TOL(dqkv_g, dqkv_c, reduction_tol(dt, 2 * T + D));
      }
    }
  }
  Tensor qkv = gpu().empty({1, 2, 18}, DType::kF32);
  Tensor probs = gpu().empty({1, 4, 2, 2}, DType::kF32), out = gpu().empty({1, 2, 6}, DType::kF32);
  CHECK_THROWS_AS(gpu().attention(qkv, 4, probs, out), Error);  // 6 channels, 4 heads
}

TEST_CASE("dropout: the mask and the output are the CPU's bit for bit, forward and backward, element offsets too") {
  const Shape shapes[] = {{1, 1}, {3, 5}, {7, 33, 3}, {64, 1000}, {5, 1}, {2, 3, 4, 5}, {4, 100003}};
  const uint64_t key = 0x0123456789ABCDEFull;
  uint64_t seed = 1700;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : shapes) {
      for (double p : {0.1, 0.5, 0.0}) {
        for (int64_t offset : {int64_t(0), int64_t(5), (int64_t(1) << 33) + 7}) {
          // Where the rows start in their samples: whole samples, and parts of them
          // starting inside a Philox block (a sequence-parallel member's positions).
          const int64_t eoff = offset == 0 ? 0 : offset == 5 ? 3 : (int64_t(1) << 20) + 2;
          CAPTURE(eoff);
          CAPTURE(dtype_name(dt));
          CAPTURE(shape_str(s));
          CAPTURE(p);
          CAPTURE(offset);
          Tensor x = random_tensor(s, dt, seed++);
          Tensor y_c = Tensor::empty(s, dt, Device::cpu()), y_g = gpu().empty(s, dt);
          cpu().dropout(x, p, key, offset, eoff, y_c);
          Tensor x_g = to_gpu(x);
          gpu().dropout(x_g, p, key, offset, eoff, y_g);
          CHECK(to_doubles(y_g) == to_doubles(y_c));

          Tensor dy = random_tensor(s, dt, seed++);
          Tensor dx_c = Tensor::empty(s, dt, Device::cpu()), dx_g = gpu().empty(s, dt);
          cpu().dropout_backward(dy, p, key, offset, eoff, dx_c);
          gpu().dropout_backward(to_gpu(dy), p, key, offset, eoff, dx_g);
          CHECK(to_doubles(dx_g) == to_doubles(dx_c));

          // In place.
          gpu().dropout(x_g, p, key, offset, eoff, x_g);
          CHECK(to_doubles(x_g) == to_doubles(y_c));
        }
      }
    }
  }
  // Split into two micro-batches, the mask is the same.
  Tensor x = to_gpu(random_tensor({8, 3, 5}, DType::kF32, 1750));
  Tensor whole = gpu().empty({8, 3, 5}, DType::kF32);
  gpu().dropout(x, 0.5, key, 0, 0, whole);
  Tensor a = gpu().empty({3, 3, 5}, DType::kF32), b = gpu().empty({5, 3, 5}, DType::kF32);
  gpu().dropout(x.narrow_rows(0, 3), 0.5, key, 0, 0, a);
  gpu().dropout(x.narrow_rows(3, 5), 0.5, key, 3, 0, b);
  std::vector<double> split = to_doubles(a);
  const std::vector<double> second = to_doubles(b);
  split.insert(split.end(), second.begin(), second.end());
  CHECK(split == to_doubles(whole));

  // Bad probabilities: the CPU's UserError; a negative offset is an Error.
  for (double p : {1.0, -0.1, std::nan("")}) {
    CAPTURE(p);
    std::string cpu_msg, gpu_msg;
    Tensor hx = random_tensor({2, 3}, DType::kF32, 1760), hy = Tensor::empty({2, 3}, DType::kF32, Device::cpu());
    Tensor gx = to_gpu(hx), gy = gpu().empty({2, 3}, DType::kF32);
    try {
      cpu().dropout(hx, p, key, 0, 0, hy);
    } catch (const UserError& e) {
      cpu_msg = e.what();
    }
    try {
      gpu().dropout(gx, p, key, 0, 0, gy);
    } catch (const UserError& e) {
      gpu_msg = e.what();
    }
    CHECK(!cpu_msg.empty());
    CHECK(gpu_msg == cpu_msg);
  }
  CHECK_THROWS_AS(gpu().dropout(x, 0.5, key, -1, 0, whole), Error);

  // A key the kernel finishes from the step's scalars on the device (kStepIndex) is the
  // CPU's with the step on the host, forward and backward; another step, another mask.
  StepScalarValues v = initial_step_scalars();
  v[kStepIndex] = 1234567;
  const Tensor scalars = gpu().step_scalars(v);
  const Tensor hx = random_tensor({6, 41}, DType::kF32, 1770);
  Tensor want = Tensor::empty({6, 41}, DType::kF32, Device::cpu()), got = gpu().empty({6, 41}, DType::kF32);
  cpu().dropout(hx, 0.3, DropoutKey::of_step(key, 0x8CB92BA72F3D8DD7ull, 1234567), 9, 2, want);
  gpu().dropout(to_gpu(hx), 0.3, DropoutKey::of_step(key, 0x8CB92BA72F3D8DD7ull, 0, scalars), 9, 2, got);
  CHECK(to_doubles(got) == to_doubles(want));
  cpu().dropout_backward(hx, 0.3, DropoutKey::of_step(key, 0x8CB92BA72F3D8DD7ull, 1234567), 9, 2, want);
  gpu().dropout_backward(to_gpu(hx), 0.3, DropoutKey::of_step(key, 0x8CB92BA72F3D8DD7ull, 0, scalars), 9, 2, got);
  CHECK(to_doubles(got) == to_doubles(want));
  v[kStepIndex] = 1234568;
  gpu().dropout(to_gpu(hx), 0.3, DropoutKey::of_step(key, 0x8CB92BA72F3D8DD7ull, 0, gpu().step_scalars(v)), 9, 2, got);
  CHECK(to_doubles(got) != to_doubles(want));
}


TEST_CASE("cast to and from bfloat16 on the GPU equals the CPU's bit for bit, every bfloat16 included") {
  // Every bfloat16 pattern to float32 and float64 and back; random float32 and float64
  // values (and values on bfloat16 ties) to bfloat16.
  Tensor patterns = cpu().empty({0x10000}, DType::kBF16);
  for (int b = 0; b < 0x10000; ++b) patterns.data<BFloat16>()[b].bits = static_cast<uint16_t>(b);
  Tensor f32 = random_tensor({1 << 16}, DType::kF32, 41), f64 = random_tensor({1 << 16}, DType::kF64, 42);
  for (int i = 0; i < (1 << 16); i += 3) {  // ties: a bfloat16 plus half its ulp, exactly
    const uint16_t b = static_cast<uint16_t>((i * 7919) % 0x7f7f);
    const double lo = bf16_to_float({b}), hi = bf16_to_float({static_cast<uint16_t>(b + 1)});
    f32.data<float>()[i] = static_cast<float>(lo + (hi - lo) / 2);
    f64.data<double>()[i] = lo + (hi - lo) / 2 + (i % 2 ? 1 : -1) * std::ldexp(lo, -40);
  }
  // Edges: NaNs of both signs and payloads, infinities, subnormals, values next to the
  // largest finite bfloat16 and past it.
  const float edges32[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::infinity(),  -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::denorm_min(), -1e-40f, 3.3895e38f, 3.3896e38f,
                           std::numeric_limits<float>::max(), -0.0f};
  for (size_t i = 0; i < sizeof edges32 / sizeof edges32[0]; ++i) {
    f32.data<float>()[i + 1] = edges32[i];
    f64.data<double>()[i + 1] = static_cast<double>(edges32[i]);
  }
  f64.data<double>()[20] = 1e300;
  f64.data<double>()[21] = -1e-300;
  struct Case {
    Tensor src;
    DType to;
  };
  // float64 to float32 and back without NaNs: their payloads through a float conversion
  // are the hardware's (Backend::cast).
  Tensor f64_finite = random_tensor({1 << 16}, DType::kF64, 43);
  for (const Case& c : {Case{patterns, DType::kF32}, Case{patterns, DType::kF64}, Case{f32, DType::kBF16},
                        Case{f64, DType::kBF16}, Case{f64_finite, DType::kF32}, Case{random_tensor({1 << 16}, DType::kF32, 44), DType::kF64}}) {
    CAPTURE(c.src.str());
    CAPTURE(dtype_name(c.to));
    Tensor want = cpu().empty(c.src.shape(), c.to);
    cpu().cast(c.src, want);
    Tensor dev = gpu().empty(c.src.shape(), c.to);
    gpu().cast(to_gpu(c.src), dev);
    Tensor got = cpu().empty(c.src.shape(), c.to);
    gpu().copy(dev, got);
    CHECK(std::memcmp(got.raw_data(), want.raw_data(), want.nbytes()) == 0);
  }
}

}  // namespace
}  // namespace gpipe

int main(int argc, char** argv) { return gpipe::gpu_testing::run_gpu_tests(argc, argv); }
