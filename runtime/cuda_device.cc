// The CUDA device selector (device_binding.h's rule on cudaSetDevice), the device
// guards, the device count and check, and the event query: what every other CUDA file
// of the runtime (cuda_allocator.cc, cuda_runtime.cc) and the kernels build on.
#include "runtime/cuda_device.h"

#include <cuda.h>  // driver types only: the two driver calls are looked up at run time
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <string>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace gpipe {

namespace {

// cuDeviceGet and cuDevicePrimaryCtxGetState, found through the runtime (no link
// against libcuda, which machines without a driver lack).
struct DriverCalls {
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_state)(CUdevice, unsigned int*, int*) = nullptr;
};

DriverCalls load_driver_calls() {
  DriverCalls calls;
  auto find = [](const char* name, void** fn) {
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &status);
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      *fn = nullptr;
      spdlog::debug("driver entry point {} not found; device guards will not restore", name);
    }
  };
  find("cuDeviceGet", reinterpret_cast<void**>(&calls.device_get));
  find("cuDevicePrimaryCtxGetState", reinterpret_cast<void**>(&calls.primary_ctx_state));
  return calls;
}

class CudaSelector : public DeviceSelector {
 public:
  int current() override {
    int d = 0;
    GPIPE_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  void select(int index) override { GPIPE_CUDA_CHECK(cudaSetDevice(index)); }
  bool has_context(int index) override {
    static const DriverCalls calls = load_driver_calls();
    if (calls.device_get == nullptr || calls.primary_ctx_state == nullptr) return false;
    CUdevice dev = 0;
    if (calls.device_get(&dev, index) != CUDA_SUCCESS) return false;
    unsigned int flags = 0;
    int active = 0;
    if (calls.primary_ctx_state(dev, &flags, &active) != CUDA_SUCCESS) return false;
    return active != 0;
  }
};

}  // namespace

DeviceSelector& cuda_device_selector() {
  static CudaSelector selector;
  return selector;
}

NoThrowDeviceGuard::NoThrowDeviceGuard(int index, const char* what) {
  int current = 0;
  const cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess) {
    if (!is_teardown(e)) spdlog::warn("{}: selecting device {} failed: {}", what, index, cudaGetErrorString(e));
    cudaGetLastError();  // do not leave the error for the next checked launch to find
    return;
  }
  try {
    scope_ = std::make_unique<ScopedDevice>(cuda_device_selector(), index);
  } catch (const std::exception& ex) {
    spdlog::warn("{}: selecting device {} failed: {}", what, index, ex.what());
    cudaGetLastError();
  }
}

bool cuda_event_done(cudaEvent_t event) {
  const cudaError_t e = cudaEventQuery(event);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    // Not an error; some CUDA versions leave it as the thread's last error, which the
    // next kernel launch check would then report.
    if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
    return false;
  }
  throw Error(error_location(__FILE__, __LINE__) + ": cudaEventQuery failed: " + cudaGetErrorName(e) + " (" +
              cudaGetErrorString(e) + ")");
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

}  // namespace gpipe
