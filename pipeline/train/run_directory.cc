#include "pipeline/train/run_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "pipeline/checkpoint/checkpoint.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kLockFile = ".gpipe.lock";
constexpr const char* kReports[] = {"report.json", "report.html", "trace.json"};

std::string utc_now(const char* format) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

// "a" is "b" itself or lies under it (both made absolute and normal).
bool is_within(const fs::path& a, const fs::path& b) {
  const fs::path x = fs::absolute(a).lexically_normal(), y = fs::absolute(b).lexically_normal();
  auto xi = x.begin(), yi = y.begin();
  for (; yi != y.end(); ++xi, ++yi) {
    if (yi->empty()) continue;  // a trailing separator
    if (xi == x.end() || *xi != *yi) return false;
  }
  return true;
}

std::string own_command() {
  std::string cmd;
  try {
    cmd = read_file("/proc/self/cmdline");
  } catch (const Error&) {
    return "?";
  }
  std::replace(cmd.begin(), cmd.end(), '\0', ' ');
  while (!cmd.empty() && cmd.back() == ' ') cmd.pop_back();
  return cmd;
}

// The run id a checkpoint folder or a report names, "" when none does.
std::string run_id_in(const std::string& output_dir, const std::string& checkpoint_dir) {
  const CheckpointListing listing = list_checkpoints(checkpoint_dir);
  for (auto it = listing.complete.rbegin(); it != listing.complete.rend(); ++it) {
    try {
      const json st = json::parse(read_file(it->path + "/trainer_state.json"));
      if (st.contains("run_id") && st["run_id"].is_string()) return st["run_id"].get<std::string>();
    } catch (const std::exception&) {
    }
  }
  try {
    const json r = json::parse(read_file(output_dir + "/report.json"));
    if (r.contains("run_id") && r["run_id"].is_string()) return r["run_id"].get<std::string>();
  } catch (const std::exception&) {
  }
  return "";
}

}  // namespace

std::string new_run_id() {
  std::random_device rd;
  const uint32_t r = rd() ^ static_cast<uint32_t>(::getpid() * 2654435761u) ^
                     static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", r);
  return utc_now("%Y%m%d-%H%M%S-") + buf;
}

json run_identity(const Config& c) {
  const layers::OptimizerConfig& o = c.optimizer.optimizer;
  const DataConfig& d = c.data;
  return {{"model.seed", c.model.seed},
          {"model.dtype", dtype_name(c.model.dtype)},
          {"data.type", d.type},
          {"data.path", d.path},
          {"data.seq_len", d.seq_len},
          {"data.vocab", d.vocab},
          {"data.validation_fraction", d.validation_fraction},
          {"data.classes", d.classes},
          {"data.teacher_hidden", d.teacher_hidden},
          {"data.teacher_scale", d.teacher_scale},
          {"data.seed", d.seed},
          {"optimizer.type", o.type},
          {"optimizer.lr", o.lr},
          {"optimizer.weight_decay", o.weight_decay},
          {"optimizer.momentum", o.momentum},
          {"optimizer.nesterov", o.nesterov},
          {"optimizer.betas", {o.beta1, o.beta2}},
          {"optimizer.eps", o.eps},
          {"optimizer.schedule", c.optimizer.schedule},
          {"optimizer.min_lr", c.optimizer.min_lr},
          {"optimizer.clip_grad_norm", c.optimizer.clip_grad_norm},
          {"train.seed", c.train.seed},
          {"train.batch_size", c.train.batch_size}};
}

std::vector<std::string> identity_changes(const json& saved, const json& now, const std::vector<std::string>& allowed) {
  const bool all = std::find(allowed.begin(), allowed.end(), "all") != allowed.end();
  std::vector<std::string> out;
  for (auto it = now.begin(); it != now.end(); ++it) {
    if (all || std::find(allowed.begin(), allowed.end(), it.key()) != allowed.end()) continue;
    const auto was = saved.find(it.key());
    if (was == saved.end()) continue;  // a field older checkpoints did not record
    if (*was != it.value()) out.push_back(it.key() + ": " + was->dump() + " -> " + it.value().dump());
  }
  return out;
}

