#include "runtime/mpi_transport.h"

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/mpi_check.h"

namespace gpipe {

void mpi_await(int n, MPI_Request* requests, MPI_Status* statuses, double timeout_s, const std::string& waiter,
               const std::string& awaited, int64_t step) {
  const Deadline deadline(timeout_s);
  const bool done = poll_until(
      [&] {
        int flag = 0;
        GPIPE_MPI_CHECK(MPI_Testall(n, requests, &flag, statuses ? statuses : MPI_STATUSES_IGNORE));
        return flag != 0;
      },
      deadline);
  if (done) return;
  // Other ranks may be blocked on this one: only the whole job ending frees them.
  spdlog::error("{}", timeout_message(waiter, awaited, timeout_s, step));
  spdlog::default_logger()->flush();
  MPI_Abort(MPI_COMM_WORLD, kTimeoutExitCode);
  std::abort();  // MPI_Abort does not return
}

MpiTransport::MpiTransport(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
  Deadline check(timeout_s);  // refuses a negative or non-finite value
  GPIPE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
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
  const int64_t t =
      kMessageKinds * (kMaxCells * static_cast<int64_t>(tag.micro_batch) + tag.cell) + static_cast<int>(tag.kind);
  if (tag.micro_batch < 0 || tag.cell < 0 || tag.cell >= kMaxCells || t > tag_ub_) {
    throw Error("the " + tag_str(tag) + " does not fit in MPI's tags (upper bound " + std::to_string(tag_ub_) +
                "); use fewer micro-batches (or a larger train.batch_size for validation)");
  }
  return static_cast<int>(t);
}

void MpiTransport::send(int src, int dst, const MessageTag& tag, const Tensor& t) {
  check_stage(dst, "send to");
  GPIPE_CHECK(src == rank_, "rank " + std::to_string(rank_) + " sending as stage " + std::to_string(src));
  GPIPE_CHECK(t.device().is_cpu(), "MpiTransport sends host tensors; " + t.str() + " is not");
  GPIPE_CHECK(t.is_contiguous(), "MpiTransport sends contiguous tensors");
  if (t.nbytes() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw Error("cannot send " + t.str() + " in one MPI message (over 2 GiB); use more micro-batches");
  }
  reap_sends(/*wait=*/false);
  // Non-blocking: the stage goes on computing while the neighbour is still busy; the
  // pending entry keeps the tensor (and the header) alive until MPI is done with them.
  auto p = std::make_unique<PendingSend>();
  p->tensor = t;
  p->header = encode_header(t, tag);
  p->what = "the " + tag_str(tag) + " to rank " + std::to_string(dst) + " to be sent";
  const int mtag = mpi_tag(tag);
  GPIPE_MPI_CHECK(MPI_Isend(p->header.data(), kMessageHeaderWords, MPI_INT64_T, dst, mtag, comm_, &p->requests[0]));
  GPIPE_MPI_CHECK(
      MPI_Isend(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, dst, mtag, comm_, &p->requests[1]));
  pending_.push_back(std::move(p));
}

void MpiTransport::await(int n, MPI_Request* requests, MPI_Status* statuses, const std::string& awaited) {
  mpi_await(n, requests, statuses, timeout_s_, "rank " + std::to_string(world_rank_) + " (stage " + std::to_string(rank_) + ")",
            awaited, step_);
}

void MpiTransport::reap_sends(bool wait) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    int done = 0;
    if (wait) {
      await(2, (*it)->requests.data(), nullptr, (*it)->what + " (MPI_Isend; the receiver never took it)");
      done = 1;
    } else {
      GPIPE_MPI_CHECK(MPI_Testall(2, (*it)->requests.data(), &done, MPI_STATUSES_IGNORE));
    }
    it = done ? pending_.erase(it) : std::next(it);
  }
}

void MpiTransport::flush(int stage) {
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " flushing as stage " + std::to_string(stage));
  reap_sends(/*wait=*/true);
}

std::vector<std::vector<double>> MpiTransport::gather_to_first(int stage, const std::vector<double>& values) {
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " gathering as stage " + std::to_string(stage));
  GPIPE_CHECK(values.size() <= static_cast<size_t>(std::numeric_limits<int>::max()), "gather: too many values");
  const int n = static_cast<int>(values.size());
  std::vector<int> counts(rank_ == 0 ? size_ : 0), displs(rank_ == 0 ? size_ : 0);
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Igather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm_, &r));
  await(1, &r, nullptr, "the gather of report values to rank 0 over " + std::to_string(size_) + " ranks (MPI_Igather)");
  std::vector<double> all;
  if (rank_ == 0) {
    int64_t total = 0;
    for (int r = 0; r < size_; ++r) {
      displs[r] = static_cast<int>(total);
      total += counts[r];
    }
    GPIPE_CHECK(total <= std::numeric_limits<int>::max(), "gather: too many values");
    all.resize(total);
  }
  GPIPE_MPI_CHECK(MPI_Igatherv(values.data(), n, MPI_DOUBLE, all.data(), counts.data(), displs.data(), MPI_DOUBLE,
                               0, comm_, &r));
  await(1, &r, nullptr, "the gather of report values to rank 0 over " + std::to_string(size_) + " ranks (MPI_Igatherv)");
  std::vector<std::vector<double>> out;
  for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
    out.emplace_back(all.begin() + displs[r], all.begin() + displs[r] + counts[r]);
  }
  return out;
}

