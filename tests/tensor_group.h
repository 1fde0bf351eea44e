// Test helpers for tensor parallelism (layers/tensor_parallel.h): a tensor group of T
// members as threads of this process, and a block of a whole tensor written out index by
// index (independently of the layers' block arithmetic).
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/backend.h"
#include "layers/tensor_parallel.h"
#include "runtime/inprocess_replica_group.h"
#include "tests/testing.h"

namespace gpipe {
namespace testing {

// A member's sums over the group's threads (runtime/inprocess_replica_group.h: added in
// member order by the last to arrive).
class ThreadCollectives : public layers::TensorCollectives {
 public:
  ThreadCollectives(InProcessReplicaHub& hub, int me) : group_(hub, me) {}
  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  void all_reduce_sum(Backend& be, Tensor& t) override {
    be.synchronize();
    group_.all_reduce_sum(t);
  }
  void all_reduce_max(Backend& be, Tensor& t) override {
    be.synchronize();
    group_.all_reduce_max(t);
  }

 private:
  InProcessReplicaGroup group_;
};

// Runs member(r, group) for r = 0 .. T-1, each on its own thread with its own member of
// one group; returns each member's error ("" when it finished).
inline std::vector<std::string> run_members(int T, const std::function<void(int, layers::TensorCollectives&)>& member) {
  InProcessReplicaHub hub(T, 30.0);
  std::vector<std::string> errors(static_cast<size_t>(T));
  std::vector<std::thread> threads;
  for (int r = 0; r < T; ++r) {
    threads.emplace_back([&, r] {
      try {
        ThreadCollectives group(hub, r);
        member(r, group);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Block `rank` of `count` along dimension `dim` of a 1-D or 2-D tensor (of each of
// `groups` equal parts of that dimension), as doubles, in row-major order.
inline std::vector<double> block_of(const Tensor& t, int dim, int rank, int count, int groups = 1) {
  const std::vector<double> v = to_doubles(t);
  const int64_t rows = t.size(0), cols = t.dim() == 1 ? 1 : t.size(1);
  const int64_t extent = dim == 0 ? rows : cols, part = extent / groups, len = part / count;
  std::vector<double> out;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (((dim == 0 ? r : c) % part) / len == rank) out.push_back(v[static_cast<size_t>(r * cols + c)]);
    }
  }
  return out;
}

}  // namespace testing
}  // namespace gpipe