DirectoryLock::DirectoryLock(const std::vector<std::string>& dirs, const std::string& run_id) {
  for (const std::string& dir : dirs) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw UserError("cannot create '" + dir + "': " + ec.message() + "; choose another output.dir");
    const std::string path = dir + "/" + kLockFile;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw UserError("cannot open the lock file '" + path + "': " + std::strerror(errno) +
                      "; is the directory writable? choose another output.dir");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string holder;
      try {
        holder = read_file(path);
      } catch (const Error&) {
      }
      ::close(fd);
      json h;
      try {
        h = json::parse(holder);
      } catch (const json::exception&) {
      }
      if (err == EWOULDBLOCK && h.is_object() && !run_id.empty() && h.value("run_id", std::string()) == run_id) {
        continue;  // this run's own supervisor holds it for the job
      }
      if (err != EWOULDBLOCK) throw UserError("cannot lock '" + path + "': " + std::strerror(err));
      std::string who = "another process";
      if (h.is_object()) {
        who = "process " + std::to_string(h.value("pid", 0)) + " (run " + h.value("run_id", std::string("?")) +
              ", started " + h.value("started", std::string("?")) + ", on " + h.value("host", std::string("?")) +
              ": " + h.value("command", std::string("?")) + ")";
      }
      throw UserError(dir + " is in use by " + who + "; two runs must not write to one directory. Wait for it to "
                      "end, or give this run another output.dir (--set output.dir=...)");
    }
    char host[256] = "?";
    ::gethostname(host, sizeof host - 1);
    const std::string text = json{{"pid", ::getpid()},
                                  {"run_id", run_id},
                                  {"started", utc_now("%Y-%m-%d %H:%M:%S UTC")},
                                  {"host", host},
                                  {"command", own_command()}}
                                 .dump() +
                             "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
      spdlog::warn("could not write the holder into {}: {}", path, std::strerror(errno));
    }
    fds_.push_back(fd);
  }
}

DirectoryLock::~DirectoryLock() {
  for (int fd : fds_) ::close(fd);  // closing the last descriptor releases the flock
}

std::vector<std::string> run_directories(const Config& config) {
  std::vector<std::string> dirs = {config.output.dir};
  const std::string ck = checkpoint_dir(config);
  if (!is_within(ck, config.output.dir)) dirs.push_back(ck);
  return dirs;
}

std::vector<std::string> PriorRun::found() const {
  std::vector<std::string> all = reports;
  all.insert(all.end(), checkpoints.begin(), checkpoints.end());
  return all;
}

std::optional<PriorRun> find_prior_run(const Config& config) {
  PriorRun prior;
  std::error_code ec;
  for (const char* name : kReports) {
    const std::string p = config.output.dir + "/" + name;
    if (fs::exists(p, ec)) prior.reports.push_back(p);
  }
  const std::string ck = checkpoint_dir(config);
  const CheckpointListing listing = list_checkpoints(ck);
  for (const auto* list : {&listing.complete, &listing.incomplete}) {
    for (const CheckpointRef& c : *list) prior.checkpoints.push_back(c.path);
  }
  if (fs::exists(ck + "/latest", ec)) prior.checkpoints.push_back(ck + "/latest");
  if (prior.reports.empty() && prior.checkpoints.empty()) return std::nullopt;
  prior.run_id = run_id_in(config.output.dir, ck);
  return prior;
}