Tensor MpiTransport::recv(int dst, int src, const MessageTag& tag, Device device) {
  check_stage(src, "receive from");
  GPIPE_CHECK(dst == rank_, "rank " + std::to_string(rank_) + " receiving as stage " + std::to_string(dst));
  reap_sends(/*wait=*/false);
  GPIPE_CHECK(device.is_cpu(), "MpiTransport receives into host memory, not " + device.str());
  const int mtag = mpi_tag(tag);
  const std::string what = "the " + tag_str(tag) + " from rank " + std::to_string(src);
  MessageHeader header{};
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Irecv(header.data(), kMessageHeaderWords, MPI_INT64_T, src, mtag, comm_, &r));
  await(1, &r, nullptr, what + " (its header, MPI_Irecv)");
  const MessageLayout layout = decode_header(header, what);
  Tensor t = Tensor::empty(layout.shape, layout.dtype, device);
  MPI_Status status;
  GPIPE_MPI_CHECK(MPI_Irecv(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, src, mtag, comm_, &r));
  await(1, &r, &status, what + " (its data, MPI_Irecv)");
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
  // Every rank's value, summed in rank (stage) order: MPI_SUM's order is the library's
  // choice, and a float sum of three or more values depends on it. The same order as
  // InProcessTransport, so a run on K processes equals the same run as K threads bit
  // for bit.
  std::vector<double> values(static_cast<size_t>(size_));
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Iallgather(&value, 1, MPI_DOUBLE, values.data(), 1, MPI_DOUBLE, comm_, &r));
  await(1, &r, nullptr, "the all-reduce of a scalar over the pipeline's " + std::to_string(size_) + " ranks (MPI_Iallgather)");
  double total = 0;
  for (double v : values) total += v;
  return total;
}

MpiReplicaGroup::MpiReplicaGroup(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
  Deadline check(timeout_s);
  GPIPE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  GPIPE_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  GPIPE_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
}

void MpiReplicaGroup::await(int n, MPI_Request* requests, const std::string& awaited) {
  mpi_await(n, requests, nullptr, timeout_s_, "rank " + std::to_string(world_rank_), awaited, step_);
}

namespace {
MPI_Datatype reducible_type(const Tensor& t) {
  GPIPE_CHECK(t.device().is_cpu() && t.is_contiguous(), "MpiReplicaGroup reduces contiguous host tensors");
  GPIPE_CHECK(t.numel() <= std::numeric_limits<int>::max(), "tensor too large for one MPI_Allreduce");
  if (t.dtype() == DType::kF64) return MPI_DOUBLE;
  if (t.dtype() != DType::kF32) throw Error("MpiReplicaGroup: cannot reduce " + t.str());
  return MPI_FLOAT;
}
}  // namespace

void MpiReplicaGroup::all_reduce_sum(Tensor& t) {
  const MPI_Datatype type = reducible_type(t);
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.raw_data(), static_cast<int>(t.numel()), type, MPI_SUM, comm_, &r));
  await(1, &r, "the all-reduce of a " + t.str() + " over the stage's " + std::to_string(size_) + " replicas");
}

void MpiReplicaGroup::start_all_reduce_sum(Tensor& t) {
  const MPI_Datatype type = reducible_type(t);
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.raw_data(), static_cast<int>(t.numel()), type, MPI_SUM, comm_, &r));
  requests_.push_back(r);
}

void MpiReplicaGroup::progress() {
  if (requests_.empty()) return;
  int done = 0;
  GPIPE_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE));
  if (done) requests_.clear();
}

void MpiReplicaGroup::wait_all() {
  if (requests_.empty()) return;
  await(static_cast<int>(requests_.size()), requests_.data(),
        std::to_string(requests_.size()) + " started gradient all-reduce(s) over the stage's " +
            std::to_string(size_) + " replicas (wait_all)");
  requests_.clear();
}

// The sharded optimizer's collectives: blocks of equal size (the shard partition pads
// the last ones), so the _block and plain forms serve; non-blocking, under the deadline.
void MpiReplicaGroup::reduce_scatter_sum(Tensor& full, Tensor& block) {
  const MPI_Datatype type = reducible_type(full);
  GPIPE_CHECK(block.device().is_cpu() && block.is_contiguous() && block.dtype() == full.dtype() &&
                  full.numel() == block.numel() * size_,
              "reduce_scatter_sum: " + full.str() + " is not " + std::to_string(size_) + " blocks of " + block.str());
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Ireduce_scatter_block(full.raw_data(), block.raw_data(), static_cast<int>(block.numel()), type,
                                            MPI_SUM, comm_, &r));
  await(1, &r, "the reduce-scatter of a " + full.str() + " over the stage's " + std::to_string(size_) + " replicas");
}

