// The CUDA side of the runtime: device count, the caching device allocator, streams,
// events and synchronous copies. Compiled by the host compiler only in CUDA builds
// (GPIPE_WITH_CUDA); no kernels live here (those are in kernels/cuda_kernels.cu).
//
// Rules followed throughout:
//   * every CUDA call is checked with GPIPE_CUDA_CHECK (throws gpipe::Error);
//   * every call that depends on the current device runs under a DeviceGuard, which
//     sets the object's device and restores the caller's device afterwards;
//   * destructors never throw: failures there are logged with spdlog::warn, and the
//     "CUDA runtime already unloaded" case at process exit is ignored silently.
#include "runtime/cuda_runtime.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {

const char* cublas_status_string(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED (cuBLAS handle not created, or no usable GPU/driver)";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED (cuBLAS could not allocate GPU memory; lower train.batch_size)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (bad dimension, leading dimension or pointer)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (feature not supported by this GPU)";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR (GPU memory access failed)";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED (the GPU kernel failed to launch or run)";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (unsupported parameter combination)";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return cublasGetStatusString(s);  // statuses added after this list was written
  }
}

namespace {

// For destructors: like DeviceGuard, but never throws. ok() is false when the device
// could not be set (the caller then skips its cleanup: at process exit the CUDA runtime
// may already be unloaded, and the driver reclaims everything anyway).
class NoThrowDeviceGuard {
 public:
  NoThrowDeviceGuard(int index, const char* what) {
    cudaError_t e = cudaGetDevice(&previous_);
    if (e == cudaSuccess && previous_ != index) {
      e = cudaSetDevice(index);
      switched_ = e == cudaSuccess;
    }
    ok_ = e == cudaSuccess;
    if (!ok_) {
      if (!is_teardown(e)) {
        spdlog::warn("{}: selecting device {} failed: {}", what, index, cudaGetErrorString(e));
      }
      cudaGetLastError();  // do not leave the error for the next checked launch to find
    }
  }
  ~NoThrowDeviceGuard() {
    if (switched_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }
  NoThrowDeviceGuard(const NoThrowDeviceGuard&) = delete;
  NoThrowDeviceGuard& operator=(const NoThrowDeviceGuard&) = delete;
  bool ok() const { return ok_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  bool ok_ = false;
};

void warn_if_failed(cudaError_t e, const char* call) {
  if (e == cudaSuccess || is_teardown(e)) {
    cudaGetLastError();
    return;
  }
  spdlog::warn("{} failed during cleanup: {} ({})", call, cudaGetErrorName(e), cudaGetErrorString(e));
  cudaGetLastError();
}

void check_cuda_device(Device device, const char* what) {
  if (!device.is_cuda()) throw Error(std::string(what) + " on " + device.str() + ", which is not a CUDA device");
  const int count = cuda_runtime_device_count();
  if (count == 0) {
    throw UserError(std::string(what) + ": device " + device.str() +
                    " requested, but no CUDA device is visible (no GPU, no driver, or CUDA_VISIBLE_DEVICES "
                    "hides them all); use cpu devices on this machine");
  }
  if (device.index < 0 || device.index >= count) {
    throw UserError(std::string(what) + ": device " + device.str() + " requested, but " + std::to_string(count) +
                    " CUDA device(s) are visible; use cuda:0..cuda:" + std::to_string(count - 1) +
                    " or check CUDA_VISIBLE_DEVICES");
  }
}

// ---------------------------------------------------------------------------------
// Allocator

// A caching allocator over cudaMalloc (the cache itself is CachingAllocator's).
//
// Reuse is safe for work ordered on one stream: a block freed by the host while a kernel
// that uses it is still queued can only be handed out again to work queued later on the
// same stream, which runs after it. Work on a *different* stream of the same device that
// receives a recycled block must be ordered with events by its caller (as the pipeline
// already does between its compute and communication streams).
class CudaAllocator : public CachingAllocator {
 public:
  explicit CudaAllocator(Device device) : CachingAllocator(device) {}
  ~CudaAllocator() override { release_cache_nothrow(); }

 protected:
  void* allocate_block(size_t size) override {
    DeviceGuard guard(device_.index);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaSuccess) return p;
    cudaGetLastError();  // clear it, or the next checked kernel launch would report it
    if (e == cudaErrorMemoryAllocation) return nullptr;
    throw Error(error_location(__FILE__, __LINE__) + ": cudaMalloc of " + std::to_string(size) + " bytes on " +
                device_.str() + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }

  void free_blocks(const std::multimap<size_t, void*>& blocks) override {
    DeviceGuard guard(device_.index);
    // cudaFree waits for the device to finish using the block (it synchronises), so the
    // blocks can be returned even if queued kernels were the last to use them.
    for (const auto& kv : blocks) GPIPE_CUDA_CHECK(cudaFree(kv.second));
  }

  UserError out_of_memory(size_t size) const override {
    const MemoryStats s = stats();
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
    return UserError("out of GPU memory on " + device_.str() + " allocating " + std::to_string(size) + " bytes (" +
                     std::to_string(s.in_use) + " bytes in use by this process's tensors, " +
                     std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
                     " bytes free on the device); lower train.batch_size, or raise pipeline.micro_batches "
                     "or pipeline.partitions so each stage holds less");
  }

 private:
  // At process exit CUDA may already be torn down: leak rather than throw.
  void release_cache_nothrow() noexcept {
    const std::multimap<size_t, void*> blocks = take_cache();
    if (blocks.empty()) return;
    NoThrowDeviceGuard guard(device_.index, "~CudaAllocator");
    if (!guard.ok()) return;  // leak at exit
    for (const auto& kv : blocks) {
      const cudaError_t e = cudaFree(kv.second);
      if (is_teardown(e)) return;  // process exit: the driver frees everything
      warn_if_failed(e, "cudaFree");
    }
  }
};

// ---------------------------------------------------------------------------------
// Streams and events

class CudaEvent;

class CudaStream : public Stream {
 public:
  explicit CudaStream(Device device) : device_(device) {
    DeviceGuard guard(device_.index);
    // Non-blocking: no implicit synchronisation with the legacy default stream, so
    // cudaMemcpy elsewhere in the process cannot serialise this stream's work.
    GPIPE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    if (stream_ == nullptr) return;
    NoThrowDeviceGuard guard(device_.index, "~CudaStream");
    if (!guard.ok()) return;
    // cudaStreamDestroy returns at once; queued work still completes.
    warn_if_failed(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Device device() const override { return device_; }
  void synchronize() override { GPIPE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  void wait(Event& event) override;
  void* native() const override { return stream_; }
  cudaStream_t handle() const { return stream_; }

 private:
  Device device_;
  cudaStream_t stream_ = nullptr;
};

class CudaEvent : public Event {
 public:
  explicit CudaEvent(Device device) : device_(device) {
    DeviceGuard guard(device_.index);
    GPIPE_CUDA_CHECK(cudaEventCreate(&event_));  // default flags: timing enabled
  }
  ~CudaEvent() override {
    if (event_ == nullptr) return;
    NoThrowDeviceGuard guard(device_.index, "~CudaEvent");
    if (!guard.ok()) return;
    warn_if_failed(cudaEventDestroy(event_), "cudaEventDestroy");
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(Stream& stream) override {
    auto* s = dynamic_cast<CudaStream*>(&stream);
    GPIPE_CHECK(s != nullptr, "a CUDA event on " + device_.str() + " recorded on a non-CUDA stream (" +
                                  stream.device().str() + ")");
    GPIPE_CHECK(s->device() == device_, "a CUDA event on " + device_.str() + " recorded on a stream of " +
                                            s->device().str() + "; events must be recorded on their own device");
    DeviceGuard guard(device_.index);
    GPIPE_CUDA_CHECK(cudaEventRecord(event_, s->handle()));
    recorded_ = true;
  }
  void synchronize() override {
    if (!recorded_) return;  // like an event that has completed: nothing to wait for
    GPIPE_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  double elapsed_ms(const Event& later) const override {
    const auto* other = dynamic_cast<const CudaEvent*>(&later);
    GPIPE_CHECK(other != nullptr, "elapsed_ms between a CUDA event and a non-CUDA event");
    GPIPE_CHECK(recorded_ && other->recorded_, "elapsed_ms of an event that was never recorded");
    // Both must have completed; wait for them rather than fail with cudaErrorNotReady.
    GPIPE_CUDA_CHECK(cudaEventSynchronize(event_));
    GPIPE_CUDA_CHECK(cudaEventSynchronize(other->event_));
    float ms = 0.0f;
    GPIPE_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, other->event_));
    return static_cast<double>(ms);
  }
  cudaEvent_t handle() const { return event_; }
  bool recorded() const { return recorded_; }

 private:
  Device device_;
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

void CudaStream::wait(Event& event) {
  auto* e = dynamic_cast<CudaEvent*>(&event);
  GPIPE_CHECK(e != nullptr, "a CUDA stream on " + device_.str() + " told to wait for a non-CUDA event");
  if (!e->recorded()) return;  // cudaStreamWaitEvent on an unrecorded event is a no-op too
  DeviceGuard guard(device_.index);
  // Cross-device waits are allowed: the event may belong to another GPU.
  GPIPE_CUDA_CHECK(cudaStreamWaitEvent(stream_, e->handle(), 0));
}

// Waits for all work on the device, including non-blocking streams, which a plain
// cudaMemcpy (legacy default stream) does not order itself after.
void synchronize_device(int index) {
  DeviceGuard guard(index);
  GPIPE_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace

int cuda_runtime_device_count() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    // cudaErrorNoDevice / cudaErrorInsufficientDriver (no GPU or no driver, error 35 on
    // machines without one) are the expected ways to have none; anything else is too.
    cudaGetLastError();
    if (e != cudaErrorNoDevice && e != cudaErrorInsufficientDriver) {
      spdlog::debug("cudaGetDeviceCount failed: {} ({}); treating it as no CUDA device", cudaGetErrorName(e),
                    cudaGetErrorString(e));
    }
    return 0;
  }
  return count;
}

std::unique_ptr<Allocator> make_cuda_allocator(Device device) {
  check_cuda_device(device, "CUDA allocator");
  return std::make_unique<CudaAllocator>(device);
}

std::unique_ptr<Stream> make_cuda_stream(Device device) {
  check_cuda_device(device, "CUDA stream");
  return std::make_unique<CudaStream>(device);
}

std::unique_ptr<Event> make_cuda_event(Device device) {
  check_cuda_device(device, "CUDA event");
  return std::make_unique<CudaEvent>(device);
}

void cuda_copy(const void* src, Device src_device, void* dst, Device dst_device, size_t bytes) {
  if (bytes == 0) return;
  if (src_device.is_cpu() && dst_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Synchronous in the strong sense: the copy sees all work queued on either device
  // before it (the backends' streams are non-blocking, so the legacy-stream cudaMemcpy
  // alone would not wait for them), and it has landed when this returns (cudaMemcpy
  // returns early for device-to-device and for host-to-device from pageable memory).
  if (src_device.is_cuda()) synchronize_device(src_device.index);
  if (dst_device.is_cuda() && dst_device != src_device) synchronize_device(dst_device.index);
  const int copy_device = src_device.is_cuda() ? src_device.index : dst_device.index;
  {
    DeviceGuard guard(copy_device);
    // Unified addressing: the runtime tells host from device pointers (and which device).
    GPIPE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
  if (src_device.is_cuda()) synchronize_device(src_device.index);
  if (dst_device.is_cuda() && dst_device != src_device) synchronize_device(dst_device.index);
}

}  // namespace gpipe
