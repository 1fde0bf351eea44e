#include "layers/tensor_parallel.h"

#include <cstring>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

std::string TensorSplit::str() const {
  if (!split()) return "";
  return std::string(kind == TensorSplitKind::kColumn ? "column " : "row ") + std::to_string(rank) + "/" +
         std::to_string(size);
}

TensorCollectives& TensorShard::checked(TensorCollectives* group, const std::string& who) const {
  if (group == nullptr || group->size() != size || group->rank() != rank) {
    throw Error(who + " is split over a tensor group of " + std::to_string(size) + " but was given " +
                (group == nullptr ? std::string("none")
                                  : "member " + std::to_string(group->rank()) + " of " + std::to_string(group->size())) +
                " (set_collectives)");
  }
  return *group;
}

void TensorShard::sum(Backend& be, TensorCollectives* group, Tensor& t, const std::string& who) const {
  if (!split()) return;
  checked(group, who).all_reduce_sum(be, t);
}

int64_t TensorShard::positions(int64_t seq_len, const std::string& who) const {
  if (!sequence_split()) return seq_len;
  if (seq_len % size != 0) {
    throw UserError(who + ": a sequence of " + std::to_string(seq_len) + " positions does not split into " +
                    std::to_string(size) + " equal shares over a tensor group of " + std::to_string(size) +
                    " (pipeline.sequence_parallel); make the sequence length a multiple of the group's size, or set "
                    "pipeline.sequence_parallel: false");
  }
  return seq_len / size;
}

Tensor TensorShard::sum_to_positions(Backend& be, TensorCollectives* group, Tensor& t, const std::string& who) const {
  if (!sequence_split()) {
    sum(be, group, t, who);
    return t;
  }
  GPIPE_CHECK(t.dim() >= 2 && t.size(1) % size == 0, who + ": no " + std::to_string(size) + " shares of positions in " +
                                                          t.str());
  Shape shape = t.shape();
  shape[1] /= size;
  Tensor shard = be.empty(shape, t.dtype());
  checked(group, who).reduce_scatter_positions(be, t, shard);
  return shard;
}

Tensor TensorShard::gather_positions(Backend& be, TensorCollectives* group, const Tensor& x,
                                     const std::string& who) const {
  if (!sequence_split()) return x;
  GPIPE_CHECK(x.dim() >= 2, who + ": no positions in " + x.str());
  Shape shape = x.shape();
  shape[1] *= size;
  Tensor whole = be.empty(shape, x.dtype());
  checked(group, who).all_gather_positions(be, x, whole);
  return whole;
}

namespace {
// GroupSumCount's.
thread_local int64_t g_shape_sums = 0, g_shape_sum_bytes = 0, g_shape_gathers = 0, g_shape_gather_bytes = 0;

// The bytes a group moves for `t`: a bfloat16 or float16 tensor goes as float32
// (GroupCollectives::run).
int64_t group_bytes(const Tensor& t) {
  return t.numel() * static_cast<int64_t>(is_narrow(t.dtype()) ? 4 : dtype_size(t.dtype()));
}

void check_on_shapes(const Tensor& t) {
  if (!t.is_meta()) {
    throw Error("a tensor group's collective on shapes (ShapeCollectives) was given a tensor with data, " + t.str() +
                "; a run sums over its real group (GroupCollectives)");
  }
}

void count_sum(const Tensor& t) {
  check_on_shapes(t);
  g_shape_sums += 1;
  g_shape_sum_bytes += group_bytes(t);
}

// A sequence collective's operands: `whole` (B, S, ...) is `members` shares of `shard`.
void check_shares(const Tensor& shard, const Tensor& whole, int members, const char* what) {
  GPIPE_CHECK(whole.numel() == shard.numel() * members && whole.dim() >= 2 && whole.size(0) == shard.size(0) &&
                  whole.dtype() == shard.dtype(),
              std::string(what) + ": " + whole.str() + " is not " + std::to_string(members) + " shares of " +
                  shard.str());
}

void count_gather(const Tensor& shard, const Tensor& whole, int size) {
  check_on_shapes(shard);
  check_on_shapes(whole);
  check_shares(shard, whole, size, "a sequence collective on shapes");
  g_shape_gathers += 1;
  g_shape_gather_bytes += group_bytes(whole);
}
}  // namespace

GroupSumCount::GroupSumCount()
    : sums_(g_shape_sums), bytes_(g_shape_sum_bytes), gathers_(g_shape_gathers), gather_bytes_(g_shape_gather_bytes) {}
