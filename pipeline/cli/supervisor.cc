#include "pipeline/cli/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "pipeline/checkpoint/checkpoint.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// The running child and the stop requests, shared with the signal handler.
volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_stop_signal = 0;  // the first stop signal
volatile sig_atomic_t g_stops = 0;        // how many came
volatile sig_atomic_t g_under_mpirun = 0;

// SIGINT, SIGTERM and SIGHUP stop the job for good; SIGUSR1 asks it for a checkpoint.
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};

// One process: the signal as it came (the trainer saves and stops on the first, dies on
// the second). mpirun answers SIGINT and SIGTERM by killing its ranks a second or two
// later (odls_base_sigkill_timeout), whatever they are doing, but forwards SIGUSR2: the
// first stop is a SIGUSR2, on which every rank saves and stops; a second is SIGTERM (the
// job ends within about two seconds), a third SIGKILL.
void on_signal(int sig) {
  const pid_t child = g_child;
  if (sig == SIGUSR1) {
    if (child > 0) ::kill(child, sig);
    return;
  }
  if (g_stop_signal == 0) g_stop_signal = sig;
  const int n = ++g_stops;
  if (child <= 0) return;
  if (!g_under_mpirun) {
    ::kill(child, sig);
  } else {
    ::kill(child, n == 1 ? SIGUSR2 : n == 2 ? SIGTERM : SIGKILL);
  }
}

// Installs the forwarding handlers for its lifetime and restores the previous ones.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_child = 0;
    g_stop_signal = 0;
    g_stops = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: waitpid returns EINTR, and we look again
    for (size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &sa, &old_[i]);
  }
  ~SignalForwarding() {
    for (size_t i = 0; i < std::size(kForwarded); ++i) ::sigaction(kForwarded[i], &old_[i], nullptr);
    g_child = 0;
  }

 private:
  struct sigaction old_[std::size(kForwarded)] {};
};

// Forks and execs `argv`; returns the child's pid. The child gets the default signal
// dispositions, its own process group (a Ctrl-C in the terminal reaches the supervisor
// only, which forwards it once: mpirun takes a second SIGINT as "kill at once"), and
// dies with the supervisor (PR_SET_PDEATHSIG). An exec failure comes back through a
// close-on-exec pipe as a UserError here, not as a failed run.
pid_t launch(const std::vector<std::string>& argv, const sigset_t& unblocked) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw Error(std::string("pipe2: ") + std::strerror(errno));
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::close(pipe_fds[0]);
    for (int sig : kForwarded) ::signal(sig, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &unblocked, nullptr);
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);  // the supervisor died before prctl
    ::execvp(args[0], args.data());
    const int err = errno;
    (void)!::write(pipe_fds[1], &err, sizeof err);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so it holds before either side goes on
  ::close(pipe_fds[1]);
  int err = 0;
  ssize_t n;
  while ((n = ::read(pipe_fds[0], &err, sizeof err)) < 0 && errno == EINTR) {
  }
  ::close(pipe_fds[0]);
  if (n == static_cast<ssize_t>(sizeof err)) {
    ::waitpid(pid, nullptr, 0);
    throw UserError("gpipe run: cannot start '" + argv[0] + "': " + std::strerror(err) +
                    (argv[0] == "mpirun" ? " (is OpenMPI installed and on PATH?)" : ""));
  }
  return pid;
}

// The progress files of one launch, watched while it runs: a file whose count has not
// changed for stall_s means a frozen process. Returns its description, or "".
class ProgressWatch {
 public:
  ProgressWatch(std::string dir, double stall_s) : dir_(std::move(dir)), stall_s_(stall_s) {}
  double stall_s() const { return stall_s_; }

  std::string stalled() {
    if (dir_.empty() || stall_s_ <= 0) return "";
    const auto now = std::chrono::steady_clock::now();
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
      std::string text;
      try {
        text = read_file(entry.path().string());
      } catch (const Error&) {
        continue;
      }
      std::istringstream in(text);
      std::string count, host;
      long pid = 0;
      in >> count >> pid >> host;
      if (count.empty()) continue;
      Seen& seen = seen_[entry.path().filename().string()];
      if (seen.count != count) {
        seen = {count, now, static_cast<pid_t>(pid), host};
      } else if (std::chrono::duration<double>(now - seen.since).count() > stall_s_) {
        return entry.path().filename().string() + " (pid " + std::to_string(pid) + " on " + host + ")";
      }
    }
    return "";
  }
  // The watched processes on this host: killed with the job, since a stopped rank may
  // not die with its launcher.
  void kill_local() const {
    char host[128] = "?";
    ::gethostname(host, sizeof host - 1);
    for (const auto& [name, seen] : seen_) {
      if (seen.pid > 0 && seen.host == host) ::kill(seen.pid, SIGKILL);
    }
  }

 private:
  struct Seen {
    std::string count;
    std::chrono::steady_clock::time_point since;
    pid_t pid = 0;
    std::string host;
  };
  std::string dir_;
  double stall_s_;
  std::map<std::string, Seen> seen_;
};

