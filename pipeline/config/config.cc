#include "pipeline/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "runtime/error.h"
#include "runtime/text.h"

namespace gpipe {
namespace pipeline {

namespace {

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

class Decoder {
 public:
  explicit Decoder(std::string source) : source_(std::move(source)) {}

  // Records that `path` (and everything under it) came from a --set override.
  void note_override(const std::string& path, const std::string& text) { overrides_[path] = text; }

  std::string where(const YAML::Node& n, const std::string& path) const {
    // --set spells list indices as components: model.layers[0].cost is model.layers.0.cost.
    std::string dotted;
    for (char ch : path) {
      if (ch == '[') {
        dotted += '.';
      } else if (ch != ']') {
        dotted += ch;
      }
    }
    const YAML::Mark m = n.Mark();
    for (const auto& kv : overrides_) {
      if (dotted == kv.first || dotted.rfind(kv.first + ".", 0) == 0) return "--set " + kv.second;
      // A key the file does not have, made by a --set below it (pipline.partitions=2).
      if (m.is_null() && kv.first.rfind(dotted + ".", 0) == 0) return "--set " + kv.second;
    }
    if (m.is_null()) return source_;
    return source_ + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
  }

  [[noreturn]] void fail(const YAML::Node& n, const std::string& path, const std::string& msg) const {
    throw UserError("config error at " + where(n, path) + ": " + path + ": " + msg);
  }

  // The node must be a mapping whose keys are all in `allowed`.
  void check_map(const YAML::Node& n, const std::string& path, const std::vector<std::string>& allowed) const {
    if (!n.IsMap()) fail(n, path, "expected a mapping of keys (" + join(allowed) + ")");
    for (auto it = n.begin(); it != n.end(); ++it) {
      const std::string key = it->first.Scalar();
      bool ok = false;
      for (const auto& a : allowed) ok = ok || a == key;
      if (!ok) {
        const std::string p = path.empty() ? key : path + "." + key;
        fail(it->first, p, "unknown key '" + key + "';" + did_you_mean(key, allowed) + " valid keys" +
                               (path.empty() ? "" : " in " + path) + ": " + join(allowed));
      }
    }
  }

  YAML::Node required(const YAML::Node& map, const std::string& key, const std::string& path) const {
    YAML::Node n = map[key];
    if (!n) fail(map, path.empty() ? key : path + "." + key, "missing; this field is required");
    return n;
  }

  std::string str(const YAML::Node& n, const std::string& path) const {
    if (!n.IsScalar()) fail(n, path, "expected a single value");
    return n.Scalar();
  }

  int64_t integer(const YAML::Node& n, const std::string& path) const {
    const std::string s = str(n, path);
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0') fail(n, path, "expected an integer, got '" + s + "'");
    return v;
  }

  int64_t positive(const YAML::Node& n, const std::string& path) const {
    const int64_t v = integer(n, path);
    if (v < 1) fail(n, path, "must be at least 1, got " + std::to_string(v));
    return v;
  }

  // An integer field held as int: at least `least`, and small enough for an int.
  int small_int(const YAML::Node& n, const std::string& path, int64_t least, const std::string& meaning) const {
    const int64_t v = integer(n, path);
    if (v < least) fail(n, path, "must be at least " + std::to_string(least) + meaning + ", got " + std::to_string(v));
    if (v > INT32_MAX) fail(n, path, "must be at most " + std::to_string(INT32_MAX) + ", got " + std::to_string(v));
    return static_cast<int>(v);
  }

  // The message of a number outside its range: "must be in [0, 1) (...), got -1.3",
  // with the value as it was written.
  [[noreturn]] void out_of_range(const YAML::Node& n, const std::string& path, const std::string& valid) const {
    fail(n, path, "must be " + valid + ", got " + (n.IsScalar() ? n.Scalar() : std::string("?")));
  }

  double number(const YAML::Node& n, const std::string& path) const {
    const std::string s = str(n, path);
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || !std::isfinite(v)) fail(n, path, "expected a number, got '" + s + "'");
    return v;
  }

  bool boolean(const YAML::Node& n, const std::string& path) const {
    const std::string s = str(n, path);
    if (const std::optional<bool> b = parse_boolean(s)) return *b;
    fail(n, path, "expected true or false, got '" + s + "'");
  }

  std::vector<int64_t> int_list(const YAML::Node& n, const std::string& path) const {
    std::vector<int64_t> out;
    if (n.IsScalar()) {
      out.push_back(integer(n, path));
      return out;
    }
    if (!n.IsSequence()) fail(n, path, "expected a list of integers, e.g. [3, 3, 2]");
    for (size_t i = 0; i < n.size(); ++i) out.push_back(integer(n[i], path + "[" + std::to_string(i) + "]"));
    return out;
  }

