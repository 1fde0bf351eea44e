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
// member.
//
// Sequence parallelism (Korthikanti et al., Megatron-LM's --sequence-parallel): between
// the split regions (the norms, the dropouts, the residual stream) each member holds
// only its share of the positions, (B, S/T, C): positions [r S/T, (r+1) S/T). A
// column-parallel layer all-gathers its input along the positions first (and
// reduce-scatters its input gradient back, in place of the all-reduce); a row-parallel
// layer reduce-scatters its partial output to the member's positions (in place of the
// all-reduce; its output gradient is all-gathered). The same bytes move as without it,
// and the activations between the regions are 1/T of theirs. The parameters of a layer
// between the regions (a norm's weight, a position table) see only the member's
// positions: their gradients are partial sums, which the executor adds over the group
// once they are final (Parameter::sequence_partial). The executor's placement of a stage on T processes, the planner's pricing of the
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
  // Sequence parallelism: column-parallel (with sum_input_grad), the input is this
  // member's positions, all-gathered first, and its gradient reduce-scattered back;
  // row-parallel, the output is reduce-scattered to this member's positions. Over
  // the first per-sample dimension (LinearOptions::leading, the whole sequence's).
  bool sequence = false;
  bool split() const { return kind != TensorSplitKind::kNone && size > 1; }
  bool sequence_split() const { return sequence && split(); }
  // "column 1/4", or "" for a layer that is not split.
  std::string str() const;
};

// A composite layer's place in its stage's tensor group (an attention split by heads,
// an MLP split by its hidden features): member `rank` of `size`; size 1: not split.
struct TensorShard {
  int rank = 0;
  int size = 1;
  // Sequence parallelism (above): the layer's input and output are this member's
  // positions, (B, S/T, ...).
  bool sequence = false;
  bool split() const { return size > 1; }
  bool sequence_split() const { return sequence && split(); }
  // A linear part's split. Column-parallel parts that leave their input gradient to the
  // caller (sum_input_grad false) take the whole positions the caller gathered.
  TensorSplit as(TensorSplitKind kind, int groups = 1, bool sum_input_grad = true) const {
    return {kind, rank, size, groups, sum_input_grad, sequence && (kind == TensorSplitKind::kRow || sum_input_grad)};
  }
  // The positions this member holds of a sequence of `seq_len`: all of them, or under
  // sequence parallelism seq_len / size (a UserError naming `who` where it does not
  // divide), from first_position.
  int64_t positions(int64_t seq_len, const std::string& who) const;
  int64_t first_position(int64_t seq_len, const std::string& who) const {
    return sequence_split() ? rank * positions(seq_len, who) : 0;
  }
  // `t`, a partial sum on each member (the inputs' gradient of column-parallel parts
  // that left it to their caller), summed over the group; nothing when not split.
  void sum(Backend& be, TensorCollectives* group, Tensor& t, const std::string& who) const;
  // The same partial sum, returned: whole (sum), or under sequence parallelism this
  // member's positions of it (a reduce-scatter along dimension 1, (B, S, ...) to
  // (B, S/T, ...)).
  Tensor sum_to_positions(Backend& be, TensorCollectives* group, Tensor& t, const std::string& who) const;
  // `x`: under sequence parallelism this member's positions (B, S/T, ...), returned
  // all-gathered to (B, S, ...); otherwise x itself.
  Tensor gather_positions(Backend& be, TensorCollectives* group, const Tensor& x, const std::string& who) const;
  // The group, checked to be this shard's (an Error naming `who` and set_collectives).
  TensorCollectives& checked(TensorCollectives* group, const std::string& who) const;
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
  // Sequence parallelism: `shard` (B, S/T, ...) is this member's positions; `whole`
  // (B, S, ...) gets every member's in member order (exact: copies).
  virtual void all_gather_positions(Backend& be, const Tensor& shard, Tensor& whole) = 0;
  // `whole` (B, S, ...), a partial sum on each member; `shard` (B, S/T, ...) gets the
  // group's sum at this member's positions.
  virtual void reduce_scatter_positions(Backend& be, const Tensor& whole, Tensor& shard) = 0;
  // Before the host reads back a result of these in the middle of a step: waits, under
  // the group's deadline, for the collectives the group queued on the device (NCCL),
  // so that a member that is gone ends the job with a message instead of a hang.
  virtual void await_queued() {}
};

// A tensor group's sums over any ReplicaGroup (runtime/transport.h): threads of one
// process (InProcessReplicaGroup), processes (MpiReplicaGroup) or GPUs (NcclReplicaGroup).
// A group that takes the tensor's device (ReplicaGroup::takes: every group a host
// tensor, an NCCL group its GPU's) is handed the tensor where it is: on a GPU the
// collective is queued, ordered with the compute stream, and the host does not wait.
// Over a group that does not (a GPU's tensor over MPI), the backend's queued work is
// waited for and the tensor goes through a host copy. A bfloat16 or float16 tensor is
// reduced in float32 and rounded once. The members' shares of positions go member-major
// and back with Backend::transpose_blocks; a maximum is an all-gather and each element's
// largest (reduce_rows: a NaN wins), exact over any group.
//
// The executor runs each of them as an instruction of its program (the tensor
// collectives, tAR tMAX tAG tRS: pipeline/schedule/schedule.h), timed there.
class GroupCollectives : public TensorCollectives {
 public:
  explicit GroupCollectives(ReplicaGroup& group) : group_(group) {}
  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  void all_reduce_sum(Backend& be, Tensor& t) override;
  void all_reduce_max(Backend& be, Tensor& t) override;
  void all_gather_positions(Backend& be, const Tensor& shard, Tensor& whole) override;
  void reduce_scatter_positions(Backend& be, const Tensor& whole, Tensor& shard) override;
  void await_queued() override { group_.await_device(); }

 private:
  // `in` to `out` (the same tensor for a sum or a maximum, in place) by move(backend,
  // in, out), on the tensors' device or through host copies (above); narrow types in
  // float32.
  template <typename F>
  void run(Backend& be, const Tensor& in, Tensor& out, F&& move);
  ReplicaGroup& group_;
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
  void all_gather_positions(Backend& be, const Tensor& shard, Tensor& whole) override;
  void reduce_scatter_positions(Backend& be, const Tensor& whole, Tensor& shard) override;
  // What was asked of it, in order (the tensor-group program's facts on shapes,
  // pipeline/executor/cell.h's run_tensor_program): the kind and the bytes the group
  // moves, a narrow tensor as float32 (a sum's or maximum's tensor; a sequence
  // collective's whole one).
  enum class Kind { kSum, kMax, kGather, kScatter };
  struct Asked {
    Kind kind;
    int64_t bytes;
  };
  const std::vector<Asked>& asked() const { return asked_; }
  void clear_asked() { asked_.clear(); }

 private:
  int rank_, size_;
  std::vector<Asked> asked_;
};

// The tensor-group sums ShapeCollectives saw on this thread since this object was made
// (nested counts each see all of theirs): how many, and their bytes; and the
// all-gathers and reduce-scatters of sequence parallelism, each one pass of a ring
// (half an all-reduce), and the bytes of their whole (B, S, ...) tensors. The planner
// counts a member's collectives per layer on shapes with it, and prices them over the
// group's link.
class GroupSumCount {
 public:
  GroupSumCount();
  int64_t sums() const;
  int64_t bytes() const;
  int64_t gathers() const;
  int64_t gather_bytes() const;

 private:
  int64_t sums_, bytes_, gathers_, gather_bytes_;
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
