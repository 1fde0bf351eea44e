#include "runtime/stream.h"

#include <map>
#include <mutex>
#include <utility>

#include "runtime/error.h"

#ifdef GPIPE_WITH_CUDA
#include "runtime/cuda_runtime.h"
#endif

namespace gpipe {

namespace {
thread_local std::function<void(std::function<void()>)>* t_event_capture = nullptr;
}  // namespace

void set_cpu_event_capture(std::function<void(std::function<void()>)>* hook) { t_event_capture = hook; }

void CpuEvent::record(Stream&) {
  if (t_event_capture != nullptr) {
    (*t_event_capture)([this] { time_ = std::chrono::steady_clock::now(); });
    return;
  }
  time_ = std::chrono::steady_clock::now();
}

double CpuEvent::elapsed_ms(const Event& later) const {
  const auto* other = dynamic_cast<const CpuEvent*>(&later);
  GPIPE_CHECK(other != nullptr, "elapsed_ms between a CPU event and a non-CPU event");
  return std::chrono::duration<double, std::milli>(other->time_ - time_).count();
}

std::unique_ptr<Stream> make_stream(Device device) {
  if (device.is_cpu()) return std::make_unique<CpuStream>(device);
#ifdef GPIPE_WITH_CUDA
  return make_cuda_stream(device);
#else
  throw UserError("a stream on " + device.str() + " needs a CUDA build");
#endif
}

std::unique_ptr<Event> make_event(Device device) {
  if (device.is_cpu()) return std::make_unique<CpuEvent>();
#ifdef GPIPE_WITH_CUDA
  return make_cuda_event(device);
#else
  throw UserError("an event on " + device.str() + " needs a CUDA build");
#endif
}

Stream& compute_stream_for(Device device) {
  static std::mutex mu;
  static auto* streams = new std::map<std::pair<int, int>, Stream*>;  // leaked on purpose (see the header)
  std::lock_guard<std::mutex> lock(mu);
  Stream*& slot = (*streams)[{static_cast<int>(device.kind), device.index}];
  if (slot == nullptr) slot = make_stream(device).release();
  return *slot;
}

}  // namespace gpipe
