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
#include "runtime/device.h"
#include "runtime/device_binding.h"
#include "runtime/mpi_check.h"
#include "runtime/mpi_transport.h"
#include "pipeline/config.h"
#include "pipeline/schedule.h"
#include "pipeline/trainer.h"
#include "runtime/error.h"
#include "runtime/logging.h"

#ifdef GPIPE_WITH_CUDA
#include "kernels/backend.h"
#include "runtime/nccl_transport.h"
#endif

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

// The device of this rank's stage in a multi-process run, from pipeline.devices (one
// per stage): `cuda` without an index is this node's GPU for this rank, its local rank
// modulo the visible GPUs, so one config serves nodes of any size; `cuda:N` and `cpu:N`
// are taken as written. All stages must be on one kind of device, because a pipeline
// has one transport: MPI between host memories, NCCL between GPUs. The resolved device
// is written back into the config, so the trainer puts the stage on exactly that GPU.
// Every rank calls this (finding the local rank is collective).
gpipe::Device multi_process_device(gpipe::pipeline::Config& config, int stage, int world_rank) {
  std::vector<std::string>& devices = config.pipeline.devices;
  // None given: CPU stages. A wrong count is the trainer's to report.
  if (devices.size() != static_cast<size_t>(config.pipeline.partitions)) return gpipe::Device::cpu(stage);
  bool any_cuda = false, any_cpu = false;
  for (const std::string& d : devices) (gpipe::parse_device(d).is_cuda() ? any_cuda : any_cpu) = true;
  if (!any_cuda) return gpipe::parse_device(devices[stage]);
  if (any_cpu) {
    throw gpipe::UserError("pipeline.devices mixes cpu and cuda devices, but the stages of a multi-process run "
                           "talk through one transport (MPI between host memories, NCCL between GPUs); put every "
                           "stage on cuda (e.g. pipeline.devices: [cuda, cuda]) or every stage on cpu");
  }
#ifndef GPIPE_WITH_CUDA
  (void)world_rank;
  throw gpipe::UserError("pipeline.devices puts the stages on CUDA devices, but this gpipe was built without CUDA "
                         "(no NCCL transport); build it where nvcc is found (./gpipe then builds with "
                         "--config=cuda) or use cpu devices");
#else
  const int local_rank = gpipe::node_local_rank(MPI_COMM_WORLD);
  const int count = gpipe::cuda_device_count();
  const std::string& text = devices[stage];
  const std::string where = "rank " + std::to_string(world_rank) + " (stage " + std::to_string(stage) + ")";
  if (count == 0) {
    throw gpipe::UserError(where + ": pipeline.devices puts the stage on " + text + ", but no CUDA device is "
                           "visible on this node (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them all)");
  }
  gpipe::Device device = gpipe::parse_device(text);
  if (text.find(':') == std::string::npos) device.index = local_rank % count;
  if (device.index >= count) {
    throw gpipe::UserError(where + ": pipeline.devices puts the stage on " + text + ", but this node has " +
                           std::to_string(count) + " visible CUDA device(s); write `cuda` to give each rank its "
                           "node's GPU by local rank");
  }
  devices[stage] = device.str();
  return device;
#endif
}

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
  // Outside the try: a failure's MPI_Abort must come before their destructors, which
  // would otherwise free buffers that sends and reductions still use.
  std::unique_ptr<gpipe::Transport> transport;
  std::unique_ptr<gpipe::ReplicaGroup> replicas;
  try {
    const Args a = parse_args(argc, argv);
    if (a.command == "help" || a.command == "--help" || a.command == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (a.command != "train" && a.command != "plan") {
      throw gpipe::UserError("unknown command '" + a.command + "'\n" + kUsage);
    }
    auto config = gpipe::pipeline::load_config(a.config, a.overrides);
    if (a.command == "plan") return plan(config);
    gpipe::pipeline::Launch launch;
    if (!mpi) {
      // This thread moves the weights and evaluates on the stages' GPUs: bound to the
      // first one before any CUDA call, it never makes a context on a GPU no stage uses.
      std::vector<gpipe::Device> stage_devices;
      for (const std::string& d : config.pipeline.devices) stage_devices.push_back(gpipe::parse_device(d));
      const gpipe::Device mine = gpipe::main_thread_device(stage_devices);
      if (mine.index < gpipe::cuda_device_count()) gpipe::bind_thread_to_device(mine);  // else the trainer says why
    }
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
      const gpipe::Device device = multi_process_device(config, launch.rank, mpi->rank);
      if (device.is_cpu()) {
        transport = std::make_unique<gpipe::MpiTransport>(mpi->pipeline);
        replicas = std::make_unique<gpipe::MpiReplicaGroup>(mpi->replicas);
      } else {
#ifdef GPIPE_WITH_CUDA
        // NCCL between the GPUs, ordered with events against the stream the stage's
        // kernels run on (the backend the executor will use for this device).
        gpipe::bind_thread_to_device(device);  // before the first CUDA call of this rank
        gpipe::Stream& compute = gpipe::backend_for(device).stream();
        auto nccl = std::make_unique<gpipe::NcclTransport>(mpi->pipeline, device, compute);
        gpipe::NcclTransport* pipeline = nccl.get();
        transport = std::move(nccl);
        // Without replicas the group is never used: no NCCL communicator for it.
        if (D > 1) {
          // Its all-reduces ordered against the pipeline's sends and receives.
          replicas = std::make_unique<gpipe::NcclReplicaGroup>(mpi->replicas, device, compute, pipeline);
        } else {
          replicas = std::make_unique<gpipe::MpiReplicaGroup>(mpi->replicas);
        }
#endif
      }
      launch.transport = transport.get();
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
