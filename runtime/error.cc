#include "runtime/error.h"

#include "runtime/logging.h"

namespace gpipe {

std::string error_location(const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line) + " [" + thread_context_str() + "]";
}

}  // namespace gpipe
