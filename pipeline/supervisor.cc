#include "pipeline/supervisor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "pipeline/checkpoint.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace pipeline {

namespace {

// The running child and the stop request, shared with the signal handler.
volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_stop_signal = 0;

// SIGINT, SIGTERM and SIGHUP stop the job for good; SIGUSR1 asks it for a checkpoint.
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};

void on_signal(int sig) {
  if (sig != SIGUSR1) g_stop_signal = sig;
  const pid_t child = g_child;
  if (child > 0) ::kill(child, sig);
}

// Installs the forwarding handlers for its lifetime and restores the previous ones.
class SignalForwarding {
 public:
  SignalForwarding() {
    g_child = 0;
    g_stop_signal = 0;
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

int wait_child(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw Error(std::string("waitpid: ") + std::strerror(errno));
  }
  return status;
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
  return "resumes from step " + std::to_string(ref->step) + " (" + ref->path + ")";
}

}  // namespace

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) + ")";
  }
  return "wait status " + std::to_string(status);
}

std::vector<std::string> child_command(const SupervisorOptions& o, bool resume) {
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
  if (resume) argv.push_back("--resume");
  return argv;
}

int supervise(const SupervisorOptions& o) {
  if (o.program.empty()) throw UserError("gpipe run: no program to run");
  if (o.processes < 1) throw UserError("gpipe run: --np must be at least 1, got " + std::to_string(o.processes));
  if (o.max_restarts < 0) {
    throw UserError("gpipe run: --max-restarts must be 0 or more, got " + std::to_string(o.max_restarts));
  }
  SignalForwarding forwarding;
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

  int last = 0;
  for (int launch_no = 0;; ++launch_no) {
    const std::vector<std::string> argv = child_command(o, launch_no > 0 || o.resume_first);
    std::string line;
    for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
    spdlog::info("gpipe run: launch {} of at most {}: {}", launch_no + 1, o.max_restarts + 1, line);
    const pid_t pid = launch(argv, previous);
    g_child = pid;
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);  // a signal from here on reaches the child
    const int status = wait_child(pid);
    ::sigprocmask(SIG_BLOCK, &forwarded, nullptr);
    g_child = 0;
    last = exit_code_of(status);
    if (status == 0 && WIFEXITED(status)) {
      spdlog::info("gpipe run: the job finished{}", launch_no > 0 ? " after " + std::to_string(launch_no) + " restart(s)" : "");
      return 0;
    }
    const std::string what = describe_wait_status(status);
    if (g_stop_signal != 0) {
      spdlog::warn("gpipe run: stopped by signal {} ({}); the job ended with {}; not restarting", int(g_stop_signal),
                   ::strsignal(g_stop_signal), what);
      return last != 0 ? last : 128 + g_stop_signal;
    }
    if (WIFEXITED(status) &&
        std::find(o.no_restart_exit_codes.begin(), o.no_restart_exit_codes.end(), last) != o.no_restart_exit_codes.end()) {
      spdlog::error("gpipe run: the job failed with {}, which means it refused its input (a config or checkpoint "
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
    // The pause before relaunching can be cut short by SIGINT/SIGTERM.
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.restart_delay_s);
    while (g_stop_signal == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::sigprocmask(SIG_BLOCK, &forwarded, nullptr);
    if (g_stop_signal != 0) {
      spdlog::warn("gpipe run: stopped by signal {} before restarting", int(g_stop_signal));
      return last;
    }
  }
}

}  // namespace pipeline
}  // namespace gpipe
