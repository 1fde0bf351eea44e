// Checked-call macros for CUDA, cuBLAS and NCCL. Include only from CUDA-enabled
// targets. Each throws gpipe::Error naming the call, file:line, rank/stage and the
// library's own message.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "runtime/error.h"

namespace gpipe {
const char* cublas_status_string(cublasStatus_t s);
}  // namespace gpipe

#define GPIPE_CUDA_CHECK(call)                                                        \
  do {                                                                                \
    cudaError_t gpipe_err_ = (call);                                                  \
    if (gpipe_err_ != cudaSuccess) {                                                  \
      throw ::gpipe::Error(::gpipe::error_location(__FILE__, __LINE__) + ": " #call   \
                           " failed: " + cudaGetErrorName(gpipe_err_) + " (" +        \
                           cudaGetErrorString(gpipe_err_) + ")");                     \
    }                                                                                 \
  } while (0)

#define GPIPE_CUBLAS_CHECK(call)                                                      \
  do {                                                                                \
    cublasStatus_t gpipe_st_ = (call);                                                \
    if (gpipe_st_ != CUBLAS_STATUS_SUCCESS) {                                         \
      throw ::gpipe::Error(::gpipe::error_location(__FILE__, __LINE__) + ": " #call   \
                           " failed: " + ::gpipe::cublas_status_string(gpipe_st_));   \
    }                                                                                 \
  } while (0)

#define GPIPE_NCCL_CHECK(call)                                                        \
  do {                                                                                \
    ncclResult_t gpipe_nr_ = (call);                                                  \
    if (gpipe_nr_ != ncclSuccess) {                                                   \
      throw ::gpipe::Error(::gpipe::error_location(__FILE__, __LINE__) + ": " #call   \
                           " failed: " + ncclGetErrorString(gpipe_nr_) +              \
                           " (set NCCL_DEBUG=INFO for details)");                     \
    }                                                                                 \
  } while (0)

// cuDNN: the same form, with cuDNN's own message. <cudnn.h> is included here so that
// targets using the macro get the status type and cudnnGetErrorString with it; those
// targets must depend on @local_cuda//:cudnn.
#include <cudnn.h>

#define GPIPE_CUDNN_CHECK(call)                                                       \
  do {                                                                                \
    cudnnStatus_t gpipe_cs_ = (call);                                                 \
    if (gpipe_cs_ != CUDNN_STATUS_SUCCESS) {                                          \
      throw ::gpipe::Error(::gpipe::error_location(__FILE__, __LINE__) + ": " #call   \
                           " failed: " + cudnnGetErrorString(gpipe_cs_));             \
    }                                                                                 \
  } while (0)
