#include "layers/registry.h"

#include <cmath>
#include <cstdlib>
#include <cctype>
#include <mutex>
#include <optional>

#include "layers/activation.h"
#include "layers/attention.h"
#include "layers/conv_registry.h"
#include "layers/dropout.h"
#include "layers/embedding.h"
#include "layers/gqa_attention.h"
#include "layers/layernorm.h"
#include "layers/llama_block.h"
#include "layers/rmsnorm.h"
#include "layers/swiglu.h"
#include "layers/linear.h"
#include "layers/transformer.h"
#include "runtime/error.h"
#include "runtime/random.h"
#include "runtime/text.h"

namespace gpipe {
namespace layers {

namespace {

std::string at(const LayerSpec& s) { return s.at(); }

// The tensor-group member build_model builds on this thread (ModelSpec::member), read by
// the built-in layers' factories; size 1 outside build_model.
thread_local TensorShard building_member;
// Whether the layer being built is the model's head (its last layer, before
// softmax_cross_entropy): split by the vocabulary when the model is split.
thread_local bool building_head = false;

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}


// Attention layers take (T, C) per sample: the output of an embedding.
void check_sequence_input(const LayerArgs& a, const Shape& in) {
  if (in.size() != 2) {
    throw UserError(a.spec().type + at(a.spec()) + ": takes a sequence (T, C) per sample, got " + shape_str(in) +
                    "; put an embedding layer before it");
  }
}

// The whole sequence's positions of an input (T, ...) per sample: under sequence
// parallelism the member holds 1/T of them (layers/tensor_parallel.h).
int64_t whole_positions(const Shape& in) {
  return in.at(0) * (building_member.sequence_split() ? building_member.size : 1);
}

// The layer types a sequence-parallel model may hold: those that keep each position's
// features to itself (norms, dropout, activations, an unsplit linear) or that gather
// the positions they mix (attention, the blocks, the split linears).
bool runs_on_positions(const std::string& type) {
  static const std::set<std::string> ok = {"embedding", "transformer_block", "llama_block", "attention",
                                           "gqa_attention", "swiglu", "linear", "layernorm", "rmsnorm",
                                           "dropout", "relu", "gelu"};
  return ok.count(type) > 0;
}

// Runs `make`, which builds the layer or loss `spec` names, and puts where the config
// wrote it into a UserError that does not say so yet: constructors name their layer
// but cannot know its place. The place follows the type, as in the registry's own
// messages: "linear (at cfg.yaml:9:7): in and out must be positive, got in=512, out=-1",
// "llama_block (at cfg.yaml:9:7): gqa_attention: kv_heads=3 does not divide heads=4".
template <typename Make>
auto located(const LayerSpec& spec, const Make& make) -> decltype(make()) {
  try {
    return make();
  } catch (const UserError& e) {
    const std::string msg = e.what();
    if (spec.where.empty() || msg.find(at(spec)) != std::string::npos) throw;
    for (const auto& [key, place] : spec.option_where) {
      if (msg.find(spec.at(key)) != std::string::npos) throw;  // placed at the option's --set
    }
    const std::string own = spec.type + ": ";  // the constructor's own "linear: "
    throw UserError(spec.type + at(spec) + ": " + (msg.rfind(own, 0) == 0 ? msg.substr(own.size()) : msg));
  }
}

struct Registry {
  std::mutex mu;
  std::map<std::string, LayerFactory> layers;
  std::map<std::string, LossFactory> losses;
  std::map<std::string, ModelFactory> models;
  std::set<std::string> builtin_layers, builtin_losses;  // refused to register_layer / register_loss
};

// The built-in layers and losses, created on first use; types that register_layer()
// and register_loss() add later are kept apart from them.
Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    auto layer = [reg](const std::string& type, LayerFactory f) {
      reg->layers[type] = std::move(f);
      reg->builtin_layers.insert(type);
    };
    layer("linear", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      if (in.empty()) throw UserError("linear" + at(a.spec()) + ": needs an input with a feature dimension");
      LinearOptions o(in.back(), a.get_int("out"));
      o.leading.assign(in.begin(), in.end() - 1);
      o.bias = a.get_bool("bias", true);
      o.dtype = dtype;
      o.seed = seed;
      const std::string parallel = a.get_string("parallel", building_head ? "column" : "none");
      if (parallel != "none" && parallel != "column" && parallel != "row") {
        throw UserError("linear" + at(a.spec()) + ": parallel must be none, column or row, got '" + parallel + "'");
      }
      // Row-parallel: `in` is this member's block of the input features (a column-parallel
      // layer's outputs before it); the whole layer's are T times as many.
      if (parallel == "row") o.in *= building_member.size;
      o.split = building_member.as(parallel == "column" ? TensorSplitKind::kColumn
                                   : parallel == "row"  ? TensorSplitKind::kRow
                                                        : TensorSplitKind::kNone);
      // Under sequence parallelism a column-parallel layer takes the member's positions
      // and gathers them (its leading dimensions are the whole sequence's); a
      // row-parallel one takes every position (a column-parallel one's output).
      if (o.split.sequence_split() && parallel == "column" && !o.leading.empty()) o.leading[0] = whole_positions(in);
      auto layer = std::make_unique<Linear>(o);
      // An unsplit one between them sees the member's positions: partial gradients.
      mark_sequence_partial(layer->parameters(), building_member.sequence_split() && parallel == "none");
      return layer;
    });
    layer("swiglu", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      if (in.empty()) throw UserError("swiglu" + at(a.spec()) + ": needs an input with a feature dimension");
      SwiGLUOptions o(in.back(), a.get_int("hidden"));
      o.leading.assign(in.begin(), in.end() - 1);
      if (building_member.sequence_split() && !o.leading.empty()) o.leading[0] = whole_positions(in);
      o.dtype = dtype;
      o.seed = seed;
      o.shard = building_member;
      return std::make_unique<SwiGLU>(o);
    });
    layer("relu", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) -> std::unique_ptr<Layer> {
      return std::make_unique<Relu>(in, dtype);
    });
    layer("gelu", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) -> std::unique_ptr<Layer> {
      return std::make_unique<Gelu>(in, dtype);
    });
    layer("embedding", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      if (in.size() != 1) {
        throw UserError("embedding" + at(a.spec()) + ": takes int32 token ids (T) per sample, got " + shape_str(in) +
                        "; set model.input to [T] and model.input_dtype to int32");
      }
      EmbeddingOptions o(a.get_int("vocab"), a.get_int("dim"), in[0]);
      o.max_positions = a.get_int("positions", in[0]);
      o.dtype = dtype;
      o.seed = seed;
      o.shard = building_member;
      return std::make_unique<Embedding>(o);
    });
    layer("layernorm", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t) -> std::unique_ptr<Layer> {
      if (in.empty()) throw UserError("layernorm" + at(a.spec()) + ": needs an input with a feature dimension");
      LayerNormOptions o(in);
      o.dtype = dtype;
      auto layer = std::make_unique<LayerNorm>(o);
      mark_sequence_partial(layer->parameters(), building_member.sequence_split());  // on the member's positions
      return layer;
    });
    layer("rmsnorm", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t) -> std::unique_ptr<Layer> {
      if (in.empty()) throw UserError("rmsnorm" + at(a.spec()) + ": needs an input with a feature dimension");
      RmsNormOptions o(in);
      o.eps = a.get_double("eps", 1e-6);
      o.dtype = dtype;
      auto layer = std::make_unique<RmsNorm>(o);
      mark_sequence_partial(layer->parameters(), building_member.sequence_split());  // on the member's positions
      return layer;
    });
    layer("attention", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      check_sequence_input(a, in);
      AttentionOptions o(in[1], a.get_int("heads"), whole_positions(in));
      o.dropout = a.get_double("dropout", 0.0);
      o.dtype = dtype;
      o.seed = seed;
      o.shard = building_member;
      return std::make_unique<CausalSelfAttention>(o);
    });
    layer("dropout", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      DropoutOptions o(in, a.get_double("p"));
      o.dtype = dtype;
      o.seed = seed;
      // On the member's positions: its share of the unsplit sample's mask.
      if (building_member.sequence_split()) o.element_offset = building_member.rank * shape_numel(in);
      return std::make_unique<Dropout>(o);
    });
    layer("transformer_block", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      check_sequence_input(a, in);
      TransformerBlockOptions o(in[1], a.get_int("heads"), whole_positions(in));
      o.mlp_ratio = a.get_int("mlp_ratio", 4);
      o.dropout = a.get_double("dropout", 0.0);
      o.dtype = dtype;
      o.seed = seed;
      o.shard = building_member;
      return std::make_unique<TransformerBlock>(o);
    });
    layer("gqa_attention", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      check_sequence_input(a, in);
      GqaAttentionOptions o(in[1], a.get_int("heads"), whole_positions(in));
      o.kv_heads = a.get_int("kv_heads", o.heads);
      o.rope = a.get_bool("rope", true);
      o.rope_base = a.get_double("rope_base", 10000.0);
      o.dtype = dtype;
      o.seed = seed;
      o.shard = building_member;
      return std::make_unique<GqaAttention>(o);
    });
    layer("llama_block", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) -> std::unique_ptr<Layer> {
      check_sequence_input(a, in);
      LlamaBlockOptions o(in[1], a.get_int("heads"), a.get_int("hidden"), whole_positions(in));
      o.kv_heads = a.get_int("kv_heads", o.heads);
      o.rope_base = a.get_double("rope_base", 10000.0);
      o.eps = a.get_double("eps", 1e-6);
      o.dropout = a.get_double("dropout", 0.0);
      o.dtype = dtype;
      o.seed = seed;
      o.shard = building_member;
      return std::make_unique<LlamaBlock>(o);
    });
    add_conv_layer_types(layer);
    reg->losses["softmax_cross_entropy"] = [](LayerArgs& a, const Shape& in, DType dtype) -> std::unique_ptr<Loss> {
      if (in.empty()) {
        throw UserError("softmax_cross_entropy" + at(a.spec()) + ": expects logits with a class dimension, got " +
                        shape_str(in) + " per sample");
      }
      return std::make_unique<SoftmaxCrossEntropy>(in, dtype, static_cast<int>(a.get_int("ignore_index", -100)));
    };
    reg->builtin_losses.insert("softmax_cross_entropy");
    return reg;
  }();
  return *r;
}

