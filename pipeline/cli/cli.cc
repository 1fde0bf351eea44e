#include "pipeline/cli/cli.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/cli/mpi_launch.h"
#include "pipeline/cli/plan_commands.h"
#include "pipeline/cli/supervisor.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/plan.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/train/checkpointing.h"
#include "pipeline/train/run_directory.h"
#include "pipeline/train/trainer.h"
#include "runtime/atomic_file.h"
#include "runtime/device_binding.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace cli {

namespace {

constexpr const char* kDefaultConfig = "configs/default.yaml";

// What a command runs with.
struct Invocation {
  std::string program;  // argv[0]'s file name, for messages
  std::string invoked_as;  // how the user started this program (./gpipe through the wrapper), for hints
  std::string command;     // the subcommand
  bool have_config = false;  // a config path was given
  std::string config = kDefaultConfig;
  std::vector<std::string> overrides;  // --set key=value
  std::map<std::string, std::string> options;  // the command's own --flags ("sweep" -> "1", "devices" -> "8")
  pipeline::MpiLaunch* mpi = nullptr;  // set under mpirun
  bool resume = false;                 // --resume: go on from the newest complete checkpoint
  bool start_over = false;             // --start-over: move an earlier run in output.dir aside
  int processes = 1;                   // run --np P
  int max_restarts = 3;                // run --max-restarts N
};

// A subcommand. Adding one is a function and an entry in kCommands.
struct Command {
  const char* name;
  const char* args;     // for the usage text; "" for none
  const char* summary;  // one line
  const char* mpirun;   // how mpirun launches it, or nullptr
  int (*run)(Invocation& inv);
};

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return v.empty() ? "(none)" : out;
}

// The command that continues this run after a stop, as the user can paste it: this
// command with the same config and --set values, and --resume.
std::string continue_command(const Invocation& inv) {
  std::vector<std::string> words;
  if (inv.mpi != nullptr) words = {"mpirun", "-np", std::to_string(inv.mpi->size())};
  words.push_back(inv.invoked_as);
  words.push_back(inv.command);
  if (inv.command == "run" && inv.processes > 1) words.insert(words.end(), {"--np", std::to_string(inv.processes)});
  if (inv.command == "run" && inv.max_restarts != 3) {
    words.insert(words.end(), {"--max-restarts", std::to_string(inv.max_restarts)});
  }
  if (inv.have_config) words.push_back(inv.config);
  for (const auto& o : inv.overrides) words.insert(words.end(), {"--set", o});
  words.push_back("--resume");
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + pipeline::shell_quote(w);
  if (inv.mpi != nullptr) out += "  (with your other mpirun options)";
  return out;
}

void check_start_flags(const Invocation& inv) {
  if (inv.resume && inv.start_over) {
    throw UserError("--resume continues the run in output.dir and --start-over moves it aside: give one of them");
  }
}

int run_train(Invocation& inv) {
  check_start_flags(inv);
  pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  if (inv.resume && config.checkpoint.resume.empty()) config.checkpoint.resume = "auto";
  if (inv.start_over && !config.checkpoint.resume.empty()) {
    throw UserError("--start-over starts a new run, but checkpoint.resume is '" + config.checkpoint.resume +
                    "'; drop one of them");
  }
  config.run.start_over = inv.start_over;
  if (inv.options.count("run-id")) {
    config.run.id = inv.options.at("run-id");
    config.run.id_given = true;
  }
  if (inv.options.count("heartbeat")) config.run.heartbeat_dir = inv.options.at("heartbeat");
  // Launched by `gpipe run` (which names the run): its supervisor prints the hint.
  if (!inv.options.count("run-id")) config.run.resume_command = continue_command(inv);
  if (inv.mpi == nullptr) {
    // This thread moves the weights and evaluates on the stages' GPUs: bound to the
    // first one before any CUDA call, it never makes a context on a GPU no stage uses.
    std::vector<Device> stage_devices;
    for (const std::string& d : config.pipeline.devices) stage_devices.push_back(parse_device(d));
    const Device mine = main_thread_device(stage_devices);
    if (mine.index < cuda_device_count()) bind_thread_to_device(mine);  // else the trainer says why
  }
  const pipeline::Launch launch = inv.mpi != nullptr ? inv.mpi->join(config) : pipeline::Launch{};
  pipeline::train(config, std::cout, launch);
  return 0;
}