  // Appends the layers of a list, expanding `repeat` blocks.
  void layers(const YAML::Node& list, const std::string& path, std::vector<layers::LayerSpec>& out) const {
    if (!list.IsSequence()) fail(list, path, "expected a list of layers, e.g. [{type: linear, out: 1024}]");
    for (size_t i = 0; i < list.size(); ++i) {
      const YAML::Node item = list[i];
      const std::string p = path + "[" + std::to_string(i) + "]";
      if (!item.IsMap()) fail(item, p, "expected a layer such as {type: relu} or a {repeat: N, layers: [...]} block");
      if (item["repeat"]) {
        check_map(item, p, {"repeat", "layers"});
        const int64_t times = positive(item["repeat"], p + ".repeat");
        std::vector<layers::LayerSpec> block;
        layers(required(item, "layers", p), p + ".layers", block);
        for (int64_t t = 0; t < times; ++t) out.insert(out.end(), block.begin(), block.end());
        continue;
      }
      out.push_back(layer(item, p));
    }
  }

  layers::LayerSpec layer(const YAML::Node& item, const std::string& p) const {
    layers::LayerSpec spec;
    if (item.IsScalar()) {  // "relu" is short for {type: relu}
      spec.type = item.Scalar();
      spec.where = where(item, p);
      return spec;
    }
    if (!item.IsMap()) fail(item, p, "expected {type: NAME, ...}");
    spec.type = str(required(item, "type", p), p + ".type");
    spec.where = where(item, p);
    for (auto it = item.begin(); it != item.end(); ++it) {
      const std::string key = it->first.Scalar();
      if (key == "type") continue;
      if (key == "cost") {
        const double c = number(it->second, p + ".cost");
        if (c < 0) fail(it->second, p + ".cost", "must be non-negative");
        spec.cost = c;
        continue;
      }
      if (key == "name") {  // what checkpoints call the layer
        spec.name = str(it->second, p + ".name");
        continue;
      }
      if (!it->second.IsScalar()) fail(it->second, p + "." + key, "layer options take single values");
      spec.args[key] = it->second.Scalar();
      const std::string own = where(it->second, p + "." + key);
      // Its messages name its own --set (not one that wrote the whole layer: the layer's place).
      if (own.rfind("--set ", 0) == 0 && own != spec.where) spec.option_where[key] = own;
    }
    return spec;
  }

  // A model written as YAML layers: input, dtypes, seed, layers, loss.
  void yaml_model(const YAML::Node& model, layers::ModelSpec& m) const {
    check_map(model, "model", {"input", "input_dtype", "dtype", "seed", "layers", "loss", "cpp"});
    for (int64_t d : int_list(required(model, "input", "model"), "model.input")) {
      if (d < 1) fail(model["input"], "model.input", "dimensions must be positive");
      m.input.push_back(d);
    }
    if (model["dtype"]) {
      const std::string dt = str(model["dtype"], "model.dtype");
      if (dt != "float32" && dt != "float64" && dt != "bf16" && dt != "bfloat16" && dt != "fp16" && dt != "float16") {
        fail(model["dtype"], "model.dtype",
             "use float32, float64, bf16 or fp16 (bfloat16 or float16 with float32 master weights), got '" + dt + "'");
      }
      m.dtype = parse_dtype(dt);
    }
    if (model["input_dtype"]) {
      const std::string dt = str(model["input_dtype"], "model.input_dtype");
      if (dt != "float32" && dt != "float64" && dt != "int32") {
        fail(model["input_dtype"], "model.input_dtype", "use int32 (token ids), float32 or float64, got '" + dt + "'");
      }
      m.input_dtype = parse_dtype(dt);
    }
    if (model["seed"]) m.seed = static_cast<uint64_t>(integer(model["seed"], "model.seed"));
    layers(required(model, "layers", "model"), "model.layers", m.layers);
    if (m.layers.empty()) fail(model["layers"], "model.layers", "is empty; list at least one layer");
    m.loss = layer(required(model, "loss", "model"), "model.loss");
    // A model that starts with an embedding reads token ids.
    if (!m.input_dtype && m.layers.front().type == "embedding") m.input_dtype = DType::kI32;
  }

  // A model built in C++ and registered by name: {cpp: NAME, OPTION: value, ...}; its
  // other keys are its options, read by its factory (layers::register_model).
  layers::LayerSpec cpp_model(const YAML::Node& model) const {
    layers::LayerSpec spec;
    spec.type = str(model["cpp"], "model.cpp");
    spec.where = where(model, "model");
    for (auto it = model.begin(); it != model.end(); ++it) {
      const std::string key = it->first.Scalar();
      if (key == "cpp") continue;
      if (!it->second.IsScalar()) fail(it->second, "model." + key, "the options of a C++ model take single values");
      spec.args[key] = it->second.Scalar();
    }
    return spec;
  }

