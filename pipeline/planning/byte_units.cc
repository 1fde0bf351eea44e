#include "pipeline/planning/byte_units.h"

#include <cstdio>

namespace gpipe {
namespace pipeline {

ByteUnit byte_unit_for(int64_t largest) {
  return largest >= (int64_t{1} << 30) ? ByteUnit{"GiB", 1073741824.0, 2} : ByteUnit{"MiB", 1048576.0, 1};
}

std::string in_unit(int64_t bytes, const ByteUnit& unit) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", unit.decimals, static_cast<double>(bytes) / unit.bytes);
  return buf;
}

std::string bytes_str(int64_t bytes) {
  const ByteUnit unit = byte_unit_for(bytes);
  return in_unit(bytes, unit) + " " + unit.name;
}

}  // namespace pipeline
}  // namespace gpipe
