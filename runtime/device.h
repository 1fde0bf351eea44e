// A device is a kind and an index. On the CPU backend a device is one core's worth of
// work (one stage thread, one BLAS thread); on CUDA it is one GPU.
#pragma once

#include <string>
#include <vector>

namespace gpipe {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device cpu(int index = 0) { return {DeviceKind::kCpu, index}; }
  static Device cuda(int index = 0) { return {DeviceKind::kCuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  // "cpu:0", "cuda:1"
  std::string str() const;
};

// Parses "cpu", "cpu:3", "cuda", "cuda:1"; throws UserError naming the text otherwise.
Device parse_device(const std::string& text);

// Stages that one process runs on the same device share its backend and take turns on
// it, an instruction at a time (the executor's device turns): per stage, the first stage
// on its device, which is itself when it has the device alone. Under mpirun each process
// runs one stage (`one_process` false): no two take turns, even on one GPU.
std::vector<int> device_turns(const std::vector<Device>& devices, bool one_process);

// Number of CUDA devices visible to this process; 0 when built without CUDA or when
// no GPU (or no driver) is present.
int cuda_device_count();

}  // namespace gpipe
