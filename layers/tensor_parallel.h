// Tensor parallelism inside a stage (issue 38), Megatron-LM's way: a layer's weights are
// split over the T members of its stage's tensor group, each member holding one shard
// and computing its share; the group sums partial results where the split needs it.
//
//   column-parallel linear: W's rows (the output features) split; each member computes
//     its block of the outputs from the whole input. Backward: each member's input
//     gradient is a partial sum, added over the group.
//   row-parallel linear: W's columns (the input features) split; each member takes its
//     block of the input features and computes a partial output, added over the group
//     before the (whole, replicated) bias. Backward: no sum (the output gradient is
//     whole on every member).
//
// A column-parallel layer followed by elementwise work and a row-parallel layer (an MLP)
// needs one sum forward and one backward: the blocks between them never leave their
// member. The executor's placement of a stage on T processes, the planner's pricing of the
// sums and whole-by-name checkpoints of the shards build on this (docs/ARCHITECTURE.md).
#pragma once

#include <string>
#include <vector>

#include "kernels/backend.h"
#include "runtime/transport.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace layers {

class TensorCollectives;

enum class TensorSplitKind { kNone, kColumn, kRow };

// How a linear layer is split over its stage's tensor group, and which member builds it.
struct TensorSplit {
  TensorSplitKind kind = TensorSplitKind::kNone;
  int rank = 0;  // this member, 0 .. size - 1
  int size = 1;  // T
  // The split features are `groups` equal parts side by side, each split into `size`
  // blocks; a member holds its block of each part (an attention's q, k and v: 3).
  int groups = 1;
  // Column-parallel: whether the layer sums its (partial) input gradient over the group
  // itself; false where its caller adds it to other partial gradients first and sums
  // once (a SwiGLU's gate and up, an attention's q, k and v).
  bool sum_input_grad = true;
  bool split() const { return kind != TensorSplitKind::kNone && size > 1; }
  // "column 1/4", or "" for a layer that is not split.
  std::string str() const;
};

// A composite layer's place in its stage's tensor group (an attention split by heads,
// an MLP split by its hidden features): member `rank` of `size`; size 1: not split.
struct TensorShard {
  int rank = 0;
  int size = 1;
  bool split() const { return size > 1; }
  TensorSplit as(TensorSplitKind kind, int groups = 1, bool sum_input_grad = true) const {
    return {kind, rank, size, groups, sum_input_grad};
  }
  // `t`, a partial sum on each member (the inputs' gradient of column-parallel parts
  // that left it to their caller), summed over the group; nothing when not split.
  void sum(Backend& be, TensorCollectives* group, Tensor& t, const std::string& who) const;
};

// The sums a split layer asks of its tensor group. Every member calls them in the same
// order with tensors of the same shape.
class TensorCollectives {
 public:
  virtual ~TensorCollectives() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // `t` (on be's device) summed in place over the group, in member order: the same
  // bits on every member whichever arrives first.
  virtual void all_reduce_sum(Backend& be, Tensor& t) = 0;
  // `t` in place, each element the largest over the group (a vocabulary-parallel loss's
  // row maxima).
  virtual void all_reduce_max(Backend& be, Tensor& t) = 0;
};

// A tensor group's sums over any ReplicaGroup (runtime/transport.h) that sums host
// tensors: threads of one process (InProcessReplicaGroup) or processes (MpiReplicaGroup).
// The backend's queued work is waited for first; a tensor on a device goes through a
// host copy (a run's GPU stages); a bfloat16 or float16 tensor is reduced in float32 and
// rounded once.
class GroupCollectives : public TensorCollectives {
 public:
  explicit GroupCollectives(ReplicaGroup& group) : group_(group) {}
  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  void all_reduce_sum(Backend& be, Tensor& t) override;
  void all_reduce_max(Backend& be, Tensor& t) override;
  // Host seconds spent in this group's sums so far, from the moment the device's queued
  // work is done (which a GPU's events count as the layer's compute): the copies, the
  // wait for the other members and the transfer. The executor's account of a split
  // layer's communication.
  double seconds() const { return seconds_; }

 private:
  template <typename F>
  void on_host(Backend& be, Tensor& t, F&& reduce);
  ReplicaGroup& group_;
  double seconds_ = 0;  // one member's thread calls it
};

// A member's place in a tensor group without the group: planning a member's model on
// shapes (tensors without data, runtime/tensor.h's ShapesOnly), where a sum or a maximum
// over the group changes no shape. A tensor with data is refused (Error): a run sums
// over its real group (GroupCollectives).
class ShapeCollectives : public TensorCollectives {
 public:
  ShapeCollectives(int rank, int size) : rank_(rank), size_(size) {}
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  void all_reduce_sum(Backend& be, Tensor& t) override;
  void all_reduce_max(Backend& be, Tensor& t) override;

 private:
  int rank_, size_;
};

// The tensor-group sums ShapeCollectives saw on this thread since this object was made
// (nested counts each see all of theirs): how many, and their bytes. The planner counts
// a member's sums per layer on shapes with it, and prices them over the group's link.
class GroupSumCount {
 public:
  GroupSumCount();
  int64_t sums() const;
  int64_t bytes() const;

 private:
  int64_t sums_, bytes_;
};

// Checkpoints keep a split parameter whole, by its name (the layout any T loads): its
// members' blocks put together, and on load each member's block cut out of it. Both
// take the block's place as Parameter gives it (shard_dim, shard_count, shard_groups,
// whole); host tensors, any element type, exactly (copies, no arithmetic).
// The whole tensor from the members' blocks, in member order.
Tensor join_blocks(const std::vector<Tensor>& blocks, int dim, int groups, const Shape& whole);
// Member `rank`'s block of a whole tensor.
Tensor cut_block(const Tensor& whole, int dim, int rank, int count, int groups);

// Element range [begin, begin + length) of block `rank` of `count` along a dimension of
// `extent`: equal blocks; `what` names the split in the error when extent does not divide.
int64_t block_length(int64_t extent, int count, const std::string& what);

}  // namespace layers
}  // namespace gpipe
