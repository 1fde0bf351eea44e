#include "runtime/heartbeat.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "runtime/error.h"

namespace gpipe {

namespace {
std::atomic<uint64_t> g_beats{0};
}  // namespace

void heartbeat() { g_beats.fetch_add(1, std::memory_order_relaxed); }
uint64_t heartbeat_count() { return g_beats.load(std::memory_order_relaxed); }

HeartbeatWriter::HeartbeatWriter(std::string path, double period_s) : path_(std::move(path)), period_s_(period_s) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error("cannot write the heartbeat file '" + path_ + "': " + std::strerror(errno));
  uint64_t last = heartbeat_count();
  write(last);
  thread_ = std::thread([this, last]() mutable {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::duration<double>(period_s_), [this] { return stop_; })) {
      const uint64_t now = heartbeat_count();
      if (now != last) write(last = now);
    }
  });
}

HeartbeatWriter::~HeartbeatWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  ::close(fd_);
}

void HeartbeatWriter::write(uint64_t count) {
  // "COUNT PID HOST": one short pwrite at offset 0, the count padded to a fixed width so no
  // stale digits remain. The supervisor compares counts, and kills PID when it is local.
  char host[128] = "?";
  ::gethostname(host, sizeof host - 1);
  char buf[192];
  const int n = std::snprintf(buf, sizeof buf, "%020llu %d %s\n", static_cast<unsigned long long>(count),
                              static_cast<int>(::getpid()), host);
  (void)!::pwrite(fd_, buf, static_cast<size_t>(n), 0);
}

}  // namespace gpipe