 private:
  std::string source_;
  std::map<std::string, std::string> overrides_;
};

// Applies "a.b.c=value" to the tree, creating mappings on the way.
void apply_override(YAML::Node& root, const std::string& text, Decoder& dec) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw UserError("--set " + text + ": expected KEY=VALUE, e.g. --set pipeline.micro_batches=8");
  }
  const std::string path = text.substr(0, eq), value = text.substr(eq + 1);
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) {
    if (part.empty()) throw UserError("--set " + text + ": empty key component in '" + path + "'");
    parts.push_back(part);
  }
  YAML::Node value_node;
  try {
    value_node = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw UserError("--set " + text + ": the value is not valid YAML: " + e.msg);
  }
  YAML::Node cur = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (cur.IsSequence()) {
      char* end = nullptr;
      const long idx = std::strtol(parts[i].c_str(), &end, 10);
      if (*end != '\0' || idx < 0 || static_cast<size_t>(idx) >= cur.size()) {
        throw UserError("--set " + text + ": '" + parts[i] + "' is not an index of the list at that point");
      }
      cur.reset(cur[static_cast<size_t>(idx)]);
      continue;
    }
    if (!cur[parts[i]]) cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
    YAML::Node next = cur[parts[i]];
    if (next.IsScalar()) {
      throw UserError("--set " + text + ": '" + parts[i] + "' holds a single value, not a mapping");
    }
    cur.reset(next);
  }
  if (cur.IsSequence()) {
    char* end = nullptr;
    const long idx = std::strtol(parts.back().c_str(), &end, 10);
    if (*end != '\0' || idx < 0 || static_cast<size_t>(idx) >= cur.size()) {
      throw UserError("--set " + text + ": '" + parts.back() + "' is not an index of the list at that point");
    }
    cur[static_cast<size_t>(idx)] = value_node;
  } else {
    cur[parts.back()] = value_node;
  }
  // pipeline.recompute and pipeline.checkpoint are one setting: setting either replaces
  // whichever the file wrote.
  for (const auto& [set, other] : {std::make_pair("pipeline.recompute", "checkpoint"),
                                   std::make_pair("pipeline.checkpoint", "recompute")}) {
    if (path == set && root["pipeline"].IsMap()) root["pipeline"].remove(other);
  }
  dec.note_override(path, text);
}

std::string stem(const std::string& path) {
  std::string base = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  const auto dot = base.rfind('.');
  return dot == std::string::npos ? base : base.substr(0, dot);
}

// A byte count with an optional unit, or -1 when the text is not one.
int64_t byte_size_or_negative(const std::string& text) {
  static const std::pair<const char*, double> kUnits[] = {
      {"B", 1},        {"KB", 1e3},         {"MB", 1e6},            {"GB", 1e9},           {"TB", 1e12},
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end == text.c_str()) return -1;
  std::string unit(end);
  unit.erase(0, unit.find_first_not_of(' '));
  double scale = unit.empty() ? 1.0 : 0.0;
  for (const auto& u : kUnits) {
    if (unit == u.first) scale = u.second;
  }
  if (scale == 0.0 || !std::isfinite(v) || v < 0 || v * scale > 9e18) return -1;
  return static_cast<int64_t>(v * scale);
}

std::string byte_size_help(const std::string& text) {
  return "'" + text + "' is not a byte size; write a number with an optional unit, e.g. 20GiB, 512MB or 1000000 "
         "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)";
}

// ---- One decoder per section, called by parse_config in this order (a later section may
// read an earlier one: the trace window needs train.steps).

// model: a list of layers, or the name of a C++ model (model.cpp).
void decode_model(Decoder& dec, const YAML::Node& root, Config& c) {
  const YAML::Node model = dec.required(root, "model", "");
  if (model.IsMap() && model["cpp"]) {
    c.model.cpp = dec.cpp_model(model);
  } else {
    dec.yaml_model(model, c.model);
  }
}

// data: the data set and its sizes.
void decode_data(Decoder& dec, const YAML::Node& root, Config& c) {
  if (const YAML::Node data = root["data"]) {
    dec.check_map(data, "data", {"type", "path", "seq_len", "vocab", "validation_fraction", "classes",
                                 "teacher_hidden", "teacher_scale", "seed", "eval_samples"});
    if (data["type"]) {
      c.data.type = dec.str(data["type"], "data.type");
      if (c.data.type != "teacher" && c.data.type != "text" && c.data.type != "tokens" && c.data.type != "cifar10") {
        dec.fail(data["type"], "data.type", "unknown data type '" + c.data.type + "'; valid: teacher, text, tokens, cifar10");
      }
    }
    if (data["path"]) c.data.path = dec.str(data["path"], "data.path");
    if (c.data.type != "teacher" && c.data.path.empty()) {
      dec.fail(data, "data.path", "data.type " + c.data.type + " reads a file: set data.path (or --set data.path=FILE)");
    }
    if (data["seq_len"]) c.data.seq_len = dec.positive(data["seq_len"], "data.seq_len");
    if (data["vocab"]) c.data.vocab = dec.positive(data["vocab"], "data.vocab");
    if (data["validation_fraction"]) {
      c.data.validation_fraction = dec.number(data["validation_fraction"], "data.validation_fraction");
      if (c.data.validation_fraction < 0 || c.data.validation_fraction >= 1) {
        dec.fail(data["validation_fraction"], "data.validation_fraction", "must be in [0, 1)");
      }
    }
    if (data["classes"]) c.data.classes = dec.positive(data["classes"], "data.classes");
    if (data["teacher_hidden"]) c.data.teacher_hidden = dec.positive(data["teacher_hidden"], "data.teacher_hidden");
    if (data["teacher_scale"]) c.data.teacher_scale = dec.number(data["teacher_scale"], "data.teacher_scale");
    if (data["seed"]) c.data.seed = static_cast<uint64_t>(dec.integer(data["seed"], "data.seed"));
    if (data["eval_samples"]) {
      c.data.eval_samples = dec.integer(data["eval_samples"], "data.eval_samples");
      if (c.data.eval_samples < 0) {
        dec.out_of_range(data["eval_samples"], "data.eval_samples", "at least 0 (the teacher task's held-out samples)");
      }
    }
  }
}

