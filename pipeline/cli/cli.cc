#include "pipeline/cli/cli.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "pipeline/cli/args.h"
#include "partition/balance.h"
#include "pipeline/cli/mpi_launch.h"
#include "pipeline/cli/plan_commands.h"
#include "pipeline/train/auto_plan.h"
#include "pipeline/train/profiling.h"
#include "pipeline/cli/supervisor.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/memory_check.h"
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
  if (inv.mpi != nullptr && !config.run.id_given && launch.first()) {
    spdlog::info("under plain mpirun, a Ctrl-C or SIGTERM gives the ranks 1 s (OpenMPI's odls_base_sigkill_timeout) "
                 "between its SIGTERM and its SIGKILL, which a long step and its save may not fit in: stop with "
                 "`kill -USR2 <mpirun's pid>`, or launch with `gpipe run --np {}`, which does that on Ctrl-C",
                 inv.mpi->size());
  }
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
  const int T = config.pipeline.tensor_parallel;
  if (T > 1 && config.autos.any()) {
    throw UserError("auto (pipeline.partitions, pipeline.micro_batches, pipeline.schedule, train.blas_threads) chooses "
                    "for pipeline.tensor_parallel 1 only (it is " + std::to_string(T) + "); give the values");
  }
  std::unique_ptr<layers::Sequential> whole;  // T > 1: the unsplit model, for its size
  if (T > 1) {
    whole = std::move(pipeline::build_run_model_on_shapes(config).model);
    std::cout << "pipeline.tensor_parallel = " << T << ": each stage is split over " << T
              << " processes (mpirun -np " << pipeline::plan_sizes(config).ranks().size()
              << "; without mpirun, gpipe train runs them as threads of one process on CPU stages); the plan below "
                 "is one member's share of each stage (its parameters, memory and compute, and its collectives over "
                 "the group, the program's tAR, tMAX, tAG and tRS after the F, R, B or W whose layers ask them, priced "
                 "over this machine's MPI link).\n";
    if (config.pipeline.sequence_parallel) {
      std::cout << "pipeline.sequence_parallel: between the split layers each member holds 1/" << T
                << " of each sample's positions (its norms', dropouts' and messages' activations); the split layers "
                   "all-gather them and reduce-scatter back, in place of their sums.\n";
    }
  }
  // Planning allocates no weights. A stage's members hold blocks of one size: member 0's
  // plan is each member's.
  pipeline::RunModel run =
      T > 1 ? pipeline::build_member_on_shapes(config, 0) : pipeline::build_run_model_on_shapes(config);
  run.config = pipeline::resolve_auto(run.config, *run.model, {}, std::cout);  // the plan a run would choose
  const pipeline::Config& c = run.config;
  layers::Sequential& model = *run.model;
  const pipeline::Plan p = pipeline::make_plan(c, model);
  pipeline::print_plan(c, model, p, std::cout, whole ? whole.get() : nullptr);
  std::cout.flush();
  if (!schedule_out.empty()) write_schedule_file(inv, p, schedule_out);
  std::fflush(stdout);
  pipeline::print_prediction(c, model, p, std::cout);
  std::cout.flush();
  pipeline::check_memory_limit(c, p);  // a plan over the limit is an error, after it is shown
  return 0;
}