// The config's schedule as a schedule file (pipeline.schedule_file) to start one's own
// from: CSV for a path ending in .csv, PyTorch's action notation otherwise.
void write_schedule_file(const Invocation& inv, const pipeline::Plan& p, const std::string& path) {
  const bool csv = path.size() >= 4 && path.compare(path.size() - 4, 4, ".csv") == 0;
  std::string command = inv.invoked_as + " plan";
  if (inv.have_config) command += " " + inv.config;
  for (const auto& o : inv.overrides) command += " --set " + o;
  const std::string comment = "From `" + command + "`, pipeline.recompute: " +
                              pipeline::recompute_mode_name(p.recompute) + ".";
  write_file_atomically(path, pipeline::schedule_file_text(
                                  p.schedule, csv ? pipeline::ScheduleNotation::kCsv : pipeline::ScheduleNotation::kActions,
                                  comment));
  std::printf("wrote the schedule to %s (%s); edit it and run it with --set pipeline.schedule_file=%s\n", path.c_str(),
              csv ? "stage,op,micro_batch lines" : "PyTorch's action notation", pipeline::shell_quote(path).c_str());
}

// How a config would be partitioned and scheduled, without training; with
// `schedule_out`, the schedule also written there as a schedule file.
int run_plan(Invocation& inv, const std::string& schedule_out = "") {
  const pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  pipeline::RunModel run = pipeline::build_run_model(config);
  const pipeline::Config& c = run.config;
  layers::Sequential& model = *run.model;
  const pipeline::Plan p = pipeline::make_plan(c, model);
  pipeline::print_plan(c, model, p, std::cout);
  std::cout.flush();
  if (!schedule_out.empty()) write_schedule_file(inv, p, schedule_out);
  std::fflush(stdout);
  pipeline::print_prediction(c, model, p, std::cout);
  return 0;
}

// `gpipe run`: the restart loop. The job (this program's train, or mpirun -np P of it) is relaunched
// with --resume after a failure, up to --max-restarts times.
int run_train_under_supervisor(Invocation& inv) {
  check_start_flags(inv);
  const pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);  // a bad config fails here, once
  pipeline::SupervisorOptions o;
  // The job's run: a new one, or with --resume the one its checkpoints belong to.
  const auto prior = pipeline::find_prior_run(config);
  o.run_id = inv.resume && prior && !prior->run_id.empty() ? prior->run_id : pipeline::new_run_id();
  // Its directories are this job's for all its launches; a fresh job does not mix with
  // an earlier run's files (refused here, before any launch, unless --start-over).
  pipeline::DirectoryLock lock(pipeline::run_directories(config), o.run_id);
  if (!inv.resume && !inv.start_over && prior) pipeline::claim_directories(config);
  o.start_over = inv.start_over;
  o.heartbeat_dir = config.output.dir + "/.heartbeat";
  o.stall_s = 2 * config.pipeline.timeout_s;
  o.resume_hint = continue_command(inv);
  o.program = std::filesystem::read_symlink("/proc/self/exe").string();
  o.config = inv.config;
  o.overrides = inv.overrides;
  o.processes = inv.processes;
  o.max_restarts = inv.max_restarts;
  o.checkpoint_dir = pipeline::checkpoint_dir(config);
  o.resume_first = inv.resume;
  return pipeline::supervise(o);
}

int option_int(const Invocation& inv, const std::string& name, int fallback) {
  auto it = inv.options.find(name);
  if (it == inv.options.end()) return fallback;
  char* end = nullptr;
  const long v = std::strtol(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || v < 1) {
    throw UserError("--" + name + " takes a positive integer, got '" + it->second + "'");
  }
  return static_cast<int>(v);
}

// `plan` with --sweep, --devices or --device-spec: beyond the config as written.
int run_plan_command(Invocation& inv) {
  std::string schedule_out;
  if (inv.options.count("schedule-file-out")) {
    schedule_out = inv.options.at("schedule-file-out");
    inv.options.erase("schedule-file-out");
  }
  if (inv.options.empty()) return run_plan(inv, schedule_out);
  if (!schedule_out.empty()) {
    throw UserError("--schedule-file-out writes the schedule of the config as it is; give it without --sweep, "
                    "--rows, --devices and --device-spec (use --set to change the config's schedule or sizes)");
  }
  const pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  pipeline::RunModel run = pipeline::build_run_model(config);
  pipeline::PlanCommandOptions o;
  o.sweep = inv.options.count("sweep") > 0;
  o.devices = option_int(inv, "devices", 0);
  if (inv.options.count("device-spec")) o.device_spec = inv.options.at("device-spec");
  o.rows = option_int(inv, "rows", o.rows);
  return pipeline::plan_other_runs(run.config, *run.model, o, std::cout);
}

// "8,16,32" -> {8, 16, 32}, each at least 1.
std::vector<int64_t> option_list(const Invocation& inv, const std::string& name) {
  const std::string& list = inv.options.at(name);
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, comma - start);
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1) {
      throw UserError("--" + name + " takes positive integers such as 1,2 or 8,16,32; '" + item + "' is not one");
    }
    out.push_back(v);
    start = comma + 1;
  }
  return out;
}