// `auto`: a key left to the sweep (AutoKeys).
bool is_auto(const YAML::Node& n) { return n && n.IsScalar() && n.Scalar() == "auto"; }

// pipeline: partitions, replicas, micro-batches, recompute, schedule, placement.
void decode_pipeline(Decoder& dec, const YAML::Node& root, Config& c) {
  if (const YAML::Node p = root["pipeline"]) {
    dec.check_map(p, "pipeline", {"partitions", "replicas", "micro_batches", "recompute", "checkpoint", "schedule",
                                  "virtual_stages", "schedule_file", "balance", "devices", "pin_threads",
                                  "bucket_mb", "timeout_s", "balance_by", "profile", "memory_limit",
                                  "batch_weight_gradients", "shard_optimizer", "tensor_parallel",
                                  "sequence_parallel", "capture"});
    if (p["shard_optimizer"]) {
      const std::string mode = dec.str(p["shard_optimizer"], "pipeline.shard_optimizer");
      if (mode == "gradients") {
        dec.fail(p["shard_optimizer"], "pipeline.shard_optimizer",
                 "gradients (ZeRO-2) is not implemented: a pipeline accumulates each stage's gradients over its M "
                 "micro-batches in full, and gpipe does not yet reduce-scatter them per micro-batch; use optimizer "
                 "(ZeRO-1: optimizer state sharded over the replicas) or none");
      }
      if (mode != "none" && mode != "optimizer") {
        dec.fail(p["shard_optimizer"], "pipeline.shard_optimizer",
                 "unknown '" + mode + "'; use none, or optimizer (ZeRO-1: each of the pipeline.replicas keeps 1/D of "
                 "the optimizer state)");
      }
      c.pipeline.shard_optimizer = mode;
    }
    if (p["timeout_s"]) {
      c.pipeline.timeout_s = dec.number(p["timeout_s"], "pipeline.timeout_s");
      if (c.pipeline.timeout_s < 0) {
        dec.fail(p["timeout_s"], "pipeline.timeout_s",
                 "must be a number of seconds > 0 (how long a stage waits for a stuck peer), or 0 for no deadline");
      }
    }
    if (p["balance_by"]) {
      c.pipeline.balance_by = dec.str(p["balance_by"], "pipeline.balance_by");
      if (c.pipeline.balance_by != "estimate" && c.pipeline.balance_by != "profile") {
        dec.fail(p["balance_by"], "pipeline.balance_by",
                 "unknown '" + c.pipeline.balance_by + "'; use estimate (the cost model) or profile (measured "
                 "times from `gpipe profile`)");
      }
    }
    if (p["profile"]) c.pipeline.profile = dec.str(p["profile"], "pipeline.profile");
    if (p["memory_limit"]) {
      const std::string text = dec.str(p["memory_limit"], "pipeline.memory_limit");
      c.pipeline.memory_limit = byte_size_or_negative(text);
      if (c.pipeline.memory_limit < 0) dec.fail(p["memory_limit"], "pipeline.memory_limit", byte_size_help(text));
    }
    if (p["bucket_mb"]) {
      c.pipeline.bucket_mb = dec.number(p["bucket_mb"], "pipeline.bucket_mb");
      if (!(c.pipeline.bucket_mb >= 0 && c.pipeline.bucket_mb <= 1e6)) {
        dec.fail(p["bucket_mb"], "pipeline.bucket_mb",
                 "must be at least 0 (0: one reduction per parameter) and at most 1e6");
      }
    }
    if (p["replicas"]) c.pipeline.replicas = dec.small_int(p["replicas"], "pipeline.replicas", 1, "");
    if (p["tensor_parallel"]) {
      c.pipeline.tensor_parallel = dec.small_int(p["tensor_parallel"], "pipeline.tensor_parallel", 1, "");
    }
    if (p["sequence_parallel"]) {
      c.pipeline.sequence_parallel = dec.boolean(p["sequence_parallel"], "pipeline.sequence_parallel");
    }
    // Both are known here, after every --set: one replica has nothing to shard its
    // optimizer state over, and a run asking for it would silently not shard.
    if (c.pipeline.shard_optimizer == "optimizer" && c.pipeline.replicas < 2) {
      dec.fail(p["shard_optimizer"], "pipeline.shard_optimizer",
               "optimizer shards the optimizer state over pipeline.replicas, which is " +
                   std::to_string(c.pipeline.replicas) +
                   ": one replica has nothing to shard; set pipeline.replicas to 2 or more (with "
                   "pipeline.partitions x pipeline.replicas processes under mpirun), or drop shard_optimizer "
                   "(or set it to none)");
    }
    if (is_auto(p["partitions"])) {
      c.autos.partitions = true;
    } else if (p["partitions"]) {
      c.pipeline.partitions = dec.small_int(p["partitions"], "pipeline.partitions", 1, " (or auto)");
    }
    if (is_auto(p["micro_batches"])) {
      c.autos.micro_batches = true;
    } else if (p["micro_batches"]) {
      c.pipeline.micro_batches = dec.small_int(p["micro_batches"], "pipeline.micro_batches", 1, " (or auto)");
    }
    if (p["recompute"] && p["checkpoint"]) {
      dec.fail(p["checkpoint"], "pipeline.checkpoint",
               "pipeline.recompute is set too; pipeline.checkpoint is its other name, give one of them");
    }
    for (const char* key : {"recompute", "checkpoint"}) {
      if (!p[key]) continue;
      const std::string what = std::string("pipeline.") + key;
      const std::string mode = dec.str(p[key], what);
      if (mode != "always" && mode != "except_last" && mode != "never") {
        dec.fail(p[key], what, "unknown mode '" + mode + "'; use always, except_last or never");
      }
      c.pipeline.recompute = parse_recompute_mode(mode);
    }
    if (is_auto(p["schedule"])) {
      c.autos.schedule = true;
    } else if (p["schedule"]) {
      c.pipeline.schedule = dec.str(p["schedule"], "pipeline.schedule");
      const auto names = schedule_names();
      if (std::find(names.begin(), names.end(), c.pipeline.schedule) == names.end() &&
          c.pipeline.schedule != "fill_drain") {
        std::string valid;
        for (const auto& n : names) valid += (valid.empty() ? "" : ", ") + n;
        dec.fail(p["schedule"], "pipeline.schedule",
                 "unknown schedule '" + c.pipeline.schedule + "'; valid: " + valid +
                     ", auto (the sweep's choice), or pipeline.schedule_file for a schedule of your own");
      }
    }
    if (p["virtual_stages"]) {
      c.pipeline.virtual_stages = dec.small_int(p["virtual_stages"], "pipeline.virtual_stages", 1, "");
    }
    if (p["schedule_file"] && !p["schedule_file"].IsNull()) {
      c.pipeline.schedule_file = dec.str(p["schedule_file"], "pipeline.schedule_file");
    }
    if (p["balance"] && !p["balance"].IsNull()) {
      for (int64_t b : dec.int_list(p["balance"], "pipeline.balance")) c.pipeline.balance.push_back(static_cast<int>(b));
    }
    if (p["devices"] && !p["devices"].IsNull()) {
      const YAML::Node d = p["devices"];
      if (!d.IsSequence()) dec.fail(d, "pipeline.devices", "expected a list such as [cpu:0, cpu:1]");
      for (size_t i = 0; i < d.size(); ++i) c.pipeline.devices.push_back(dec.str(d[i], "pipeline.devices"));
    }
    if (p["pin_threads"]) c.pipeline.pin_threads = dec.boolean(p["pin_threads"], "pipeline.pin_threads");
    if (p["capture"]) {
      c.pipeline.capture = dec.boolean(p["capture"], "pipeline.capture");
      if (c.pipeline.capture && c.autos.partitions) {
        dec.fail(p["capture"], "pipeline.capture",
                 "captures the training step of one stage; pipeline.partitions: auto may choose more: set "
                 "pipeline.partitions: 1, or pipeline.capture: false");
      }
      const std::string refusal = c.pipeline.capture ? capture_refusal(c.pipeline) : std::string();
      if (!refusal.empty()) dec.fail(p["capture"], "pipeline.capture", refusal);
    }
    if (p["batch_weight_gradients"]) {
      c.pipeline.batch_weight_gradients = dec.boolean(p["batch_weight_gradients"], "pipeline.batch_weight_gradients");
    }
  }
}

