// Every user error of the config reader, one row each: the mistake (a --set override
// or a YAML text), and what the message must say: where it was written (the --set, or
// file:line:column), the key, and the problem. Then the mistakes only the trainer and
// the executor can see (devices, schedule, replicas, stages), which must name their
// key too.
#include <doctest/doctest.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "pipeline/config/config.h"
#include "pipeline/executor/executor.h"
#include "pipeline/train/trainer.h"
#include "runtime/error.h"
#include "runtime/inprocess_transport.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

const char* kBase = R"(model:
  input: [8]
  layers:
    - {type: linear, out: 16}
    - repeat: 2
      layers:
        - {type: relu}
        - {type: linear, out: 16}
    - {type: linear, out: 4}
  loss: softmax_cross_entropy
data: {classes: 4, eval_samples: 16}
pipeline: {partitions: 2, micro_batches: 2}
optimizer: {type: sgd, lr: 0.1}
train:
  steps: 2
  batch_size: 8
)";

std::string error_of(const std::string& text, const std::vector<std::string>& overrides) {
  try {
    parse_config(text, "t.yaml", overrides);
  } catch (const UserError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a UserError: ") + e.what();
  }
  return "no error";
}

struct Row {
  std::string set;                // one --set override of kBase
  std::vector<std::string> says;  // fragments the message must contain, the key first
};

}  // namespace

