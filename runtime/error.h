// Typed errors for the whole runtime: what failed, where, and what to do about it.
// Every checked library call and every user mistake ends up as one of these.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe {

// A failure of the runtime or of a library it calls (CUDA, cuBLAS, NCCL, MPI).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A mistake in what the user asked for (config, shapes, balance): the message names
// the thing, the value and the fix.
class UserError : public Error {
 public:
  explicit UserError(const std::string& what) : Error(what) {}
};

// Raised in a stage that was told to stop because another stage failed. The driver
// reports the first non-abort error instead of these.
class Aborted : public Error {
 public:
  explicit Aborted(const std::string& what) : Error(what) {}
};

// Something a captured step cannot hold (Backend::begin_capture, pipeline.capture): a
// value read back to the host, a copy from host memory, a wait for the device. The
// executor then runs the step op by op, as without capture.
class CaptureError : public Error {
 public:
  explicit CaptureError(const std::string& what) : Error(what) {}
};

// "file:line" prefix for checked calls; includes the rank and stage of the calling
// thread (see logging.h) so a message from a multi-stage run says who failed.
std::string error_location(const char* file, int line);

// What `word` may have meant among `known`, for a message: the names it begins ("--sw" of
// "--sweep"), else the nearest within a third of its letters ("--device" of "--devices",
// "layer_norm" of "layernorm"), as " did you mean X?"; "" when none is close.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& known);

}  // namespace gpipe

#define GPIPE_CHECK(cond, msg)                                                          \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw ::gpipe::Error(::gpipe::error_location(__FILE__, __LINE__) + ": check `" #cond \
                           "` failed: " + std::string(msg));                            \
    }                                                                                   \
  } while (0)

#define GPIPE_USER_CHECK(cond, msg)               \
  do {                                            \
    if (!(cond)) throw ::gpipe::UserError(msg);   \
  } while (0)
