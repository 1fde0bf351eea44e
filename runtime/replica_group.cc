// ReplicaGroup's sharded collectives where a group has no native form: built on its
// all-reduce, which every group has. Host tensors only (the MPI and NCCL groups and the
// in-process one override them).
#include <cstring>

#include "runtime/error.h"
#include "runtime/transport.h"

namespace gpipe {

int ReplicaGroup::rank() const {
  throw Error("this replica group does not know its rank, so it cannot shard the optimizer state; "
              "use pipeline.shard_optimizer: none with it");
}

namespace {
void check_blocks(const Tensor& full, const Tensor& block, int size, const char* what) {
  GPIPE_CHECK(full.is_contiguous() && block.is_contiguous() && full.dtype() == block.dtype() &&
                  full.numel() == block.numel() * size,
              std::string(what) + ": " + full.str() + " is not " + std::to_string(size) + " blocks of " + block.str());
}
}  // namespace

void ReplicaGroup::reduce_scatter_sum(Tensor& full, Tensor& block) {
  check_blocks(full, block, size(), "reduce_scatter_sum");
  all_reduce_sum(full);
  copy_tensor(full.narrow_rows(block.numel() * rank(), block.numel()).reshape(block.shape()), block);
}

void ReplicaGroup::all_gather(const Tensor& block, Tensor& full) {
  check_blocks(full, block, size(), "all_gather");
  GPIPE_CHECK(full.device().is_cpu(), "ReplicaGroup::all_gather's default takes host tensors");
  std::memset(full.raw_data(), 0, full.nbytes());
  Tensor mine = full.narrow_rows(block.numel() * rank(), block.numel()).reshape(block.shape());
  copy_tensor(block, mine);
  all_reduce_sum(full);
}

}  // namespace gpipe
