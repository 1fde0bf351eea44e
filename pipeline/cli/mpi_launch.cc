#include "pipeline/cli/mpi_launch.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "pipeline/train/auto_plan.h"
#include "pipeline/train/run_directory.h"
#include "runtime/device.h"
#include "runtime/device_binding.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/mpi_check.h"
#include "runtime/mpi_transport.h"

#ifdef GPIPE_WITH_CUDA
#include "kernels/backend.h"
#include "runtime/nccl_replica_group.h"
#include "runtime/nccl_transport.h"
#endif

namespace gpipe {
namespace pipeline {

namespace {

// The device of this rank's stage in a multi-process run, from pipeline.devices (one
// per stage): `cuda` without an index is this node's GPU for this rank, its local rank
// modulo the visible GPUs, so one config serves nodes of any size; `cuda:N` and `cpu:N`
// are taken as written. All stages must be on one kind of device, because a pipeline
// has one transport: MPI between host memories, NCCL between GPUs. The resolved device
// is written back into the config, so the trainer puts the stage on exactly that GPU.
// Every rank calls this (finding the local rank is collective).
Device multi_process_device(Config& config, int stage, int world_rank) {
  std::vector<std::string>& devices = config.pipeline.devices;
  // None given: CPU stages. A wrong count is the trainer's to report.
  if (devices.size() != static_cast<size_t>(config.pipeline.partitions)) return Device::cpu(stage);
  bool any_cuda = false, any_cpu = false;
  for (const std::string& d : devices) (parse_device(d).is_cuda() ? any_cuda : any_cpu) = true;
  if (!any_cuda) return parse_device(devices[stage]);
  if (any_cpu) {
    throw UserError("pipeline.devices mixes cpu and cuda devices, but the stages of a multi-process run "
                    "talk through one transport (MPI between host memories, NCCL between GPUs); put every "
                    "stage on cuda (e.g. pipeline.devices: [cuda, cuda]) or every stage on cpu");
  }
#ifndef GPIPE_WITH_CUDA
  (void)world_rank;
  throw UserError("pipeline.devices puts the stages on CUDA devices, but this gpipe was built without CUDA "
                  "(no NCCL transport); build it where nvcc is found (./gpipe then builds with "
                  "--config=cuda) or use cpu devices");
#else
  const int local_rank = node_local_rank(MPI_COMM_WORLD);
  const int count = cuda_device_count();
  const std::string& text = devices[stage];
  const std::string where = "rank " + std::to_string(world_rank) + " (stage " + std::to_string(stage) + ")";
  if (count == 0) {
    throw UserError(where + ": pipeline.devices puts the stage on " + text + ", but no CUDA device is "
                    "visible on this node (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them all)");
  }
  Device device = parse_device(text);
  if (config.pipeline.tensor_parallel > 1 && text.find(':') != std::string::npos) {
    throw UserError(where + ": pipeline.devices names " + text + " for stage " + std::to_string(stage) +
                    ", which would put all " + std::to_string(config.pipeline.tensor_parallel) +
                    " members of its tensor group (pipeline.tensor_parallel) on that one GPU; write `cuda` to give "
                    "each rank its node's GPU by local rank");
  }
  if (text.find(':') == std::string::npos) device.index = local_rank % count;
  if (device.index >= count) {
    throw UserError(where + ": pipeline.devices puts the stage on " + text + ", but this node has " +
                    std::to_string(count) + " visible CUDA device(s); write `cuda` to give each rank its "
                    "node's GPU by local rank");
  }
  devices[stage] = device.str();
  return device;
#endif
}

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

MpiLaunch::MpiLaunch(int* argc, char*** argv) {
  int provided = 0;
  GPIPE_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided));
  if (provided < MPI_THREAD_SERIALIZED) {
    throw Error("this MPI library cannot be called from the stage threads (MPI_THREAD_SERIALIZED)");
  }
  GPIPE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  GPIPE_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
}

MpiLaunch::~MpiLaunch() {
  // The transports use the communicators: they go first.
  tensor_group_.reset();
  replica_group_.reset();
  transport_.reset();
  if (pipeline_ != MPI_COMM_NULL) MPI_Comm_free(&pipeline_);
  if (replicas_ != MPI_COMM_NULL) MPI_Comm_free(&replicas_);
  if (tensor_ != MPI_COMM_NULL) MPI_Comm_free(&tensor_);
  MPI_Finalize();
}

Launch MpiLaunch::join(Config& config) {
  GPIPE_CHECK(transport_ == nullptr, "MpiLaunch::join called twice");
  check_auto_launch(config, size_);
  // The job's layout, from the plan's sizes (validated there: a batch that does not split
  // over the replicas is named before any communicator exists).
  const RankLayout layout = plan_sizes(config).ranks();
  const int K = layout.stages, T = layout.tensor, D = layout.replicas;
  if (size_ != layout.size()) {
    const std::string t = T > 1 ? " x pipeline.tensor_parallel" : "";
    throw UserError("launched as " + std::to_string(size_) + " processes but pipeline.partitions" + t +
                    " x pipeline.replicas is " + std::to_string(K) + (T > 1 ? " x " + std::to_string(T) : "") + " x " +
                    std::to_string(D) + "; run one process per stage" + (T > 1 ? ", tensor-group member" : "") +
                    " and replica: mpirun -np " + std::to_string(layout.size()));
  }
  set_thread_context(rank_, -1);
  // One run id for every rank: the one `gpipe run` gave, else rank 0's new one.
  if (config.run.id.empty() && rank_ == 0) config.run.id = new_run_id();
  char id[64] = {};
  std::snprintf(id, sizeof id, "%s", config.run.id.c_str());
  GPIPE_MPI_CHECK(MPI_Bcast(id, sizeof id, MPI_CHAR, 0, MPI_COMM_WORLD));
  config.run.id = id;
  const RankPlace place = layout.place(rank_);
  Launch launch;
  launch.rank = place.stage;
  launch.replica = place.replica;
  launch.member = place.member;
  launch.tensor = T;
  // A pipeline per (replica, member), its stages in order; the replicas of a (stage,
  // member); the tensor group of a (replica, stage), its members in order.
  GPIPE_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, place.replica * T + place.member, place.stage, &pipeline_));
  GPIPE_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, place.stage * T + place.member, place.replica, &replicas_));
  GPIPE_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, place.replica * K + place.stage, place.member, &tensor_));
  launch.size = K;
  const Device device = multi_process_device(config, launch.rank, rank_);
  if (device.is_cpu()) {
    transport_ = std::make_unique<MpiTransport>(pipeline_, config.pipeline.timeout_s);
    replica_group_ = std::make_unique<MpiReplicaGroup>(replicas_, config.pipeline.timeout_s);
    tensor_group_ = std::make_unique<MpiReplicaGroup>(tensor_, config.pipeline.timeout_s);
  } else {
#ifdef GPIPE_WITH_CUDA
    // NCCL between the GPUs, ordered with events against the stream the stage's
    // kernels run on (the backend the executor will use for this device).
    bind_thread_to_device(device);  // before the first CUDA call of this rank
    Stream& compute = backend_for(device).stream();
    auto nccl = std::make_unique<NcclTransport>(pipeline_, device, compute, config.pipeline.timeout_s);
    NcclTransport* pipeline = nccl.get();
    transport_ = std::move(nccl);
    // Without replicas the group is never used: no NCCL communicator for it.
    if (D > 1) {
      // Its all-reduces ordered against the pipeline's sends and receives, and waited
      // for (with the deadline) by the transport's flush.
      replica_group_ =
          std::make_unique<NcclReplicaGroup>(replicas_, device, compute, pipeline, config.pipeline.timeout_s);
    } else {
      replica_group_ = std::make_unique<MpiReplicaGroup>(replicas_, config.pipeline.timeout_s);
    }
    // The tensor group's sums on the stage's GPUs by NCCL, queued on the device in the
    // same chain as the pipeline's transfers and the replicas' buckets (its split layers'
    // collectives: layers::GroupCollectives hands it the tensors where they are).
    if (T > 1) {
      tensor_group_ = std::make_unique<NcclReplicaGroup>(tensor_, device, compute, pipeline,
                                                         config.pipeline.timeout_s, "the stage's tensor group");
    } else {
      tensor_group_ = std::make_unique<MpiReplicaGroup>(tensor_, config.pipeline.timeout_s);
    }
#endif
  }
  launch.transport = transport_.get();
  launch.replicas = replica_group_.get();
  launch.tensor_group = tensor_group_.get();
  return launch;
}

int MpiLaunch::abort(int code) {
  if (size_ > 1) MPI_Abort(MPI_COMM_WORLD, code);
  return code;
}

}  // namespace pipeline
}  // namespace gpipe