TEST_CASE("each config mistake given with --set names the --set, the key and the fix") {
  const std::vector<Row> rows = {
      // The shapes of values.
      {"train=5", {"train: expected a mapping of keys (steps, batch_size"}},
      {"output=[a]", {"output: expected a mapping of keys (dir, trace)"}},
      {"output.dirs=x", {"output.dirs: unknown key 'dirs'; did you mean dir? valid keys in output: dir, trace"}},
      // A misspelt section the file does not have: placed at the --set, with the likely key.
      {"pipline.partitions=2", {"pipline: unknown key 'pipline'; did you mean pipeline? valid keys: model, data"}},
      {"train.log_level=[a, b]", {"train.log_level: expected a single value"}},
      {"train.eval_interval=often", {"train.eval_interval: expected an integer, got 'often'"}},
      {"data.seq_len=0", {"data.seq_len: must be at least 1, got 0"}},
      {"optimizer.lr=fast", {"optimizer.lr: expected a number, got 'fast'"}},
      {"optimizer.beta2=inf", {"optimizer.beta2: expected a number, got 'inf'"}},
      {"pipeline.pin_threads=maybe", {"pipeline.pin_threads: expected true or false, got 'maybe'"}},
      {"pipeline.balance={a: 1}", {"pipeline.balance: expected a list of integers, e.g. [3, 3, 2]"}},
      {"pipeline.balance=[2, x]", {"pipeline.balance[1]: expected an integer, got 'x'"}},
      // model
      {"model.input=[4, 0]", {"model.input: dimensions must be positive"}},
      {"model.dtype=int32", {"model.dtype: use float32, float64, bf16 or fp16 (bfloat16 or float16 with float32 master weights), got 'int32'"}},
      {"optimizer.loss_scale=1024", {"optimizer.loss_scale: must be given only with model.dtype: fp16"}},
      {"model.input_dtype=int8", {"model.input_dtype: use int32 (token ids), float32 or float64, got 'int8'"}},
      {"model.layers=5", {"model.layers: expected a list of layers, e.g. [{type: linear, out: 1024}]"}},
      {"model.layers=[]", {"model.layers: is empty; list at least one layer"}},
      {"model.layers=[[1]]", {"model.layers[0]: expected a layer such as {type: relu}"}},
      {"model.layers=[{repeat: 2, layers: [{type: relu}], times: 3}]",
       {"model.layers[0].times: unknown key 'times'; valid keys in model.layers[0]: repeat, layers"}},
      {"model.layers=[{repeat: 0, layers: [{type: relu}]}]", {"model.layers[0].repeat: must be at least 1, got 0"}},
      {"model.layers=[{repeat: 2}]", {"model.layers[0].layers: missing; this field is required"}},
      {"model.layers=[{out: 3}]", {"model.layers[0].type: missing; this field is required"}},
      {"model.layers.0.cost=-1", {"model.layers[0].cost: must be non-negative"}},
      {"model.layers.0.out=[1, 2]", {"model.layers[0].out: layer options take single values"}},
      {"model.layers.1.layers.0=[relu]", {"model.layers[1].layers[0]: expected a layer such as {type: relu}"}},
      {"model.loss=[a]", {"model.loss: expected {type: NAME, ...}"}},
      // data
      {"data.type=images", {"data.type: unknown data type 'images'; valid: teacher, text, tokens, cifar10"}},
      {"data.validation_fraction=1", {"data.validation_fraction: must be in [0, 1)"}},
      {"data.validation_fraction=-0.1", {"data.validation_fraction: must be in [0, 1)"}},
      // pipeline
      {"pipeline.replicas=0", {"pipeline.replicas: must be at least 1, got 0"}},
      {"pipeline.partitions=-2", {"pipeline.partitions: must be at least 1 (or auto), got -2"}},
      {"pipeline.micro_batches=0", {"pipeline.micro_batches: must be at least 1 (or auto), got 0"}},
      {"pipeline.checkpoint=sometimes", {"pipeline.checkpoint: unknown mode 'sometimes'; use always, except_last or never"}},
      {"pipeline.bucket_mb=-1", {"pipeline.bucket_mb: must be at least 0"}},
      {"pipeline.bucket_mb=2e6", {"pipeline.bucket_mb: must be at least 0 (0: one reduction per parameter) and at most 1e6"}},
      {"pipeline.devices=cpu:0", {"pipeline.devices: expected a list such as [cpu:0, cpu:1]"}},
      {"pipeline.devices=[[cpu:0]]", {"pipeline.devices: expected a single value"}},
      {"pipeline.capture=yes please", {"pipeline.capture: "}},
      {"pipeline.capture=true",
       {"pipeline.capture: captures the training step of one stage, or of stages that all run on one device",
        "this config has partitions 2 on cpu:0 to cpu:1 (the default)",
        "set pipeline.capture: false, or pipeline.partitions: 1, or one device for every stage in pipeline.devices"}},
      {"pipeline.shard_optimizer=optimizer",
       {"pipeline.shard_optimizer: optimizer shards the optimizer state over pipeline.replicas, which is 1: one replica "
        "has nothing to shard; set pipeline.replicas to 2 or more",
        "or drop shard_optimizer (or set it to none)"}},
      // optimizer
      {"optimizer.type=lamb", {"optimizer.type: unknown optimizer 'lamb'; valid: sgd, adam, adamw"}},
      {"optimizer.lr=0", {"optimizer.lr: must be > 0 and at most 10 (typical: 1e-4 to 1e-3 for adam", "got 0"}},
      {"optimizer.lr=-0.5", {"optimizer.lr: must be > 0 and at most 10", "got -0.5"}},
      {"optimizer.lr=100000.3",
       {"optimizer.lr: 100000.3 is too large: a learning rate above 10 diverges at once; it must be > 0 and at most 10"}},
      {"optimizer.lr=1e3", {"optimizer.lr: 1e3 is too large"}},
      {"optimizer.momentum=-1.3", {"optimizer.momentum: must be in [0, 1) (0: plain SGD; 0.9 is usual), got -1.3"}},
      {"optimizer.momentum=1", {"optimizer.momentum: must be in [0, 1)", "got 1"}},
      {"optimizer.weight_decay=-0.01", {"optimizer.weight_decay: must be >= 0 (0: none", "got -0.01"}},
      {"optimizer.beta1=1", {"optimizer.beta1: must be in [0, 1) (0.9 is usual), got 1"}},
      {"optimizer.beta2=-0.5", {"optimizer.beta2: must be in [0, 1) (0.999 is usual), got -0.5"}},
      {"optimizer.eps=0", {"optimizer.eps: must be > 0 (1e-8 is usual), got 0"}},
      {"optimizer.eps=-1e-8", {"optimizer.eps: must be > 0", "got -1e-8"}},
      {"optimizer.warmup_steps=-5", {"optimizer.warmup_steps: must be at least 0 (0: no warmup), got -5"}},
      {"optimizer.warmup_steps=1e3", {"optimizer.warmup_steps: expected an integer, got '1e3'"}},
      {"optimizer.warmup_steps=3000000000", {"optimizer.warmup_steps: must be at most 2147483647, got 3000000000"}},
      {"optimizer.min_lr=-0.001", {"optimizer.min_lr: must be in [0, optimizer.lr] = [0, 0.1] (where the cosine", "got -0.001"}},
      {"optimizer.min_lr=0.5", {"optimizer.min_lr: must be in [0, optimizer.lr] = [0, 0.1]", "got 0.5"}},
      {"optimizer.nesterov=true", {"optimizer.nesterov: needs optimizer.momentum > 0"}},
      {"optimizer.nesterov=yes please", {"optimizer.nesterov: expected true or false, got 'yes please'"}},
      {"optimizer.schedule=linear", {"optimizer.schedule: unknown schedule 'linear'; valid: constant, cosine"}},
      {"optimizer.clip_grad_norm=-1", {"optimizer.clip_grad_norm: must be >= 0 (0 = off), got -1"}},
      // train
      {"train.steps=0", {"train.steps: must be at least 1, got 0"}},
      {"train.steps=5000000000", {"train.steps: must be at most 2147483647, got 5000000000"}},
      {"train.batch_size=-8", {"train.batch_size: must be at least 1, got -8"}},
      {"train.log_interval=0", {"train.log_interval: must be at least 1, got 0"}},
      {"train.eval_interval=-1", {"train.eval_interval: must be at least 0 (0: only at the end), got -1"}},
      {"train.eval_samples=-2", {"train.eval_samples: must be at least 0 (0: the whole validation set), got -2"}},
      {"train.blas_threads=0", {"train.blas_threads: must be at least 1 (or auto), got 0"}},
      {"train.log_level=verbose",
       {"train.log_level: unknown level 'verbose'; valid: trace, debug, info, warn, error, critical, off"}},
      {"data.eval_samples=-16", {"data.eval_samples: must be at least 0", "got -16"}},
      {"pipeline.micro_batches=4294967297", {"pipeline.micro_batches: must be at most 2147483647, got 4294967297"}},
      // checkpoint
      {"checkpoint.allow_changes=[nosuch.key]",
       {"checkpoint.allow_changes[0]: unknown key 'nosuch.key'; valid keys: all, model.seed, model.dtype, data.type",
        "train.seed, train.batch_size (the run's identity; anything else, such as train.steps or the pipeline, may "
        "change on resume without being listed)"}},
      {"checkpoint.allow_changes=[optimizer.lr, optimiser.lr]",
       {"checkpoint.allow_changes[1]: unknown key 'optimiser.lr'; did you mean optimizer.lr? valid keys: all, "}},
      {"checkpoint.allow_changes=al", {"checkpoint.allow_changes: unknown key 'al'; did you mean all? valid keys: "}},
      // The overrides themselves.
      {"pipeline.partitions", {"--set pipeline.partitions: expected KEY=VALUE, e.g. --set pipeline.micro_batches=8"}},
      {"=3", {"--set =3: expected KEY=VALUE"}},
      {"pipeline..partitions=2", {"--set pipeline..partitions=2: empty key component in 'pipeline..partitions'"}},
      {"train.steps=[1", {"--set train.steps=[1: the value is not valid YAML"}},
      {"train.steps.x=1", {"--set train.steps.x=1: 'steps' holds a single value, not a mapping"}},
      {"model.layers.9.out=1", {"--set model.layers.9.out=1: '9' is not an index of the list at that point"}},
      {"model.layers.first.out=1", {"--set model.layers.first.out=1: 'first' is not an index of the list"}},
      {"model.layers.-1=relu", {"--set model.layers.-1=relu: '-1' is not an index of the list at that point"}},
  };
  for (const Row& row : rows) {
    CAPTURE(row.set);
    const std::string e = error_of(kBase, {row.set});
    CAPTURE(e);
    // A decoded value's mistake is placed at the --set that wrote it; an override's own
    // mistake starts with it.
    CHECK((e.rfind("config error at --set " + row.set + ": ", 0) == 0 || e.rfind("--set " + row.set + ": ", 0) == 0));
    for (const std::string& s : row.says) CHECK(e.find(s) != std::string::npos);
  }
}