// A name a config can write as `type:` (or `cpp:`), given to `call` exactly once.
void check_new_name(const char* call, const char* kind, const std::string& name, bool has_factory,
                    const std::set<std::string>& builtin, bool taken, const std::string& example) {
  std::string why;
  bool valid = !name.empty();
  for (char ch : name) valid = valid && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_');
  if (!valid) {
    why = "a " + std::string(kind) + " name is letters, digits and '_' (it is written in configs), e.g. '" + example + "'";
  } else if (!has_factory) {
    why = "the factory is empty; pass a function that builds the " + std::string(kind);
  } else if (builtin.count(name)) {
    why = "'" + name + "' is a built-in " + kind + " type; register yours under another name, e.g. 'my_" + name + "'";
  } else if (taken) {
    why = "'" + name + "' is registered already; register each " + kind + " once (e.g. in main, before "
          "gpipe::cli::main), under a name of its own";
  }
  if (!why.empty()) throw UserError(std::string(call) + "(\"" + name + "\"): " + why);
}

}  // namespace

std::string LayerArgs::example(const std::string& key, const char* value) const {
  return "{" + std::string(what_ == "model" ? "cpp" : "type") + ": " + spec_.type + ", " + key + ": " + value + "}";
}

const std::string* LayerArgs::find(const std::string& key) {
  used_.insert(key);
  auto it = spec_.args.find(key);
  return it == spec_.args.end() ? nullptr : &it->second;
}