int64_t GroupSumCount::sums() const { return g_shape_sums - sums_; }
int64_t GroupSumCount::bytes() const { return g_shape_sum_bytes - bytes_; }
int64_t GroupSumCount::gathers() const { return g_shape_gathers - gathers_; }
int64_t GroupSumCount::gather_bytes() const { return g_shape_gather_bytes - gather_bytes_; }

void ShapeCollectives::all_reduce_sum(Backend&, Tensor& t) {
  count_sum(t);
  asked_.push_back({Kind::kSum, group_bytes(t)});
}
void ShapeCollectives::all_reduce_max(Backend&, Tensor& t) {
  count_sum(t);
  asked_.push_back({Kind::kMax, group_bytes(t)});
}
void ShapeCollectives::all_gather_positions(Backend&, const Tensor& shard, Tensor& whole) {
  count_gather(shard, whole, size_);
  asked_.push_back({Kind::kGather, group_bytes(whole)});
}
void ShapeCollectives::reduce_scatter_positions(Backend&, const Tensor& whole, Tensor& shard) {
  count_gather(shard, whole, size_);
  asked_.push_back({Kind::kScatter, group_bytes(whole)});
}

template <typename F>
void GroupCollectives::run(Backend& be, const Tensor& in, Tensor& out, F&& move) {
  const bool in_place = in.raw_data() == out.raw_data();  // a sum or maximum: `out` is `in`
  if (is_narrow(in.dtype())) {
    // A bfloat16 or float16 activation: reduced in float32 and rounded once, the same on
    // every member whatever the group's transport (an all-gather is exact either way).
    Tensor wide_in = be.empty(in.shape(), DType::kF32);
    be.cast(in, wide_in);
    Tensor wide_out = in_place ? wide_in : be.empty(out.shape(), DType::kF32);
    run(be, wide_in, wide_out, move);
    be.cast(wide_out, out);
    return;
  }
  GPIPE_CHECK(in.is_contiguous() && out.is_contiguous(), "a tensor group's collective of " + in.str() + " into " +
                                                             out.str() + ": contiguous tensors");
  if (group_.takes(in.device()) && group_.takes(out.device())) {
    move(be, in, out);  // queued on a GPU, done on return on a CPU
  } else {
    // The group sums host memory only: after the device's queued work, through host copies.
    be.synchronize();
    Backend& host = backend_for(Device::cpu());
    Tensor hin = in;
    if (!in.device().is_cpu()) {
      hin = Tensor::empty(in.shape(), in.dtype(), Device::cpu());
      copy_tensor(in, hin);
    }
    Tensor hout = out.device().is_cpu() ? out : in_place ? hin : Tensor::empty(out.shape(), out.dtype(), Device::cpu());
    move(host, hin, hout);
    if (!out.device().is_cpu()) copy_tensor(hout, out);
  }
}

void GroupCollectives::all_gather_positions(Backend& be, const Tensor& shard, Tensor& whole) {
  const int T = group_.size();
  check_shares(shard, whole, T, "all_gather_positions");
  run(be, shard, whole, [&](Backend& b, const Tensor& in, Tensor& out) {
    // The members' shares member-major, (T, B, run), as the group gathers them; then
    // each sample's positions in member order, (B, T, run).
    Tensor members = b.empty({T * in.numel()}, in.dtype());
    group_.all_gather(in.reshape({in.numel()}), members);
    b.transpose_blocks(members, T, in.size(0), out);
  });
}

void GroupCollectives::reduce_scatter_positions(Backend& be, const Tensor& whole, Tensor& shard) {
  const int T = group_.size();
  check_shares(shard, whole, T, "reduce_scatter_positions");
  run(be, whole, shard, [&](Backend& b, const Tensor& in, Tensor& out) {
    // (B, T, run) to the member-major blocks the group scatters, (T, B, run).
    Tensor members = b.empty({in.numel()}, in.dtype());
    b.transpose_blocks(in, in.size(0), T, members);
    Tensor mine = out.reshape({out.numel()});
    group_.reduce_scatter_sum(members, mine);
  });
}

void GroupCollectives::all_reduce_sum(Backend& be, Tensor& t) {
  run(be, t, t, [&](Backend&, const Tensor&, Tensor& x) { group_.all_reduce_sum(x); });
}

