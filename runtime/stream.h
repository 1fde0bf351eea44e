// Streams and events. On the CPU backend work runs synchronously on the calling
// thread, so a stream is trivial and an event is a timestamp. On CUDA they wrap
// cudaStream_t and cudaEvent_t (runtime/cuda_runtime.cc), and ordering between the
// compute and communication streams is expressed with events, not host waits.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "runtime/device.h"

namespace gpipe {

class Event;

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  // Blocks the host until all work queued so far has finished.
  virtual void synchronize() = 0;
  // Work queued after this call waits for `event` (without blocking the host).
  virtual void wait(Event& event) = 0;
  // The native handle (cudaStream_t) or nullptr on the CPU.
  virtual void* native() const { return nullptr; }
  // Whether its work is being captured into a graph now (Backend::begin_capture on a GPU)
  // rather than run.
  virtual bool capturing() const { return false; }
};

class Event {
 public:
  virtual ~Event() = default;
  virtual void record(Stream& stream) = 0;
  virtual void synchronize() = 0;
  // Milliseconds between two recorded events (both must have completed).
  virtual double elapsed_ms(const Event& later) const = 0;
};

class CpuStream : public Stream {
 public:
  explicit CpuStream(Device device) : device_(device) {}
  Device device() const override { return device_; }
  void synchronize() override {}
  void wait(Event&) override {}

 private:
  Device device_;
};

// While a step is captured on the CPU on this thread (WideningBackend::begin_capture), a
// CPU event's record is handed to `hook` to run at each replay, in its place among the
// captured ops, instead of taking the time now; nullptr ends it.
void set_cpu_event_capture(std::function<void(std::function<void()>)>* hook);

class CpuEvent : public Event {
 public:
  void record(Stream&) override;
  void synchronize() override {}
  double elapsed_ms(const Event& later) const override;

 private:
  std::chrono::steady_clock::time_point time_{};
};

// A new stream/event for the device (CUDA ones need a CUDA build and a GPU).
std::unique_ptr<Stream> make_stream(Device device);
std::unique_ptr<Event> make_event(Device device);

// The stream a device's kernels run on: the CUDA backend's, and the one the device's
// allocator hands blocks out for by default. Created on first use (UserError for a
// CUDA device that does not exist) and never destroyed, so that objects destroyed at
// exit (backends, allocators) can still name it.
Stream& compute_stream_for(Device device);

}  // namespace gpipe