int64_t LayerArgs::get_int(const std::string& key) {
  const std::string* v = find(key);
  if (v == nullptr) {
    throw UserError(what_ + " '" + spec_.type + "'" + at(spec_) + " needs the option '" + key + "', e.g. " +
                    example(key, "1024"));
  }
  return get_int(key, 0);
}

int64_t LayerArgs::get_int(const std::string& key, int64_t fallback) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0') {
    throw UserError(what_ + " '" + spec_.type + "'" + spec_.at(key) + ": option '" + key + "' must be an integer, got '" +
                    *v + "'");
  }
  return n;
}

double LayerArgs::get_double(const std::string& key) {
  if (find(key) == nullptr) {
    throw UserError(what_ + " '" + spec_.type + "'" + at(spec_) + " needs the option '" + key + "', e.g. " +
                    example(key, "0.1"));
  }
  return get_double(key, 0.0);
}

double LayerArgs::get_double(const std::string& key, double fallback) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const double d = std::strtod(v->c_str(), &end);
  if (v->empty() || *end != '\0' || !std::isfinite(d)) {
    throw UserError(what_ + " '" + spec_.type + "'" + spec_.at(key) + ": option '" + key + "' must be a number, got '" +
                    *v + "'");
  }
  return d;
}

bool LayerArgs::get_bool(const std::string& key, bool fallback) {
  const std::string* v = find(key);
  if (v == nullptr) return fallback;
  if (const std::optional<bool> b = parse_boolean(*v)) return *b;
  throw UserError(what_ + " '" + spec_.type + "'" + spec_.at(key) + ": option '" + key + "' must be true or false, got '" +
                  *v + "'");
}

