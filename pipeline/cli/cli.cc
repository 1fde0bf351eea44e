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

#include <CLI/CLI.hpp>

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
  std::map<std::string, std::string> options;  // the command's own --flags given ("sweep" -> "1", "devices" -> "8")
  std::string help_topic;                      // help COMMAND
  pipeline::MpiLaunch* mpi = nullptr;  // set under mpirun
  bool resume = false;                 // --resume: go on from the newest complete checkpoint
  bool start_over = false;             // --start-over: move an earlier run in output.dir aside
  int processes = 1;                   // run --np P
  int max_restarts = 3;                // run --max-restarts N
};

// A flag of a command, declared once: the parser (CLI11) takes it, `help COMMAND` explains
// it, and a mistyped flag is matched against it.
struct Flag {
  const char* name;             // "--devices"
  const char* value;            // its value's name ("N"), or nullptr for a switch
  const char* help;             // what it does, for the command's help
  const char* needs = nullptr;  // the flag it only applies with ("--sweep"), or nullptr
  bool hidden = false;          // gpipe run's own, not in the help
};

// The positional arguments a command takes: a config, or (help) a command's name.
constexpr const char* kConfig = "CONFIG.yaml";
constexpr const char* kCommandName = "COMMAND";

// A subcommand. Adding one is a function and an entry in commands().
struct Command {
  const char* name;
  const char* positional;  // kConfig (and then --set), kCommandName, or nullptr
  const char* summary;     // what it does
  const char* mpirun;      // how mpirun launches it, or nullptr
  std::vector<Flag> flags;
  const char* more;  // the help's last paragraph, or nullptr
  int (*run)(Invocation& inv);
};

bool takes_config(const Command& cmd) { return cmd.positional != nullptr && std::string(cmd.positional) == kConfig; }

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

// --np P, --max-restarts N: a count of at least `least`, or `fallback` when not given.
int option_count(const Invocation& inv, const std::string& name, int least, int fallback) {
  auto it = inv.options.find(name);
  if (it == inv.options.end()) return fallback;
  const std::string& v = it->second;
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < least || n > 100000) {
    throw UserError("--" + name + " " + v + ": expected a whole number of at least " + std::to_string(least));
  }
  return static_cast<int>(n);
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
  pipeline::RunModel run = pipeline::build_run_model(config);
  pipeline::PlanCommandOptions o;
  o.sweep = inv.options.count("sweep") > 0;
  o.devices = option_int(inv, "devices", 0);
  if (inv.options.count("device-spec")) o.device_spec = inv.options.at("device-spec");
  o.rows = option_int(inv, "rows", o.rows);
  o.max_micro_batches = option_int(inv, "max-micro-batches", o.max_micro_batches);
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