void MpiReplicaGroup::all_gather(const Tensor& block, Tensor& full) {
  const MPI_Datatype type = reducible_type(full);
  GPIPE_CHECK(block.device().is_cpu() && block.is_contiguous() && block.dtype() == full.dtype() &&
                  full.numel() == block.numel() * size_,
              "all_gather: " + full.str() + " is not " + std::to_string(size_) + " blocks of " + block.str());
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Iallgather(block.raw_data(), static_cast<int>(block.numel()), type, full.raw_data(),
                                 static_cast<int>(block.numel()), type, comm_, &r));
  await(1, &r, "the all-gather of a " + full.str() + " over the stage's " + std::to_string(size_) + " replicas");
}

double MpiReplicaGroup::all_reduce_sum(double value) {
  double total = 0;
  MPI_Request r;
  GPIPE_MPI_CHECK(MPI_Iallreduce(&value, &total, 1, MPI_DOUBLE, MPI_SUM, comm_, &r));
  await(1, &r, "the all-reduce of a scalar over the stage's " + std::to_string(size_) + " replicas");
  return total;
}

void MpiTransport::abort(const std::string& why) {
  spdlog::error("rank {} ends the job: {}", rank_, why);
  MPI_Abort(MPI_COMM_WORLD, 1);  // the whole job: other replicas too
}

// ---- Clock offsets (for traces that merge several processes' timings).

namespace {

constexpr int kClockIdSize = 128;

// What names this process's steady clock: the kernel's boot id and the time namespace
// (which can shift CLOCK_MONOTONIC), or "" where either cannot be read.
std::string monotonic_clock_id() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(boot >> id) || id.empty()) return "";
  char ns[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/time", ns, sizeof(ns) - 1);
  // A kernel without time namespaces (before 5.6) has one monotonic clock per boot.
  return id + "|" + (n > 0 ? std::string(ns, static_cast<size_t>(n)) : std::string("no-time-ns"));
}

}  // namespace

double MpiTransport::clock_offset_to_first(int stage) {
  GPIPE_CHECK(stage == rank_, "rank " + std::to_string(rank_) + " measuring its clock as stage " + std::to_string(stage));
  constexpr int kRounds = 10;
  auto now_ms = [] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  };
  MPI_Comm comm = MPI_COMM_NULL;
  GPIPE_MPI_CHECK(MPI_Comm_dup(comm_, &comm));
  // Processes of one kernel boot in one time namespace read one CLOCK_MONOTONIC (which
  // steady_clock is on Linux): their offset is exactly 0, where a measured one would be
  // off by up to half a round trip (tens of microseconds with more ranks than cores,
  // enough to draw a message arriving before it left).
  const std::string mine = monotonic_clock_id();
  std::array<char, kClockIdSize> key{};
  std::memcpy(key.data(), mine.data(), std::min(mine.size(), key.size() - 1));
  std::vector<char> keys(static_cast<size_t>(size_) * kClockIdSize);
  GPIPE_MPI_CHECK(MPI_Allgather(key.data(), kClockIdSize, MPI_CHAR, keys.data(), kClockIdSize, MPI_CHAR, comm));
  auto shares_first = [&](int r) {
    const char* theirs = keys.data() + static_cast<size_t>(r) * kClockIdSize;
    return theirs[0] != 0 && std::strncmp(theirs, keys.data(), kClockIdSize) == 0;
  };
  double offset = 0;
  if (rank_ != 0 && shares_first(rank_)) {
    GPIPE_MPI_CHECK(MPI_Comm_free(&comm));
    return 0.0;
  }
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) {
      if (shares_first(r)) continue;
      double best_rtt = -1;
      for (int i = 0; i < kRounds; ++i) {
        const double t0 = now_ms();
        double theirs = 0;
        GPIPE_MPI_CHECK(MPI_Send(&t0, 1, MPI_DOUBLE, r, 0, comm));
        GPIPE_MPI_CHECK(MPI_Recv(&theirs, 1, MPI_DOUBLE, r, 0, comm, MPI_STATUS_IGNORE));
        const double t1 = now_ms();
        // Their clock read half-way through the round trip, at best.
        if (best_rtt < 0 || t1 - t0 < best_rtt) {
          best_rtt = t1 - t0;
          offset = theirs - 0.5 * (t0 + t1);
        }
      }
      GPIPE_MPI_CHECK(MPI_Send(&offset, 1, MPI_DOUBLE, r, 1, comm));
    }
    offset = 0;
  } else {
    for (int i = 0; i < kRounds; ++i) {
      double t0 = 0;
      GPIPE_MPI_CHECK(MPI_Recv(&t0, 1, MPI_DOUBLE, 0, 0, comm, MPI_STATUS_IGNORE));
      const double mine = now_ms();
      GPIPE_MPI_CHECK(MPI_Send(&mine, 1, MPI_DOUBLE, 0, 0, comm));
    }
    GPIPE_MPI_CHECK(MPI_Recv(&offset, 1, MPI_DOUBLE, 0, 1, comm, MPI_STATUS_IGNORE));
  }
  GPIPE_MPI_CHECK(MPI_Comm_free(&comm));
  return offset;
}

}  // namespace gpipe