int run_profile(Invocation& inv) {
  pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  pipeline::ProfileOptions o;
  o.sweep = inv.options.count("sweep") > 0;
  o.repeats = option_int(inv, "repeats", o.repeats);
  o.warmup = option_int(inv, "warmup", o.warmup);
  if (inv.options.count("seconds")) o.min_seconds = option_int(inv, "seconds", 3);
  if (inv.options.count("micro-batches")) o.micro_batches = option_list(inv, "micro-batches");
  if (inv.options.count("concurrency")) {
    for (int64_t v : option_list(inv, "concurrency")) o.concurrency.push_back(static_cast<int>(v));
  }
  pipeline::Launch launch;
  if (inv.mpi != nullptr) {
    config.pipeline.partitions = inv.mpi->size();  // one stage per rank: the transport between them
    config.pipeline.replicas = 1;
    launch = inv.mpi->join(config);
  }
  return pipeline::profile_command(config, o, launch, std::cout);
}

int run_help(Invocation& inv) {
  std::cout << usage(inv.program) << "\nlayer types: " << join(layers::layer_types())
            << "\nlosses: " << join(layers::loss_types())
            << "\nmodels built in C++ (model: {cpp: NAME}): " << join(layers::model_names()) << "\n";
  return 0;
}

const Command kCommands[] = {
    {"train", "[CONFIG.yaml] [--set key=value ...] [--resume] [--start-over] [--run-id ID] [--heartbeat DIR]",
     "train (default config: configs/default.yaml); --resume: from the newest intact checkpoint; --start-over: "
     "move an earlier run in output.dir to output.dir/previous/ first (--run-id and --heartbeat: gpipe run's)",
     "one process per stage and replica (K = pipeline.partitions, D = pipeline.replicas)", run_train},
    {"run", "[--np P] [--max-restarts N] [CONFIG.yaml] [--set key=value ...] [--resume] [--start-over]",
     "train, and after a failure or a frozen process restart from the newest intact checkpoint (mpirun -np P for "
     "P > 1)",
     nullptr, run_train_under_supervisor},
    {"plan",
     "[CONFIG.yaml] [--set key=value ...] [--sweep] [--rows N] [--devices N] [--device-spec FILE] "
     "[--schedule-file-out FILE]",
     "predict step time, bubble and memory per stage; --sweep ranks the ways to run it; --schedule-file-out writes "
     "the schedule as a pipeline.schedule_file to start your own from (CSV for FILE.csv, else PyTorch's notation)",
     nullptr, run_plan_command},
    {"profile",
     "[CONFIG.yaml] [--set key=value ...] [--micro-batches N,N,...] [--sweep] [--concurrency N,N] [--repeats N] "
     "[--warmup N] [--seconds N]",
     "measure each layer's times into pipeline.profile (--sweep: at every size the sweep tries)",
     "two processes: measure the MPI transport between them into the profile", run_profile},
    {"help", "", "this text, and the layer types and models this program knows", nullptr, run_help},
};

const Command* find_command(const std::string& name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

// The command's arguments: an optional config path and --set overrides.
void parse_args(int argc, char** argv, const Command& cmd, Invocation& inv) {
  const std::string args = cmd.args;
  const bool takes_config = args.find("CONFIG") != std::string::npos;
  auto takes = [&](const char* flag) { return args.find(std::string("[") + flag) != std::string::npos; };
  // --np P, --max-restarts N: a count of at least `least`.
  auto count = [&](int& i, const std::string& flag, int least) {
    if (i + 1 >= argc) throw UserError(flag + " needs a number, e.g. " + flag + " 2");
    const std::string v = argv[++i];
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < least || n > 100000) {
      throw UserError(flag + " " + v + ": expected a whole number of at least " + std::to_string(least));
    }
    return static_cast<int>(n);
  };
  bool have_config = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (takes("--resume") && arg == "--resume") {
      inv.resume = true;
    } else if (takes("--start-over") && arg == "--start-over") {
      inv.start_over = true;
    } else if (takes("--np") && arg == "--np") {
      inv.processes = count(i, arg, 1);
    } else if (takes("--max-restarts") && arg == "--max-restarts") {
      inv.max_restarts = count(i, arg, 0);
    } else if (takes_config && arg == "--set") {
      if (i + 1 >= argc) throw UserError("--set needs KEY=VALUE, e.g. --set train.steps=10");
      inv.overrides.push_back(argv[++i]);
    } else if (takes_config && arg.rfind("--set=", 0) == 0) {
      inv.overrides.push_back(arg.substr(6));
    } else if (arg.rfind("--", 0) == 0 && std::string(cmd.args).find("[" + arg) != std::string::npos) {
      // A flag the command lists in its usage: "[--sweep]" alone, "[--devices N]" with a value.
      const std::string declared(cmd.args);
      const size_t at = declared.find("[" + arg) + 1 + arg.size();
      if (declared[at] == ' ') {
        if (i + 1 >= argc) throw UserError(arg + " needs a value\n" + usage(inv.program));
        inv.options[arg.substr(2)] = argv[++i];
      } else {
        inv.options[arg.substr(2)] = "1";
      }
    } else if (!arg.empty() && arg[0] == '-') {
      throw UserError("unknown option '" + arg + "' for " + cmd.name + "\n" + usage(inv.program));
    } else if (takes_config && !have_config) {
      inv.config = arg;
      have_config = true;
      inv.have_config = true;
    } else {
      throw UserError("unexpected argument '" + arg + "' for " + cmd.name +
                      (takes_config ? " (one config file at most)" : "") + "\n" + usage(inv.program));
    }
  }
}