// Waits for the launch; kills it (its process group, and its local processes that write
// progress) when one of them stops making progress, and says so in `stall`.
int wait_child(pid_t pid, ProgressWatch& watch, std::string& stall) {
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) throw Error(std::string("waitpid: ") + std::strerror(errno));
    if (stall.empty()) {
      stall = watch.stalled();
      if (!stall.empty()) {
        spdlog::error("gpipe run: {} made no progress for {:.0f} s (2 x pipeline.timeout_s): killing the job", stall,
                      watch.stall_s());
        watch.kill_local();
        ::kill(-pid, SIGKILL);
        ::kill(pid, SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::string heartbeat_launch_dir(const SupervisorOptions& o, int launch_no) {
  return o.heartbeat_dir + "/launch-" + std::to_string(launch_no + 1);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string resume_point(const std::string& checkpoint_dir) {
  if (checkpoint_dir.empty()) return "resumes from the newest complete checkpoint";
  const auto ref = find_latest_complete(checkpoint_dir);
  if (!ref) return "starts over: no complete checkpoint in " + checkpoint_dir + " yet";
  return "resumes from step " + std::to_string(ref->step) + " (" + ref->path +
         "; the launch checks it and goes back to an older one if it is damaged)";
}

// ---- supervise's pieces. None of them blocks or unblocks a signal, nor sets g_child:
// supervise does that, in its order.

// Refuses options that cannot make a job.
void check_options(const SupervisorOptions& o) {
  if (o.program.empty()) throw UserError("gpipe run: no program to run");
  if (o.processes < 1) throw UserError("gpipe run: --np must be at least 1, got " + std::to_string(o.processes));
  if (o.max_restarts < 0) {
    throw UserError("gpipe run: --max-restarts must be 0 or more, got " + std::to_string(o.max_restarts));
  }
}

// Logs the launch's number and command line.
void log_launch(const SupervisorOptions& o, int launch_no, const std::vector<std::string>& argv) {
  std::string line;
  for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
  spdlog::info("gpipe run: launch {} of at most {}: {}", launch_no + 1, o.max_restarts + 1, line);
}

// The launch's own, empty heartbeat directory (the previous launches' are removed), or ""
// when progress is not watched.
std::string make_heartbeat_dir(const SupervisorOptions& o, int launch_no) {
  std::string watched;
  if (!o.heartbeat_dir.empty() && o.stall_s > 0) {
    watched = heartbeat_launch_dir(o, launch_no);
    std::error_code ec;
    std::filesystem::remove_all(o.heartbeat_dir, ec);  // the previous launches' files
    std::filesystem::create_directories(watched, ec);
    if (ec) throw UserError("gpipe run: cannot create '" + watched + "': " + ec.message());
  }
  return watched;
}

// After a launch ended with `status`: the job's exit code when it is over (finished, stopped
// by a signal, refused its input, or out of restarts), or none when it restarts; says which.
std::optional<int> end_of_launch(const SupervisorOptions& o, int launch_no, int status, const std::string& stall) {
  const int last = exit_code_of(status);
  if (status == 0 && WIFEXITED(status)) {
    spdlog::info("gpipe run: the job finished{}",
                 launch_no > 0 ? " after " + std::to_string(launch_no) + " restart(s)" : "");
    return 0;
  }
  const std::string what = stall.empty() ? describe_wait_status(status) : "no progress from " + stall;
  if (g_stop_signal != 0) {
    spdlog::warn("gpipe run: stopped by signal {} ({}); the job ended with {}; not restarting{}", int(g_stop_signal),
                 ::strsignal(g_stop_signal), what,
                 o.resume_hint.empty() ? std::string() : ". Continue it with: " + o.resume_hint);
    return 128 + g_stop_signal;
  }
  if (WIFEXITED(status) && std::find(o.no_restart_exit_codes.begin(), o.no_restart_exit_codes.end(), last) !=
                               o.no_restart_exit_codes.end()) {
    spdlog::error("gpipe run: the job failed with {}, which means it refused its input (a config, checkpoint or disk "
                  "error, see above); a restart would fail the same way, so there is none",
                  what);
    return last;
  }
  if (launch_no >= o.max_restarts) {
    spdlog::error("gpipe run: the job failed {} time(s), the last with {}; giving up (--max-restarts {})",
                  launch_no + 1, what, o.max_restarts);
    return last;
  }
  spdlog::warn("gpipe run: the job failed with {}; restart {} of {} {}", what, launch_no + 1, o.max_restarts,
               resume_point(o.checkpoint_dir));
  return std::nullopt;
}

// Sleeps for `seconds`, or until a stop signal comes.
void pause_unless_stopped(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (g_stop_signal == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) + ")";
  }
  return "wait status " + std::to_string(status);
}

std::vector<std::string> child_command(const SupervisorOptions& o, bool resume, int launch_no) {
  std::vector<std::string> argv;
  if (o.processes > 1) {
    argv = {o.mpirun, "-np", std::to_string(o.processes)};
    const auto has = [&](const std::string& a) {
      return std::find(o.mpirun_args.begin(), o.mpirun_args.end(), a) != o.mpirun_args.end();
    };
    if (::geteuid() == 0 && !has("--allow-run-as-root")) argv.push_back("--allow-run-as-root");
    if (o.processes > static_cast<int>(std::thread::hardware_concurrency()) && !has("--oversubscribe")) {
      argv.push_back("--oversubscribe");
    }
    argv.insert(argv.end(), o.mpirun_args.begin(), o.mpirun_args.end());
  }
  argv.insert(argv.end(), {o.program, "train", o.config});
  for (const auto& s : o.overrides) argv.insert(argv.end(), {"--set", s});
  if (!o.run_id.empty()) argv.insert(argv.end(), {"--run-id", o.run_id});
  if (!o.heartbeat_dir.empty() && o.stall_s > 0) {
    argv.insert(argv.end(), {"--heartbeat", heartbeat_launch_dir(o, launch_no)});
  }
  if (resume) {
    argv.push_back("--resume");
  } else if (o.start_over && launch_no == 0) {
    argv.push_back("--start-over");
  }
  return argv;
}

int supervise(const SupervisorOptions& o) {
  check_options(o);
  SignalForwarding forwarding;
  g_under_mpirun = o.processes > 1;
  // Signals wait while a child is being started, so none is lost between fork and
  // g_child being set.
  sigset_t forwarded, previous;
  sigemptyset(&forwarded);
  for (int sig : kForwarded) sigaddset(&forwarded, sig);
  ::sigprocmask(SIG_BLOCK, &forwarded, &previous);
  struct Restore {
    sigset_t mask;
    ~Restore() { ::sigprocmask(SIG_SETMASK, &mask, nullptr); }
  } restore{previous};

  // The launches' heartbeat files go with the job.
  struct RemoveHeartbeats {
    std::string dir;
    ~RemoveHeartbeats() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } remove_heartbeats{o.stall_s > 0 ? o.heartbeat_dir : ""};
  int last = 0;
  for (int launch_no = 0;; ++launch_no) {
    const std::vector<std::string> argv = child_command(o, launch_no > 0 || o.resume_first, launch_no);
    log_launch(o, launch_no, argv);
    ProgressWatch watch(make_heartbeat_dir(o, launch_no), o.stall_s);
    std::string stall;
    const pid_t pid = launch(argv, previous);
    g_child = pid;
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);  // a signal from here on reaches the child
    const int status = wait_child(pid, watch, stall);
    ::sigprocmask(SIG_BLOCK, &forwarded, nullptr);
    g_child = 0;
    last = exit_code_of(status);
    if (const std::optional<int> code = end_of_launch(o, launch_no, status, stall)) return *code;
    // The pause before relaunching can be cut short by SIGINT/SIGTERM.
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    pause_unless_stopped(o.restart_delay_s);
    ::sigprocmask(SIG_BLOCK, &forwarded, nullptr);
    if (g_stop_signal != 0) {
      spdlog::warn("gpipe run: stopped by signal {} before restarting", int(g_stop_signal));
      return last;
    }
  }
}

}  // namespace pipeline
}  // namespace gpipe
