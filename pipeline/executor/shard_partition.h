// Sharded optimizer state (pipeline.shard_optimizer, ZeRO-1): which part of a stage's
// parameters each of its D replicas updates. The stage's parameters, flattened in
// order into one vector of N elements, are cut into D contiguous shards of N / D
// elements, one more for the first N % D (split_sizes' rule: sizes differ by at most
// one), so a parameter may lie in two or more shards. The collectives move equal
// blocks (MPI_Reduce_scatter_block, ncclReduceScatter): shard d travels in block d of
// block() = ceil(N / D) elements, padded at its end.
//
//   parameters   | w0 (5)       | b0 (2) | w1 (4)     |        N = 11, D = 3
//   shards       | shard 0 (4)    | shard 1 (4) | shard 2 (3) |
//   blocks       | 4            | 4           | 3 + 1 pad   |  block() = 4
#pragma once

#include <cstdint>
#include <vector>

namespace gpipe {
namespace pipeline {

// A run of a shard inside one parameter.
struct ShardPiece {
  int param = 0;             // index in the stage's parameter list
  int64_t param_offset = 0;  // first element, in the parameter (flattened)
  int64_t shard_offset = 0;  // where it lands in the shard (and in the shard's block)
  int64_t length = 0;
  bool operator==(const ShardPiece& o) const {
    return param == o.param && param_offset == o.param_offset && shard_offset == o.shard_offset && length == o.length;
  }
};

struct ShardPartition {
  int replicas = 1;
  std::vector<int64_t> numels;  // per parameter
  std::vector<int64_t> begin;   // D + 1 offsets in the flattened parameters: shard d is [begin[d], begin[d + 1])
  int64_t total() const { return begin.back(); }
  int64_t size(int d) const { return begin.at(d + 1) - begin.at(d); }
  int64_t block() const { return replicas > 0 ? (total() + replicas - 1) / replicas : 0; }
  // Shard d's pieces, in order.
  std::vector<ShardPiece> pieces(int d) const;
  // Where parameter i starts in the flattened parameters.
  int64_t param_begin(int i) const;
};

// Throws Error for D < 1 or a negative size.
ShardPartition shard_partition(const std::vector<int64_t>& numels, int replicas);

}  // namespace pipeline
}  // namespace gpipe
