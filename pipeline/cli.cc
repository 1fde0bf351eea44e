#include "pipeline/cli.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "partition/balance.h"
#include "pipeline/config.h"
#include "pipeline/mpi_launch.h"
#include "pipeline/run_model.h"
#include "pipeline/schedule.h"
#include "pipeline/trainer.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace gpipe {
namespace cli {

namespace {

constexpr const char* kDefaultConfig = "configs/default.yaml";

// What a command runs with.
struct Invocation {
  std::string program;  // argv[0]'s file name, for messages
  std::string config = kDefaultConfig;
  std::vector<std::string> overrides;  // --set key=value
  pipeline::MpiLaunch* mpi = nullptr;  // set under mpirun
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

int run_train(Invocation& inv) {
  pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  const pipeline::Launch launch = inv.mpi != nullptr ? inv.mpi->join(config) : pipeline::Launch{};
  pipeline::train(config, std::cout, launch);
  return 0;
}

// How a config would be partitioned and scheduled, without training.
int run_plan(Invocation& inv) {
  const pipeline::Config config = pipeline::load_config(inv.config, inv.overrides);
  const pipeline::RunModel run = pipeline::build_run_model(config);
  const pipeline::Config& c = run.config;
  const layers::Sequential& model = *run.model;
  const auto balance = pipeline::plan_balance(c, model);
  const int64_t micro = (c.train.batch_size + c.pipeline.micro_batches - 1) / c.pipeline.micro_batches;
  const bool remat = c.pipeline.checkpoint != "never";
  const auto costs = partition::layer_costs(model, micro, remat, pipeline::cost_overrides(c));
  std::printf("model: %d layers, %lld parameters, input %s\n", model.size(),
              static_cast<long long>(run.model->parameter_count()), shape_str(model.input_shape()).c_str());
  const auto memory =
      partition::estimate_stage_memory(model, balance, c.train.batch_size, c.pipeline.micro_batches, remat);
  int first = 0;
  for (size_t k = 0; k < balance.size(); ++k) {
    double s = 0;
    for (int i = first; i < first + balance[k]; ++i) s += costs[i];
    std::printf("stage %zu: layers %d-%d, estimated %.3f ms per micro-batch of %lld, memory %.1f MB "
                "(parameters+state %.1f, activations %.1f)\n",
                k, first, first + balance[k] - 1, s * 1e3, static_cast<long long>(micro), memory[k].total() / 1e6,
                memory[k].parameter_bytes / 1e6, memory[k].activation_bytes / 1e6);
    for (int i = first; i < first + balance[k]; ++i) {
      std::printf("  %3d %-28s %10.3f ms\n", i, model.layer(i).describe().c_str(), costs[i] * 1e3);
    }
    first += balance[k];
  }
  const auto sched = pipeline::make_schedule(c.pipeline.schedule, c.pipeline.partitions, c.pipeline.micro_batches,
                                             pipeline::parse_checkpoint_mode(c.pipeline.checkpoint));
  pipeline::check_schedule(sched);
  std::printf("schedule %s (ideal bubble %.3f):\n%s", sched.name.c_str(),
              pipeline::ideal_bubble(c.pipeline.partitions, c.pipeline.micro_batches),
              pipeline::schedule_table(sched).c_str());
  return 0;
}

int run_help(Invocation& inv) {
  std::cout << usage(inv.program) << "\nlayer types: " << join(layers::layer_types())
            << "\nlosses: " << join(layers::loss_types())
            << "\nmodels built in C++ (model: {cpp: NAME}): " << join(layers::model_names()) << "\n";
  return 0;
}

const Command kCommands[] = {
    {"train", "[CONFIG.yaml] [--set key=value ...]", "train (default config: configs/default.yaml)",
     "one process per stage and replica (K = pipeline.partitions, D = pipeline.replicas)", run_train},
    {"plan", "[CONFIG.yaml] [--set key=value ...]", "show the partition and schedule, do not train", nullptr, run_plan},
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
  const bool takes_config = std::string(cmd.args).find("CONFIG") != std::string::npos;
  bool have_config = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (takes_config && arg == "--set") {
      if (i + 1 >= argc) throw UserError("--set needs KEY=VALUE, e.g. --set train.steps=10");
      inv.overrides.push_back(argv[++i]);
    } else if (takes_config && arg.rfind("--set=", 0) == 0) {
      inv.overrides.push_back(arg.substr(6));
    } else if (!arg.empty() && arg[0] == '-') {
      throw UserError("unknown option '" + arg + "' for " + cmd.name + "\n" + usage(inv.program));
    } else if (takes_config && !have_config) {
      inv.config = arg;
      have_config = true;
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
  size_t width = 0;
  for (const auto& l : lines) width = std::max(width, l.first.size());
  std::string out = "usage:\n";
  for (const auto& l : lines) out += "  " + l.first + std::string(width - l.first.size() + 3, ' ') + l.second + "\n";
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