// optimizer: its type, hyperparameters and the learning-rate schedule.
void decode_optimizer(Decoder& dec, const YAML::Node& root, Config& c) {
  if (const YAML::Node o = root["optimizer"]) {
    dec.check_map(o, "optimizer", {"type", "lr", "momentum", "weight_decay", "nesterov", "beta1", "beta2", "eps",
                                   "schedule", "warmup_steps", "min_lr", "clip_grad_norm", "loss_scale",
                                   "loss_scale_window"});
    layers::OptimizerConfig& oc = c.optimizer.optimizer;
    if (o["type"]) {
      oc.type = dec.str(o["type"], "optimizer.type");
      if (oc.type != "sgd" && oc.type != "adam" && oc.type != "adamw") {
        dec.fail(o["type"], "optimizer.type", "unknown optimizer '" + oc.type + "'; valid: sgd, adam, adamw");
      }
    }
    // Each number's valid range, and a learning rate above kMaxLr taken for a mistake
    // (a lost minus in an exponent, 1e3 for 1e-3): it diverges on the first steps.
    constexpr double kMaxLr = 10;
    const std::string lr_valid = "> 0 and at most " + std::to_string(static_cast<int>(kMaxLr)) +
                                 " (typical: 1e-4 to 1e-3 for adam and adamw, 0.01 to 0.1 for sgd)";
    if (o["lr"]) {
      oc.lr = dec.number(o["lr"], "optimizer.lr");
      if (!(oc.lr > 0)) dec.out_of_range(o["lr"], "optimizer.lr", lr_valid);
      if (oc.lr > kMaxLr) {
        dec.fail(o["lr"], "optimizer.lr",
                 o["lr"].Scalar() + " is too large: a learning rate above " + std::to_string(static_cast<int>(kMaxLr)) +
                     " diverges at once; it must be " + lr_valid);
      }
    }
    if (o["momentum"]) {
      oc.momentum = dec.number(o["momentum"], "optimizer.momentum");
      if (!(oc.momentum >= 0 && oc.momentum < 1)) {
        dec.out_of_range(o["momentum"], "optimizer.momentum", "in [0, 1) (0: plain SGD; 0.9 is usual)");
      }
    }
    if (o["weight_decay"]) {
      oc.weight_decay = dec.number(o["weight_decay"], "optimizer.weight_decay");
      if (!(oc.weight_decay >= 0)) {
        dec.out_of_range(o["weight_decay"], "optimizer.weight_decay", ">= 0 (0: none; 0.01 to 0.1 is usual for adamw)");
      }
    }
    if (o["nesterov"]) oc.nesterov = dec.boolean(o["nesterov"], "optimizer.nesterov");
    for (const auto& [key, usual, value] : {std::make_tuple("beta1", "0.9", &oc.beta1),
                                            std::make_tuple("beta2", "0.999", &oc.beta2)}) {
      if (!o[key]) continue;
      const std::string what = std::string("optimizer.") + key;
      *value = dec.number(o[key], what);
      if (!(*value >= 0 && *value < 1)) dec.out_of_range(o[key], what, std::string("in [0, 1) (") + usual + " is usual)");
    }
    if (o["eps"]) {
      oc.eps = dec.number(o["eps"], "optimizer.eps");
      if (!(oc.eps > 0)) dec.out_of_range(o["eps"], "optimizer.eps", "> 0 (1e-8 is usual)");
    }
    if (oc.nesterov && oc.momentum <= 0) dec.fail(o["nesterov"], "optimizer.nesterov", "needs optimizer.momentum > 0");
    if (o["schedule"]) {
      c.optimizer.schedule = dec.str(o["schedule"], "optimizer.schedule");
      if (c.optimizer.schedule != "constant" && c.optimizer.schedule != "cosine") {
        dec.fail(o["schedule"], "optimizer.schedule", "unknown schedule '" + c.optimizer.schedule + "'; valid: constant, cosine");
      }
    }
    if (o["warmup_steps"]) {
      c.optimizer.warmup_steps = dec.small_int(o["warmup_steps"], "optimizer.warmup_steps", 0, " (0: no warmup)");
    }
    if (o["min_lr"]) {
      c.optimizer.min_lr = dec.number(o["min_lr"], "optimizer.min_lr");
      if (!(c.optimizer.min_lr >= 0 && c.optimizer.min_lr <= oc.lr)) {
        std::ostringstream lr;
        lr << oc.lr;
        dec.out_of_range(o["min_lr"], "optimizer.min_lr",
                         "in [0, optimizer.lr] = [0, " + lr.str() + "] (where the cosine schedule ends)");
      }
    }
    if (o["clip_grad_norm"]) {
      c.optimizer.clip_grad_norm = dec.number(o["clip_grad_norm"], "optimizer.clip_grad_norm");
      if (c.optimizer.clip_grad_norm < 0) dec.out_of_range(o["clip_grad_norm"], "optimizer.clip_grad_norm", ">= 0 (0 = off)");
    }
  }
  // Loss scaling is fp16's: on by default there, refused elsewhere (bfloat16 has float32's
  // range, so nothing underflows that scaling would save).
  const bool fp16 = c.model.dtype == DType::kF16;
  c.optimizer.loss_scale = fp16 ? 65536.0 : 0.0;
  const YAML::Node o = root["optimizer"];
  for (const char* key : {"loss_scale", "loss_scale_window"}) {
    if (o && o[key] && !fp16) {
      dec.out_of_range(o[key], std::string("optimizer.") + key,
                       "given only with model.dtype: fp16 (loss scaling keeps float16's small gradients from "
                       "flushing to zero; float32 and bf16 need none)");
    }
  }
  if (o && o["loss_scale"]) {
    const double s = dec.number(o["loss_scale"], "optimizer.loss_scale");
    if (s != 0 && !(s >= 1 && s <= 16777216 && std::exp2(std::round(std::log2(s))) == s)) {
      dec.out_of_range(o["loss_scale"], "optimizer.loss_scale",
                       "0 (off) or a power of two in [1, 2^24], e.g. 65536 (so that scaling and unscaling are exact)");
    }
    c.optimizer.loss_scale = s;
  }
  if (o && o["loss_scale_window"]) {
    const int64_t w = dec.integer(o["loss_scale_window"], "optimizer.loss_scale_window");
    if (w < 1 || w > 1000000) dec.out_of_range(o["loss_scale_window"], "optimizer.loss_scale_window", "in [1, 1000000]");
    c.optimizer.loss_scale_window = static_cast<int>(w);
  }
}

