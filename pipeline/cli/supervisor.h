// The restart loop of `gpipe run`: starts the training job as a child process (this
// binary's `train`, or `mpirun -np P` of it), and when the job fails relaunches it with
// --resume, so the trainer goes on from the newest complete checkpoint, up to a number of
// times; what torchrun --max-restarts gives PyTorch users. The supervisor does not train,
// load or decide anything about checkpoints: it relaunches, and says from which step the
// next launch will resume (find_latest_complete).
//
// The CLI calls it as:
//   SupervisorOptions o;
//   o.program = std::filesystem::read_symlink("/proc/self/exe");  // resolved: mpirun
//                                          // would read /proc/self/exe as itself
//   o.config = config_path; o.overrides = the --set values;
//   o.processes = P (--np); o.max_restarts = N (--max-restarts);
//   o.checkpoint_dir = the config's checkpoint folder (for the log line);
//   return supervise(o);                   // the exit status of `gpipe run`
#pragma once

#include <string>
#include <vector>

namespace gpipe {
namespace pipeline {

struct SupervisorOptions {
  std::string program;                 // the gpipe binary
  std::string config;                  // CONFIG.yaml
  std::vector<std::string> overrides;  // "key=value", passed on as --set key=value
  int processes = 1;                   // P > 1: mpirun -np P
  int max_restarts = 3;                // relaunches after failures; 0: run once
  std::string checkpoint_dir;          // where the trainer saves; empty: the log line names no step
  bool resume_first = false;           // --resume on the first launch too (e.g. a requeued job)
  double restart_delay_s = 1.0;        // pause before a relaunch
  std::string mpirun = "mpirun";
  // Added after `mpirun -np P`; --allow-run-as-root is added for root, --oversubscribe
  // when P exceeds this machine's cores (README: across processes and nodes).
  std::vector<std::string> mpirun_args;
  // Exit statuses that mean the job refused its input (gpipe exits 2 on a user error: a
  // bad config, a checkpoint that does not fit, a full or read-only disk): a relaunch
  // would fail the same way.
  std::vector<int> no_restart_exit_codes = {2};
  // The run every launch belongs to (--run-id): a launch resumes only this run's checkpoints.
  std::string run_id;
  bool start_over = false;  // --start-over on the first launch
  // Liveness: each launch writes its processes' progress under heartbeat_dir/launch-N
  // (--heartbeat, runtime/heartbeat.h); a process whose count stays the same for
  // stall_s seconds is killed (with the rest of its job) and the job restarted like any
  // failure. 0 or no directory: not watched.
  std::string heartbeat_dir;
  double stall_s = 0;
  // Printed when a signal stops the job: the command that continues it.
  std::string resume_hint;
};

// The argv of launch `launch_no` (0-based): [mpirun -np P ARGS...] PROGRAM train CONFIG
// [--set K=V]... [--run-id ID] [--heartbeat DIR] [--start-over | --resume]
std::vector<std::string> child_command(const SupervisorOptions& options, bool resume, int launch_no = 0);

// Runs the job until it succeeds (returns 0), fails max_restarts + 1 times, fails with a
// no-restart status, or is stopped by SIGINT, SIGTERM or SIGHUP, which are forwarded to
// the job and end the restarts (SIGUSR1 is forwarded and ends nothing: a save on demand).
// Otherwise returns the last launch's exit status (128 + N for a job killed by signal N),
// never 0. Logs one line per relaunch: what failed and from which checkpoint step it
// resumes. Throws UserError when the program cannot be started at all.
int supervise(const SupervisorOptions& options);

// "exit status 3", "killed by signal 9 (Killed)": a waitpid status in words.
std::string describe_wait_status(int status);

}  // namespace pipeline
}  // namespace gpipe
