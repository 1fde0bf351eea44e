// Transport between stage threads of one process: a send is a hand-over of the tensor
// handle (no copy when both stages share a device kind that can read the memory), a
// receive waits on the destination stage's mailbox. Every wait has a deadline
// (pipeline.timeout_s): a stage whose neighbour is stuck gets an Error saying what it
// waited for instead of hanging the process. Between two GPUs, the sender records an
// event on its compute stream (what produced the tensor), and the receiver copies on
// its device's transfer stream after that event, with its compute stream waiting for
// the copy: no host wait, and the copy of micro-batch m + 1 overlaps the receiver's
// forward of m (runtime/tensor.h, transfer_tensor). A message sent twice under the same
// kind, micro-batch and cell before the first was received is a schedule's bug among
// the stages of one executor (refused); between separate executors (a job's ranks as
// threads of one process, `ordered_repeats`), a stage may start its next program (the
// next evaluation chunk) before its neighbour has finished this one, and the second
// waits behind the first, in order, as MPI's messages do.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/transport.h"

namespace gpipe {

class InProcessTransport : public Transport {
 public:
  // timeout_s: how long a receive or collective may wait (0 = no deadline).
  // ordered_repeats: queue a repeated key's messages in order (above) instead of refusing.
  explicit InProcessTransport(int num_stages, double timeout_s = kDefaultTimeoutS, bool ordered_repeats = false);
  // The step the stages are in, for the messages of expired waits.
  void set_step(int64_t step) override { step_.store(step); }
  void send(int src, int dst, const MessageTag& tag, const Tensor& t) override;
  Tensor recv(int dst, int src, const MessageTag& tag, Device device) override;
  double all_reduce_sum(int stage, double value) override;
  std::vector<std::vector<double>> gather_to_first(int stage, const std::vector<double>& values) override;
  void abort(const std::string& why) override;
  bool recover(const std::string& why) override;
  // Messages sent and not yet received (a finished schedule leaves none).
  size_t pending() const;

 private:
  using Key = std::tuple<int, int, int, int>;  // src, kind, micro-batch, cell
  struct Message {
    Tensor tensor;
    std::shared_ptr<Event> ready;  // GPU tensors: recorded on the sender's compute stream at the send
  };
  struct Mailbox {
    std::multimap<Key, Message> messages;  // a key's messages in sending order
    std::condition_variable cv;
  };
  [[noreturn]] void expire(int stage, const std::string& awaited) const;
  double timeout_s_;
  bool ordered_repeats_;
  std::atomic<int64_t> step_{-1};
  mutable std::mutex mu_;
  std::vector<Mailbox> boxes_;  // one per destination stage
  bool aborted_ = false;
  std::string why_;
  // all_reduce_sum: the round being gathered, its partial sum and arrivals, and the
  // result of the last finished round.
  std::condition_variable reduce_cv_;
  uint64_t reduce_round_ = 0;
  int reduce_arrived_ = 0;
  std::vector<double> reduce_values_;  // this round's value per stage, summed in stage order
  double reduce_result_ = 0;
  // gather_to_first, likewise (woken through reduce_cv_).
  uint64_t gather_round_ = 0;
  int gather_arrived_ = 0;
  std::vector<std::vector<double>> gather_partial_, gather_result_;
};

}  // namespace gpipe