std::string LayerArgs::get_string(const std::string& key, const std::string& fallback) {
  const std::string* v = find(key);
  return v == nullptr ? fallback : *v;
}

void LayerArgs::finish() const {
  for (const auto& kv : spec_.args) {
    if (!used_.count(kv.first)) {
      std::vector<std::string> known(used_.begin(), used_.end());
      throw UserError(what_ + " '" + spec_.type + "'" + spec_.at(kv.first) + ": unknown option '" + kv.first + "'" +
                      (known.empty() ? std::string("; it takes no options")
                                     : ";" + did_you_mean(kv.first, known) + " valid options: " + join(known)));
    }
  }
}

void register_layer(const std::string& type, LayerFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  check_new_name("register_layer", "layer", type, factory != nullptr, r.builtin_layers, r.layers.count(type) > 0,
                 "my_rmsnorm");
  r.layers[type] = std::move(factory);
}

void register_loss(const std::string& type, LossFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  check_new_name("register_loss", "loss", type, factory != nullptr, r.builtin_losses, r.losses.count(type) > 0,
                 "my_loss");
  r.losses[type] = std::move(factory);
}

void register_model(const std::string& name, ModelFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  check_new_name("register_model", "model", name, factory != nullptr, {}, r.models.count(name) > 0, "my_model");
  r.models[name] = std::move(factory);
}

std::vector<std::string> model_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (auto& kv : r.models) out.push_back(kv.first);
  return out;
}

std::vector<std::string> layer_types() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (auto& kv : r.layers) out.push_back(kv.first);
  return out;
}

std::vector<std::string> loss_types() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (auto& kv : r.losses) out.push_back(kv.first);
  return out;
}

std::unique_ptr<Layer> make_layer(const LayerSpec& spec, const Shape& input, DType dtype, uint64_t seed) {
  LayerFactory f;
  bool own_types = false;  // whether this program registered layer types of its own
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.layers.find(spec.type);
    if (it != r.layers.end()) f = it->second;
    own_types = r.layers.size() > r.builtin_layers.size();
  }
  if (!f) {
    const std::vector<std::string> types = layer_types();
    throw UserError("unknown layer type '" + spec.type + "'" + at(spec) + ";" + did_you_mean(spec.type, types) +
                    " valid types: " + join(types) +
                    (own_types ? std::string()
                               : ". A layer type of your own is registered in your own program "
                                 "(layers::register_layer before gpipe::cli::main), which then runs this config: "
                                 "docs/WRITING_LAYERS.md, \"4. Register it and train it\""));
  }
  LayerArgs args(spec);
  return located(spec, [&] {
    auto layer = f(args, input, dtype, seed);
    args.finish();
    return layer;
  });
}

std::unique_ptr<Loss> make_loss(const LayerSpec& spec, const Shape& input, DType dtype) {
  LossFactory f;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.losses.find(spec.type);
    if (it != r.losses.end()) f = it->second;
  }
  if (!f) {
    const std::vector<std::string> types = loss_types();
    throw UserError("unknown loss type '" + spec.type + "'" + at(spec) + ";" + did_you_mean(spec.type, types) +
                    " valid types: " + join(types));
  }
  LayerArgs args(spec);
  return located(spec, [&] {
    auto loss = f(args, input, dtype);
    args.finish();
    return loss;
  });
}

