#include "runtime/mpi_transport.h"

#include <array>
#include <cstring>
#include <limits>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/mpi_check.h"

namespace gpipe {

namespace {
// Header: element type, number of dimensions, then up to kMaxDims sizes.
constexpr int kMaxDims = 8;
constexpr int kHeaderWords = 2 + kMaxDims;
}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm) : comm_(comm) {
  GPIPE_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  GPIPE_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  int* ub = nullptr;
  int found = 0;
  GPIPE_MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &found));
  if (found && ub != nullptr) tag_ub_ = *ub;
}

void MpiTransport::check_stage(int stage, const char* what) const {
  if (stage < 0 || stage >= size_) {
    throw Error(std::string(what) + " stage " + std::to_string(stage) + " outside the " + std::to_string(size_) +
                " ranks of the pipeline");
  }
}

int MpiTransport::mpi_tag(const MessageTag& tag) const {
  const int64_t t = 2 * static_cast<int64_t>(tag.micro_batch) + (tag.kind == MessageKind::kGradient ? 1 : 0);
  if (tag.micro_batch < 0 || t > tag_ub_) {
    throw Error("micro-batch " + std::to_string(tag.micro_batch) + " does not fit in MPI's tags (upper bound " +
                std::to_string(tag_ub_) + "); use fewer micro-batches");
  }
  return static_cast<int>(t);
}

void MpiTransport::send(int src, int dst, const MessageTag& tag, const Tensor& t) {
  check_stage(dst, "send to");
  GPIPE_CHECK(src == rank_, "rank " + std::to_string(rank_) + " sending as stage " + std::to_string(src));
  GPIPE_CHECK(t.device().is_cpu(), "MpiTransport sends host tensors; " + t.str() + " is not");
  GPIPE_CHECK(t.is_contiguous(), "MpiTransport sends contiguous tensors");
  if (t.dim() > kMaxDims) throw Error("cannot send " + t.str() + ": more than 8 dimensions");
  if (t.nbytes() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw Error("cannot send " + t.str() + " in one MPI message (over 2 GiB); use more micro-batches");
  }
  std::array<int64_t, kHeaderWords> header{};
  header[0] = static_cast<int64_t>(t.dtype());
  header[1] = t.dim();
  for (int d = 0; d < t.dim(); ++d) header[2 + d] = t.size(d);
  const int mtag = mpi_tag(tag);
  GPIPE_MPI_CHECK(MPI_Send(header.data(), kHeaderWords, MPI_INT64_T, dst, mtag, comm_));
  GPIPE_MPI_CHECK(MPI_Send(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, dst, mtag, comm_));
}

Tensor MpiTransport::recv(int dst, int src, const MessageTag& tag, Device device) {
  check_stage(src, "receive from");
  GPIPE_CHECK(dst == rank_, "rank " + std::to_string(rank_) + " receiving as stage " + std::to_string(dst));
  GPIPE_CHECK(device.is_cpu(), "MpiTransport receives into host memory, not " + device.str());
  const int mtag = mpi_tag(tag);
  std::array<int64_t, kHeaderWords> header{};
  GPIPE_MPI_CHECK(MPI_Recv(header.data(), kHeaderWords, MPI_INT64_T, src, mtag, comm_, MPI_STATUS_IGNORE));
  if (header[1] < 0 || header[1] > kMaxDims || header[0] < 0 || header[0] > static_cast<int64_t>(DType::kI32)) {
    throw Error("malformed message header from rank " + std::to_string(src) + " for the " + tag_str(tag));
  }
  Shape shape(header.begin() + 2, header.begin() + 2 + header[1]);
  Tensor t = Tensor::empty(shape, static_cast<DType>(header[0]), device);
  MPI_Status status;
  GPIPE_MPI_CHECK(MPI_Recv(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, src, mtag, comm_, &status));
  int got = 0;
  GPIPE_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &got));
  if (static_cast<size_t>(got) != t.nbytes()) {
    throw Error("the " + tag_str(tag) + " from rank " + std::to_string(src) + " announced " + t.str() + " (" +
                std::to_string(t.nbytes()) + " bytes) but carried " + std::to_string(got));
  }
  return t;
}

double MpiTransport::all_reduce_sum(int stage, double value) {
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " reducing as stage " + std::to_string(stage));
  double total = 0;
  GPIPE_MPI_CHECK(MPI_Allreduce(&value, &total, 1, MPI_DOUBLE, MPI_SUM, comm_));
  return total;
}

MpiReplicaGroup::MpiReplicaGroup(MPI_Comm comm) : comm_(comm) { GPIPE_MPI_CHECK(MPI_Comm_size(comm_, &size_)); }

void MpiReplicaGroup::all_reduce_sum(Tensor& t) {
  GPIPE_CHECK(t.device().is_cpu() && t.is_contiguous(), "MpiReplicaGroup reduces contiguous host tensors");
  MPI_Datatype type = MPI_FLOAT;
  if (t.dtype() == DType::kF64) {
    type = MPI_DOUBLE;
  } else if (t.dtype() != DType::kF32) {
    throw Error("MpiReplicaGroup: cannot reduce " + t.str());
  }
  GPIPE_CHECK(t.numel() <= std::numeric_limits<int>::max(), "tensor too large for one MPI_Allreduce");
  GPIPE_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, t.raw_data(), static_cast<int>(t.numel()), type, MPI_SUM, comm_));
}

double MpiReplicaGroup::all_reduce_sum(double value) {
  double total = 0;
  GPIPE_MPI_CHECK(MPI_Allreduce(&value, &total, 1, MPI_DOUBLE, MPI_SUM, comm_));
  return total;
}

void MpiTransport::abort(const std::string& why) {
  spdlog::error("rank {} ends the job: {}", rank_, why);
  MPI_Abort(comm_, 1);
}

}  // namespace gpipe