std::string move_prior_run_aside(const Config& config, const PriorRun& prior) {
  const fs::path previous = fs::path(config.output.dir) / "previous";
  std::string base = prior.run_id.empty() ? "run" : prior.run_id;
  fs::path to = previous / base;
  for (int n = 2; fs::exists(to); ++n) to = previous / (base + "-" + std::to_string(n));
  std::error_code ec;
  fs::create_directories(to / "checkpoints", ec);
  if (ec) throw UserError("cannot create '" + to.string() + "' to move the earlier run aside: " + ec.message());
  const std::string ck = checkpoint_dir(config);
  for (const std::string& p : prior.found()) {
    const bool report = std::find(prior.reports.begin(), prior.reports.end(), p) != prior.reports.end();
    const fs::path from(p);
    const fs::path dest = (report ? to : to / "checkpoints") / from.filename();
    fs::rename(from, dest, ec);
    if (ec) {
      throw UserError("cannot move '" + p + "' to '" + dest.string() + "': " + ec.message() +
                      (ec.value() == EXDEV ? " (another file system); move the earlier run's files away yourself, or "
                                             "give this run another output.dir"
                                           : ""));
    }
  }
  if (fs::is_directory(ck, ec)) fsync_directory(ck);
  fsync_directory(config.output.dir);
  return to.string();
}

void claim_directories(const Config& config) {
  const auto prior = find_prior_run(config);
  if (!prior) return;
  const bool resuming = config.checkpoint.resume == "auto";
  if (resuming) {
    // Its checkpoints are what --resume continues; reports with none would be overwritten
    // by a run that starts from step 0.
    if (!prior->checkpoints.empty()) return;
    throw UserError(config.output.dir + " holds another run's reports (" + prior->reports.front() +
                    ") but no checkpoint to resume from (it saved none: checkpoint.every was 0 and it was not "
                    "stopped by a signal). Start a new run there with --start-over (the earlier one moves to " +
                    config.output.dir + "/previous/), or give this one another directory (--set output.dir=...)");
  }
  if (config.run.start_over) {
    const std::string to = move_prior_run_aside(config, *prior);
    spdlog::warn("--start-over: the earlier run{} in {} ({} report file(s), {} checkpoint entries) was moved to {}",
                 prior->run_id.empty() ? "" : " " + prior->run_id, config.output.dir, prior->reports.size(),
                 prior->checkpoints.size(), to);
    return;
  }
  const std::vector<std::string> found = prior->found();
  std::string listed;
  for (size_t i = 0; i < found.size() && i < 4; ++i) listed += (i ? ", " : "") + found[i];
  if (found.size() > 4) listed += " and " + std::to_string(found.size() - 4) + " more";
  throw UserError(config.output.dir + " holds another run" +
                  (prior->run_id.empty() ? std::string() : " (" + prior->run_id + ")") + ": " + listed +
                  ". A new run there would mix with it. " +
                  (prior->checkpoints.empty() ? std::string() : "Continue that run with --resume, ") +
                  "give this one another directory (--set output.dir=...), or add --start-over to move the earlier "
                  "run to " + config.output.dir + "/previous/ and start afresh");
}

void check_checkpoint_room(const std::string& dir, int64_t checkpoint_bytes) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw UserError("cannot create the checkpoint folder '" + dir + "': " + ec.message() +
                    "; make it writable or set checkpoint.dir (or output.dir) elsewhere");
  }
  const std::string probe = dir + "/.write-test-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw UserError("cannot write in the checkpoint folder '" + dir + "': " + std::strerror(errno) +
                    "; make it writable or set checkpoint.dir (or output.dir) elsewhere");
  }
  ::close(fd);
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return;
  const int64_t free_bytes = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
  if (free_bytes < checkpoint_bytes) {
    auto mb = [](int64_t b) { return std::to_string((b + 999999) / 1000000) + " MB"; };
    throw UserError("the checkpoint folder '" + dir + "' has " + mb(free_bytes) + " free but a checkpoint of this "
                    "model needs " + mb(checkpoint_bytes) + " (weights and optimizer state; older checkpoints are "
                    "deleted only after a new one is complete); free space there, lower checkpoint.keep, or set "
                    "checkpoint.dir elsewhere");
  }
}

std::string shell_quote(const std::string& w) {
  if (!w.empty() && w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,@+%") ==
                        std::string::npos) {
    return w;
  }
  std::string out = "'";
  for (char ch : w) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

}  // namespace pipeline
}  // namespace gpipe
