// Checked-call macro for MPI: throws gpipe::Error with the call, file:line,
// rank/stage and MPI's own error string.
#pragma once

#include <mpi.h>

#include <string>

#include "runtime/error.h"

namespace gpipe {
inline std::string mpi_error_string(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);  // MPI_Error_string is only allowed after MPI_Init
  if (!initialized) return "MPI error code " + std::to_string(code) + " (MPI not initialised)";
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, len);
}
}  // namespace gpipe

#define GPIPE_MPI_CHECK(call)                                                          \
  do {                                                                                 \
    int gpipe_mpi_rc_ = (call);                                                        \
    if (gpipe_mpi_rc_ != MPI_SUCCESS) {                                                \
      throw ::gpipe::Error(::gpipe::error_location(__FILE__, __LINE__) + ": " #call    \
                           " failed: " + ::gpipe::mpi_error_string(gpipe_mpi_rc_));    \
    }                                                                                  \
  } while (0)
