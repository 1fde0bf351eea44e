#include "runtime/inprocess_replica_group.h"

#include <cstring>
#include <vector>

#include "runtime/error.h"

namespace gpipe {

InProcessReplicaHub::InProcessReplicaHub(int members, double timeout_s)
    : members_(members), timeout_s_(timeout_s), next_(static_cast<size_t>(members), 0) {
  GPIPE_CHECK(members >= 1, "a replica group has at least one member");
}

namespace {
std::vector<double> host_values(const Tensor& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  copy_tensor(t, h);
  std::vector<double> v(static_cast<size_t>(h.numel()));
  for (int64_t i = 0; i < h.numel(); ++i) {
    v[i] = h.dtype() == DType::kF64 ? h.data<double>()[i] : static_cast<double>(h.data<float>()[i]);
  }
  return v;
}
void write_values(const std::vector<double>& v, int64_t from, Tensor& out) {
  Tensor h = Tensor::empty(out.shape(), out.dtype(), Device::cpu());
  for (int64_t i = 0; i < h.numel(); ++i) {
    if (h.dtype() == DType::kF64) {
      h.data<double>()[i] = v[from + i];
    } else {
      h.data<float>()[i] = static_cast<float>(v[from + i]);
    }
  }
  copy_tensor(h, out);
}
// finish() on contiguous host tensors of one floating type T: the members' tensors read
// and written where they are (no widened copies). The sum goes to a buffer first, so an
// output may share memory with its member's input.
template <typename T>
void finish_on_host(InProcessReplicaHub::Kind kind, const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  using Kind = InProcessReplicaHub::Kind;
  const size_t D = in.size();
  const int64_t n = in[0].numel();
  if (kind == Kind::kAllGather) {
    for (size_t d = 0; d < D; ++d) {
      for (size_t from = 0; from < D; ++from) {
        if (n > 0) std::memmove(out[d].data<T>() + from * n, in[from].data<T>(), static_cast<size_t>(n) * sizeof(T));
      }
    }
    return;
  }
  std::vector<T> sum(static_cast<size_t>(n));
  std::vector<const T*> from(D);
  for (size_t d = 0; d < D; ++d) from[d] = in[d].data<T>();
  for (int64_t i = 0; i < n; ++i) {
    T acc = from[0][i];
    for (size_t d = 1; d < D; ++d) acc = acc + from[d][i];  // replica order, rounded at each add
    sum[static_cast<size_t>(i)] = acc;
  }
  for (size_t d = 0; d < D; ++d) {
    const int64_t from = kind == Kind::kAllReduce ? 0 : static_cast<int64_t>(d) * (n / static_cast<int64_t>(D));
    const int64_t count = out[d].numel();
    if (count > 0) std::memcpy(out[d].data<T>(), sum.data() + from, static_cast<size_t>(count) * sizeof(T));
  }
}

bool on_host_as(const std::vector<Tensor>& ts, DType dtype) {
  for (const Tensor& t : ts) {
    if (!t.device().is_cpu() || !t.is_contiguous() || t.dtype() != dtype) return false;
  }
  return true;
}
}  // namespace

// The last member to arrive computes every member's result, adding in replica order
// (in the tensor's own precision, as MPI would: a float32 sum rounds after each add).
void InProcessReplicaHub::finish(Round& r) {
  const int D = members_;
  const int64_t n_in = r.in[0].numel();
  for (int d = 0; d < D; ++d) {
    if (r.in[d].numel() != n_in || r.in[d].dtype() != r.in[0].dtype()) {
      r.error = "replica " + std::to_string(d) + " gave " + r.in[d].str() + " where replica 0 gave " + r.in[0].str();
      return;
    }
  }
  for (DType t : {DType::kF32, DType::kF64}) {
    if (on_host_as(r.in, t) && on_host_as(r.out, t)) {
      if (t == DType::kF32) {
        finish_on_host<float>(r.kind, r.in, r.out);
      } else {
        finish_on_host<double>(r.kind, r.in, r.out);
      }
      return;
    }
  }
  // Elsewhere (a device's tensors): through widened host copies.
  const bool f32 = r.in[0].dtype() == DType::kF32;
  std::vector<std::vector<double>> in;
  for (int d = 0; d < D; ++d) in.push_back(host_values(r.in[d]));
  if (r.kind == Kind::kAllGather) {
    std::vector<double> all;
    for (int d = 0; d < D; ++d) all.insert(all.end(), in[d].begin(), in[d].end());
    for (int d = 0; d < D; ++d) write_values(all, 0, r.out[d]);
    return;
  }
  std::vector<double> sum(in[0]);
  for (int d = 1; d < D; ++d) {
    for (size_t i = 0; i < sum.size(); ++i) {
      sum[i] = f32 ? static_cast<double>(static_cast<float>(sum[i]) + static_cast<float>(in[d][i])) : sum[i] + in[d][i];
    }
  }
  for (int d = 0; d < D; ++d) {
    if (r.kind == Kind::kAllReduce) {
      write_values(sum, 0, r.out[d]);
    } else {
      const int64_t block = n_in / D;
      write_values(sum, block * d, r.out[d]);
    }
  }
}

void InProcessReplicaHub::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.empty()) aborted_ = why.empty() ? std::string("aborted") : why;
  cv_.notify_all();
}

