// Prints how many CUDA devices this process sees (0 without a GPU, a driver, or a CUDA
// build), for the shell tests and bench/gpu_check.sh that need a number of GPUs.
#include <cstdio>

#include "runtime/device.h"

int main() {
  std::printf("%d\n", gpipe::cuda_device_count());
  return 0;
}
