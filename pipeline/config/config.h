// A training run's configuration, decoded from YAML at the edge into plain structs:
// nothing below this layer sees a YAML node. Errors name the key with its file, line
// and column (or the --set override it came from) and say what would be valid.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layers/optimizer.h"
#include "layers/registry.h"
#include "pipeline/schedule/schedule.h"
#include "runtime/deadline.h"

namespace gpipe {
namespace pipeline {

struct DataConfig {
  // "teacher": inputs x ~ N(0, 1); the label of x is the argmax of a fixed random
  // two-layer tanh network (the teacher), so the task is learnable and seeded.
  // "text": the bytes of any file, for byte-level language modelling (vocabulary 256).
  // "tokens": a file of little-endian uint16 token ids below `vocab`.
  // "cifar10": CIFAR-10's binary format (1 label byte + 3072 pixel bytes per record).
  std::string type = "teacher";
  std::string path;                  // text, tokens, cifar10
  int64_t seq_len = 128;             // text, tokens
  int64_t vocab = 256;               // tokens (text is always 256)
  double validation_fraction = 0.1;  // text, tokens, cifar10: the held-out tail
  int64_t classes = 10;
  int64_t teacher_hidden = 64;
  double teacher_scale = 1.0;  // gain of the teacher's first layer: larger = sharper boundaries
  uint64_t seed = 1;
  int64_t eval_samples = 2048;  // a fixed held-out set, scored at the end
};

struct PipelineConfig {
  int partitions = 1;       // K
  int replicas = 1;         // D: data-parallel copies of the pipeline (multi-process runs)
  // T: each stage split over this many processes, its tensor group (Megatron-LM's tensor
  // parallelism, layers/tensor_parallel.h; multi-process runs, K x T x D ranks).
  int tensor_parallel = 1;
  // With T > 1: Megatron-LM's sequence parallelism (layers/tensor_parallel.h): between
  // the split layers each member holds 1/T of each sample's positions, the norms' and
  // dropouts' activations included; all-gathers and reduce-scatters replace the
  // all-reduces. Nothing changes at T = 1.
  bool sequence_parallel = false;
  double bucket_mb = 25;    // with replicas: gradients reduced in buckets of this many MiB
  // With replicas: "none", or "optimizer" (ZeRO-1: each replica keeps and updates 1/D of
  // each stage's optimizer state, gradients reduce-scattered, parameters all-gathered).
  // "gradients" (ZeRO-2) is a reserved name, refused until it is built.
  std::string shard_optimizer = "none";
  int micro_batches = 1;    // M
  // Rematerialization: pipeline.recompute, or torchgpipe's name pipeline.checkpoint
  // (saved training state is the top-level checkpoint section).
  RecomputeMode recompute = RecomputeMode::kExceptLast;
  std::string schedule = "gpipe";  // see schedule_names()
  int virtual_stages = 1;          // v: cells per stage, for interleaved schedules
  std::string schedule_file;       // a schedule of the user's own (overrides schedule)
  // Weight gradients batched across micro-batches (batch_weight_gradients() in
  // pipeline/schedule/schedule.h): the drain's, and each run of W's, as one product.
  bool batch_weight_gradients = false;
  std::vector<int> balance;          // layers per partition; empty = balance automatically
  std::vector<std::string> devices;  // one per partition; empty = cpu:0 .. cpu:K-1
  bool pin_threads = true;
  // Capture a training step once and replay it (a CUDA graph on a GPU, the recorded calls
  // on the CPU; ExecutorOptions::capture): one stage, or stages all on one device (their
  // steps captured together, one graph), no replicas, no tensor group (capture_refusal).
  bool capture = false;
  // Deadline of every transport wait (a receive, a send's completion, a reduction), in
  // seconds: a stuck or stopped peer ends the job after it instead of hanging it. 0: none.
  double timeout_s = kDefaultTimeoutS;
  // How the balancer weighs layers: "estimate" (the roofline cost model) or "profile"
  // (the measured times in `profile`, torchgpipe's balance by time).
  std::string balance_by = "estimate";
  std::string profile;       // the profile file (`gpipe profile`); default <output.dir>/profile.json
  int64_t memory_limit = 0;  // bytes per device the planner may use ("20GiB"); 0: no limit given
};

struct OptimizerConfig {
  layers::OptimizerConfig optimizer;  // type, lr, momentum, nesterov, betas, eps, weight_decay
  std::string schedule = "constant";  // constant | cosine
  int warmup_steps = 0;
  double min_lr = 0.0;                // where cosine decay ends
  double clip_grad_norm = 0.0;        // 0: no clipping
  // fp16's dynamic loss scaling (pipeline::ExecutorOptions::loss_scale): the initial
  // scale (65536 for an fp16 model unless given; 0 turns it off) and the clean steps
  // after which it doubles. Only an fp16 model scales its loss.
  double loss_scale = 0.0;
  int loss_scale_window = 2000;
};

struct TrainConfig {
  int steps = 100;
  int64_t batch_size = 64;
  uint64_t seed = 0;
  int log_interval = 10;
  int eval_interval = 0;     // validation loss every N steps (0: only at the end)
  int64_t eval_samples = 0;  // validation samples scored each time (0: all)
  int blas_threads = 1;  // BLAS threads per stage: a CPU device is one core
  std::string log_level = "info";
};

struct OutputConfig {
  std::string dir;  // default runs/<config name>
  // Write trace.json (Chrome trace events, for Perfetto). Default: on for runs of at
  // most kTraceDefaultMaxSteps steps, or whenever trace.steps is given; an explicit
  // false wins.
  bool trace = true;
};

// Saved training state (pipeline/checkpoint/checkpoint.h): what to save, where, and what to resume.
struct CheckpointConfig {
  int every = 0;    // save after every N steps; 0: only on demand (SIGUSR1) and on SIGINT/SIGTERM
  int keep = 3;     // complete checkpoints kept, newest first; 0: all
  std::string dir;  // default <output.dir>/checkpoints
  bool async = false;  // copy to host memory, write on a background thread while training goes on
  // "": start afresh; "auto": the newest complete checkpoint in dir (none: start afresh);
  // otherwise a step directory or a checkpoints folder that must hold one.
  std::string resume;
  // Fields of the run's identity (run_identity in run_directory.h: model, data, seeds,
  // batch, optimizer) that a resume may change from what the checkpoint was saved with,
  // by their keys ("optimizer.lr"), or "all". Anything else that differs is refused.
  // A key that is not in identity_keys() (nor "all") is refused when the config loads.
  std::vector<std::string> allow_changes;
};

// The keys of a run's identity, in run_identity's order (pipeline/train/run_directory.h
// builds the identity; the config reader, below it, refuses any other key in
// checkpoint.allow_changes). Listed once here: run_directory_test checks that
// run_identity has exactly these keys, so the two cannot drift apart.
const std::vector<std::string>& identity_keys();

// How this process was asked to run, from the command line (not YAML).
struct RunOptions {
  // The run's id: given by `gpipe run` to every launch of its job; empty: a new run
  // makes one (rank 0 under mpirun, for every rank), a resumed run keeps its checkpoint's.
  std::string id;
  bool id_given = false;  // --run-id named it: a resume refuses a checkpoint of another run
  // --start-over: a fresh run in an output directory that holds another run's
  // checkpoints or reports moves them aside (run_directory.h) instead of refusing.
  bool start_over = false;
  // --heartbeat DIR: `gpipe run` watches this process's progress through a file there.
  std::string heartbeat_dir;
  // The command that continues this run, for the hint after a stop ("" when a
  // supervisor prints its own).
  std::string resume_command;
};

// Which steps the trace (and report.html's timeline, which shows the median one) records:
// [first_step, last_step], numbered from 1 as in the terminal and report.json. Default:
// steps 2 .. 11 (step 1 warms up), clipped to the run; a one-step run records step 1. A
// window, so that a long run's trace stays small.
struct TraceConfig {
  int first_step = 2, last_step = 11;
  bool given = false;  // trace.steps written in the config (a resumed run keeps it)
  // trace.ops: time each backend op of every training step (ExecutorOptions::op_times):
  // the report lists each stage's ops by their time (the device's on a GPU). Each op
  // records two events, which slows a step whose host is its bound: a run to read where
  // the time goes, not to time the step. Not with pipeline.capture.
  bool ops = false;
};
constexpr int kTraceDefaultMaxSteps = 1000;
constexpr int kTraceDefaultSteps = 10;
// The default window of a launch of a run of `steps` steps whose first step is number
// `first` (1, or a resumed run's checkpoint step + 1): the kTraceDefaultSteps steps after
// `first` (which warms up), clipped to the run.
TraceConfig default_trace_window(int first, int steps);

// The keys a config leaves to gpipe with `auto`: the trainer takes the sweep's fastest
// plan that fits for them (pipeline/train/auto_plan.h). Until then the values beside them
// are the defaults.
struct AutoKeys {
  bool partitions = false, micro_batches = false, schedule = false, blas_threads = false;
  bool any() const { return partitions || micro_batches || schedule || blas_threads; }
};

struct Config {
  std::string name;  // the file's stem, "default"
  std::string source;
  std::string effective;  // the YAML as decoded, --set overrides applied (empty for a config built in C++)
  layers::ModelSpec model;
  DataConfig data;
  PipelineConfig pipeline;
  OptimizerConfig optimizer;
  TrainConfig train;
  OutputConfig output;
  CheckpointConfig checkpoint;
  TraceConfig trace;
  RunOptions run;
  AutoKeys autos;
};

// The checkpoints folder: checkpoint.dir, or <output.dir>/checkpoints.
std::string checkpoint_dir(const Config& config);

// Why pipeline.capture cannot take this pipeline (partitions, replicas, tensor_parallel and
// devices as given), with the fix; empty when it can: one stage, or stages that all name
// one device, without replicas or a tensor group.
std::string capture_refusal(const PipelineConfig& p);

// "20GiB", "512 MB", "1.5e9": a byte count with an optional unit (B, KB, MB, GB, TB in
// powers of 1000; KiB, MiB, GiB, TiB in powers of 1024). Throws UserError naming `what`.
int64_t parse_byte_size(const std::string& text, const std::string& what);

// Reads and decodes a YAML file; `overrides` are "a.b=value" strings applied before
// decoding (value is YAML: 3, 0.1, always, [3, 3, 2]). Throws UserError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from text; `source` names it in messages.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

}  // namespace pipeline
}  // namespace gpipe
