// gpipe: the command-line program. `gpipe train [CONFIG] [--set key=value ...]`
// trains from a YAML config; `gpipe plan` shows how a config would be partitioned and
// scheduled without training.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <mpi.h>

#include <cstdlib>

#include "partition/balance.h"
#include "runtime/mpi_check.h"
#include "runtime/mpi_transport.h"
#include "pipeline/config.h"
#include "pipeline/schedule.h"
#include "pipeline/trainer.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace {

constexpr const char* kUsage = R"(usage:
  gpipe train [CONFIG.yaml] [--set key=value ...]   train (default config: configs/default.yaml)
  mpirun -np K*D gpipe train ...                    one process per stage and replica (K = pipeline.partitions,
                                                    D = pipeline.replicas)
  gpipe plan  [CONFIG.yaml] [--set key=value ...]   show the partition and schedule, do not train
  gpipe help

--set overrides any config field, e.g. --set pipeline.partitions=2 --set pipeline.balance=[3,3,2]
)";

struct Args {
  std::string command;
  std::string config = "configs/default.yaml";
  std::vector<std::string> overrides;
};

Args parse_args(int argc, char** argv) {
  Args a;
  if (argc < 2) throw gpipe::UserError(std::string("no command given\n") + kUsage);
  a.command = argv[1];
  bool have_config = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--set") {
      if (i + 1 >= argc) throw gpipe::UserError("--set needs KEY=VALUE, e.g. --set train.steps=10");
      a.overrides.push_back(argv[++i]);
    } else if (arg.rfind("--set=", 0) == 0) {
      a.overrides.push_back(arg.substr(6));
    } else if (!arg.empty() && arg[0] == '-') {
      throw gpipe::UserError("unknown option '" + arg + "'\n" + kUsage);
    } else if (!have_config) {
      a.config = arg;
      have_config = true;
    } else {
      throw gpipe::UserError("unexpected argument '" + arg + "' (one config file at most)\n" + kUsage);
    }
  }
  return a;
}

int plan(const gpipe::pipeline::Config& c) {
  using namespace gpipe;
  auto model = layers::build_model(c.model);
  const auto balance = pipeline::plan_balance(c, *model);
  const int64_t micro = (c.train.batch_size + c.pipeline.micro_batches - 1) / c.pipeline.micro_batches;
  std::vector<std::optional<double>> overrides;
  for (const auto& l : c.model.layers) overrides.push_back(l.cost);
  const auto costs = partition::layer_costs(*model, micro, c.pipeline.checkpoint != "never", overrides);
  std::printf("model: %d layers, %lld parameters, input %s\n", model->size(),
              static_cast<long long>(model->parameter_count()), shape_str(model->input_shape()).c_str());
  const auto memory = partition::estimate_stage_memory(*model, balance, c.train.batch_size, c.pipeline.micro_batches,
                                                       c.pipeline.checkpoint != "never");
  int first = 0;
  for (size_t k = 0; k < balance.size(); ++k) {
    double s = 0;
    for (int i = first; i < first + balance[k]; ++i) s += costs[i];
    std::printf("stage %zu: layers %d-%d, estimated %.3f ms per micro-batch of %lld, memory %.1f MB "
                "(parameters+state %.1f, activations %.1f)\n",
                k, first, first + balance[k] - 1, s * 1e3, static_cast<long long>(micro), memory[k].total() / 1e6,
                memory[k].parameter_bytes / 1e6, memory[k].activation_bytes / 1e6);
    for (int i = first; i < first + balance[k]; ++i) {
      std::printf("  %3d %-28s %10.3f ms\n", i, model->layer(i).describe().c_str(), costs[i] * 1e3);
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

// Started by mpirun (OpenMPI or a PMI launcher such as Slurm's)?
bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

// MPI for the life of the process, when launched by mpirun.
struct MpiSession {
  MpiSession(int* argc, char*** argv) {
    int provided = 0;
    GPIPE_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided));
    if (provided < MPI_THREAD_SERIALIZED) {
      throw gpipe::Error("this MPI library cannot be called from the stage threads (MPI_THREAD_SERIALIZED)");
    }
    GPIPE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    GPIPE_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  }
  ~MpiSession() {
    if (pipeline != MPI_COMM_NULL) MPI_Comm_free(&pipeline);
    if (replicas != MPI_COMM_NULL) MPI_Comm_free(&replicas);
    MPI_Finalize();
  }
  int rank = 0, size = 1;
  MPI_Comm pipeline = MPI_COMM_NULL, replicas = MPI_COMM_NULL;
};

}  // namespace

int main(int argc, char** argv) {
  gpipe::init_logging("info");
  std::unique_ptr<MpiSession> mpi;
  try {
    if (launched_by_mpi()) mpi = std::make_unique<MpiSession>(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpipe: error: %s\n", e.what());
    return 1;
  }
  // A user's mistake seen by one rank ends every rank, with the message.
  auto fail = [&](int code) {
    if (mpi && mpi->size > 1) MPI_Abort(MPI_COMM_WORLD, code);
    return code;
  };
  try {
    const Args a = parse_args(argc, argv);
    if (a.command == "help" || a.command == "--help" || a.command == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (a.command != "train" && a.command != "plan") {
      throw gpipe::UserError("unknown command '" + a.command + "'\n" + kUsage);
    }
    const auto config = gpipe::pipeline::load_config(a.config, a.overrides);
    if (a.command == "plan") return plan(config);
    gpipe::pipeline::Launch launch;
    std::unique_ptr<gpipe::MpiTransport> transport;
    std::unique_ptr<gpipe::MpiReplicaGroup> replicas;
    if (mpi) {
      // P = K x D ranks: rank r runs stage r % K of replica r / K. One communicator per
      // pipeline (its K stages) and one per stage (its D replicas).
      const int K = config.pipeline.partitions, D = config.pipeline.replicas;
      if (mpi->size != K * D) {
        throw gpipe::UserError("launched as " + std::to_string(mpi->size) + " processes but pipeline.partitions x "
                               "pipeline.replicas is " + std::to_string(K) + " x " + std::to_string(D) +
                               "; run one process per stage and replica: mpirun -np " + std::to_string(K * D));
      }
      gpipe::set_thread_context(mpi->rank, -1);
      launch.rank = mpi->rank % K;
      launch.replica = mpi->rank / K;
      GPIPE_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, launch.replica, launch.rank, &mpi->pipeline));
      GPIPE_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, launch.rank, launch.replica, &mpi->replicas));
      launch.size = K;
      transport = std::make_unique<gpipe::MpiTransport>(mpi->pipeline);
      launch.transport = transport.get();
      replicas = std::make_unique<gpipe::MpiReplicaGroup>(mpi->replicas);
      launch.replicas = replicas.get();
    }
    gpipe::pipeline::train(config, std::cout, launch);
    return 0;
  } catch (const gpipe::UserError& e) {
    std::fprintf(stderr, "gpipe: error%s: %s\n",
                 mpi ? (" on rank " + std::to_string(mpi->rank)).c_str() : "", e.what());
    return fail(2);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpipe: internal error%s: %s\n",
                 mpi ? (" on rank " + std::to_string(mpi->rank)).c_str() : "", e.what());
    return fail(1);
  }
}
