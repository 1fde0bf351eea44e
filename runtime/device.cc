#include "runtime/device.h"

#include <cstdlib>

#include "runtime/error.h"

#ifdef GPIPE_WITH_CUDA
#include "runtime/cuda_runtime.h"
#endif

namespace gpipe {

std::string Device::str() const {
  return std::string(kind == DeviceKind::kCpu ? "cpu" : "cuda") + ":" + std::to_string(index);
}

std::vector<int> device_turns(const std::vector<Device>& devices, bool one_process) {
  std::vector<int> first(devices.size());
  for (size_t k = 0; k < devices.size(); ++k) {
    size_t j = 0;
    while (one_process && j < k && devices[j] != devices[k]) ++j;
    first[k] = static_cast<int>(one_process ? j : k);
  }
  return first;
}

Device parse_device(const std::string& text) {
  auto colon = text.find(':');
  std::string kind = text.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string num = text.substr(colon + 1);
    char* end = nullptr;
    long v = std::strtol(num.c_str(), &end, 10);
    if (num.empty() || *end != '\0' || v < 0) {
      throw UserError("device '" + text + "': the index must be a non-negative integer, as in cpu:0 or cuda:1");
    }
    index = static_cast<int>(v);
  }
  if (kind == "cpu") return Device::cpu(index);
  if (kind == "cuda") return Device::cuda(index);
  throw UserError("device '" + text + "': unknown kind '" + kind + "'; use cpu or cuda (e.g. cuda:0)");
}

int cuda_device_count() {
#ifdef GPIPE_WITH_CUDA
  return cuda_runtime_device_count();
#else
  return 0;
#endif
}

}  // namespace gpipe
