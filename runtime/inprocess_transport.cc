#include "runtime/inprocess_transport.h"

#include "runtime/error.h"

namespace gpipe {

std::string tag_str(const MessageTag& tag) {
  const std::string cell = tag.cell != 0 ? " (cell " + std::to_string(tag.cell) + ")" : std::string();
  switch (tag.kind) {
    case MessageKind::kActivation:
      return "activation of micro-batch " + std::to_string(tag.micro_batch) + cell;
    case MessageKind::kGradient:
      return "gradient of micro-batch " + std::to_string(tag.micro_batch) + cell;
    case MessageKind::kTiedGradient:
      break;
  }
  return "gradient of tied weight " + std::to_string(tag.micro_batch);
}

InProcessTransport::InProcessTransport(int num_stages, double timeout_s, bool ordered_repeats)
    : timeout_s_(timeout_s), ordered_repeats_(ordered_repeats), boxes_(num_stages) {
  Deadline check(timeout_s);  // refuses a negative or non-finite value
}

void InProcessTransport::expire(int stage, const std::string& awaited) const {
  throw Error(timeout_message("stage " + std::to_string(stage), awaited, timeout_s_, step_.load()));
}

void InProcessTransport::send(int src, int dst, const MessageTag& tag, const Tensor& t) {
  GPIPE_CHECK(dst >= 0 && dst < static_cast<int>(boxes_.size()), "send to stage " + std::to_string(dst));
  Message message{t, nullptr};
  // Stages that capture their step together share the device's compute stream, which
  // orders the hand-over by itself: an event recorded inside the capture would become a
  // node of its graph that outlives the event.
  if (t.defined() && t.device().is_cuda() && !compute_stream_for(t.device()).capturing()) {
    // The work that produced t, and not what this stage queues after the send.
    message.ready = make_event(t.device());
    message.ready->record(compute_stream_for(t.device()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) throw Aborted(why_);
  Mailbox& box = boxes_[dst];
  const Key key{src, static_cast<int>(tag.kind), tag.micro_batch, tag.cell};
  GPIPE_CHECK(ordered_repeats_ || box.messages.find(key) == box.messages.end(),
              "stage " + std::to_string(src) + " sent the " + tag_str(tag) + " to stage " + std::to_string(dst) +
                  " twice");
  box.messages.emplace(key, std::move(message));  // after any of the same key: first in, first out
  box.cv.notify_all();
}

Tensor InProcessTransport::recv(int dst, int src, const MessageTag& tag, Device device) {
  GPIPE_CHECK(dst >= 0 && dst < static_cast<int>(boxes_.size()), "recv on stage " + std::to_string(dst));
  Message m;
  {
    std::unique_lock<std::mutex> lock(mu_);
    Mailbox& box = boxes_[dst];
    const Key key{src, static_cast<int>(tag.kind), tag.micro_batch, tag.cell};
    std::multimap<Key, Message>::iterator it;
    const bool arrived = wait_until(box.cv, lock, Deadline(timeout_s_), [&] {
      // The first of the key's messages (lower_bound: the earliest sent).
      return aborted_ || ((it = box.messages.lower_bound(key)) != box.messages.end() && it->first == key);
    });
    if (aborted_) throw Aborted(why_);
    if (!arrived) expire(dst, "the " + tag_str(tag) + " from stage " + std::to_string(src));
    m = std::move(it->second);
    box.messages.erase(it);
  }
  // Host memory is shared by all CPU devices, and stages sharing a GPU share its
  // compute stream: hand the tensor over as it is. Otherwise copy, ordered on streams.
  return transfer_tensor(m.tensor, device, m.ready.get());
}

double InProcessTransport::all_reduce_sum(int stage, double value) {
  GPIPE_CHECK(stage >= 0 && stage < static_cast<int>(boxes_.size()), "all_reduce_sum on stage " + std::to_string(stage));
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_) throw Aborted(why_);
  const uint64_t round = reduce_round_;
  // Summed in stage order, not in the order the stages arrive: a float sum of three or
  // more values depends on its order, and the result must not depend on the threads'
  // timing (MpiTransport sums in the same order, so one process and many agree).
  reduce_values_.resize(boxes_.size());
  reduce_values_[stage] = value;
  if (++reduce_arrived_ == static_cast<int>(boxes_.size())) {
    reduce_result_ = 0;
    for (double v : reduce_values_) reduce_result_ += v;
    reduce_arrived_ = 0;
    ++reduce_round_;
    reduce_cv_.notify_all();
    return reduce_result_;
  }
  const bool done = wait_until(reduce_cv_, lock, Deadline(timeout_s_), [&] { return aborted_ || reduce_round_ != round; });
  if (reduce_round_ == round && aborted_) throw Aborted(why_);
  if (!done) {
    expire(stage, "the all-reduce over the " + std::to_string(boxes_.size()) + " stages (" +
                      std::to_string(reduce_arrived_) + " of them had arrived)");
  }
  return reduce_result_;
}

std::vector<std::vector<double>> InProcessTransport::gather_to_first(int stage, const std::vector<double>& values) {
  const int K = static_cast<int>(boxes_.size());
  GPIPE_CHECK(stage >= 0 && stage < K, "gather_to_first on stage " + std::to_string(stage));
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_) throw Aborted(why_);
  const uint64_t round = gather_round_;
  if (gather_partial_.empty()) gather_partial_.resize(K);
  gather_partial_[stage] = values;
  if (++gather_arrived_ == K) {
    gather_result_ = std::move(gather_partial_);
    gather_partial_.clear();
    gather_arrived_ = 0;
    ++gather_round_;
    reduce_cv_.notify_all();
  } else {
    const bool done =
        wait_until(reduce_cv_, lock, Deadline(timeout_s_), [&] { return aborted_ || gather_round_ != round; });
    if (gather_round_ == round && aborted_) throw Aborted(why_);
    if (!done) {
      expire(stage, "the gather to stage 0 over the " + std::to_string(K) + " stages (" +
                        std::to_string(gather_arrived_) + " of them had arrived)");
    }
  }
  return stage == 0 ? gather_result_ : std::vector<std::vector<double>>{};
}

void InProcessTransport::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) return;
  aborted_ = true;
  why_ = why;
  for (auto& box : boxes_) box.cv.notify_all();
  reduce_cv_.notify_all();
}

bool InProcessTransport::recover(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_ || why_ != why) return false;  // not aborted, or for something else: that stands
  aborted_ = false;
  why_.clear();
  for (auto& box : boxes_) box.messages.clear();
  reduce_arrived_ = 0;
  gather_arrived_ = 0;
  gather_partial_.clear();
  return true;
}

size_t InProcessTransport::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& box : boxes_) n += box.messages.size();
  return n;
}

}  // namespace gpipe
