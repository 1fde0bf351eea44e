// Config decoding: defaults, repeats, overrides, and errors that name the key with
// its line and column.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "layers/registry.h"
#include "layers/sequential.h"
#include "pipeline/config/config.h"
#include "runtime/error.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {
const char* kBase = R"(model:
  input: [8]
  layers:
    - {type: linear, out: 16}
    - repeat: 3
      layers:
        - {type: relu}
        - {type: linear, out: 16, cost: 2.5}
    - {type: linear, out: 4}
  loss: softmax_cross_entropy
train:
  steps: 5
  batch_size: 32
)";

std::string error_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(text, "t.yaml", overrides);
  } catch (const UserError& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("the default config loads") {
  const Config c = load_config("configs/default.yaml");
  CHECK(c.name == "default");
  CHECK(c.pipeline.partitions == 2);
  CHECK(c.pipeline.micro_batches == 4);
  CHECK(c.output.dir == "runs/default");
  CHECK(c.model.layers.size() == 7);  // embedding, 4 blocks, layernorm, tied head
  CHECK(c.model.layers.back().args.at("tied") == "true");
}

TEST_CASE("the LLaMA config loads: no learned positions, llama_blocks with their options, rmsnorm") {
  const Config c = load_config("configs/llama.yaml");
  CHECK(c.name == "llama");
  CHECK(c.output.dir == "runs/llama");
  REQUIRE(c.model.layers.size() == 7);  // embedding, 4 blocks, rmsnorm, head
  CHECK(c.model.layers[0].args.at("positions") == "0");
  for (int i = 1; i <= 4; ++i) {
    CAPTURE(i);
    CHECK(c.model.layers[i].type == "llama_block");
    CHECK(c.model.layers[i].args.at("kv_heads") == "2");
    CHECK(c.model.layers[i].args.at("hidden") == "352");
  }
  CHECK(c.model.layers[5].type == "rmsnorm");
  auto model = layers::build_model(c.model);
  CHECK(model->layer(1).describe() == "llama_block(128, 4 heads, 2 kv heads, hidden 352, dropout 0.1)");
  // An embedding with no position table, grouped k and v: 256 x 128 + 4 x (2 x 128 + 128^2 x 2
  // + 2 x 64 x 128 + 3 x 128 x 352) + 128 + 128 x 256.
  CHECK(model->parameter_count() == 256 * 128 + 4 * (2 * 128 + 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 352) +
                                        128 + 128 * 256);
}

TEST_CASE("repeats expand, costs and defaults are kept") {
  const Config c = parse_config(kBase, "configs/small.yaml");
  REQUIRE(c.model.layers.size() == 8);
  CHECK(c.model.layers[1].type == "relu");
  CHECK(c.model.layers[2].args.at("out") == "16");
  CHECK(c.model.layers[2].cost.value() == 2.5);
  CHECK(!c.model.layers[0].cost.has_value());
  CHECK(c.model.loss.type == "softmax_cross_entropy");
  CHECK(c.pipeline.recompute == RecomputeMode::kExceptLast);
  CHECK(c.output.dir == "runs/small");
  CHECK(c.model.layers[0].where == "configs/small.yaml:4:7");
}

TEST_CASE("--set overrides any field, including lists and new keys") {
  const Config c = parse_config(kBase, "t.yaml",
                                {"pipeline.partitions=2", "pipeline.balance=[4,4]", "train.steps=7",
                                 "model.layers.0.out=12", "optimizer.lr=0.5"});
  CHECK(c.pipeline.partitions == 2);
  CHECK(c.pipeline.balance == std::vector<int>{4, 4});
  CHECK(c.train.steps == 7);
  CHECK(c.model.layers[0].args.at("out") == "12");
  CHECK(c.optimizer.optimizer.lr == 0.5);
}

TEST_CASE("an unknown key names itself, its place and the valid keys") {
  const std::string e = error_of(std::string(kBase) + "  stepz: 4\n");
  CHECK(e.find("t.yaml:14:3") != std::string::npos);
  CHECK(e.find("train.stepz") != std::string::npos);
  CHECK(e.find("valid keys in train: steps, batch_size") != std::string::npos);
  CHECK(error_of(std::string(kBase) + "trian: {}\n").find("unknown key 'trian'") != std::string::npos);
}

TEST_CASE("a wrong type names the key with line and column") {
  std::string text = kBase;
  text.replace(text.find("steps: 5"), 8, "steps: five");
  const std::string e = error_of(text);
  CHECK(e.find("t.yaml:12:10") != std::string::npos);
  CHECK(e.find("train.steps: expected an integer, got 'five'") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.checkpoint=sometimes"}).find("--set pipeline.checkpoint=sometimes") !=
        std::string::npos);
  CHECK(error_of(kBase, {"pipeline.micro_batches=0"}).find("must be at least 1") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.bucket_mb=-1"}).find("pipeline.bucket_mb: must be at least 0") !=
        std::string::npos);
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.bucket_mb=0.5"}).pipeline.bucket_mb == 0.5);
  // pipeline.capture: one stage, named, not left to auto.
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.partitions=1", "pipeline.capture=true"}).pipeline.capture);
  CHECK(error_of(kBase, {"pipeline.partitions=auto", "pipeline.capture=true"})
            .find("pipeline.capture: captures the training step of one stage; pipeline.partitions: auto may choose "
                  "more: set pipeline.partitions: 1") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.partitions=1", "pipeline.replicas=2", "pipeline.capture=true"})
            .find("pipeline.capture: captures the training step of one stage, or of stages that all run on one device "
                  "(pipeline.devices naming it for every stage, e.g. [cuda:0, cuda:0]), without replicas or a tensor "
                  "group; this config has partitions 1, replicas 2 and tensor_parallel 1: set pipeline.capture: false, "
                  "or replicas and tensor_parallel to 1") != std::string::npos);
  // More stages: captured together when they share one device.
  const Config two = parse_config(kBase, "t.yaml", {"pipeline.partitions=2", "pipeline.devices=[cpu:0, cpu:0]",
                                                    "pipeline.capture=yes"});
  CHECK(two.pipeline.capture);
  CHECK(capture_refusal(two.pipeline).empty());
  CHECK(error_of(kBase, {"pipeline.partitions=2", "pipeline.capture=true"})
            .find("this config has partitions 2 on cpu:0 to cpu:1 (the default): set pipeline.capture: false, or "
                  "pipeline.partitions: 1, or one device for every stage in pipeline.devices") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.partitions=2", "pipeline.devices=[cuda:0, cuda:1]", "pipeline.capture=true"})
            .find("partitions 2 on [cuda:0, cuda:1]: set") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.partitions=3", "pipeline.devices=[cuda:0, cuda:0]", "pipeline.capture=true"})
            .find("partitions 3 on [cuda:0, cuda:0]: set") != std::string::npos);
}

TEST_CASE("pipeline.timeout_s: a default for real jobs, 0 for none, never negative") {
  CHECK(parse_config(kBase, "t.yaml").pipeline.timeout_s == 600);
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.timeout_s=2.5"}).pipeline.timeout_s == 2.5);
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.timeout_s=0"}).pipeline.timeout_s == 0);
  CHECK(error_of(kBase, {"pipeline.timeout_s=-1"}).find("pipeline.timeout_s: must be a number of seconds > 0") !=
        std::string::npos);
  CHECK(error_of(kBase, {"pipeline.timeout_s=soon"}).find("expected a number, got 'soon'") != std::string::npos);
}

TEST_CASE("a missing field is named") {
  std::string text = kBase;
  text.erase(text.find("  batch_size: 32\n"));
  const std::string e = error_of(text);
  CHECK(e.find("train.batch_size: missing") != std::string::npos);
  CHECK(error_of("train: {steps: 1, batch_size: 1}\n").find("model: missing") != std::string::npos);
}

TEST_CASE("malformed YAML and bad overrides are clear errors") {
  CHECK(error_of("model: [1, 2\n").find("t.yaml:2:1: invalid YAML") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.partitions"}).find("expected KEY=VALUE") != std::string::npos);
  CHECK(error_of(kBase, {"train.steps.x=1"}).find("holds a single value") != std::string::npos);
  CHECK_THROWS_WITH_AS(load_config("no/such/file.yaml"), doctest::Contains("cannot read config file"), UserError);
}

TEST_CASE("trace and planner keys: defaults, values and errors naming the key") {
  const Config c = parse_config(kBase, "t.yaml");
  CHECK(c.output.trace);  // 5 steps: a short run
  CHECK(c.trace.first_step == 2);  // steps are numbered from 1, and step 1 warms up
  CHECK(c.trace.last_step == 5);   // clipped to the run
  CHECK(c.pipeline.balance_by == "estimate");
  CHECK(c.pipeline.profile == "runs/t/profile.json");
  CHECK(c.pipeline.memory_limit == 0);
  CHECK_FALSE(parse_config(kBase, "t.yaml", {"train.steps=5000"}).output.trace);  // long: off unless asked
  const Config asked = parse_config(kBase, "t.yaml", {"train.steps=5000", "trace.steps=[100, 120]"});
  CHECK(asked.output.trace);
  CHECK(asked.trace.first_step == 100);
  CHECK(asked.trace.last_step == 120);
  CHECK_FALSE(parse_config(kBase, "t.yaml", {"trace.steps=[1, 2]", "output.trace=false"}).output.trace);
  CHECK(parse_config(kBase, "t.yaml", {"train.steps=1"}).trace.first_step == 1);
  CHECK(parse_config(kBase, "t.yaml", {"train.steps=1"}).trace.last_step == 1);
  CHECK(parse_config(kBase, "t.yaml", {"trace.steps=[5, 5]"}).trace.last_step == 5);  // the last step, 5 of 5
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.memory_limit=20GiB"}).pipeline.memory_limit == (int64_t{20} << 30));
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.memory_limit=1.5 GB"}).pipeline.memory_limit == 1500000000);
  CHECK(parse_config(kBase, "t.yaml", {"pipeline.memory_limit=4096"}).pipeline.memory_limit == 4096);
  CHECK(error_of(kBase, {"trace.steps=[3, 9]"}).find("trace.steps: [3, 9] is not a range of this run's steps 1..5") !=
        std::string::npos);
  CHECK(error_of(kBase, {"trace.steps=[0, 2]"}).find("not a range of this run's steps 1..5 (numbered from 1") !=
        std::string::npos);
  CHECK(error_of(kBase, {"trace.steps=[2]"}).find("expected [first, last]") != std::string::npos);
  CHECK(error_of(kBase, {"output.trace=maybe"}).find("output.trace: expected true or false") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.memory_limit=20 gigs"}).find("pipeline.memory_limit: '20 gigs' is not a byte size") !=
        std::string::npos);
  CHECK(error_of(kBase, {"pipeline.balance_by=time"}).find("pipeline.balance_by: unknown 'time'") != std::string::npos);
  CHECK(error_of(kBase, {"trace.every=3"}).find("unknown key 'every'") != std::string::npos);
  // trace.ops: off by default; times each op, which a captured step does not run one by one.
  CHECK_FALSE(c.trace.ops);
  CHECK(parse_config(kBase, "t.yaml", {"trace.ops=true"}).trace.ops);
  CHECK(error_of(kBase, {"trace.ops=yes please"}).find("trace.ops: expected true or false") != std::string::npos);
  CHECK(error_of(kBase, {"pipeline.partitions=1", "pipeline.capture=true", "trace.ops=true"})
            .find("trace.ops: times each op of a step one by one, and pipeline.capture replays the step as one launch: "
                  "set trace.ops: false, or pipeline.capture: false") != std::string::npos);
  CHECK_FALSE(parse_config(kBase, "t.yaml", {"pipeline.partitions=1", "pipeline.capture=true", "trace.ops=false"})
                  .trace.ops);
}

TEST_CASE("a boolean is read as YAML 1.1 (PyYAML) reads one, and as 1 or 0, for keys and layer options alike") {
  const std::vector<std::pair<std::string, bool>> words = {
      {"true", true},   {"True", true},   {"TRUE", true},   {"yes", true},  {"Yes", true},   {"YES", true},
      {"on", true},     {"On", true},     {"ON", true},     {"1", true},    {"false", false}, {"False", false},
      {"FALSE", false}, {"no", false},    {"No", false},    {"NO", false},  {"off", false},  {"Off", false},
      {"OFF", false},   {"0", false}};
  for (const auto& [word, value] : words) {
    CAPTURE(word);
    // Over the default (a short run traces): each word sets the key both ways.
    CHECK(parse_config(kBase, "t.yaml", {"output.trace=" + word}).output.trace == value);
    CHECK(parse_config(kBase, "t.yaml", {"train.steps=5000", "output.trace=" + word}).output.trace == value);
    // A layer's option (layers/registry.cc: LayerArgs::get_bool): linear's bias.
    const Config c = parse_config(kBase, "t.yaml", {"model.layers.0.bias=" + word});
    CHECK(gpipe::layers::build_model(c.model)->layer(0).parameters().size() == (value ? 2u : 1u));
  }
  for (const char* bad : {"maybe", "y", "n", "2", "truee", "Yes please", "oN"}) {
    CAPTURE(bad);
    CHECK(error_of(kBase, {std::string("output.trace=") + bad}).find("output.trace: expected true or false, got '" +
                                                                    std::string(bad) + "'") != std::string::npos);
    const Config c = parse_config(kBase, "t.yaml", {std::string("model.layers.0.bias=") + bad});
    std::string message = "no error";
    try {
      gpipe::layers::build_model(c.model);
    } catch (const UserError& e) {
      message = e.what();
    }
    CHECK(message.find("option 'bias' must be true or false, got '" + std::string(bad) + "'") != std::string::npos);
  }
}

TEST_CASE("checkpoint.allow_changes takes the identity's keys or all, and refuses any other key by name") {
  using V = std::vector<std::string>;
  CHECK(parse_config(kBase, "t.yaml").checkpoint.allow_changes.empty());
  CHECK(parse_config(kBase, "t.yaml", {"checkpoint.allow_changes=all"}).checkpoint.allow_changes == V{"all"});
  CHECK(parse_config(kBase, "t.yaml", {"checkpoint.allow_changes=[optimizer.lr, data.path]"}).checkpoint.allow_changes ==
        V{"optimizer.lr", "data.path"});
  for (const std::string& key : identity_keys()) {
    CAPTURE(key);
    CHECK(parse_config(kBase, "t.yaml", {"checkpoint.allow_changes=[" + key + "]"}).checkpoint.allow_changes ==
          V{key});
  }
  // A misspelt key would allow nothing and say nothing: refused, with its place, the
  // nearest key and every valid one.
  const std::string e = error_of(kBase, {"checkpoint.allow_changes=[optimizer.lr, nosuch.key]"});
  CHECK(e.rfind("config error at --set checkpoint.allow_changes=[optimizer.lr, nosuch.key]: "
                "checkpoint.allow_changes[1]: unknown key 'nosuch.key'; valid keys: all, model.seed, model.dtype, ",
                0) == 0);
  CHECK(e.find("optimizer.clip_grad_norm, train.seed, train.batch_size (the run's identity") != std::string::npos);
  CHECK(error_of(kBase, {"checkpoint.allow_changes=optimizer.betta"})
            .find("checkpoint.allow_changes: unknown key 'optimizer.betta'; did you mean optimizer.betas? valid keys") !=
        std::string::npos);
  const std::string in_file = error_of(std::string(kBase) + "checkpoint:\n  allow_changes: [model.sead]\n");
  CHECK(in_file.rfind("config error at t.yaml:15:19: checkpoint.allow_changes[0]: unknown key 'model.sead'; did you "
                      "mean model.seed?",
                      0) == 0);
}

TEST_CASE("pipeline.shard_optimizer: optimizer needs pipeline.replicas >= 2, however the two are given") {
  auto sharded = [](const std::vector<std::string>& sets) {
    return parse_config(kBase, "t.yaml", sets).pipeline.shard_optimizer;
  };
  CHECK(sharded({"pipeline.replicas=2", "pipeline.shard_optimizer=optimizer"}) == "optimizer");
  CHECK(sharded({"pipeline.shard_optimizer=none"}) == "none");  // one replica, nothing asked
  const std::string fix = "pipeline.shard_optimizer: optimizer shards the optimizer state over pipeline.replicas, "
                          "which is 1: one replica has nothing to shard; set pipeline.replicas to 2 or more (with "
                          "pipeline.partitions x pipeline.replicas processes under mpirun), or drop shard_optimizer "
                          "(or set it to none)";
  // One replica by default, or named: refused where shard_optimizer was written.
  CHECK(error_of(kBase, {"pipeline.shard_optimizer=optimizer"}) ==
        "config error at --set pipeline.shard_optimizer=optimizer: " + fix);
  CHECK(error_of(kBase, {"pipeline.shard_optimizer=optimizer", "pipeline.replicas=1"}) ==
        "config error at --set pipeline.shard_optimizer=optimizer: " + fix);
  // The file asks for two replicas and a --set lowers them to one: the check sees the
  // value after every --set.
  const std::string two = std::string(kBase) + "pipeline: {replicas: 2, shard_optimizer: optimizer}\n";
  CHECK(parse_config(two, "t.yaml").pipeline.shard_optimizer == "optimizer");
  CHECK(error_of(two, {"pipeline.replicas=1"}) == "config error at t.yaml:14:42: " + fix);
  // And the other way: a file with one replica, raised on the command line.
  const std::string one = std::string(kBase) + "pipeline: {shard_optimizer: optimizer}\n";
  CHECK(error_of(one).rfind("config error at t.yaml:14:29: " + fix, 0) == 0);
  CHECK(parse_config(one, "t.yaml", {"pipeline.replicas=4"}).pipeline.shard_optimizer == "optimizer");
}