// The text of `PROGRAM help COMMAND` (and `PROGRAM COMMAND --help`).
std::string command_help(const Command& cmd, const std::string& program);
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
       {{"--np", "P", "launch P processes with mpirun -np P, one per stage and replica (default 1: one process)"},
        {"--max-restarts", "N", "relaunch with --resume at most N times (default 3; 0: never)"},
        kResume, kStartOver},
       nullptr, run_train_under_supervisor},
      {"plan", kConfig, "predict step time, bubble and memory per stage, without training", nullptr,
       {{"--sweep", nullptr,
         "rank the ways to run the config (stages K, micro-batches M, recompute, schedule, virtual stages; on CPUs "
         "also one stage with every core's BLAS threads) by predicted samples/s"},
        {"--rows", "N", "rows of the sweep's table to show (default 30; the recommendation is always shown)",
         "--sweep"},
        {"--max-micro-batches", "N", "the sweep tries M = 1, 2, 4, ... up to N micro-batches (default 32)",
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

// Levenshtein distance with adjacent transpositions ("--rwos" is one from "--rows").
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// What `word` may have meant among `known`: the names it begins ("--sw" of "--sweep"), else the nearest within
// a third of its letters ("--device" of "--devices"), as " did you mean X?"; "" when none is close.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& known) {
  std::vector<std::string> close;
  const size_t letters = word.size() - std::min(word.find_first_not_of('-'), word.size());
  if (letters > 0) {
    for (const std::string& k : known) {
      if (k.size() > word.size() && k.compare(0, word.size(), word) == 0) close.push_back(k);
    }
  }
  if (close.empty()) {
    size_t best = std::max<size_t>(1, letters / 3) + 1;
    for (const std::string& k : known) {
      const size_t d = edit_distance(word, k);
      if (d < best) close.clear(), best = d;
      if (d == best) close.push_back(k);
    }
  }
  if (close.empty()) return "";
  std::string out = " did you mean ";
  for (size_t i = 0; i < close.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == close.size() ? " or " : ", ") + close[i];
  }
  return out + "?";
}

std::string unknown_command(const std::string& name) {
  std::vector<std::string> names;
  for (const Command& c : commands()) names.push_back(c.name);
  const std::string hint = did_you_mean(name, names);
  return "unknown command '" + name + "'" + (hint.empty() ? "" : ";" + hint);
}

// Lines of at most `width` characters, broken between words.
std::string wrap(const std::string& text, size_t width) {
  std::string out, line;
  std::istringstream words(text);
  std::string w;
  while (words >> w) {
    if (!line.empty() && line.size() + 1 + w.size() > width) {
      out += line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + w;
  }
  return out + line;
}

// `cmd`'s parser: its positional argument, --set for a config, and its flags, each bound to
// `values[name]` (a switch's value is its count). The help CLI11 prints from it is the command's.
void declare(CLI::App& app, const Command& cmd, std::string& positional, std::vector<std::string>& overrides,
             std::map<std::string, std::string>& values) {
  constexpr size_t kWidth = 62;  // of the descriptions, right of the 28 columns of names
  app.get_formatter()->column_width(28);
  app.allow_extras();  // refused by refuse_extras, with what was meant
  app.set_help_flag("-h,--help", "print this help and exit");
  if (cmd.positional != nullptr) {
    const bool config = takes_config(cmd);
    app.add_option(cmd.positional, positional,
                   wrap(config ? "the config file (default configs/default.yaml)" : "a command to explain", kWidth))
        ->type_name("");
    if (config) {
      app.add_option("--set", overrides,
                     wrap("override a config field; the value is YAML (--set pipeline.partitions=2, --set "
                          "pipeline.balance=[3,3,2]); give it once per field",
                          kWidth))
          ->option_text("KEY=VALUE")
          ->expected(1)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    }
  }
  for (const Flag& f : cmd.flags) {
    const std::string needs = f.needs != nullptr ? " (with " + std::string(f.needs) + ")" : "";
    const std::string help = wrap(f.help + needs, kWidth);
    // A value's name as the help's only note on a flag: the help says "(with --sweep)" itself.
    CLI::Option* o = f.value != nullptr ? app.add_option(f.name, values[f.name])->option_text(f.value)
                                        : app.add_flag(f.name);
    o->description(help);
    if (f.needs != nullptr) o->needs(app.get_option(f.needs));  // refused without it
    if (f.hidden) o->group("");
  }
  if (cmd.more != nullptr) app.footer(wrap(cmd.more, 90));
}

std::string command_help(const Command& cmd, const std::string& program) {
  CLI::App app(wrap(cmd.summary, 90), program + " " + cmd.name);
  std::string positional;
  std::vector<std::string> overrides;
  std::map<std::string, std::string> values;
  declare(app, cmd, positional, overrides, values);
  return app.help();
}

// Refuses what the parser did not take: the first flag `cmd` does not have (a mistyped
// or shortened one, with what was meant; one of another command), or a second positional.
void refuse_extras(const std::vector<std::string>& extras, const Command& cmd, const Invocation& inv) {
  const std::string see = " (`" + inv.program + " help " + cmd.name + "` lists its flags)";
  for (const std::string& arg : extras) {
    if (arg.size() > 1 && arg[0] == '-') {
      const std::string flag = arg.substr(0, arg.find('='));
      std::vector<std::string> known = {"--help"};
      if (takes_config(cmd)) known.push_back("--set");
      for (const Flag& f : cmd.flags) {
        if (!f.hidden) known.push_back(f.name);
      }
      std::string hint = did_you_mean(flag, known);
      if (hint.empty()) {  // another command's flag
        std::vector<std::string> owners;
        for (const Command& c : commands()) {
          for (const Flag& f : c.flags) {
            if (!f.hidden && flag == f.name) owners.push_back(c.name);
          }
        }
        for (size_t i = 0; i < owners.size(); ++i) {
          hint += (i == 0 ? " " + flag + " is an option of " : i + 1 == owners.size() ? " and " : ", ") + owners[i];
        }
        if (!owners.empty()) hint += ", not of " + std::string(cmd.name) + ".";
      }
      throw UserError("unknown option '" + flag + "' for " + cmd.name + ";" +
                      (hint.empty() ? std::string(" it has no such flag (a config field is set with --set KEY=VALUE).")
                                    : hint) +
                      see);
    }
  }
  for (const std::string& arg : extras) {
    if (arg == "--") continue;
    throw UserError("unexpected argument '" + arg + "' for " + cmd.name +
                    (takes_config(cmd) ? " (one config file at most)" : "") + see);
  }
}

// A parser's refusal in our words: the flag, what it needs, where the help is.
std::string parse_error(const CLI::ParseError& e, const Command& cmd, const Invocation& inv) {
  const std::string what = e.what();
  const std::string see = " (`" + inv.program + " help " + cmd.name + "` lists its flags)";
  if (dynamic_cast<const CLI::RequiresError*>(&e) != nullptr) {  // "--rows requires --sweep"
    const size_t at = what.find(" requires ");
    if (at != std::string::npos) {
      const std::string flag = what.substr(0, at), needs = what.substr(at + 10);
      return flag + " applies only with " + needs + ": add " + needs + ", or drop " + flag + see;
    }
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr) {  // "--set: 1 required KEY=VALUE missing"
    const std::string flag = what.substr(0, what.find(':'));
    if (flag == "--set") return "--set needs KEY=VALUE, e.g. --set train.steps=10";
    for (const Flag& f : cmd.flags) {
      if (flag != f.name) continue;
      if (what.find("missing") != std::string::npos) return flag + " needs a value: " + flag + " " + f.value + see;
      return flag + " is given more than once; give it once" + see;
    }
  }
  return what + see;
}

// Parses the command's arguments (argv[2] on) into `inv`: its config path, --set overrides
// and flags. Returns false when it printed the command's help instead (--help, -h).
bool parse_args(int argc, char** argv, const Command& cmd, Invocation& inv) {
  CLI::App app(wrap(cmd.summary, 90), inv.program + " " + cmd.name);
  std::string positional;
  std::map<std::string, std::string> values;
  declare(app, cmd, positional, inv.overrides, values);
  std::string refused;
  try {
    app.parse(argc - 1, argv + 1);  // argv[1], the command, stands for the program's name
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  } catch (const CLI::ParseError& e) {
    refused = parse_error(e, cmd, inv);
  }
  refuse_extras(app.remaining(), cmd, inv);  // a mistyped flag first: it may be why another is refused
  if (!refused.empty()) throw UserError(refused);
  if (!positional.empty()) {
    if (takes_config(cmd)) {
      inv.config = positional;
      inv.have_config = true;
    } else {
      inv.help_topic = positional;
    }
  }
  for (const Flag& f : cmd.flags) {
    const CLI::Option* o = app.get_option(f.name);
    if (o->count() > 0) inv.options[std::string(f.name).substr(2)] = f.value != nullptr ? values[f.name] : "1";
  }
  inv.resume = inv.options.count("resume") > 0;
  inv.start_over = inv.options.count("start-over") > 0;
  inv.processes = option_count(inv, "np", 1, 1);
  inv.max_restarts = option_count(inv, "max-restarts", 0, 3);
  return true;
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
    if (c.mpirun != nullptr) lines.push_back({"mpirun -np K*D " + program + " " + c.name + " ...", c.mpirun});
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
    if (!parse_args(argc, argv, *cmd, inv)) return 0;  // it printed the command's help
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