std::unique_ptr<Sequential> build_model(const ModelSpec& spec, const LayerFilter& with_data) {
  if (spec.cpp) return build_cpp_model(*spec.cpp);
  if (spec.layers.empty()) {
    throw UserError("the model has no layers; list them in model.layers, or name a model registered in C++ "
                    "with model.cpp (register_model)");
  }
  // Which layers get weights: with_data's, and the embedding a head with weights is tied
  // to (the nearest earlier one, as below), whose values the head starts from.
  std::vector<bool> data(spec.layers.size(), true);
  if (with_data) {
    for (size_t i = 0; i < spec.layers.size(); ++i) data[i] = with_data(static_cast<int>(i));
    for (size_t i = 0; i < spec.layers.size(); ++i) {
      const auto it = spec.layers[i].args.find("tied");
      if (it == spec.layers[i].args.end() || parse_boolean(it->second) != std::optional<bool>(true)) continue;
      for (int owner = static_cast<int>(i) - 1; owner >= 0; --owner) {
        if (spec.layers[owner].type != "embedding") continue;
        data[owner] = data[owner] || data[i];
        break;
      }
    }
  }
  auto model = std::make_unique<Sequential>(spec.input, spec.dtype, spec.input_dtype.value_or(spec.dtype));
  // The member this process or thread builds (ModelSpec::member), for the factories.
  struct Member {
    explicit Member(TensorShard m) : outer(building_member), outer_head(building_head) { building_member = m; }
    ~Member() {
      building_member = outer;
      building_head = outer_head;
    }
    TensorShard outer;
    bool outer_head;
  } member(spec.member);
  const bool split = spec.member.split();
  if (spec.member.sequence_split()) {
    // Sequence parallelism: the embedding scatters each sample's positions over the
    // group, the head gathers them back; every layer between runs on a member's share.
    const LayerSpec& first = spec.layers.front();
    const LayerSpec& last = spec.layers.back();
    const std::string fix = "; or set pipeline.sequence_parallel: false";
    if (first.type != "embedding") {
      throw UserError("pipeline.sequence_parallel splits each sample's positions over the tensor group from the "
                      "model's embedding on, but its first layer is " + first.type + at(first) +
                      "; start the model with an embedding layer (token ids)" + fix);
    }
    const auto head_split = last.args.find("parallel");
    if (last.type != "linear" || spec.loss.type != "softmax_cross_entropy" ||
        (head_split != last.args.end() && head_split->second != "column")) {
      throw UserError("pipeline.sequence_parallel gathers the positions back in the model's output head, a linear "
                      "layer before softmax_cross_entropy split by the vocabulary (parallel: column, its default), "
                      "but the model ends with " + last.type + at(last) +
                      (head_split != last.args.end() ? " (parallel: " + head_split->second + ")" : std::string()) +
                      " and " + spec.loss.type + "; end it with such a head" + fix);
    }
    for (const LayerSpec& ls : spec.layers) {
      if (!runs_on_positions(ls.type)) {
        throw UserError(ls.type + at(ls) + ": sequence parallelism runs each layer on a member's share of the "
                        "positions, and " + ls.type + " mixes positions without gathering them; use the sequence "
                        "layers (embedding, transformer_block, llama_block, attention, gqa_attention, swiglu, linear, "
                        "layernorm, rmsnorm, dropout, relu, gelu)" + fix);
      }
    }
  }
  if (split) {
    // Between a column-parallel linear layer and the row-parallel one after it each member
    // holds a block of the features: a norm there would normalise its block alone, and a
    // dropout draw another mask than the unsplit model's. Refused (relu and gelu are
    // elementwise, and fine).
    bool inside = false;
    for (const LayerSpec& ls : spec.layers) {
      const auto parallel = ls.args.find("parallel");
      if (ls.type == "linear" && parallel != ls.args.end() && (parallel->second == "column" || parallel->second == "row")) {
        inside = parallel->second == "column";
        continue;
      }
      if (inside && (ls.type == "dropout" || ls.type == "layernorm" || ls.type == "rmsnorm" || ls.type == "linear")) {
        throw UserError(ls.type + at(ls) + ": between a column-parallel linear layer and its row-parallel one each "
                        "member of the tensor group holds a block of the features, and " + ls.type +
                        " would not compute the unsplit model's result there; move it after the row-parallel layer, "
                        "or set pipeline.tensor_parallel: 1");
      }
    }
  }
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    // A split model's head: its last layer, a linear one before softmax_cross_entropy.
    building_head = split && i + 1 == spec.layers.size() && spec.layers[i].type == "linear" &&
                    spec.loss.type == "softmax_cross_entropy";
    // `tied: true` on a linear layer: its weight is the nearest earlier embedding's
    // token table (an output head tied to the input embedding, as in GPT-2).
    LayerSpec ls = spec.layers[i];
    bool tied = false;
    if (auto it = ls.args.find("tied"); it != ls.args.end()) {
      const std::optional<bool> b = parse_boolean(it->second);
      if (!b) throw UserError("tied" + at(ls) + ": expected true or false, got '" + it->second + "'");
      tied = *b;
      ls.args.erase(it);
    }
    std::optional<ShapesOnly> shapes;
    if (!data[i]) shapes.emplace();  // another process's layer: its shapes only
    std::unique_ptr<Layer> made = make_layer(ls, model->output_shape(), spec.dtype, mix_seed(spec.seed, i));
    shapes.reset();
    Layer* added = nullptr;
    try {  // with its name, so that a layer of one's own that does not fit is named as the config names it
      added = &model->add(std::move(made), ls.name);
    } catch (const UserError& e) {
      throw UserError(std::string(e.what()) + at(ls));
    }
    Layer& layer = *added;
    if (!tied) continue;
    auto* head = dynamic_cast<Linear*>(&layer);
    if (head == nullptr) throw UserError("tied" + at(ls) + ": only a linear layer can be tied to an embedding");
    int owner = static_cast<int>(i) - 1;
    while (owner >= 0 && dynamic_cast<Embedding*>(&model->layer(owner)) == nullptr) --owner;
    if (owner < 0) throw UserError("tied" + at(ls) + ": no embedding layer before this one to tie to");
    auto& emb = static_cast<Embedding&>(model->layer(owner));
    if (head->weight().value.shape() != emb.token().value.shape()) {
      throw UserError("tied" + at(ls) + ": the head's weight " + shape_str(head->weight().value.shape()) +
                      " must match embedding layer " + std::to_string(owner) + "'s token table " +
                      shape_str(emb.token().value.shape()) + " (out = vocab, in = dim)");
    }
    model->tie(owner, emb.token(), static_cast<int>(i), head->weight());
  }
  std::unique_ptr<Loss> loss = make_loss(spec.loss, model->output_shape(), spec.dtype);
  auto* head = split ? dynamic_cast<Linear*>(&model->layer(model->size() - 1)) : nullptr;
  auto* xent = dynamic_cast<SoftmaxCrossEntropy*>(loss.get());
  if (head != nullptr && head->weight().shard_dim == 0 && xent != nullptr) {
    // The head's outputs are this member's block of the vocabulary: the loss is split too.
    const Shape logits = model->output_shape();
    loss = std::make_unique<VocabParallelCrossEntropy>(logits, logits.back() * spec.member.size, spec.member,
                                                       spec.dtype, xent->ignore_index());
  }
  model->set_loss(std::move(loss));
  return model;
}

