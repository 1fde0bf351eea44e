// A captured step on a GPU (Backend::begin_capture): the backend's stream captured into a
// CUDA graph, replayed with one launch.
//
//   begin_capture  wait() (the stream idle, no check pending: the capture's slots start
//                  at 0), the allocator's private pool on (Allocator::begin_private_pool),
//                  cudaStreamBeginCapture in relaxed mode (a new segment's cudaMalloc may
//                  happen inside; it is the pool's, not the graph's, and stays)
//   ...ops...      kernels, cuBLAS, cuDNN and copies between device buffers become the
//                  graph's nodes; OpClock's events external event-record nodes
//                  (cuda_runtime.cc); their checks pending as usual
//   end_capture    cudaStreamEndCapture, the pending checks taken out unread (nothing
//                  ran), cudaGraphInstantiate
//   replay         the checks put back in their slots, cudaGraphLaunch; the caller's
//                  synchronize reads the slots as after any step
//
// What a step must not do to be captured fails the capture (the caller then runs it as
// before): a wait for the stream or a read back (cudaStreamSynchronize on a capturing
// stream is an error), a copy from host memory (stage_to_device refuses), a multi-tensor
// op on a list no earlier step used (its table's copy from the host).
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda_backend.h"
#include "runtime/allocator.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_device.h"

namespace gpipe {

class CudaCapturedOps : public CapturedOps {
 public:
  CudaCapturedOps(CudaBackend& backend, cudaGraph_t graph, cudaGraphExec_t exec,
                  std::vector<DeferredChecks::Queued> checks, std::unique_ptr<char> key,
                  std::vector<const int64_t*> tables, int64_t nodes)
      : backend_(backend), graph_(graph), exec_(exec), checks_(std::move(checks)), key_(std::move(key)),
        tables_(std::move(tables)), nodes_(nodes), thread_(std::this_thread::get_id()) {
    for (const int64_t* t : tables_) backend_.captured_tables_.insert(t);
  }
  ~CudaCapturedOps() override {
    NoThrowDeviceGuard guard(backend_.device().index, "~CudaCapturedOps");
    if (!guard.ok()) return;  // CUDA torn down at exit: the driver reclaims the graph
    // A queued replay still reads the graph's memory: wait for it before letting go.
    cudaError_t e = cudaStreamSynchronize(backend_.cuda_stream());
    if (e == cudaSuccess) e = cudaGraphExecDestroy(exec_);
    if (e == cudaSuccess) e = cudaGraphDestroy(graph_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (!is_teardown(e)) spdlog::warn("freeing a captured step on {}: {}", backend_.device().str(), cudaGetErrorString(e));
      return;  // keep the pool and the tables: something may still read them
    }
    for (const int64_t* t : tables_) {
      auto it = backend_.captured_tables_.find(t);
      if (it != backend_.captured_tables_.end()) backend_.captured_tables_.erase(it);
    }
    allocator_for(backend_.device()).release_private_pool(key_.get());
  }
  CudaCapturedOps(const CudaCapturedOps&) = delete;
  CudaCapturedOps& operator=(const CudaCapturedOps&) = delete;

  void replay() override {
    GPIPE_CHECK(std::this_thread::get_id() == thread_, "a captured step replayed on another thread than its own");
    backend_.replay_graph(exec_, checks_);
  }
  int64_t nodes() const override { return nodes_; }

