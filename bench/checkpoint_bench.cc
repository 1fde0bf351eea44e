// Checkpoint speed: how fast a model's and its optimizer's state is saved and loaded,
// against a plain copy of the same bytes on the same disk, and how long a save stops
// training, synchronous and asynchronous. One JSON line per measurement.
//
//   checkpoint_bench CONFIG.yaml DIR [--set key=value ...] [--repeats N]
//
// The config's model is built and placed on its pipeline's stages (one process), takes
// one optimizer step (so Adam's moments exist), and is then saved to DIR/ckpt
// repeatedly: `sync` = host copies plus the files written and made durable; `stall`
// = what the training thread waits for with checkpoint.async (the host copies and the
// hand-over to the writer thread); `load` = reading it back with every file checked;
// `copy` = the saved folder copied file by file with `dd bs=16M conv=fsync` (read, write,
// fsync: what a writer of these bytes does) right after each save, the disk's own rate
// for the same bytes. Not `cp`: coreutils' cp copies in the kernel (copy_file_range),
// which on this VM's disk is 3 to 4 times faster than any write from user space.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pipeline/checkpoint/checkpoint.h"
#include "pipeline/checkpoint/checkpoint_writer.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/executor/executor.h"
#include "pipeline/planning/plan.h"
#include "runtime/inprocess_transport.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::pipeline;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int64_t folder_bytes(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  }
  return n;
}

void emit(const std::string& config, const std::string& what, double s, int64_t bytes) {
  nlohmann::json j{{"config", config}, {"what", what}, {"seconds", s}, {"bytes", bytes},
                   {"gb_per_s", bytes / s / 1e9}};
  std::cout << j.dump() << std::endl;
}

// The command line: CONFIG.yaml DIR [--set key=value ...] [--repeats N].
struct Args {
  std::string config_path, dir;
  std::vector<std::string> overrides;
  int repeats = 3;
};

// Reads the arguments after the two positional ones; anything else is ignored.
Args parse_args(int argc, char** argv) {
  Args args;
  args.config_path = argv[1];
  args.dir = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--set" && i + 1 < argc) args.overrides.push_back(argv[++i]);
    if (a == "--repeats" && i + 1 < argc) args.repeats = std::atoi(argv[++i]);
  }
  return args;
}

// One step, so that the optimizer has state: random inputs of the model's shape.
void train_one_step(Executor& ex, const layers::Sequential& model, const Plan& plan) {
  Shape in{plan.replica_batch};
  in.insert(in.end(), model.input_shape().begin(), model.input_shape().end());
  Tensor x = model.input_dtype() == DType::kI32
                 ? gpipe::testing::random_labels(shape_numel(in), 2, 1).reshape(in)
                 : gpipe::testing::random_tensor(in, model.input_dtype(), 1);
  Shape out_shape{plan.replica_batch};
  const Shape& o = model.output_shape();
  out_shape.insert(out_shape.end(), o.begin(), o.end() - 1);
  Tensor y = gpipe::testing::random_labels(shape_numel(out_shape), static_cast<int>(o.back()), 2).reshape(out_shape);
  ex.step(x, y);
}

// Every stage's model and optimizer state, as a save takes them.
std::vector<ShardTensors> stage_shards(Executor& ex, int stages) {
  std::vector<ShardTensors> out;
  for (int k = 0; k < stages; ++k) {
    StageState s = ex.save_state(k);
    out.push_back({std::move(s.model), std::move(s.optimizer)});
  }
  return out;
}

// Copies the saved folder's files into dir/copy with dd (read, write, fsync) and returns the seconds dd took;
// throws if it failed.
double timed_dd_copy(const std::string& dir, const std::string& saved) {
  std::filesystem::remove_all(dir + "/copy");
  const std::string cmd = "mkdir '" + dir + "/copy' && for f in '" + saved + "'/*; do dd if=\"$f\" of='" + dir +
                          "/copy/'\"$(basename \"$f\")\" bs=16M conv=fsync status=none || exit 1; done";
  const auto t1 = Clock::now();
  if (std::system(cmd.c_str()) != 0) throw Error("the copy with dd failed");
  return seconds_since(t1);
}

// Synchronous saves (steps 1 to repeats) into the store, each followed by a dd copy of what it wrote: this disk's
// write rate drifts by several times within minutes, so each pair sees the same disk. Returns the last save's size.
int64_t time_saves_and_copies(const Args& args, Executor& ex, int stages, CheckpointStore& store) {
  int64_t bytes = 0;
  for (int r = 0; r < args.repeats; ++r) {
    const auto t0 = Clock::now();
    store.save(r + 1, stage_shards(ex, stages), nlohmann::json::object());
    const double s = seconds_since(t0);
    bytes = folder_bytes(store.step_path(r + 1));
    emit(args.config_path, "sync", s, bytes);
    emit(args.config_path, "copy", timed_dd_copy(args.dir, store.step_path(r + 1)), bytes);
  }
  return bytes;
}

// How long an asynchronous save stops the training thread: the host copies and the hand-over to the writer.
void time_async_stalls(const Args& args, Executor& ex, int stages, int64_t bytes) {
  AsyncCheckpointWriter writer(CheckpointStore(args.dir + "/async", 1));
  for (int r = 0; r < args.repeats; ++r) {
    writer.wait();  // the previous save, outside the stall
    const auto t0 = Clock::now();
    writer.save(r + 1, stage_shards(ex, stages), nlohmann::json::object());
    emit(args.config_path, "stall", seconds_since(t0), bytes);
  }
  writer.wait();
}

// Loads the last synchronous save back, every file checked, `repeats` times.
void time_loads(const Args& args, const CheckpointStore& store, int64_t bytes) {
  const std::string saved = store.step_path(args.repeats);
  for (int r = 0; r < args.repeats; ++r) {
    const auto t0 = Clock::now();
    const LoadedCheckpoint back = load_checkpoint(saved);
    emit(args.config_path, "load", seconds_since(t0), bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s CONFIG.yaml DIR [--set key=value ...] [--repeats N]\n", argv[0]);
    return 2;
  }
  const Args args = parse_args(argc, argv);
  try {
    const Config loaded = load_config(args.config_path, args.overrides);
    RunModel run = build_run_model(loaded);
    const Config& c = run.config;
    layers::Sequential& model = *run.model;
    const Plan plan = make_plan(c, model);
    InProcessTransport transport(plan.stages);
    ExecutorOptions opts;
    opts.optimizer = c.optimizer.optimizer;
    Executor ex(model, plan.cells, plan.schedule, transport, opts);
    train_one_step(ex, model, plan);

    std::filesystem::remove_all(args.dir);
    CheckpointStore store(args.dir + "/ckpt", 1);
    const int64_t bytes = time_saves_and_copies(args, ex, plan.stages, store);
    time_async_stalls(args, ex, plan.stages, bytes);
    time_loads(args, store, bytes);
    std::filesystem::remove_all(args.dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