std::string base_name(const char* path) {
  const std::string p = path != nullptr ? path : "gpipe";
  const auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace

std::string usage(const std::string& program) {
  std::vector<std::pair<std::string, std::string>> lines;
  for (const Command& c : kCommands) {
    lines.push_back({program + " " + c.name + (*c.args ? " " + std::string(c.args) : ""), c.summary});
    if (c.mpirun != nullptr) lines.push_back({"mpirun -np K*D " + program + " " + c.name + " ...", c.mpirun});
  }
  // Each command's line, and under it what it does.
  std::string out = "usage:\n";
  for (const auto& l : lines) out += "  " + l.first + "\n      " + l.second + "\n";
  out += "\n--set overrides any config field, e.g. --set pipeline.partitions=2 --set pipeline.balance=[3,3,2]\n";
  return out;
}

namespace {

// Runs `body` as a command of this program: under mpirun with MPI initialised for the
// life of the call (and a failure on one rank ending every rank), its messages on
// stderr as "PROGRAM: error: ...", and its exit status.
int guarded(int& argc, char**& argv, const std::function<int(Invocation&)>& body) {
  init_logging("info");
  Invocation inv;
  inv.program = base_name(argc > 0 ? argv[0] : nullptr);
  const char* wrapper = std::getenv("GPIPE_INVOKED_AS");  // set by the ./gpipe script
  inv.invoked_as = wrapper != nullptr && *wrapper ? wrapper : (argc > 0 && argv[0] ? argv[0] : "gpipe");
  // Outside the try: a failure's MPI_Abort must come before the transports'
  // destructors, which would otherwise free buffers that sends and reductions use.
  std::unique_ptr<pipeline::MpiLaunch> mpi;
  try {
    if (pipeline::launched_by_mpi()) mpi = std::make_unique<pipeline::MpiLaunch>(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", inv.program.c_str(), e.what());
    return 1;
  }
  inv.mpi = mpi.get();
  const std::string on_rank = mpi ? " on rank " + std::to_string(mpi->rank()) : "";
  try {
    return body(inv);
  } catch (const pipeline::RunStopped& e) {
    // Every process stopped after the same step and saved its share: a clean exit.
    std::fprintf(stderr, "%s%s: %s\n", inv.program.c_str(), on_rank.c_str(), e.what());
    return 128 + e.signal();
  } catch (const UserError& e) {
    std::fprintf(stderr, "%s: error%s: %s\n", inv.program.c_str(), on_rank.c_str(), e.what());
    return mpi ? mpi->abort(2) : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error%s: %s\n", inv.program.c_str(), on_rank.c_str(), e.what());
    return mpi ? mpi->abort(1) : 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return guarded(argc, argv, [&](Invocation& inv) {
    if (argc < 2) throw UserError("no command given\n" + usage(inv.program));
    const std::string name = argv[1];
    const Command* cmd = find_command(name == "--help" || name == "-h" ? "help" : name);
    if (cmd == nullptr) throw UserError("unknown command '" + name + "'\n" + usage(inv.program));
    inv.command = cmd->name;
    parse_args(argc, argv, *cmd, inv);
    return cmd->run(inv);
  });
}

int train(int argc, char** argv, pipeline::Config config, const pipeline::MakeModel& make_model) {
  return guarded(argc, argv, [&](Invocation& inv) {
    const pipeline::Launch launch = inv.mpi != nullptr ? inv.mpi->join(config) : pipeline::Launch{};
    pipeline::train(config, make_model, std::cout, launch);
    return 0;
  });
}

}  // namespace cli
}  // namespace gpipe
