#include "pipeline/planning/memory_check.h"

#include <cstdio>
#include <string>
#include <vector>

#include "layers/registry.h"
#include "pipeline/planning/byte_units.h"
#include "runtime/device.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {

// The refusal of weights that cannot fit, with the advice that helps them: neither
// micro-batches nor the batch size change them, and neither do more stages on one
// machine, whose memory holds every stage's weights (one process's or several's).
// `largest` follows the parts, `available_note` the bytes available.
[[noreturn]] void refuse_weights(const Config& c, const WeightBytes& w, const std::string& largest, int64_t available,
                                 const std::string& available_note) {
  const layers::OptimizerConfig& o = c.optimizer.optimizer;
  std::string parts = "weights " + bytes_str(w.weights) + ", gradients " + bytes_str(w.gradients);
  if (w.optimizer > 0) {
    const int slots = optimizer_slots(o);
    parts += ", " + o.type + " state " + bytes_str(w.optimizer) + " (" + std::to_string(slots) +
             (slots == 1 ? " value" : " values") + " per weight)";
  }
  std::vector<std::string> ways = {"use a smaller model (fewer or narrower layers)"};
  if (c.model.dtype == DType::kF64) ways.push_back("set model.dtype: float32 instead of float64 (half the bytes)");
  if (w.optimizer > 0) {
    ways.push_back(o.type == "sgd" ? "set optimizer.momentum: 0 (SGD without momentum keeps no state)"
                                   : "use optimizer.type: sgd without momentum (it keeps no state)");
  }
  std::string advice;
  for (size_t i = 0; i < ways.size(); ++i) {
    advice += (i == 0 ? "" : i + 1 == ways.size() ? ", or " : ", ") + ways[i];
  }
  throw UserError("the model's weights cannot fit in host memory: with their gradients" +
                  std::string(w.optimizer > 0 ? " and optimizer state" : "") + " they need " + bytes_str(w.total()) +
                  " (" + parts + ")" + largest + ", but only " + bytes_str(available) +
                  " is available" + available_note + ". Weights do not depend on pipeline.micro_batches or train.batch_size: " + advice +
                  ". More pipeline.partitions do not help on one machine either: its memory holds every stage's "
                  "weights");
}

}  // namespace

void check_weights_fit(const Config& c, int64_t available) {
  if (available <= 0) return;
  const auto layers = layers::measure_parameters(c.model);
  if (!layers || layers->empty()) return;  // checked once built (check_run_fits)
  WeightBytes w;
  size_t largest = 0;
  // measure_parameters counts what the layers read: a bf16 or fp16 model's working copies,
  // beside which it keeps float32 masters, gradients and optimizer state.
  int64_t master = 0;
  for (size_t i = 0; i < layers->size(); ++i) {
    master += layers::master_param_bytes((*layers)[i].bytes, c.model.dtype);
    w.weights += layers::weight_bytes((*layers)[i].bytes, c.model.dtype);
    if ((*layers)[i].bytes > (*layers)[largest].bytes) largest = i;
  }
  w.gradients = master;  // made with each weight
  // The optimizer's state is on the host when every stage runs there.
  bool state_on_host = true;
  for (const std::string& d : c.pipeline.devices) state_on_host = state_on_host && parse_device(d).is_cpu();
  if (state_on_host) w.optimizer = optimizer_slots(c.optimizer.optimizer) * master;
  if (w.total() <= available) return;
  const layers::LayerWeights& big = (*layers)[largest];
  refuse_weights(c, w,
                 "; the largest is layer " + std::to_string(largest) + ", " + big.describe +
                     (big.where.empty() ? std::string() : " at " + big.where) + ", with " + bytes_str(big.bytes) +
                     " of weights",
                 available, "");
}

void check_run_fits(const Config& c, layers::Sequential& model, const Plan& plan, int64_t available) {
  if (available <= 0) return;
  const std::vector<StageMemory>& mem = plan.memory;
  WeightBytes w;
  int64_t activations = 0;
  for (size_t k = 0; k < mem.size(); ++k) {
    if (!plan.devices[k].is_cpu()) continue;
    w.weights += mem[k].weight_bytes;
    w.gradients += mem[k].gradient_bytes;
    w.optimizer += mem[k].optimizer_bytes;
    activations += mem[k].activation_bytes;
  }
  // The built model's weights and gradients are on the host already, so `available`
  // no longer counts them (those of stages on a GPU leave it when they move there).
  int64_t held = 0;
  for (int i = 0; i < model.size(); ++i) {
    for (const layers::Parameter* p : model.layer(i).parameters()) {
      for (const Tensor* t : {&p->value, &p->grad, &p->working}) {
        if (t->defined() && !t->is_meta() && t->device().is_cpu()) held += static_cast<int64_t>(t->nbytes());
      }
    }
  }
  const int64_t usable = available + held;
  const std::string of_which =
      held > 0 ? " (" + bytes_str(available) + " free and the " + bytes_str(held) + " the built model holds)" : "";
  if (w.total() > usable) refuse_weights(c, w, "", usable, of_which);
  if (w.total() + activations > usable) {
    throw UserError("the run needs about " + bytes_str(w.total() + activations) + " of host memory, " +
                    bytes_str(w.total()) + " for the weights with their gradients and optimizer state and " +
                    bytes_str(activations) + " for the activations its schedule keeps at their peak, but only " +
                    bytes_str(usable) + " is available" + of_which +
                    ". The activations grow with the micro-batch: lower train.batch_size, raise "
                    "pipeline.micro_batches, set pipeline.recompute: always, or use narrower layers");
  }
}

void check_memory_limit(const Config& c, const Plan& plan, int64_t device_memory, const MemoryLimitWords& words) {
  const bool own = c.pipeline.memory_limit > 0;
  const int64_t limit = own ? c.pipeline.memory_limit : device_memory;
  if (limit <= 0) return;
  const std::string limit_name = own ? "pipeline.memory_limit" : "the device description's memory";
  for (size_t k = 0; k < plan.memory.size(); ++k) {
    const StageMemory& m = plan.memory[k];
    if (m.total() <= limit) continue;
    const std::string parts = "weights " + bytes_str(m.weight_bytes) + ", gradients " + bytes_str(m.gradient_bytes) +
                              ", optimizer state " + bytes_str(m.optimizer_bytes) + ", activations " +
                              bytes_str(m.activation_bytes);
    // More tensor-group members split a stage's weights and most of its activations.
    const std::string split = "pipeline.tensor_parallel: " + std::to_string(2 * plan.tensor_parallel) +
                              " (each of a stage's processes holds 1/T of its split layers)";
    const std::string fix =
        m.parameter_bytes > limit
            ? "its weights, gradients and optimizer state alone are over it, whatever the micro-batches: use more " +
                  words.stages + " (fewer layers a stage), " + split +
                  ", pipeline.shard_optimizer: optimizer with replicas, or a smaller model"
            : "set pipeline.recompute: always, raise pipeline.micro_batches, lower train.batch_size, use more " +
                  words.stages + " or " + split;
    throw UserError("stage " + std::to_string(k) + " would hold " + bytes_str(m.total()) + " on " +
                    plan.devices.at(k).str() + " (" + parts + "), over " + limit_name + " of " + bytes_str(limit) +
                    ": " + fix + (own ? ", or raise the limit" : "") +
                    " (`" + words.sweep + "` lists the plans that fit)");
  }
}

}  // namespace pipeline
}  // namespace gpipe