// train: steps, batch size, seed, logging and evaluation intervals.
void decode_train(Decoder& dec, const YAML::Node& root, Config& c) {
  const YAML::Node t = dec.required(root, "train", "");
  dec.check_map(t, "train", {"steps", "batch_size", "seed", "log_interval", "eval_interval", "eval_samples",
                             "blas_threads", "log_level"});
  c.train.steps = dec.small_int(dec.required(t, "steps", "train"), "train.steps", 1, "");
  c.train.batch_size = dec.positive(dec.required(t, "batch_size", "train"), "train.batch_size");
  if (t["seed"]) c.train.seed = static_cast<uint64_t>(dec.integer(t["seed"], "train.seed"));
  if (t["log_interval"]) c.train.log_interval = dec.small_int(t["log_interval"], "train.log_interval", 1, "");
  if (t["eval_interval"]) {
    c.train.eval_interval = dec.small_int(t["eval_interval"], "train.eval_interval", 0, " (0: only at the end)");
  }
  if (t["eval_samples"]) {
    c.train.eval_samples = dec.integer(t["eval_samples"], "train.eval_samples");
    if (c.train.eval_samples < 0) {
      dec.out_of_range(t["eval_samples"], "train.eval_samples", "at least 0 (0: the whole validation set)");
    }
  }
  if (is_auto(t["blas_threads"])) {
    c.autos.blas_threads = true;
  } else if (t["blas_threads"]) {
    c.train.blas_threads = dec.small_int(t["blas_threads"], "train.blas_threads", 1, " (or auto)");
  }
  if (t["log_level"]) {
    c.train.log_level = dec.str(t["log_level"], "train.log_level");
    const std::set<std::string> levels = {"trace", "debug", "info", "warn", "warning", "error", "err", "critical", "off"};
    if (!levels.count(c.train.log_level)) {
      dec.fail(t["log_level"], "train.log_level",
               "unknown level '" + c.train.log_level + "'; valid: trace, debug, info, warn, error, critical, off");
    }
  }
}

