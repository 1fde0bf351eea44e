// Which GPU each thread talks to. Since CUDA 12, cudaSetDevice(d) creates device d's
// primary context (several hundred MB of GPU memory) the first time a process selects
// it, and a new thread starts on device 0. A guard that "restores" a worker thread to
// device 0 therefore leaves a context on GPU 0 in every rank (PyTorch #91219, #94864).
// The rule here: every thread is bound to its device before its first CUDA call, a
// guard does nothing when its device is already current, and a guard restores the
// previous device only when that device already has a context. The rule is written
// against DeviceSelector, so the tests run it on a host model of CUDA's semantics.
#pragma once

#include <vector>

#include "runtime/device.h"

namespace gpipe {

// What the rule needs from CUDA. The CUDA build's implementation calls the runtime.
class DeviceSelector {
 public:
  virtual ~DeviceSelector() = default;
  // The calling thread's current device (0 in a thread that never selected one).
  virtual int current() = 0;
  // Makes `index` the calling thread's device (and creates its primary context).
  virtual void select(int index) = 0;
  // Whether `index` has a primary context, i.e. this process already uses the device.
  virtual bool has_context(int index) = 0;
};

// Makes `index` the calling thread's device for the scope. A no-op when it is current
// already (the usual case in a bound thread). On exit the previous device is selected
// again only if it has a context: restoring a thread to a device nobody uses would
// create one there. Failures of the restore are logged, never thrown.
class ScopedDevice {
 public:
  ScopedDevice(DeviceSelector& selector, int index);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  DeviceSelector& selector_;
  int previous_ = 0;
  bool switched_ = false;
};

// Binds the calling thread to `device` before it makes any CUDA call: selects it for a
// CUDA device, does nothing for a CPU device (which must not touch CUDA at all).
void bind_thread_to_device(Device device, DeviceSelector& selector);
// The same with the CUDA runtime's selector; a no-op for CPU devices and in builds
// without CUDA. Stage worker threads call it first thing; so does `main`.
void bind_thread_to_device(Device device);

// The device a process's main thread binds to: the first CUDA device among the stages
// it runs (it moves their weights there and evaluates on them), or a CPU device when
// they are all on the host.
Device main_thread_device(const std::vector<Device>& stage_devices);

}  // namespace gpipe
