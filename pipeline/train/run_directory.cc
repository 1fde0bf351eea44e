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
#include <map>
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

// A path made absolute, with the symbolic links of its existing part resolved, so that two
// names of one folder compare equal.
fs::path normal(const std::string& p) {
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : real.lexically_normal();
}

// "a" is "b" itself or lies under it (both as normal() makes them).

bool is_within(const fs::path& a, const fs::path& b) {
  const fs::path x = normal(a.string()), y = normal(b.string());
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


// The run id report.json in `dir` names; "" when none does.
std::string report_run_id(const std::string& dir) {
  try {
    const json r = json::parse(read_file(dir + "/report.json"));
    if (r.is_object() && r.contains("run_id") && r["run_id"].is_string()) return r["run_id"].get<std::string>();
  } catch (const std::exception&) {
  }
  return "";
}

// The run a folder belongs to by its record, else by its report; "" when neither names one.
std::string recorded_run_id(const std::string& dir) {
  if (const auto record = read_run_record(dir)) return record->run_id;
  return report_run_id(dir);
}

// The nearest folder at or above `from` whose run.json (or report.json) names a run, with
// that run; an empty id when none does.
std::pair<fs::path, std::string> enclosing_run(const fs::path& from) {
  for (fs::path dir = from; !dir.empty(); dir = dir.parent_path()) {
    std::string id = recorded_run_id(dir.string());
    if (!id.empty()) return {dir, std::move(id)};
    if (dir == dir.root_path()) break;
  }
  return {};
}

// Writes <dir>/run.json for `run`; true when there was none before.
bool write_run_record(const std::string& dir, const ClaimedRun& run) {
  const std::string path = dir + "/" + kRunRecordFile;
  json j = {{"run_id", run.run_id}, {"created", utc_now("%Y-%m-%d %H:%M:%S UTC")}};
  std::error_code ec;
  const bool existed = fs::exists(path, ec);
  if (existed) {
    try {  // the same run claims its folder again: it keeps its date of birth
      const json old = json::parse(read_file(path));
      if (old.value("run_id", std::string()) == run.run_id && old.contains("created")) j["created"] = old["created"];
    } catch (const std::exception&) {
    }
  }
  if (!run.parent.is_null()) j["parent"] = run.parent;
  fs::create_directories(dir, ec);
  write_file_atomically(path, j.dump(2) + "\n");
  return !existed;
}

// Step directories (complete or torn) of `dir` that belong to a run other than `run_id`,
// as "path (run X)"; a step that names no run counts as the folder's.
std::vector<std::pair<std::string, std::string>> foreign_steps(const std::string& dir, const std::string& run_id) {
  std::vector<std::pair<std::string, std::string>> out;
  const CheckpointListing listing = list_checkpoints(dir);
  for (const auto* list : {&listing.complete, &listing.incomplete}) {
    for (const CheckpointRef& c : *list) {
      if (!belongs_to_run(c.path, run_id)) out.push_back({c.path, checkpoint_run_id(c.path)});
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Another run's step directories in this run's checkpoint folder: refused, naming each and
// its run, with how to move them. `doing` says what was asked ("--resume continues run X").
void refuse_foreign_steps(const std::string& dir, const std::string& run_id, const std::string& doing) {
  const auto foreign = foreign_steps(dir, run_id);
  if (foreign.empty()) return;
  std::string listed;
  for (size_t i = 0; i < foreign.size() && i < 4; ++i) {
    listed += (i ? ", " : "") + foreign[i].first + " (run " + foreign[i].second + ")";
  }
  if (foreign.size() > 4) listed += " and " + std::to_string(foreign.size() - 4) + " more";
  const std::string& first = foreign.front().first;
  throw UserError(dir + " holds checkpoints of another run: " + listed + ". " + doing + " (run " +
                  (run_id.empty() ? std::string("?") : run_id) + "), and gpipe never resumes, deletes or overwrites "
                  "another run's checkpoint. Move them out of the folder (e.g. mv " + shell_quote(first) +
                  " <elsewhere>), then run this again; to go on from one of them as a new run, fork it into a fresh "
                  "directory: --set checkpoint.resume=<its new path> --set output.dir=<a new folder>");
}

// A checkpoint.dir outside output.dir must not be another run's folder, nor lie inside one
// (its run.json or report.json names another run than `run_id`).
void refuse_anothers_checkpoint_dir(const Config& config, const std::string& run_id) {
  const fs::path ck = normal(checkpoint_dir(config));
  if (is_within(ck, config.output.dir)) return;
  const auto [dir, theirs] = enclosing_run(ck);
  if (!theirs.empty() && theirs != run_id) {
    throw UserError("checkpoint.dir " + checkpoint_dir(config) + (dir == ck ? " is" : " lies inside " + dir.string() +
                    ", which is") + " the folder of another run (" + theirs + "); a run keeps its checkpoints in a "
                    "folder of its own. Set checkpoint.dir elsewhere (or leave it out: <output.dir>/checkpoints)");
  }
}

// The last step report.json in `dir` holds; 0 when there is none.
int64_t reported_steps(const std::string& dir) {
  try {
    const json r = json::parse(read_file(dir + "/report.json"));
    int64_t last = 0;
    for (const json& s : r.at("steps")) last = std::max<int64_t>(last, s.at("step").get<int64_t>());
    return last;
  } catch (const std::exception&) {
    return 0;
  }
}

// An output.dir that holds step directories itself (another run's checkpoint.dir), or that
// is no run's folder of its own and lies inside a folder that names a run (say another
// run's <output.dir>/checkpoints): refused. A folder with a record, a report or checkpoints
// of its own is a run's own (<output.dir>/previous/<run>/ is one, resumed where
// --start-over moved it).
void refuse_anothers_output_dir(const Config& config, bool has_record) {
  const std::string& out = config.output.dir;
  const fs::path mine = normal(out), ck = normal(checkpoint_dir(config));
  if (mine != ck) {
    const CheckpointListing steps = list_checkpoints(out);
    if (!steps.complete.empty() || !steps.incomplete.empty()) {
      const std::string& first = (steps.complete.empty() ? steps.incomplete : steps.complete).front().path;
      const std::string theirs = checkpoint_run_id(first);
      throw UserError("output.dir " + out + " holds checkpoints itself (" + first + ", of run " +
                      (theirs.empty() ? std::string("?") : theirs) + "): it is a run's checkpoint folder, not an "
                      "output folder. Give this run a folder of its own (--set output.dir=...)");
    }
  }
  // A run's own folder: its record, or (written before run.json) its report or checkpoints.
  const CheckpointListing own = list_checkpoints(checkpoint_dir(config));
  std::error_code ec;
  if (has_record || fs::exists(out + "/report.json", ec) || !own.complete.empty() || !own.incomplete.empty()) return;
  const auto [dir, theirs] = enclosing_run(mine.parent_path());
  if (!theirs.empty()) {
    throw UserError("output.dir " + out + " lies inside " + dir.string() + ", the folder of run " + theirs +
                    "; a run writes into a folder of its own. Give it one outside (--set output.dir=...)");
  }
}

int64_t step_of(const std::string& step_dir) {
  try {
    const json st = json::parse(read_file(step_dir + "/trainer_state.json"));
    if (st.contains("step") && st["step"].is_number_integer()) return st["step"].get<int64_t>();
  } catch (const std::exception&) {
  }
  return -1;
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

DirectoryLock::DirectoryLock(const std::vector<std::string>& dirs, const std::string& run_id, bool supervisor) {
  try {
    for (const std::string& dir : dirs) {
      std::error_code ec;
      // symlink_status: a dangling link on the way is the user's, not a folder to make.
      for (fs::path p = fs::absolute(dir, ec); !p.empty() && !fs::exists(fs::symlink_status(p, ec));
           p = p.parent_path()) {
        created_dirs_.push_back(p.string());
        if (p == p.parent_path()) break;
      }
      fs::create_directories(dir, ec);
      if (ec) throw UserError("cannot create '" + dir + "': " + ec.message() + "; choose another folder (output.dir, or checkpoint.dir where you set it)");
      const std::string path = dir + "/" + kLockFile;
      bool existed = true;  // unknown counts as found: abandon() never removes what it did not make
      int fd = -1;
      int flocked = -1;
      // A lock file can be removed by a refused launch (abandon) between our open and our
      // flock: a lock taken on a name that is gone, or that names another file now, is no
      // lock; take it again on the file the name holds.
      for (int attempt = 0; attempt < 100; ++attempt) {
        std::error_code exists_ec;
        existed = fs::exists(path, exists_ec) || exists_ec;
        fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) {
          throw UserError("cannot open the lock file '" + path + "': " + std::strerror(errno) +
                          "; is the directory writable? choose another folder (output.dir, or checkpoint.dir where you set it)");
        }
        flocked = ::flock(fd, LOCK_EX | LOCK_NB);
        if (flocked != 0) break;
        struct stat held {}, named {};
        if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
            held.st_ino == named.st_ino) {
          break;
        }
        ::close(fd);
        fd = -1;
        fs::create_directories(dir, ec);  // the refused launch may have removed the folder too
      }
      if (fd < 0) throw UserError("cannot lock '" + path + "': its lock file keeps being replaced; try again");
      if (flocked != 0) {
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
        if (err == EWOULDBLOCK && !supervisor && h.is_object() && !run_id.empty() &&
            h.value("run_id", std::string()) == run_id && h.value("supervisor", false)) {
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
                        "end, or give this run folders of its own (--set output.dir=..., and checkpoint.dir where you "
                        "set it)");
      }
      Held held{fd, path, !existed, ""};
      if (existed) {
        try {
          held.previous = read_file(path);
        } catch (const Error&) {
        }
      }
      held_.push_back(held);
      char host[256] = "?";
      ::gethostname(host, sizeof host - 1);
      const std::string text = json{{"pid", ::getpid()},
                                    {"run_id", run_id},
                                    {"started", utc_now("%Y-%m-%d %H:%M:%S UTC")},
                                    {"host", host},
                                    {"command", own_command()},
                                    {"supervisor", supervisor}}
                                   .dump() +
                               "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
        spdlog::warn("could not write the holder into {}: {}", path, std::strerror(errno));
      }
    }
  } catch (...) {
    abandon();
    throw;
  }
}

DirectoryLock::~DirectoryLock() {
  for (const Held& h : held_) ::close(h.fd);  // closing the last descriptor releases the flock
}

void DirectoryLock::abandon() noexcept {
  for (Held& h : held_) {
    if (h.created) {
      ::unlink(h.path.c_str());  // while locked; whoever locks it after sees the name gone and retries
    } else if (::ftruncate(h.fd, 0) != 0 ||
               ::pwrite(h.fd, h.previous.data(), h.previous.size(), 0) != static_cast<ssize_t>(h.previous.size())) {
      spdlog::warn("could not put back the earlier holder of {}: {}", h.path, std::strerror(errno));
    }
    ::close(h.fd);
  }
  held_.clear();
  // The deepest first (a longer path), so that a folder made inside another made one goes
  // before it.
  std::sort(created_dirs_.begin(), created_dirs_.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  for (const std::string& d : created_dirs_) {
    std::error_code ec;
    fs::remove(d, ec);  // only while empty: a directory never holds anything of another's here
  }
  created_dirs_.clear();
}

std::vector<std::string> run_directories(const Config& config) {
  std::vector<std::string> dirs = {config.output.dir, checkpoint_dir(config)};
  const auto by_path = [](const std::string& a, const std::string& b) { return normal(a) < normal(b); };
  std::sort(dirs.begin(), dirs.end(), by_path);
  dirs.erase(std::unique(dirs.begin(), dirs.end(), [](const std::string& a, const std::string& b) {
               return normal(a) == normal(b);
             }),
             dirs.end());
  return dirs;
}

std::optional<RunRecord> read_run_record(const std::string& dir) {
  const std::string path = dir + "/" + kRunRecordFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  json j;
  try {
    j = json::parse(read_file(path));
  } catch (const std::exception& e) {
    throw UserError(path + " (the record of the run this folder belongs to) cannot be read: " + e.what() +
                    "; restore it, or delete it: the folder's run is then read from its report.json and checkpoints");
  }
  if (!j.is_object() || !j.contains("run_id") || !j["run_id"].is_string() || j["run_id"].get<std::string>().empty()) {
    throw UserError(path + " (the record of the run this folder belongs to) has no run_id: " + j.dump() +
                    "; restore it, or delete it: the folder's run is then read from its report.json and checkpoints");
  }
  RunRecord r;
  r.run_id = j["run_id"].get<std::string>();
  if (j.contains("parent")) r.parent = j["parent"];
  return r;
}

std::string folder_run_id(const Config& config) {
  const std::string id = recorded_run_id(config.output.dir);
  if (!id.empty()) return id;
  // A checkpoint.dir outside output.dir that is a run's folder or lies in one says that
  // run, which need not be this folder's (refuse_anothers_checkpoint_dir).
  const std::string ck = checkpoint_dir(config);
  if (!is_within(ck, config.output.dir) && !enclosing_run(normal(ck)).second.empty()) return "";
  // A folder written before run.json existed: its checkpoints' run, when they name one.
  const CheckpointListing listing = list_checkpoints(ck);
  std::map<std::string, std::vector<std::string>> runs;
  for (const auto* list : {&listing.complete, &listing.incomplete}) {
    for (const CheckpointRef& c : *list) {
      const std::string theirs = checkpoint_run_id(c.path);
      if (!theirs.empty()) runs[theirs].push_back(fs::path(c.path).filename().string());
    }
  }
  if (runs.size() > 1) {
    std::string listed;
    for (const auto& [run, steps] : runs) {
      listed += (listed.empty() ? "" : "; ") + std::string("run ") + run + ": ";
      for (size_t i = 0; i < steps.size(); ++i) listed += (i ? ", " : "") + steps[i];
    }
    throw UserError(ck + " holds checkpoints of more than one run (" + listed + ") and " + config.output.dir +
                    " has no run.json or report.json saying whose folder it is. Move the steps that are not this "
                    "folder's run out of it (mv " + ck + "/step-N <elsewhere>), then run this again");
  }
  return runs.empty() ? "" : runs.begin()->first;
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
  for (const std::string& dir : {config.output.dir, ck}) {
    const std::string p = dir + "/" + kRunRecordFile;
    if (fs::exists(p, ec) && std::find(prior.records.begin(), prior.records.end(), p) == prior.records.end()) {
      prior.records.push_back(p);
    }
  }
  prior.run_id = folder_run_id(config);
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
  std::vector<std::string> moved = prior.found();
  moved.insert(moved.end(), prior.records.begin(), prior.records.end());
  for (const std::string& p : moved) {
    const fs::path from(p);
    const bool report = std::find(prior.reports.begin(), prior.reports.end(), p) != prior.reports.end() ||
                        p == config.output.dir + "/" + kRunRecordFile;
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

namespace {

// A fresh run (no checkpoint.resume) where `prior` was found: refused, or with
// --start-over that run's own files moved aside.
void claim_for_fresh_run(const Config& config, const PriorRun& prior) {
  if (config.run.start_over) {
    refuse_foreign_steps(checkpoint_dir(config), prior.run_id,
                         "--start-over moves the folder's own run aside");
    const std::string to = move_prior_run_aside(config, prior);
    spdlog::warn("--start-over: the earlier run{} in {} ({} report file(s), {} checkpoint entries) was moved to {}",
                 prior.run_id.empty() ? "" : " " + prior.run_id, config.output.dir, prior.reports.size(),
                 prior.checkpoints.size(), to);
    return;
  }
  const std::vector<std::string> found = prior.found();
  std::string listed;
  for (size_t i = 0; i < found.size() && i < 4; ++i) listed += (i ? ", " : "") + found[i];
  if (found.size() > 4) listed += " and " + std::to_string(found.size() - 4) + " more";
  throw UserError(config.output.dir + " holds another run" +
                  (prior.run_id.empty() ? std::string() : " (" + prior.run_id + ")") + ": " + listed +
                  ". A new run there would mix with it. " +
                  (prior.checkpoints.empty() ? std::string() : "Continue that run with --resume, ") +
                  "give this one another directory (--set output.dir=...), or add --start-over to move the earlier "
                  "run to " + config.output.dir + "/previous/ and start afresh");
}

}  // namespace

bool names_fork_parent(const json& parent, const std::string& path) {
  if (!parent.is_object() || !parent.contains("checkpoint") || !parent["checkpoint"].is_string()) return false;
  const fs::path step_dir = normal(parent["checkpoint"].get<std::string>());
  const fs::path given = normal(path);
  return given == step_dir || given == step_dir.parent_path();
}

std::string resume_step_dir(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw UserError("checkpoint '" + path + "' does not exist or is not a directory (checkpoint.resume); give a "
                    "checkpoint's step directory (<checkpoint.dir>/step-N) or its checkpoints folder");
  }
  if (fs::exists(path + "/trainer_state.json", ec) || fs::exists(path + "/COMPLETE", ec)) return path;
  const CheckpointListing listing = list_checkpoints(path);
  if (listing.complete.empty() && listing.incomplete.empty()) return path;  // load_checkpoint names what is missing
  if (const auto latest = find_latest_complete(path)) return latest->path;
  throw UserError("checkpoint.resume=" + path + " holds no complete checkpoint (only interrupted saves); give "
                  "another step directory");
}

ClaimedRun claim_directories(const Config& config, bool record_it) {
  const std::string ck = checkpoint_dir(config);
  const std::optional<RunRecord> record = read_run_record(config.output.dir);
  const std::optional<PriorRun> prior = find_prior_run(config);
  const std::string owner = folder_run_id(config);
  const std::string& resume = config.checkpoint.resume;
  const bool fresh_folder = !record && !prior;
  ClaimedRun run{config.run.id, nullptr};
  // gpipe run names the run its launches continue: the folder must be that run's.
  if (config.run.id_given && !fresh_folder && !owner.empty() && owner != config.run.id && !resume.empty()) {
    throw UserError(config.output.dir + " belongs to run " + owner + ", not to this run " + config.run.id +
                    ": a job resumes only its own checkpoints. Continue that run with --resume (without --run-id), "
                    "or give this one another output.dir");
  }
  // Before anything is moved or written: an output.dir or a checkpoint.dir that is another
  // run's folder.
  refuse_anothers_output_dir(config, record.has_value());
  refuse_anothers_checkpoint_dir(config, owner.empty() ? config.run.id : owner);
  if (resume.empty()) {
    if (prior && !(config.run.start_over && !record_it)) claim_for_fresh_run(config, *prior);
  } else if (resume == "auto") {
    if (prior && prior->checkpoints.empty()) {
      // Its reports with no checkpoint would be overwritten by a run that starts at step 0.
      const int64_t reported = reported_steps(config.output.dir);
      if (reported > 0 && reported >= config.train.steps) {
        throw UserError(config.output.dir + " holds a finished run (its report.json covers all " +
                        std::to_string(reported) + " steps) that saved no checkpoint, so there is nothing to continue. "
                        "To train on from where a run ends, give it checkpoint.every (it then saves its last step); "
                        "to run this config again, give another directory (--set output.dir=...) or add --start-over "
                        "(the earlier run moves to " + config.output.dir + "/previous/)");
      }
      throw UserError(config.output.dir + " holds another run's reports (" + prior->reports.front() +
                      ") but no checkpoint to resume from (it saved none: checkpoint.every was 0 and it was not "
                      "stopped by a signal). Start a new run there with --start-over (the earlier one moves to " +
                      config.output.dir + "/previous/), or give this one another directory (--set output.dir=...)");
    }
    if (!owner.empty()) run.run_id = owner;
    if (record) run.parent = record->parent;
    refuse_foreign_steps(ck, run.run_id, "--resume continues the run this folder belongs to");
  } else if (record && names_fork_parent(record->parent, resume)) {
    // A fork resumed with the checkpoint.resume it was forked with (its continue command,
    // gpipe run's restarts): the fork goes on, from its own newest checkpoint, else its
    // parent's step, whatever that path holds now.
    run.run_id = record->run_id;
    run.parent = record->parent;
    refuse_foreign_steps(ck, run.run_id, "Resuming continues the fork this folder belongs to");
  } else {
    const std::string step_dir = resume_step_dir(resume);
    const std::string theirs = checkpoint_run_id(step_dir);
    if (fresh_folder) {
      if (!theirs.empty() && theirs == run.run_id) {
        run.parent = nullptr;  // its own checkpoint, copied elsewhere: the same run goes on here
      } else {
        run.parent = {{"run_id", theirs}, {"step", step_of(step_dir)}, {"checkpoint", normal(step_dir).string()}};
        spdlog::info("forking run {} at step {} ({}) into a new run {} in {}", theirs.empty() ? "?" : theirs,
                     step_of(step_dir), step_dir, run.run_id, config.output.dir);
      }
    } else if (!theirs.empty() && theirs == owner) {
      run.run_id = owner;  // the folder's own run, from a checkpoint named by its path
      if (record) run.parent = record->parent;
      refuse_foreign_steps(ck, owner, "Resuming " + step_dir + " continues the run this folder belongs to");
    } else {
      throw UserError("checkpoint " + step_dir + " belongs to run " + (theirs.empty() ? "?" : theirs) + ", but " +
                      config.output.dir + " holds run " + (owner.empty() ? "?" : owner) +
                      (prior ? " (" + prior->found().front() + (prior->found().size() > 1 ? ", ..." : "") + ")" : "") +
                      ": resuming it there would mix the two runs. To go on from it as a new run (a fork that records "
                      "its parent), give a fresh directory: --set output.dir=<a new folder>; to continue " +
                      config.output.dir + "'s own run, drop checkpoint.resume and use --resume");
    }
  }
  if (!record_it) return run;
  if (write_run_record(config.output.dir, run)) run.created_records.push_back(config.output.dir + "/" + kRunRecordFile);
  if (!is_within(ck, config.output.dir) && write_run_record(ck, run)) {
    run.created_records.push_back(ck + "/" + kRunRecordFile);
  }
  return run;
}

ClaimedRun claimed_run(const Config& config) {
  const auto record = read_run_record(config.output.dir);
  if (!record) {
    throw UserError(config.output.dir + "/" + kRunRecordFile + " is missing: the folder was not claimed by this "
                    "run's first process (was it removed while the run started?); run the command again");
  }
  return {record->run_id, record->parent};
}

void remove_torn_saves(const std::string& dir, const std::string& run_id) {
  for (const CheckpointRef& c : list_checkpoints(dir).incomplete) {
    if (!belongs_to_run(c.path, run_id)) continue;
    std::error_code ec;
    fs::remove_all(c.path, ec);
    if (ec) {
      spdlog::warn("could not remove {}, an interrupted save of this run: {}", c.path, ec.message());
    } else {
      spdlog::info("removed {}, an interrupted save of this run (it was never complete)", c.path);
    }
  }
}

int checkpoints_to_fit(const std::string& dir, const std::string& run_id, int64_t saves) {
  if (saves <= 0) return 0;
  int own = 0;
  for (const CheckpointRef& c : list_checkpoints(dir).complete) own += belongs_to_run(c.path, run_id);
  return static_cast<int>(std::min<int64_t>(saves, own > 0 ? 1 : 2));
}

void check_checkpoint_room(const std::string& dir, int64_t checkpoint_bytes, int count) {
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
  if (free_bytes < checkpoint_bytes * count) {
    auto mb = [](int64_t b) {  // rounded up, so that what it says is enough is
      return b < 1000000 ? std::to_string((b + 999) / 1000) + " kB" : std::to_string((b + 999999) / 1000000) + " MB";
    };
    const CheckpointListing listing = list_checkpoints(dir);
    std::string held;
    if (!listing.complete.empty()) {
      held = " It holds " + std::to_string(listing.complete.size()) + " complete checkpoint(s) (" +
             listing.complete.front().path + (listing.complete.size() > 1 ? " to " + listing.complete.back().path : "") +
             "); delete those you no longer need, keeping the newest, which a resume reads.";
    }
    throw UserError("the checkpoint folder '" + dir + "' has " + mb(free_bytes) + " free but a checkpoint of this "
                    "model needs " + mb(checkpoint_bytes) + " (weights and optimizer state), and this run needs room "
                    "for " + (count == 1 ? std::string("one more") : std::to_string(count) + ", " +
                    mb(checkpoint_bytes * count)) + " (the newest checkpoint is deleted only after the next one is "
                    "complete, so both must fit)." + held + " Free space there, or set checkpoint.dir elsewhere");
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
