#include "pipeline/executor/shard_partition.h"

#include <algorithm>
#include <string>

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

ShardPartition shard_partition(const std::vector<int64_t>& numels, int replicas) {
  GPIPE_CHECK(replicas >= 1, "a shard partition over " + std::to_string(replicas) + " replicas");
  ShardPartition p;
  p.replicas = replicas;
  p.numels = numels;
  int64_t n = 0;
  for (int64_t x : numels) {
    GPIPE_CHECK(x >= 0, "a parameter of " + std::to_string(x) + " elements");
    n += x;
  }
  p.begin.assign(static_cast<size_t>(replicas) + 1, 0);
  for (int d = 0; d < replicas; ++d) p.begin[d + 1] = p.begin[d] + n / replicas + (d < n % replicas ? 1 : 0);
  return p;
}

int64_t ShardPartition::param_begin(int i) const {
  int64_t at = 0;
  for (int j = 0; j < i; ++j) at += numels.at(j);
  return at;
}

std::vector<ShardPiece> ShardPartition::pieces(int d) const {
  std::vector<ShardPiece> out;
  const int64_t lo = begin.at(d), hi = begin.at(d + 1);
  int64_t at = 0;
  for (size_t i = 0; i < numels.size() && at < hi; ++i) {
    const int64_t from = std::max(lo, at), to = std::min(hi, at + numels[i]);
    if (from < to) out.push_back({static_cast<int>(i), from - at, from - lo, to - from});
    at += numels[i];
  }
  return out;
}

}  // namespace pipeline
}  // namespace gpipe