TEST_CASE("the same mistakes written in the file give file:line:column") {
  struct FileRow {
    std::string from, to;  // replace `from` in kBase by `to`
    std::string says;      // "line:col: key: problem"
  };
  const std::vector<FileRow> rows = {
      {"  input: [8]\n", "  input: [8]\n  dtype: half\n", "t.yaml:3:10: model.dtype: use float32, float64, bf16 or fp16 (bfloat16 or float16 with float32 master weights), got 'half'"},
      {"  input: [8]\n", "  input: [8, -1]\n", "t.yaml:2:10: model.input: dimensions must be positive"},
      {"    - {type: linear, out: 4}\n", "    - {type: linear, out: 4, cost: -2}\n",
       "t.yaml:9:36: model.layers[2].cost: must be non-negative"},
      {"        - {type: relu}\n", "        - [relu]\n", "t.yaml:7:11: model.layers[1].layers[0]: expected a layer such as"},
      {"data: {classes: 4, eval_samples: 16}", "data: {type: csv}", "t.yaml:11:14: data.type: unknown data type 'csv'"},
      {"pipeline: {partitions: 2, micro_batches: 2}", "pipeline: {partitions: 2, devices: cpu}",
       "t.yaml:12:36: pipeline.devices: expected a list such as [cpu:0, cpu:1]"},
      {"pipeline: {partitions: 2, micro_batches: 2}", "pipeline: {partitions: 2, shard_optimizer: optimizer}",
       "t.yaml:12:44: pipeline.shard_optimizer: optimizer shards the optimizer state over pipeline.replicas, which is "
       "1: one replica has nothing to shard; set pipeline.replicas to 2 or more"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: sgd, lr: 0.1, nesterov: true}",
       "t.yaml:13:43: optimizer.nesterov: needs optimizer.momentum > 0"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: rmsprop, lr: 0.1}",
       "t.yaml:13:19: optimizer.type: unknown optimizer 'rmsprop'"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: sgd, lr: 0}", "t.yaml:13:28: optimizer.lr: must be > 0"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: sgd, lr: 100000.3}",
       "t.yaml:13:28: optimizer.lr: 100000.3 is too large"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: sgd, lr: 0.1, momentum: -1.3}",
       "t.yaml:13:43: optimizer.momentum: must be in [0, 1) (0: plain SGD; 0.9 is usual), got -1.3"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: adam, lr: 0.1, warmup_steps: -5}",
       "t.yaml:13:48: optimizer.warmup_steps: must be at least 0 (0: no warmup), got -5"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: adam, lr: 0.01, min_lr: 0.02}",
       "t.yaml:13:43: optimizer.min_lr: must be in [0, optimizer.lr] = [0, 0.01]"},
      {"optimizer: {type: sgd, lr: 0.1}", "optimizer: {type: sgd, lr: 0.1, clip_grad_norm: -3}",
       "t.yaml:13:49: optimizer.clip_grad_norm: must be >= 0"},
      {"  batch_size: 8\n", "  batch_size: 8\n  log_level: [debug]\n", "t.yaml:17:14: train.log_level: expected a single value"},
      {"  steps: 2\n", "  steps: 2\n  log_interval: 0\n", "t.yaml:16:17: train.log_interval: must be at least 1, got 0"},
      {"  batch_size: 8\n", "  batch_size: 8\ncheckpoint: {allow_changes: [optimizer.lr, data.sed]}\n",
       "t.yaml:17:44: checkpoint.allow_changes[1]: unknown key 'data.sed'; did you mean data.seed? valid keys: all, "},
  };
  for (const FileRow& row : rows) {
    std::string text = kBase;
    REQUIRE(text.find(row.from) != std::string::npos);
    text.replace(text.find(row.from), row.from.size(), row.to);
    CAPTURE(text);
    const std::string e = error_of(text, {});
    CAPTURE(e);
    CHECK(e.find("config error at " + row.says) == 0);
  }
  // A file that --set turned into one that lacks a key: the missing key is the file's.
  CHECK(error_of(kBase, {"data.type=text"})
            .find("config error at t.yaml:11:7: data.path: data.type text reads a file: set data.path") == 0);
  CHECK(error_of("- model\n- train\n", {}).find("config error at t.yaml: the top level must be a mapping of sections") ==
        0);
}

