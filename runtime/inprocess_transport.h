// Transport between stage threads of one process: a send is a hand-over of the tensor
// handle (no copy when both stages share a device kind that can read the memory), a
// receive waits on the destination stage's mailbox.
#pragma once

#include <condition_variable>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "runtime/transport.h"

namespace gpipe {

class InProcessTransport : public Transport {
 public:
  explicit InProcessTransport(int num_stages);
  void send(int src, int dst, const MessageTag& tag, const Tensor& t) override;
  Tensor recv(int dst, int src, const MessageTag& tag, Device device) override;
  void abort(const std::string& why) override;
  // Messages sent and not yet received (a finished schedule leaves none).
  size_t pending() const;

 private:
  using Key = std::tuple<int, int, int>;  // src, kind, micro-batch
  struct Mailbox {
    std::map<Key, Tensor> messages;
    std::condition_variable cv;
  };
  mutable std::mutex mu_;
  std::vector<Mailbox> boxes_;  // one per destination stage
  bool aborted_ = false;
  std::string why_;
};

}  // namespace gpipe