void InProcessReplicaHub::run(int me, Kind kind, const Tensor& in, Tensor& out) {
  if (kind == Kind::kReduceScatter) {
    GPIPE_CHECK(in.numel() == out.numel() * members_, "reduce_scatter_sum: " + in.str() + " is not " +
                                                          std::to_string(members_) + " blocks of " + out.str());
  }
  if (kind == Kind::kAllGather) {
    GPIPE_CHECK(out.numel() == in.numel() * members_, "all_gather: " + out.str() + " is not " +
                                                          std::to_string(members_) + " blocks of " + in.str());
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!aborted_.empty()) throw Aborted(aborted_);
  const int64_t number = next_.at(static_cast<size_t>(me))++;
  while (first_round_ + static_cast<int64_t>(rounds_.size()) <= number) {
    rounds_.emplace_back();
    left_.push_back(members_);
  }
  Round& r = rounds_[static_cast<size_t>(number - first_round_)];
  if (r.arrived == 0) {
    r.kind = kind;
    r.in.resize(static_cast<size_t>(members_));
    r.out.resize(static_cast<size_t>(members_));
  } else if (r.kind != kind) {
    r.error = "replica " + std::to_string(me) + " started another kind of collective than the others";
  }
  r.in[me] = in;
  r.out[me] = out;
  if (++r.arrived == members_) {
    if (r.error.empty()) finish(r);
    r.done = true;
    cv_.notify_all();
  } else {
    const Deadline deadline(timeout_s_);
    if (!wait_until(cv_, lock, deadline, [&] { return r.done || !aborted_.empty(); })) {
      throw Error(timeout_message("replica " + std::to_string(me), "collective " + std::to_string(number) +
                                      " of its " + std::to_string(members_) + " replicas", timeout_s_, -1));
    }
    if (!r.done) throw Aborted(aborted_);
  }
  const std::string error = r.error;
  // The last member to leave drops the finished rounds at the front.
  --left_[static_cast<size_t>(number - first_round_)];
  while (!rounds_.empty() && rounds_.front().done && left_.front() == 0) {
    rounds_.pop_front();
    left_.erase(left_.begin());
    ++first_round_;
  }
  if (!error.empty()) throw Error("in-process replica group: " + error);
}

double InProcessReplicaGroup::all_reduce_sum(double value) {
  Tensor t = Tensor::from_vector<double>({value}, {1});
  all_reduce_sum(t);
  return t.data<double>()[0];
}

}  // namespace gpipe