std::optional<std::vector<LayerWeights>> measure_parameters(const ModelSpec& spec) {
  if (spec.cpp) return std::nullopt;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const LayerSpec& ls : spec.layers) {
      if (r.layers.count(ls.type) && !r.builtin_layers.count(ls.type)) return std::nullopt;
    }
  }
  const ShapesOnly measuring;
  std::vector<LayerWeights> out;
  Shape shape = spec.input;
  DType dtype = spec.input_dtype.value_or(spec.dtype);
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    LayerSpec ls = spec.layers[i];
    ls.args.erase("tied");  // build_model checks it; a tied head holds a copy of the table
    const std::unique_ptr<Layer> layer = make_layer(ls, shape, spec.dtype, mix_seed(spec.seed, i));
    if (layer->input_shape() != shape || layer->input_dtype() != dtype) return std::nullopt;  // build_model says why
    out.push_back({layer->describe(), ls.where, layer->cost(1).param_bytes});
    shape = layer->output_shape();
    dtype = layer->dtype();
  }
  return out;
}

std::unique_ptr<Sequential> build_cpp_model(const LayerSpec& spec) {
  ModelFactory f;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.models.find(spec.type);
    if (it != r.models.end()) f = it->second;
  }
  if (!f) {
    const auto names = model_names();
    throw UserError("model.cpp" + at(spec) + ": no model '" + spec.type + "' is registered in this program; " +
                    (names.empty() ? std::string("it registers none (call register_model before gpipe::cli::main)")
                                   : "registered: " + join(names)));
  }
  LayerArgs args(spec, "model");
  std::unique_ptr<Sequential> model = f(args);
  args.finish();
  if (model == nullptr || model->size() == 0) {
    throw UserError("model '" + spec.type + "'" + at(spec) + ": its factory returned " +
                    (model == nullptr ? std::string("no model") : std::string("a model without layers")) +
                    "; return a Sequential with its layers and loss");
  }
  return model;
}

}  // namespace layers
}  // namespace gpipe
