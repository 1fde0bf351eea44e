// Bytes as `gpipe plan` and its sweep print them: binary units only (MiB = 2^20 bytes,
// GiB = 2^30), so a plan's table, its sweep and pipeline.memory_limit's GiB agree. A
// table picks one unit for a column and names it in the header.
#pragma once

#include <cstdint>
#include <string>

namespace gpipe {
namespace pipeline {

struct ByteUnit {
  const char* name;  // "MiB" or "GiB"
  double bytes;      // bytes in one unit
  int decimals;      // digits after the point
};

// The unit of a column whose largest value is `largest`: GiB from 1 GiB up, else MiB.
ByteUnit byte_unit_for(int64_t largest);

// `bytes` in `unit`, without the unit's name: "12.3" (MiB), "1.25" (GiB).
std::string in_unit(int64_t bytes, const ByteUnit& unit);

// `bytes` with its own unit, for prose: "12.3 MiB", "1.25 GiB"; below a MiB "4.0 KiB",
// below a KiB "100 bytes".
std::string bytes_str(int64_t bytes);

}  // namespace pipeline
}  // namespace gpipe
