// Routes the default spdlog logger to a string while it lives, so that a test can check
// the warnings and log lines the code under test wrote (header only).
#pragma once

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <sstream>
#include <string>

namespace gpipe {
namespace testing {

class LogCapture {
 public:
  LogCapture() : old_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(os_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  }
  ~LogCapture() { spdlog::set_default_logger(old_); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::string text() const { return os_.str(); }

 private:
  std::ostringstream os_;
  std::shared_ptr<spdlog::logger> old_;
};

}  // namespace testing
}  // namespace gpipe
