#include "layers/tensor_parallel.h"

#include "runtime/error.h"

namespace gpipe {
namespace layers {

std::string TensorSplit::str() const {
  if (!split()) return "";
  return std::string(kind == TensorSplitKind::kColumn ? "column " : "row ") + std::to_string(rank) + "/" +
         std::to_string(size);
}

int64_t block_length(int64_t extent, int count, const std::string& what) {
  if (count < 1 || extent % count != 0) {
    throw UserError(what + ": " + std::to_string(extent) + " does not split into " + std::to_string(count) +
                    " equal blocks over a tensor group of " + std::to_string(count) +
                    "; make it a multiple of the group's size or split over fewer devices");
  }
  return extent / count;
}

}  // namespace layers
}  // namespace gpipe