 private:
  CudaBackend& backend_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  std::vector<DeferredChecks::Queued> checks_;
  std::unique_ptr<char> key_;
  std::vector<const int64_t*> tables_;
  int64_t nodes_;
  std::thread::id thread_;
};

void CudaBackend::begin_capture() {
  if (capture_) throw CaptureError("the backend of " + device_.str() + " is capturing already");
  DeviceGuard guard(device_.index);
  wait();  // the stream idle and no check pending: the capture's checks take slots from 0
  auto c = std::make_unique<Capture>();
  Allocator& alloc = allocator_for(device_);
  // The capture draws on a pool of its own, which cannot take the blocks the earlier
  // steps cached for the stream: give those back to the device first, so that the step
  // fits a second time (an out-of-memory inside the capture cannot wait to free them).
  alloc.release_cache();
  alloc.begin_private_pool(c->key.get());
  const cudaError_t e = cudaStreamBeginCapture(cuda_stream(), cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    cudaGetLastError();
    alloc.end_private_pool();
    alloc.release_private_pool(c->key.get());
    throw CaptureError(std::string("cudaStreamBeginCapture on ") + device_.str() + " failed: " + cudaGetErrorString(e));
  }
  capture_ = std::move(c);
}

std::unique_ptr<CapturedOps> CudaBackend::end_capture() {
  if (!capture_) throw CaptureError("the backend of " + device_.str() + " is not capturing");
  GPIPE_CHECK(capture_->thread == std::this_thread::get_id(), "end_capture on another thread than begin_capture");
  DeviceGuard guard(device_.index);
  std::unique_ptr<Capture> c = std::move(capture_);
  Allocator& alloc = allocator_for(device_);
  alloc.end_private_pool();
  std::vector<DeferredChecks::Queued> checks = checks_.take_unread();  // nothing ran: the slots are clear
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(cuda_stream(), &graph);
  cudaGraphExec_t exec = nullptr;
  if (e == cudaSuccess && graph != nullptr) e = cudaGraphInstantiate(&exec, graph, 0);
  size_t nodes = 0;
  if (e == cudaSuccess) e = cudaGraphGetNodes(graph, nullptr, &nodes);
  if (e != cudaSuccess || graph == nullptr) {
    cudaGetLastError();
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    alloc.release_private_pool(c->key.get());
    throw CaptureError(std::string("capturing a step on ") + device_.str() + " failed: " +
                       (e != cudaSuccess ? cudaGetErrorString(e) : "no graph"));
  }
  return std::make_unique<CudaCapturedOps>(*this, graph, exec, std::move(checks), std::move(c->key),
                                           std::move(c->tables), static_cast<int64_t>(nodes));
}

void CudaBackend::abort_capture() noexcept {
  if (!capture_) return;
  std::unique_ptr<Capture> c = std::move(capture_);
  try {  // host bookkeeping only: the thread's requests go back to the stream's pool
    Allocator& alloc = allocator_for(device_);
    alloc.end_private_pool();
    alloc.release_private_pool(c->key.get());
  } catch (const std::exception& e) {
    spdlog::warn("abort_capture on {}: {}", device_.str(), e.what());
  }
  NoThrowDeviceGuard guard(device_.index, "abort_capture");
  if (!guard.ok()) return;
  checks_.take_unread();  // the captured ops never ran
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(cuda_stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(cuda_stream(), &graph);  // an invalidated capture ends with an error, and no graph
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
  cudaGetLastError();  // the capture's error, not the next call's
}

// The stream is the backend's, whichever thread queues on it: a joining thread's ops are
// captured as they are queued; only its blocks need the capture's pool.
void CudaBackend::join_capture() {
  if (!capture_) throw CaptureError("the backend of " + device_.str() + " is not capturing: nothing to join");
  GPIPE_CHECK(capture_->thread != std::this_thread::get_id(), "join_capture on the thread that began the capture");
  allocator_for(device_).join_private_pool(capture_->key.get());
}

void CudaBackend::leave_capture() noexcept {
  if (!capture_ || capture_->thread == std::this_thread::get_id()) return;  // the beginning thread ends it
  try {
    allocator_for(device_).end_private_pool();
  } catch (const std::exception& e) {
    spdlog::warn("leave_capture on {}: {}", device_.str(), e.what());
  }
}

void CudaBackend::replay_graph(void* exec, const std::vector<DeferredChecks::Queued>& checks) {
  GPIPE_CHECK(!capture_, "a captured step replayed while the backend of " + device_.str() + " captures");
  DeviceGuard guard(device_.index);
  if (checks_.size() > 0) wait();  // the graph's checks take slots from 0
  checks_.put_back(checks);
  GPIPE_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), cuda_stream()));
}

void CudaBackend::note_captured_table(const int64_t* table) { capture_->tables.push_back(table); }

}  // namespace gpipe