// output: the run folder. Returns output.trace, which decode_trace applies last.
std::optional<YAML::Node> decode_output(Decoder& dec, const YAML::Node& root, Config& c) {
  std::optional<YAML::Node> trace_flag;
  if (const YAML::Node o = root["output"]) {
    dec.check_map(o, "output", {"dir", "trace"});
    if (o["dir"]) c.output.dir = dec.str(o["dir"], "output.dir");
    if (o["trace"]) trace_flag = o["trace"];
  }
  if (c.output.dir.empty()) c.output.dir = "runs/" + c.name;
  return trace_flag;
}

// trace: which steps are traced; output.trace: whether trace.json is written (see
// TraceConfig). Needs train.steps.
void decode_trace(Decoder& dec, const YAML::Node& root, const std::optional<YAML::Node>& trace_flag, Config& c) {
  const int last = c.train.steps;
  c.trace = default_trace_window(1, c.train.steps);
  c.output.trace = c.train.steps <= kTraceDefaultMaxSteps;
  if (const YAML::Node tr = root["trace"]) {
    dec.check_map(tr, "trace", {"steps", "ops"});
    if (const YAML::Node ops = tr["ops"]) {
      c.trace.ops = dec.boolean(ops, "trace.ops");
      if (c.trace.ops && c.pipeline.capture) {
        dec.fail(ops, "trace.ops",
                 "times each op of a step one by one, and pipeline.capture replays the step as one launch: set "
                 "trace.ops: false, or pipeline.capture: false for the run that times the ops");
      }
    }
    if (const YAML::Node st = tr["steps"]) {
      const std::vector<int64_t> v = dec.int_list(st, "trace.steps");
      if (v.size() != 2) dec.fail(st, "trace.steps", "expected [first, last], e.g. [2, 11]");
      if (v[0] < 1 || v[1] < v[0] || v[1] > last) {
        dec.fail(st, "trace.steps",
                 "[" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + "] is not a range of this run's steps 1.." +
                     std::to_string(last) + " (numbered from 1, as the progress lines are; first <= last); e.g. [" +
                     std::to_string(std::min(2, last)) + ", " + std::to_string(std::min(11, last)) + "]");
      }
      c.trace.first_step = static_cast<int>(v[0]);
      c.trace.last_step = static_cast<int>(v[1]);
      c.trace.given = true;
      c.output.trace = true;
    }
  }
  // output.trace: false wins over trace.steps, which still picks report.html's step.
  if (trace_flag) c.output.trace = dec.boolean(*trace_flag, "output.trace");
}

// checkpoint: saved training state (pipeline.recompute is rematerialization).
void decode_checkpoint(Decoder& dec, const YAML::Node& root, Config& c) {
  if (const YAML::Node k = root["checkpoint"]) {
    dec.check_map(k, "checkpoint", {"every", "keep", "dir", "async", "resume", "allow_changes"});
    if (k["every"]) {
      c.checkpoint.every = static_cast<int>(dec.integer(k["every"], "checkpoint.every"));
      if (c.checkpoint.every < 0) dec.fail(k["every"], "checkpoint.every", "must be 0 (off) or a number of steps");
    }
    if (k["keep"]) {
      c.checkpoint.keep = static_cast<int>(dec.integer(k["keep"], "checkpoint.keep"));
      if (c.checkpoint.keep < 0) dec.fail(k["keep"], "checkpoint.keep", "must be 0 (keep all) or how many to keep");
    }
    if (k["dir"] && !k["dir"].IsNull()) c.checkpoint.dir = dec.str(k["dir"], "checkpoint.dir");
    if (k["async"]) c.checkpoint.async = dec.boolean(k["async"], "checkpoint.async");
    if (k["resume"] && !k["resume"].IsNull()) c.checkpoint.resume = dec.str(k["resume"], "checkpoint.resume");
    if (const YAML::Node a = k["allow_changes"]) {
      // Each entry is a key of the run's identity, or "all"; a misspelt one would allow
      // nothing and say nothing.
      auto allow = [&](const YAML::Node& e, const std::string& path) {
        const std::string key = dec.str(e, path);
        std::vector<std::string> valid = {"all"};
        valid.insert(valid.end(), identity_keys().begin(), identity_keys().end());
        if (std::find(valid.begin(), valid.end(), key) == valid.end()) {
          dec.fail(e, path,
                   "unknown key '" + key + "';" + did_you_mean(key, valid) + " valid keys: " + join(valid) +
                       " (the run's identity; anything else, such as train.steps or the pipeline, may change on "
                       "resume without being listed)");
        }
        c.checkpoint.allow_changes.push_back(key);
      };
      if (a.IsScalar()) {
        allow(a, "checkpoint.allow_changes");
      } else if (a.IsSequence()) {
        for (size_t i = 0; i < a.size(); ++i) allow(a[i], "checkpoint.allow_changes[" + std::to_string(i) + "]");
      } else if (!a.IsNull()) {
        dec.fail(a, "checkpoint.allow_changes", "must be a list of keys such as [optimizer.lr, data.path], or all");
      }
    }
  }
}

}  // namespace

