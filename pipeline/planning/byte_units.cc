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
  // Below a MiB, which a MiB column shows as 0.0: KiB, or bytes below a KiB.
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  if (bytes < (int64_t{1} << 20)) return in_unit(bytes, ByteUnit{"KiB", 1024.0, 1}) + " KiB";
  const ByteUnit unit = byte_unit_for(bytes);
  return in_unit(bytes, unit) + " " + unit.name;
}

}  // namespace pipeline
}  // namespace gpipe
