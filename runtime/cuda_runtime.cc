// The CUDA side of the runtime: streams, events, copies and transfers between GPUs
// (the device selector, guards and count are in cuda_device.cc, the allocator and
// pinned staging in cuda_allocator.cc; both sit below this file). Compiled by the host compiler only in CUDA builds
// (GPIPE_WITH_CUDA); no kernels live here (those are in kernels/cuda_kernels.cu).
//
// Rules followed throughout:
//   * every CUDA call is checked with GPIPE_CUDA_CHECK (throws gpipe::Error);
//   * every call that depends on the current device runs under a DeviceGuard, which
//     selects the object's device unless the thread is on it already (the rule of
//     runtime/device_binding.h);
//   * nothing here waits for a whole device: copies are ordered on streams with events,
//     and only a copy to the host waits, for the one stream that produced the data;
//   * destructors never throw: failures there are logged with spdlog::warn, and the
//     "CUDA runtime already unloaded" case at process exit is ignored silently.
#include "runtime/cuda_runtime.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "runtime/cuda_allocator.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

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

void warn_if_failed(cudaError_t e, const char* call) {
  if (e == cudaSuccess || is_teardown(e)) {
    cudaGetLastError();
    return;
  }
  spdlog::warn("{} failed during cleanup: {} ({})", call, cudaGetErrorName(e), cudaGetErrorString(e));
  cudaGetLastError();
}

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
  bool capturing() const override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    GPIPE_CUDA_CHECK(cudaStreamIsCapturing(stream_, &status));
    return status != cudaStreamCaptureStatusNone;
  }
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
    // In a captured step (Backend::begin_capture) the record becomes the graph's own
    // node, so that each replay records the event again (the OpClock's times).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    GPIPE_CUDA_CHECK(cudaStreamIsCapturing(s->handle(), &capture));
    if (capture == cudaStreamCaptureStatusActive) {
      GPIPE_CUDA_CHECK(cudaEventRecordWithFlags(event_, s->handle(), cudaEventRecordExternal));
    } else {
      GPIPE_CUDA_CHECK(cudaEventRecord(event_, s->handle()));
    }
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

cudaStream_t native(Stream& s) { return static_cast<cudaStream_t>(s.native()); }

// The stream that copies arriving from other GPUs of this process run on, one per
// destination device, so that they overlap the destination's compute. Never destroyed,
// like the compute streams.
Stream& transfer_stream_for(Device device) {
  static std::mutex mu;
  static auto* streams = new std::map<int, Stream*>;
  std::lock_guard<std::mutex> lock(mu);
  Stream*& slot = (*streams)[device.index];
  if (slot == nullptr) slot = make_cuda_stream(device).release();
  return *slot;
}

}  // namespace

std::unique_ptr<Stream> make_cuda_stream(Device device) {
  check_cuda_device(device, "CUDA stream");
  return std::make_unique<CudaStream>(device);
}

std::unique_ptr<Event> make_cuda_event(Device device) {
  check_cuda_device(device, "CUDA event");
  return std::make_unique<CudaEvent>(device);
}

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  static std::mutex mu;
  static std::set<std::pair<int, int>> tried;
  std::lock_guard<std::mutex> lock(mu);
  if (!tried.insert({device, peer}).second) return;
  int can = 0;
  GPIPE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
  if (can == 0) {
    spdlog::info("cuda:{} cannot access cuda:{} directly; copies between them go through host memory", device, peer);
    return;
  }
  DeviceGuard guard(device);
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(error_location(__FILE__, __LINE__) + ": cudaDeviceEnablePeerAccess(" + std::to_string(peer) +
                ") on cuda:" + std::to_string(device) + " failed: " + cudaGetErrorName(e) + " (" +
                cudaGetErrorString(e) + "); set NCCL_P2P_DISABLE=1 and CUDA_VISIBLE_DEVICES to GPUs that can");
  }
}

void cuda_copy(const void* src, Device src_device, void* dst, Device dst_device, size_t bytes) {
  if (bytes == 0) return;
  if (src_device.is_cpu() && dst_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  if (src_device.is_cpu()) {
    stage_to_device(src, dst, bytes, dst_device, native(compute_stream_for(dst_device)));
    return;
  }
  Stream& from = compute_stream_for(src_device);
  if (dst_device.is_cpu()) {
    // The host needs the bytes: wait for the stream that produced them (and nothing else).
    DeviceGuard guard(src_device.index);
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, native(from)));
    GPIPE_CUDA_CHECK(cudaStreamSynchronize(native(from)));
    return;
  }
  Stream& to = compute_stream_for(dst_device);
  if (src_device == dst_device) {
    DeviceGuard guard(dst_device.index);
    GPIPE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, native(to)));
    return;
  }
  // After the work queued so far on the source's stream, before what follows on the
  // destination's; the host does not wait.
  std::unique_ptr<Event> produced = make_cuda_event(src_device);
  produced->record(from);
  to.wait(*produced);
  enable_peer_access(dst_device.index, src_device.index);
  DeviceGuard guard(dst_device.index);
  GPIPE_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, bytes, native(to)));
}

Tensor cuda_transfer(const Tensor& src, Device device, Event* ready) {
  GPIPE_CHECK(src.device().is_cuda() && device.is_cuda() && src.device() != device,
              "cuda_transfer of " + src.str() + " to " + device.str());
  GPIPE_CHECK(src.is_contiguous(), "cuda_transfer of a non-contiguous tensor " + src.str());
  Stream& link = transfer_stream_for(device);
  Stream& compute = compute_stream_for(device);
  // (the destination's shape): a block of the transfer stream, which no compute work waits for
  Tensor out = Tensor::empty(src.shape(), src.dtype(), device, &link);
  if (src.nbytes() == 0) return out;
  std::unique_ptr<Event> now;
  if (ready == nullptr) {  // produced by everything queued on the source's stream so far
    now = make_cuda_event(src.device());
    now->record(compute_stream_for(src.device()));
    ready = now.get();
  }
  link.wait(*ready);
  enable_peer_access(device.index, src.device().index);
  {
    DeviceGuard guard(device.index);
    GPIPE_CUDA_CHECK(cudaMemcpyPeerAsync(out.raw_data(), device.index, src.raw_data(), src.device().index,
                                         src.nbytes(), native(link)));
  }
  std::unique_ptr<Event> arrived = make_cuda_event(device);
  arrived->record(link);
  compute.wait(*arrived);  // what the receiver queues next sees the data
  record_stream(out, compute);  // ... and the block waits for it once freed
  record_stream(src, link);     // the source's block waits for the copy
  return out;
}

}  // namespace gpipe
