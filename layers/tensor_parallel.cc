#include "layers/tensor_parallel.h"

#include "runtime/error.h"

namespace gpipe {
namespace layers {

std::string TensorSplit::str() const {
  if (!split()) return "";
  return std::string(kind == TensorSplitKind::kColumn ? "column " : "row ") + std::to_string(rank) + "/" +
         std::to_string(size);
}

void TensorShard::sum(Backend& be, TensorCollectives* group, Tensor& t, const std::string& who) const {
  if (!split()) return;
  if (group == nullptr || group->size() != size || group->rank() != rank) {
    throw Error(who + " is split over a tensor group of " + std::to_string(size) + " but was given " +
                (group == nullptr ? std::string("none")
                                  : "member " + std::to_string(group->rank()) + " of " + std::to_string(group->size())) +
                " (set_collectives)");
  }
  group->all_reduce_sum(be, t);
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