// `gpipe run`: the restart loop. The job (this program's train, or mpirun -np P of it) is relaunched
// with --resume after a failure, up to --max-restarts times.
int run_train_under_supervisor(Invocation& inv) {
  check_start_flags(inv);
  pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);  // a bad config fails here, once
  if (inv.resume && config.checkpoint.resume.empty()) config.checkpoint.resume = "auto";  // as train reads it
  if (inv.start_over && !config.checkpoint.resume.empty()) {
    throw UserError("--start-over starts a new run, but checkpoint.resume is '" + config.checkpoint.resume +
                    "'; drop one of them");
  }
  config.run.start_over = inv.start_over;
  pipeline::SupervisorOptions o;
  // The job's run: a new one, or when it resumes (--resume, checkpoint.resume) the one its
  // folder belongs to.
  const std::string owner = pipeline::folder_run_id(config);
  o.run_id = !config.checkpoint.resume.empty() && !owner.empty() ? owner : pipeline::new_run_id();
  config.run.id = o.run_id;
  config.run.id_given = true;
  // Its directories are this job's for all its launches; the launches claim them as
  // train does (whose run, a fork, another run's files refused); the job checks the same
  // here, writing nothing, so that what its first launch would refuse is refused at once.
  pipeline::DirectoryLock lock(pipeline::run_directories(config), o.run_id, /*supervisor=*/true);
  o.run_id = pipeline::claim_directories(config, /*record=*/false).run_id;
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
                    "--devices and --device-spec (use --set to change the config's schedule or sizes)");
  }
  const pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  pipeline::RunModel run = pipeline::build_run_model_on_shapes(config);
  pipeline::PlanCommandOptions o;
  o.sweep = inv.options.count("sweep") > 0;
  o.devices = option_int(inv, "devices", 0);
  if (inv.options.count("device-spec")) o.device_spec = inv.options.at("device-spec");
  o.rows = option_int(inv, "rows", o.rows);
  o.max_micro_batches = option_int(inv, "max-micro-batches", o.max_micro_batches);
  o.measure = option_count(inv, "time-best", 0, o.measure);
  // --precisions: the config and its model in each model.dtype, kept alive for the sweep.
  std::vector<pipeline::RunModel> precision_runs;
  if (inv.options.count("precisions")) {
    const std::string list = inv.options.at("precisions");
    if (config.pipeline.tensor_parallel > 1) {
      throw UserError("--precisions compares the whole model in each precision, but pipeline.tensor_parallel is " +
                      std::to_string(config.pipeline.tensor_parallel) +
                      "; compare precisions with pipeline.tensor_parallel: 1, or sweep T with --sweep alone");
    }
    for (size_t start = 0; start <= list.size();) {
      const size_t comma = std::min(list.find(',', start), list.size());
      const std::string name = list.substr(start, comma - start);
      start = comma + 1;
      std::vector<std::string> overrides = inv.overrides;
      overrides.push_back("model.dtype=" + name);
      pipeline::Config c;
      try {
        c = pipeline::load_config(inv.config, overrides);
      } catch (const UserError& e) {
        throw UserError("--precisions " + list + ": '" + name + "' does not make a config: " + e.what());
      }
      pipeline::RunModel r;
      try {
        r = pipeline::build_run_model_on_shapes(c);
      } catch (const UserError& e) {
        throw UserError("--precisions: the model in " + name + ": " + e.what());
      }
      if (r.model->dtype() != c.model.dtype) {
        throw UserError("--precisions: this config's model is built in C++ (model: {cpp: ...}) in " +
                        std::string(dtype_name(r.model->dtype())) +
                        " whatever model.dtype says; compare precisions by building it in each");
      }
      for (const pipeline::RunModel& seen : precision_runs) {
        if (seen.model->dtype() == r.model->dtype()) {
          throw UserError("--precisions " + list + " names " + dtype_name(r.model->dtype()) + " twice");
        }
      }
      precision_runs.push_back(std::move(r));
      o.precisions.push_back({name, nullptr, nullptr});
    }
    for (size_t i = 0; i < precision_runs.size(); ++i) {  // the vector has stopped moving
      o.precisions[i].config = &precision_runs[i].config;
      o.precisions[i].model = precision_runs[i].model.get();
    }
  }
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

const Command* find_command(const std::string& name);
std::string unknown_command(const std::string& name);

// `help`: the commands, or with a command's name that command's flags.
int run_help(Invocation& inv) {
  if (!inv.help_topic.empty()) {
    const Command* topic = find_command(inv.help_topic);
    if (topic == nullptr) throw UserError(unknown_command(inv.help_topic) + "\n" + usage(inv.program));
    std::cout << command_help(*topic, inv.program);
    return 0;
  }
  std::cout << usage(inv.program) << "\nlayer types: " << join(layers::layer_types())
            << "\nlosses: " << join(layers::loss_types())
            << "\nmodels built in C++ (model: {cpp: NAME}): " << join(layers::model_names()) << "\n";
  return 0;
}

// The flags that start and name a run, of train and run.
const Flag kResume{"--resume", nullptr,
                   "go on from the newest intact checkpoint of the run in output.dir (checkpoint.resume: auto)"};
const Flag kStartOver{"--start-over", nullptr,
                      "move an earlier run in output.dir to output.dir/previous/ and start afresh"};

const char* kPlanMore =
    "Memory: the sweep drops every candidate whose fullest device would hold more than pipeline.memory_limit, "
    "e.g. --set pipeline.memory_limit=8GiB (a number with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, "
    "TiB); without it the limit is --device-spec's memory per device, and CPU stages on this machine must fit in "
    "its available memory together. Without --sweep, the prediction says whether the fullest device is within "
    "pipeline.memory_limit. Bytes are printed in MiB (2^20) and GiB (2^30).";

