#include "runtime/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <memory>

namespace gpipe {

namespace {
thread_local int t_rank = -1;
thread_local int t_stage = -1;

// %* in the pattern: the rank and stage of the logging thread.
class ContextFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string s = thread_context_str();
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<ContextFlag>(); }
};
}  // namespace

void set_thread_context(int rank, int stage) {
  t_rank = rank;
  t_stage = stage;
}
int thread_rank() { return t_rank; }
int thread_stage() { return t_stage; }

std::string thread_context_str() {
  std::string s = "r" + (t_rank < 0 ? std::string("0") : std::to_string(t_rank));
  s += " s" + (t_stage < 0 ? std::string("-") : std::to_string(t_stage));
  return s;
}

void init_logging(const std::string& level) {
  static std::once_flag once;
  std::call_once(once, [] {
    auto logger = spdlog::stderr_color_mt("gpipe");
    spdlog::set_default_logger(logger);
  });
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<ContextFlag>('*').set_pattern("[%H:%M:%S.%e] [%^%l%$] [%*] %v");
  spdlog::set_formatter(std::move(formatter));
  spdlog::set_level(spdlog::level::from_str(level));
}

}  // namespace gpipe
