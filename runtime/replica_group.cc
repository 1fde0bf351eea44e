// ReplicaGroup's sharded collectives where a group has no native form: built on its
// all-reduce, which every group has. Host tensors only (the MPI and NCCL groups and the
// in-process one override them).
#include <cmath>
#include <cstring>
#include <type_traits>

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

void ReplicaGroup::all_reduce_max(Tensor& t) {
  GPIPE_CHECK(t.is_contiguous() && (t.dtype() == DType::kF32 || t.dtype() == DType::kF64),
              "all_reduce_max of " + t.str() + ": a contiguous float32 or float64 tensor");
  const int64_t n = t.numel();
  Tensor mine = Tensor::empty({n}, t.dtype(), Device::cpu());
  copy_tensor(t.reshape({n}), mine);
  Tensor all = Tensor::empty({n * size()}, t.dtype(), Device::cpu());
  all_gather(mine, all);
  auto largest = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* out = mine.data<T>();
    const T* in = all.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      T best = in[i];
      for (int m = 1; m < size() && !std::isnan(best); ++m) {
        const T v = in[m * n + i];
        if (std::isnan(v) || v > best) best = v;
      }
      out[i] = best;
    }
  };
  if (t.dtype() == DType::kF64) {
    largest(static_cast<double*>(nullptr));
  } else {
    largest(static_cast<float*>(nullptr));
  }
  Tensor back = t.reshape({n});
  copy_tensor(mine, back);
}

}  // namespace gpipe