const std::vector<Command>& commands() {
  static const std::vector<Command> kCommands = {
      {"train", kConfig,
       "train (default config: configs/default.yaml)",
       "one process per stage and replica (K = pipeline.partitions, D = pipeline.replicas)",
       {kResume, kStartOver,
        {"--run-id", "ID", "the run's id (gpipe run gives it to each launch)", nullptr, true},
        {"--heartbeat", "DIR", "where to write the progress counter gpipe run watches", nullptr, true}},
       nullptr, run_train},
      {"run", kConfig,
       "train, and after a failure or a frozen process restart from the newest intact checkpoint (mpirun -np P for "
       "P > 1)",
       nullptr,
       {{"--np", "P", "launch P processes with mpirun -np P, one per stage, tensor-group member and replica (default 1: one process)"},
        {"--max-restarts", "N", "relaunch with --resume at most N times (default 3; 0: never)"},
        kResume, kStartOver},
       nullptr, run_train_under_supervisor},
      {"plan", kConfig, "predict step time, bubble and memory per stage, without training", nullptr,
       {{"--sweep", nullptr,
         "rank the ways to run the config (stages K, micro-batches M, recompute, schedule, virtual stages; on CPUs "
         "also one stage with every core's BLAS threads) by predicted samples/s"},
        {"--time-best", "N",
         "before recommending, time the sweep's best N plans and the config's own for 1 + 3 real steps each on this "
         "machine, and recommend the measured fastest (default 3; 0: recommend by the prediction alone)",
         "--sweep"},
        {"--rows", "N", "rows of the sweep's table to show (default 30; the recommendation is always shown)",
         "--sweep"},
        {"--max-micro-batches", "N", "the sweep tries M = 1, 2, 4, ... up to N micro-batches (default 32)",
         "--sweep"},
        {"--precisions", "LIST",
         "the sweep tries the config in each of these model.dtype values and ranks them together, e.g. float32,bf16 "
         "(default: the config's alone; a precision changes the numbers a run computes, so the sweep tries one only "
         "when asked)",
         "--sweep"},
        {"--devices", "N",
         "plan for N devices (default: pipeline.partitions; with --sweep, this machine's cores or GPUs)"},
        {"--device-spec", "FILE",
         "plan for devices this machine does not have, from their description (e.g. "
         "configs/devices/h100_nvlink_ib.yaml: peak FLOP/s, memory, links)"},
        {"--schedule-file-out", "FILE",
         "write the config's schedule as a pipeline.schedule_file to start your own from (CSV for FILE.csv, else "
         "PyTorch's notation)"}},
       kPlanMore, run_plan_command},
      {"profile", kConfig, "measure each layer's times into pipeline.profile, for the planner",
       "two processes: measure the MPI transport between them into the profile",
       {{"--micro-batches", "N,N,...", "micro-batch sizes (rows) to measure (default: the config's)"},
        {"--sweep", nullptr, "also measure every micro-batch size gpipe plan --sweep tries"},
        {"--concurrency", "N,N", "stages computing at once while measuring (default: 1 and, on CPUs, every core)"},
        {"--repeats", "N", "timed repetitions per measurement (default 10; the median is kept)"},
        {"--warmup", "N", "untimed repetitions first (default 3)"},
        {"--seconds", "N", "go on repeating for at least N seconds per size (default 3)"}},
       nullptr, run_profile},
      {"help", kCommandName, "the commands, or one command's flags; the layer types and models this program knows",
       nullptr, {}, nullptr, run_help},
  };
  return kCommands;
}

const Command* find_command(const std::string& name) {
  for (const Command& c : commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

std::string unknown_command(const std::string& name) {
  std::vector<std::string> names;
  for (const Command& c : commands()) names.push_back(c.name);
  const std::string hint = did_you_mean(name, names);
  return "unknown command '" + name + "'" + (hint.empty() ? "" : ";" + hint);
}

std::string base_name(const char* path) {
  const std::string p = path != nullptr ? path : "gpipe";
  const auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace

std::string usage(const std::string& program) {
  std::vector<std::pair<std::string, std::string>> lines;
  for (const Command& c : commands()) {
    std::string synopsis = program + " " + c.name;
    if (c.positional != nullptr) synopsis += " [" + std::string(c.positional) + "]";
    if (takes_config(c)) synopsis += " [--set KEY=VALUE ...]";
    for (const Flag& f : c.flags) {
      if (f.hidden) continue;
      synopsis += " [" + std::string(f.name) + (f.value != nullptr ? " " + std::string(f.value) : "") + "]";
    }
    lines.push_back({synopsis, c.summary});
    if (c.mpirun != nullptr) lines.push_back({"mpirun -np K*T*D " + program + " " + c.name + " ...", c.mpirun});
  }
  // Each command's line, and under it what it does.
  std::string out = "usage:\n";
  for (const auto& l : lines) out += "  " + l.first + "\n      " + l.second + "\n";
  out += "\n" + program + " help COMMAND (or " + program +
         " COMMAND --help) explains each flag of COMMAND.\n"
         "--set overrides any config field, e.g. --set pipeline.partitions=2 --set pipeline.balance=[3,3,2]\n";
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
    if (cmd == nullptr) throw UserError(unknown_command(name) + "\n" + usage(inv.program));
    inv.command = cmd->name;
    if (!parse_args(argc, argv, *cmd, commands(), inv)) return 0;  // it printed the command's help
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
