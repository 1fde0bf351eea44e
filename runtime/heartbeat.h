// Liveness of a training process, for the supervisor (`gpipe run`) that restarts a job
// that makes no progress: a frozen process (kill -STOP), a deadlock, a hung file system.
// Progress is a process-wide counter that work bumps (each executor instruction, each
// checkpoint file, each validation chunk, each step); a background thread writes it to a
// file when it has changed, as "COUNT PID HOST". A stopped or stuck process leaves the file unchanged, which
// the supervisor notices after its deadline (supervisor.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace gpipe {

// Counts one unit of progress; cheap enough for every instruction (a relaxed atomic add).
void heartbeat();
uint64_t heartbeat_count();

class HeartbeatWriter {
 public:
  // Writes the count to `path` now and then every `period_s` while it changes.
  explicit HeartbeatWriter(std::string path, double period_s = 0.25);
  ~HeartbeatWriter();
  HeartbeatWriter(const HeartbeatWriter&) = delete;
  HeartbeatWriter& operator=(const HeartbeatWriter&) = delete;

 private:
  void write(uint64_t count);
  std::string path_;
  double period_s_;
  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace gpipe
