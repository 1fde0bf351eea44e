// The supervisor with real child processes (supervisor_test_child): restarts after exit
// statuses and signals, --resume on relaunches, the step it resumes from, giving up
// after --max-restarts, no restart after a user error or a forwarded SIGTERM, mpirun.
#include "pipeline/cli/supervisor.h"

#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "pipeline/checkpoint/checkpoint.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "tests/log_capture.h"
#include "tests/temp_dir.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using gpipe::testing::LogCapture;
using gpipe::testing::TempDir;

namespace {

// The child program is built beside this test (in bazel-bin and in the runfiles).
std::string child_program() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "supervisor_test_child").string();
}

SupervisorOptions options(const TempDir& dir, int failures, const std::string& mode, int max_restarts) {
  SupervisorOptions o;
  o.program = child_program();
  o.config = dir.path();
  o.overrides = {"failures=" + std::to_string(failures), "mode=" + mode};
  o.max_restarts = max_restarts;
  o.restart_delay_s = 0;
  return o;
}

int launches(const TempDir& dir) {
  int n = 0;
  std::ifstream(dir / "count") >> n;
  return n;
}

std::vector<std::string> arg_lines(const TempDir& dir) {
  std::vector<std::string> out;
  std::istringstream in(read_file(dir / "args"));
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// Sends `sig` to this process as a terminal or `kill` would, once the supervisor's child
// has written its pid. gpipe run is one thread, which blocks the signals while it starts a
// child, so a signal arriving then waits until the child is known. Here supervise runs on
// a second thread: the test's thread blocks the signals too, or it could take one in the
// instant between the child's start and the supervisor's noting it, and forward it to
// nobody (the job would then hang).
void signal_supervisor(const TempDir& dir, int sig) {
  pid_t child = 0;
  for (int i = 0; i < 6000 && child == 0; ++i) {
    std::ifstream(dir / "pid") >> child;
    if (child == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(child > 0);
  ::kill(::getpid(), sig);
}

// Blocks the supervisor's signals on this thread for its lifetime (see signal_supervisor).
struct BlockSignalsHere {
  sigset_t old;
  BlockSignalsHere() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGUSR1, SIGHUP}) sigaddset(&set, sig);
    ::pthread_sigmask(SIG_BLOCK, &set, &old);
  }
  ~BlockSignalsHere() { ::pthread_sigmask(SIG_SETMASK, &old, nullptr); }
};

}  // namespace

TEST_CASE("supervisor: a job that fails twice is relaunched with --resume and finishes") {
  TempDir dir;
  // A complete checkpoint at step 5 for the log line to name.
  CheckpointStore(dir / "ckpt").save(5, {ShardTensors{{{"w", step_tensor(1)}}, {}}}, nlohmann::json::object());
  SupervisorOptions o = options(dir, 2, "exit3", 3);
  o.checkpoint_dir = dir / "ckpt";
  LogCapture log;
  CHECK(supervise(o) == 0);
  CHECK(launches(dir) == 3);
  const auto args = arg_lines(dir);
  REQUIRE(args.size() == 3);
  CHECK(args[0] == "train " + dir.path() + " --set failures=2 --set mode=exit3");
  CHECK(args[1] == args[0] + " --resume");
  CHECK(args[2] == args[0] + " --resume");
  const std::string text = log.text();
  CHECK(text.find("the job failed with exit status 3; restart 1 of 3 resumes from step 5 (" + dir / "ckpt/step-5; the launch checks it") !=
        std::string::npos);
  CHECK(text.find("restart 2 of 3 resumes from step 5") != std::string::npos);
  CHECK(text.find("the job finished after 2 restart(s)") != std::string::npos);
}

TEST_CASE("supervisor: a job killed by a signal is restarted; with no checkpoint it starts over") {
  TempDir dir;
  SupervisorOptions o = options(dir, 1, "kill9", 1);
  o.checkpoint_dir = dir / "none";
  LogCapture log;
  CHECK(supervise(o) == 0);
  CHECK(launches(dir) == 2);
  CHECK(log.text().find("failed with killed by signal 9 (Killed); restart 1 of 1 starts over: no complete checkpoint") !=
        std::string::npos);
}

TEST_CASE("supervisor: after max_restarts failures it gives up with the last error") {
  TempDir dir;
  LogCapture log;
  CHECK(supervise(options(dir, 5, "exit3", 2)) == 3);
  CHECK(launches(dir) == 3);
  CHECK(log.text().find("the job failed 3 time(s), the last with exit status 3; giving up (--max-restarts 2)") !=
        std::string::npos);
  TempDir once;
  CHECK(supervise(options(once, 1, "kill9", 0)) == 128 + SIGKILL);
  CHECK(launches(once) == 1);
}

