// The device rule of device_binding.h; the CUDA selector lives in cuda_runtime.cc.
#include "runtime/device_binding.h"

#include <spdlog/spdlog.h>

#include <exception>

#ifdef GPIPE_WITH_CUDA
#include "runtime/cuda_runtime.h"
#endif

namespace gpipe {

ScopedDevice::ScopedDevice(DeviceSelector& selector, int index) : selector_(selector) {
  previous_ = selector_.current();
  if (previous_ == index) return;
  selector_.select(index);
  switched_ = true;
}

ScopedDevice::~ScopedDevice() {
  if (!switched_) return;
  try {
    // A thread whose previous device has no context never used it (a fresh thread
    // reports device 0): stay on the device just used rather than create one there.
    if (selector_.has_context(previous_)) selector_.select(previous_);
  } catch (const std::exception& e) {
    spdlog::warn("restoring the current device to {} failed: {}", previous_, e.what());
  }
}

void bind_thread_to_device(Device device, DeviceSelector& selector) {
  if (!device.is_cuda()) return;  // host stages never touch CUDA
  if (selector.current() != device.index || !selector.has_context(device.index)) selector.select(device.index);
}

void bind_thread_to_device(Device device) {
#ifdef GPIPE_WITH_CUDA
  if (device.is_cuda()) bind_thread_to_device(device, cuda_device_selector());
#else
  (void)device;  // a CUDA device here fails where its backend is created, with the message
#endif
}

Device main_thread_device(const std::vector<Device>& stage_devices) {
  for (const Device& d : stage_devices) {
    if (d.is_cuda()) return d;
  }
  return Device::cpu();
}

}  // namespace gpipe