namespace {
std::string train_error(const std::vector<std::string>& overrides, const Launch& launch = {}) {
  std::ostringstream out;
  try {
    train(parse_config(kBase, "t.yaml", overrides), out, launch);
  } catch (const UserError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a UserError: ") + e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("mistakes only the trainer can see name their key and the fix") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> rows = {
      {{"pipeline.devices=[cpu:0]"},
       "pipeline.devices lists 1 devices but pipeline.partitions is 2; give one device per partition"},
      {{"pipeline.devices=[cpu:0, gpu:1]"}, "device 'gpu:1': unknown kind 'gpu'; use cpu or cuda (e.g. cuda:0)"},
      {{"pipeline.devices=[cpu:0, cpu:one]"}, "device 'cpu:one': the index must be a non-negative integer"},
      {{"pipeline.schedule=zigzag"}, "pipeline.schedule: unknown schedule 'zigzag'"},
      {{"pipeline.balance=[4, 1, 1]"}, "pipeline.balance has 3 entries but the pipeline has 2 cells"},
      {{"pipeline.balance=[6, 0]"}, "pipeline.balance[1] = 0"},
      {{"pipeline.balance=[2, 2]"}, "pipeline.balance sums to 4 but the model has 6"},
      {{"pipeline.partitions=7"}, "the model has only 6 layers but the pipeline has 7 cells"},
      {{"pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=4"},
       "the model has only 6 layers but the pipeline has 8 cells (pipeline.partitions x pipeline.virtual_stages)"},
      {{"pipeline.schedule=1f1b", "pipeline.virtual_stages=2"}, "use interleaved_1f1b or zero_bubble"},
      {{"train.batch_size=1"}, "raise train.batch_size to at least 2 or lower pipeline.micro_batches"},
      {{"pipeline.replicas=2"}, "pipeline.replicas = 2 needs 2 copies of the pipeline: launch mpirun -np 4"},
      {{"model.layers.0.type=linearr"}, "unknown layer type 'linearr'"},
      {{"model.layers.0.type=linearr"}, "; did you mean linear? valid types: "},
      {{"model.layers.0.outt=3"}, "unknown option 'outt'"},
      {{"model.loss=mse"}, "unknown loss type 'mse'"},
      {{"model.loss=softmax_cross_entropi"}, "; did you mean softmax_cross_entropy? valid types: "},
      {{"model.dtype=fp16", "optimizer.loss_scale=1000"}, "optimizer.loss_scale: must be 0 (off) or a power of two"},
      // A plan over the user's memory limit: train refuses it as plan and the sweep do.
      {{"pipeline.memory_limit=100"}, "over pipeline.memory_limit of 100 bytes"},
      // 10^6 x 10^6 float64 weights (8 TB, more than any host has), refused before any is
      // allocated, with the advice for weights (memory_check.h has the exact message).
      {{"model.dtype=float64", "model.input=[1000000]", "model.layers.0.out=1000000"},
       "Weights do not depend on pipeline.micro_batches or train.batch_size: use a smaller model"},
  };
  for (const auto& [sets, says] : rows) {
    CAPTURE(sets.front());
    const std::string e = train_error(sets);
    CAPTURE(e);
    CHECK(e.find(says) != std::string::npos);
  }
}

TEST_CASE("a layer's own refusal of its options names the layer's file:line:column or --set") {
  // What the layer's constructor says, after the type and where the config wrote the
  // layer; the trainer builds the model (and measures its weights) from the config.
  auto error_in = [](const std::string& from, const std::string& to, const std::vector<std::string>& sets = {}) {
    std::string text = kBase;
    REQUIRE(text.find(from) != std::string::npos);
    text.replace(text.find(from), from.size(), to);
    std::ostringstream out;
    try {
      train(parse_config(text, "t.yaml", sets), out);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::vector<std::pair<std::string, std::string>> rows = {
      {error_in("    - {type: linear, out: 4}\n", "    - {type: linear, out: -1}\n"),
       "linear (at t.yaml:9:7): in and out must be positive, got in=16, out=-1"},
      {error_in("    - {type: linear, out: 16}\n", "    - {type: embedding, vocab: 32, dim: 0}\n",
                {"model.input_dtype=int32"}),
       "embedding (at t.yaml:4:7): vocab, dim and the sequence length must be positive, got vocab=32, dim=0, seq_len=8"},
      {error_in("    - {type: linear, out: 16}\n", "    - {type: embedding, vocab: 32, dim: 16, positions: 4}\n",
                {"model.input_dtype=int32"}),
       "embedding (at t.yaml:4:7): positions=4 is shorter than the sequence (8 tokens); use at least 8, or 0 for no "
       "learned positions"},
      {error_in("        - {type: relu}\n", "        - {type: dropout, p: 1.5}\n"),
       "dropout (at t.yaml:7:11): p=1.5 must be in [0, 1); use 0 to disable dropout"},
      {error_in("    - {type: linear, out: 4}\n", "    - {type: swiglu, hidden: 0}\n"),
       "swiglu (at t.yaml:9:7): dim and hidden must be positive, got dim=16, hidden=0"},
      {error_in("  input: [8]\n", "  input: [3, 8, 8]\n", {"model.layers.0={type: conv2d, out: 4, kernel: 0}"}),
       "conv2d (at --set model.layers.0={type: conv2d, out: 4, kernel: 0}): conv2d(3 -> 4, "},
      {error_in("    - {type: linear, out: 16}\n", "    - {type: conv2d, out: 4, kernel: 9, pad: 0}\n",
                {"model.input=[3, 8, 8]"}),
       "conv2d (at t.yaml:4:7): conv2d(3 -> 4, "},
      // A --set of one option: the layer is still the one written at its line, and the
      // option's --set follows (a --set that writes the whole layer names the --set, as
      // conv2d's above).
      {error_in("", "", {"model.layers.0.out=-1"}),
       "linear (at t.yaml:4:7, its out from --set model.layers.0.out=-1): in and out must be positive, got in=8, "
       "out=-1"},
      // A message about that option alone names its --set, once.
      {error_in("", "", {"model.layers.0.out=many"}),
       "layer 'linear' (at --set model.layers.0.out=many): option 'out' must be an integer, got 'many'"},
  };
  for (const auto& [e, says] : rows) {
    CAPTURE(e);
    CHECK(e.rfind(says, 0) == 0);
    CHECK(e.find("(at ") == e.rfind("(at "));  // one place, not two
  }
}

TEST_CASE("the executor refuses stages that do not fit the schedule or the model") {
  layers::ModelSpec spec;
  spec.input = {4};
  spec.layers = {{"linear", {{"out", "4"}}, {}, ""}, {"relu", {}, {}, ""}, {"linear", {{"out", "3"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = layers::build_model(spec);
  const std::vector<Device> two = {Device::cpu(0), Device::cpu(1)};
  InProcessTransport transport(2);
  auto error = [&](std::vector<CellSpec> stages, Schedule s, ExecutorOptions o) -> std::string {
    try {
      Executor ex(*model, std::move(stages), std::move(s), transport, o);
    } catch (const UserError& e) {
      return e.what();
    }
    return "no error";
  };
  const Schedule g2 = gpipe_schedule(2, 2, RecomputeMode::kNever);
  CHECK(error(make_stages({1, 1, 1}, {Device::cpu(0), Device::cpu(1), Device::cpu(0)}), g2, {}) ==
        "the schedule runs 2 cells on 2 stages but 3 cells were given");
  CHECK(error({{0, 2, Device::cpu(0)}, {1, 2, Device::cpu(1)}}, g2, {}) ==
        "cell 1 must start at layer 2 and hold at least one layer");
  CHECK(error({{0, 3, Device::cpu(0)}, {3, 0, Device::cpu(1)}}, g2, {}) ==
        "cell 1 must start at layer 3 and hold at least one layer");
  CHECK(error(make_stages({1, 1}, two), g2, {}) == "the cells hold 2 layers but the model has 3");
  ExecutorOptions far;
  far.local_stage = 2;
  CHECK(error(make_stages({2, 1}, two), g2, far) == "this process was asked to run stage 2 of a 2-stage pipeline");
}

TEST_CASE("a layer option given with --set is placed at the --set, one in the file at its layer") {
  auto build_error = [](const std::string& text, const std::vector<std::string>& sets) {
    try {
      const Config c = parse_config(text, "base.yaml", sets);
      layers::build_model(c.model);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(build_error(kBase, {"model.layers.0.out=many"}) ==
        "layer 'linear' (at --set model.layers.0.out=many): option 'out' must be an integer, got 'many'");
  // Inside a repeat block, and an option the layer does not have.
  CHECK(build_error(kBase, {"model.layers.1.layers.1.bias=perhaps"}) ==
        "layer 'linear' (at --set model.layers.1.layers.1.bias=perhaps): option 'bias' must be true or false, got "
        "'perhaps'");
  CHECK(build_error(kBase, {"model.layers.2.outs=4"})
            .find("layer 'linear' (at --set model.layers.2.outs=4): unknown option 'outs'") == 0);
  // Another layer's --set leaves this one's mistake at its place in the file.
  std::string text = kBase;
  const std::string first = "- {type: linear, out: 16}";
  const size_t at = text.find(first);
  REQUIRE(at != std::string::npos);
  text.replace(at, first.size(), "- {type: linear, out: sixteen}");
  const std::string e = build_error(text, {"model.layers.2.out=4"});
  CHECK(e.find("layer 'linear' (at base.yaml:") == 0);
  CHECK(e.find("option 'out' must be an integer, got 'sixteen'") != std::string::npos);
  CHECK(build_error(kBase, {"model.layers.2.out=4"}) == "no error");
}