TEST_CASE("supervisor: a user error (exit status 2) is not restarted") {
  TempDir dir;
  LogCapture log;
  CHECK(supervise(options(dir, 1, "exit2", 3)) == 2);
  CHECK(launches(dir) == 1);
  CHECK(log.text().find("refused its input") != std::string::npos);
}

TEST_CASE("supervisor: SIGTERM is forwarded to the job and ends the restarts") {
  TempDir dir;
  int result = -1;
  std::thread runner([&] { result = supervise(options(dir, 3, "hang", 3)); });
  pid_t child = 0;
  {
    BlockSignalsHere blocked;  // after the runner started: it keeps them unblocked
    signal_supervisor(dir, SIGTERM);
    runner.join();
  }
  std::ifstream(dir / "pid") >> child;
  CHECK(result == 128 + SIGTERM);
  CHECK(launches(dir) == 1);
  CHECK(::kill(child, 0) != 0);  // reaped: gone
}

TEST_CASE("supervisor: SIGUSR1 is forwarded to the job and does not end the restarts") {
  TempDir dir;
  int result = -1;
  std::thread runner([&] { result = supervise(options(dir, 1, "hang", 3)); });
  {
    BlockSignalsHere blocked;
    // The hanging child has SIGUSR1's default action (it ends the process), so the job
    // fails with it and is relaunched; the relaunch succeeds.
    signal_supervisor(dir, SIGUSR1);
    runner.join();
  }
  CHECK(result == 0);
  CHECK(launches(dir) == 2);
}

TEST_CASE("supervisor: the command line, mpirun for several processes, and a program that cannot start") {
  SupervisorOptions o;
  o.program = "/bin/gpipe";
  o.config = "c.yaml";
  o.overrides = {"train.steps=3"};
  CHECK(child_command(o, false) == std::vector<std::string>{"/bin/gpipe", "train", "c.yaml", "--set", "train.steps=3"});
  o.processes = 4;
  o.mpirun_args = {"--oversubscribe", "-x", "NCCL_DEBUG=INFO"};
  const auto argv = child_command(o, true);
  CHECK(std::vector<std::string>(argv.begin(), argv.begin() + 3) == std::vector<std::string>{"mpirun", "-np", "4"});
  CHECK(std::count(argv.begin(), argv.end(), "--oversubscribe") == 1);
  CHECK(argv.back() == "--resume");
  CHECK(std::vector<std::string>(argv.end() - 8, argv.end()) ==
        std::vector<std::string>{"-x", "NCCL_DEBUG=INFO", "/bin/gpipe", "train", "c.yaml", "--set", "train.steps=3",
                                 "--resume"});
  // The job's run id goes to every launch; the heartbeat folder is the launch's own;
  // --start-over only to the first launch, which is the only one not resuming.
  o.processes = 1;
  o.run_id = "r1";
  o.heartbeat_dir = "out/.heartbeat";
  o.stall_s = 4;
  o.start_over = true;
  const std::vector<std::string> base = {"/bin/gpipe", "train", "c.yaml", "--set", "train.steps=3", "--run-id", "r1"};
  auto with = [&](std::vector<std::string> tail) {
    std::vector<std::string> v = base;
    v.insert(v.end(), tail.begin(), tail.end());
    return v;
  };
  CHECK(child_command(o, false, 0) == with({"--heartbeat", "out/.heartbeat/launch-1", "--start-over"}));
  CHECK(child_command(o, true, 1) == with({"--heartbeat", "out/.heartbeat/launch-2", "--resume"}));
  o.stall_s = 0;  // not watched: no heartbeat
  CHECK(child_command(o, true, 2) == with({"--resume"}));
  o.program = "/no/such/gpipe";
  CHECK_THROWS_WITH_AS(supervise(o), doctest::Contains("cannot start '/no/such/gpipe': No such file"), UserError);
}

TEST_CASE("supervisor: P > 1 launches the job under mpirun") {
  TempDir dir;
  SupervisorOptions o = options(dir, 0, "exit3", 0);
  o.processes = 2;
  o.mpirun_args = {"--oversubscribe"};
  CHECK(supervise(o) == 0);
  CHECK(arg_lines(dir).size() == 2);  // both ranks ran the job
}
