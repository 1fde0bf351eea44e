// Builds layers from plain specs (decoded from YAML by the config layer): a registry
// maps a config's `type` to a factory. An unknown type or option is an error that
// names it, says where it was written, and lists what is valid.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "layers/layer.h"
#include "layers/loss.h"
#include "layers/sequential.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

struct LayerSpec {
  std::string type;
  std::map<std::string, std::string> args;  // option -> scalar text, e.g. {"out": "1024"}
  std::optional<double> cost;               // a user's cost for the balancer, overriding the estimate
  std::string where;                        // "configs/default.yaml:12:7", for messages
  std::string name;                         // what checkpoints call the layer; empty: layers.<i>
  // An option given somewhere else than the layer (a --set): its place, for messages about it.
  std::map<std::string, std::string> option_where;
  // " (at PLACE)" for a message about option `key`: its own place, else the layer's; "" when
  // neither is known. For the layer as a whole, the options given elsewhere follow its
  // place: " (at cfg.yaml:4:7, its out from --set model.layers.0.out=-1)".
  std::string at(const std::string& key = std::string()) const {
    const auto it = option_where.find(key);
    if (it != option_where.end()) return " (at " + it->second + ")";
    if (where.empty()) return std::string();
    std::string out = " (at " + where;
    for (const auto& [option, place] : option_where) out += ", its " + option + " from " + place;
    return out + ")";
  }
};

struct ModelSpec {
  // A model built in C++ and registered by name (register_model), when set: its type
  // is the name and its args the model's options; the fields below are then unused.
  std::optional<LayerSpec> cpp;
  Shape input;  // per sample
  DType dtype = DType::kF32;          // parameters and activations
  std::optional<DType> input_dtype;   // of the model's input; default dtype (int32 for token ids)
  std::vector<LayerSpec> layers;  // repeats already expanded
  LayerSpec loss;
  uint64_t seed = 0;
  // Tensor parallelism (layers/tensor_parallel.h): build the model as member `rank` of a
  // tensor group of `size`. Attention, the transformer and LLaMA blocks, SwiGLU and the
  // embedding are split Megatron's way; a linear layer as its `parallel:` option says
  // (column, row, or none: whole on every member), and the model's last layer, a linear
  // layer before softmax_cross_entropy, column-parallel by the vocabulary with the
  // vocabulary-parallel loss; every other layer whole. Size 1: the model as written.
  // A column-parallel linear layer's outputs are the member's block: what follows must
  // take them so (elementwise layers, then a row-parallel linear layer). A model
  // registered in C++ (cpp) is built whole whatever the member.
  TensorShard member;
};

// Typed access to a spec's options; every option must be read or it is reported
// as unknown by finish(). `what` names the spec in messages ("layer", "model").
class LayerArgs {
 public:
  explicit LayerArgs(const LayerSpec& spec, std::string what = "layer") : spec_(spec), what_(std::move(what)) {}
  int64_t get_int(const std::string& key);
  int64_t get_int(const std::string& key, int64_t fallback);
  double get_double(const std::string& key);
  double get_double(const std::string& key, double fallback);
  bool get_bool(const std::string& key, bool fallback);
  std::string get_string(const std::string& key, const std::string& fallback);
  const LayerSpec& spec() const { return spec_; }
  // Throws UserError for any option not read.
  void finish() const;

 private:
  const std::string* find(const std::string& key);
  std::string example(const std::string& key, const char* value) const;  // "{type: linear, out: 1024}"
  const LayerSpec& spec_;
  std::string what_;
  std::set<std::string> used_;
};

using LayerFactory =
    std::function<std::unique_ptr<Layer>(LayerArgs& args, const Shape& input, DType dtype, uint64_t seed)>;
using LossFactory = std::function<std::unique_ptr<Loss>(LayerArgs& args, const Shape& input, DType dtype)>;

// Makes a layer or loss type of one's own available to configs (`type: NAME`). A name
// already registered, or one of a built-in type, is a UserError: register each type
// once, at start (before gpipe::cli::main), under a name of its own.
void register_layer(const std::string& type, LayerFactory factory);
void register_loss(const std::string& type, LossFactory factory);
std::vector<std::string> layer_types();
std::vector<std::string> loss_types();

// A whole model built in C++ (layers, loss and any ties), made available to configs by
// name: `model: {cpp: NAME, OPTION: value, ...}`. The factory reads its options from
// `options` as a layer factory does (an option it does not read is reported as
// unknown); every process of a multi-process run calls it. Registering a name twice is
// a UserError.
using ModelFactory = std::function<std::unique_ptr<Sequential>(LayerArgs& options)>;
void register_model(const std::string& name, ModelFactory factory);
std::vector<std::string> model_names();
// The registered model spec.type with options spec.args; UserError if none is.
std::unique_ptr<Sequential> build_cpp_model(const LayerSpec& spec);

// The layer or loss `spec` names, from its type's factory. A UserError of the factory or
// of the constructor it calls gets the spec's place in the config (spec.where) after the
// type, unless it names it already: "linear (at cfg.yaml:4:7): in and out must be positive".
std::unique_ptr<Layer> make_layer(const LayerSpec& spec, const Shape& input, DType dtype, uint64_t seed);
std::unique_ptr<Loss> make_loss(const LayerSpec& spec, const Shape& input, DType dtype);
// The whole model; layer i is seeded with mix_seed(spec.seed, i), so the weights do
// not depend on how the model is later partitioned. A spec with `cpp` set builds that
// registered C++ model instead.
// With `with_data`, layer i gets weights (allocated and initialised) only where
// with_data(i) is true, and the others are built on shapes (ShapesOnly: parameters
// without data): a process of a multi-process run builds only its stage's weights, with
// the values the whole model would have. A head with weights tied to an embedding gives
// the embedding weights too (the head starts from its values). A model registered in C++
// is built whole.
using LayerFilter = std::function<bool(int layer)>;
std::unique_ptr<Sequential> build_model(const ModelSpec& spec, const LayerFilter& with_data = {});

// The bytes of each layer's parameters (LayerCost::param_bytes; a tied head counted as
// the copy of the embedding's table it keeps), from the spec alone: its layers are
// built as build_model builds them, with the same errors, but on shapes (ShapesOnly:
// parameters without data, runtime/tensor.h), so nothing the size of the weights is
// allocated. std::nullopt for a model registered in C++ and for one with a layer type
// of one's own (register_layer), whose code may write its parameters as it makes them.
struct LayerWeights {
  std::string describe;  // "linear(200000 -> 200000)"
  std::string where;     // the spec's, "configs/default.yaml:12:7"
  int64_t bytes = 0;
};
std::optional<std::vector<LayerWeights>> measure_parameters(const ModelSpec& spec);

}  // namespace layers
}  // namespace gpipe