void GroupCollectives::all_reduce_max(Backend& be, Tensor& t) {
  const int T = group_.size();
  run(be, t, t, [&](Backend& b, const Tensor&, Tensor& x) {
    // Every member's values, member-major (T, n); each element's T values as a row
    // (n, T); the row's largest, the first NaN if it holds one.
    const int64_t n = x.numel();
    Tensor members = b.empty({T * n}, x.dtype());
    group_.all_gather(x.reshape({n}), members);
    Tensor rows = b.empty({n, T}, x.dtype());
    b.transpose_blocks(members, T, n, rows);
    Tensor largest = x.reshape({n});
    b.reduce_rows(Reduce::kMax, rows, largest);
  });
}

namespace {

// The whole's layout around `dim`: outer slices, each `groups` parts of `count` blocks of
// `run` contiguous elements (a block's extent along dim times the elements after it).
struct BlockLayout {
  int64_t outer = 1, run = 1;
  int groups = 1, count = 1;
  int64_t element = 1;  // bytes
};

BlockLayout layout_of(const Shape& whole, int dim, int count, int groups, DType dtype, const std::string& what) {
  GPIPE_CHECK(dim >= 0 && dim < static_cast<int>(whole.size()) && count >= 1 && groups >= 1 &&
                  whole[dim] % (static_cast<int64_t>(count) * groups) == 0,
              what + ": no " + std::to_string(count) + " blocks in " + std::to_string(groups) + " parts along dimension " +
                  std::to_string(dim) + " of " + shape_str(whole));
  BlockLayout l;
  for (int d = 0; d < dim; ++d) l.outer *= whole[d];
  int64_t inner = 1;
  for (size_t d = static_cast<size_t>(dim) + 1; d < whole.size(); ++d) inner *= whole[d];
  l.run = whole[dim] / groups / count * inner;
  l.groups = groups;
  l.count = count;
  l.element = static_cast<int64_t>(dtype_size(dtype));
  return l;
}

}  // namespace

Tensor join_blocks(const std::vector<Tensor>& blocks, int dim, int groups, const Shape& whole) {
  GPIPE_CHECK(!blocks.empty(), "join_blocks: no blocks");
  const DType dtype = blocks[0].dtype();
  const int count = static_cast<int>(blocks.size());
  const BlockLayout l = layout_of(whole, dim, count, groups, dtype, "join_blocks");
  Tensor out = Tensor::empty(whole, dtype, Device::cpu());
  char* dst = static_cast<char*>(out.raw_data());
  const int64_t bytes = l.run * l.element;
  for (int r = 0; r < count; ++r) {
    const Tensor& b = blocks[static_cast<size_t>(r)];
    GPIPE_CHECK(b.device().is_cpu() && b.is_contiguous() && b.dtype() == dtype &&
                    b.numel() * count == out.numel(),
                "join_blocks: block " + std::to_string(r) + " " + b.str() + " is not 1/" + std::to_string(count) +
                    " of " + shape_str(whole));
    const char* src = static_cast<const char*>(b.raw_data());
    for (int64_t o = 0; o < l.outer; ++o) {
      for (int g = 0; g < groups; ++g) {
        const int64_t at = ((o * groups + g) * count + r) * bytes;  // in the whole
        const int64_t from = (o * groups + g) * bytes;              // in the block
        std::memcpy(dst + at, src + from, static_cast<size_t>(bytes));
      }
    }
  }
  return out;
}

Tensor cut_block(const Tensor& whole, int dim, int rank, int count, int groups) {
  GPIPE_CHECK(whole.device().is_cpu() && whole.is_contiguous(), "cut_block: " + whole.str() + " is not a host tensor");
  const BlockLayout l = layout_of(whole.shape(), dim, count, groups, whole.dtype(), "cut_block");
  GPIPE_CHECK(rank >= 0 && rank < count, "cut_block: no member " + std::to_string(rank) + " of " + std::to_string(count));
  Shape shape = whole.shape();
  shape[dim] /= count;
  Tensor out = Tensor::empty(shape, whole.dtype(), Device::cpu());
  const char* src = static_cast<const char*>(whole.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  const int64_t bytes = l.run * l.element;
  for (int64_t o = 0; o < l.outer; ++o) {
    for (int g = 0; g < groups; ++g) {
      std::memcpy(dst + (o * groups + g) * bytes, src + ((o * groups + g) * count + rank) * bytes,
                  static_cast<size_t>(bytes));
    }
  }
  return out;
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