Config parse_config(const std::string& text, const std::string& source, const std::vector<std::string>& overrides) {
  Decoder dec(source);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw UserError("config error at " + source + ":" + std::to_string(e.mark.line + 1) + ":" +
                    std::to_string(e.mark.column + 1) + ": invalid YAML: " + e.msg);
  }
  if (!root || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) throw UserError("config error at " + source + ": the top level must be a mapping of sections");
  for (const auto& o : overrides) apply_override(root, o, dec);

  Config c;
  c.source = source;
  c.name = stem(source);
  {
    YAML::Emitter emitted;
    emitted << root;
    c.effective = std::string(emitted.c_str()) + "\n";
  }
  dec.check_map(root, "", {"model", "data", "pipeline", "optimizer", "train", "output", "checkpoint", "trace"});

  decode_model(dec, root, c);
  decode_data(dec, root, c);
  decode_pipeline(dec, root, c);
  decode_optimizer(dec, root, c);
  decode_train(dec, root, c);
  const std::optional<YAML::Node> trace_flag = decode_output(dec, root, c);
  if (c.pipeline.profile.empty()) c.pipeline.profile = c.output.dir + "/profile.json";
  decode_trace(dec, root, trace_flag, c);
  decode_checkpoint(dec, root, c);
  c.checkpoint.dir = checkpoint_dir(c);
  return c;
}

const std::vector<std::string>& identity_keys() {
  static const std::vector<std::string> keys = {
      "model.seed", "model.dtype",
      "data.type", "data.path", "data.seq_len", "data.vocab", "data.validation_fraction", "data.classes",
      "data.teacher_hidden", "data.teacher_scale", "data.seed",
      "optimizer.type", "optimizer.lr", "optimizer.weight_decay", "optimizer.momentum", "optimizer.nesterov",
      "optimizer.betas", "optimizer.eps", "optimizer.schedule", "optimizer.min_lr", "optimizer.clip_grad_norm",
      "train.seed", "train.batch_size"};
  return keys;
}

TraceConfig default_trace_window(int first, int steps) {
  TraceConfig w;
  w.first_step = std::min(first + 1, steps);  // the launch's first step warms up
  w.last_step = std::min(first + kTraceDefaultSteps, steps);
  return w;
}

std::string capture_refusal(const PipelineConfig& p) {
  const std::string rule =
      "captures the training step of one stage, or of stages that all run on one device (pipeline.devices naming it "
      "for every stage, e.g. [cuda:0, cuda:0]), without replicas or a tensor group; this config has ";
  if (p.replicas > 1 || p.tensor_parallel > 1) {
    return rule + "partitions " + std::to_string(p.partitions) + ", replicas " + std::to_string(p.replicas) +
           " and tensor_parallel " + std::to_string(p.tensor_parallel) +
           ": set pipeline.capture: false, or replicas and tensor_parallel to 1";
  }
  if (p.partitions <= 1) return std::string();
  bool one_device = static_cast<int>(p.devices.size()) == p.partitions;
  for (const std::string& d : p.devices) one_device = one_device && d == p.devices[0];
  if (one_device) return std::string();
  std::string devices;
  for (const std::string& d : p.devices) devices += (devices.empty() ? "" : ", ") + d;
  return rule + "partitions " + std::to_string(p.partitions) + " on " +
         (p.devices.empty() ? std::string("cpu:0 to cpu:") + std::to_string(p.partitions - 1) + " (the default)"
                            : "[" + devices + "]") +
         ": set pipeline.capture: false, or pipeline.partitions: 1, or one device for every stage in pipeline.devices";
}

std::string checkpoint_dir(const Config& c) {
  if (!c.checkpoint.dir.empty()) return c.checkpoint.dir;
  return c.output.dir.empty() ? std::string("checkpoints") : c.output.dir + "/checkpoints";
}

int64_t parse_byte_size(const std::string& text, const std::string& what) {
  const int64_t v = byte_size_or_negative(text);
  if (v < 0) throw UserError(what + ": " + byte_size_help(text));
  return v;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) {
    throw UserError("cannot read config file '" + path + "'; check the path (configs/default.yaml is the default)");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path, overrides);
}

}  // namespace pipeline
}  // namespace gpipe
