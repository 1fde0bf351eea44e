// The data-parallel replicas of a stage as threads of one process (one executor per
// replica and stage, as under mpirun but joined in memory): all-reduce, reduce-scatter
// and all-gather, each summed in replica order by the last member to arrive, so the
// result does not depend on which thread came first. Every wait has a deadline.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/transport.h"

namespace gpipe {

// What the members of one group share; outlives them.
class InProcessReplicaHub {
 public:
  explicit InProcessReplicaHub(int members, double timeout_s = kDefaultTimeoutS);
  int members() const { return members_; }

  enum class Kind { kAllReduce, kReduceScatter, kAllGather };
  // Member `me`'s next collective: `in` is what it gives, `out` where its result goes
  // (the same tensor for an all-reduce). Returns once every member has taken part.
  void run(int me, Kind kind, const Tensor& in, Tensor& out);
  // Wakes every member waiting in run(), and fails every later call, with Aborted(why):
  // a member that failed does not leave the others waiting for it. Idempotent.
  void abort(const std::string& why);

 private:
  struct Round {
    Kind kind = Kind::kAllReduce;
    std::vector<Tensor> in, out;
    int arrived = 0;
    bool done = false;
    std::string error;
  };
  void finish(Round& r);

  const int members_;
  const double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int64_t> next_;  // per member: its next round
  std::deque<Round> rounds_;
  int64_t first_round_ = 0;    // rounds_[0]'s number (finished rounds are dropped)
  std::vector<int> left_;      // per live round: members yet to leave it
  std::string aborted_;        // abort()'s reason; empty while the group runs
};

class InProcessReplicaGroup : public ReplicaGroup {
 public:
  InProcessReplicaGroup(InProcessReplicaHub& hub, int me) : hub_(hub), me_(me) {}
  int size() const override { return hub_.members(); }
  int rank() const override { return me_; }
  void all_reduce_sum(Tensor& t) override { hub_.run(me_, InProcessReplicaHub::Kind::kAllReduce, t, t); }
  double all_reduce_sum(double value) override;
  void reduce_scatter_sum(Tensor& full, Tensor& block) override {
    hub_.run(me_, InProcessReplicaHub::Kind::kReduceScatter, full, block);
  }
  void all_gather(const Tensor& block, Tensor& full) override {
    hub_.run(me_, InProcessReplicaHub::Kind::kAllGather, block, full);
  }

 private:
  InProcessReplicaHub& hub_;
  int me_;
};

}  // namespace gpipe
