// A stage's state saved and restored by name (Executor::state_names, save_state,
// restore_state): the names checkpoints use, and the checks of a restore.
#include "pipeline/executor/executor.h"

#include <set>

#include "pipeline/executor/stage_runtime.h"
#include "layers/tensor_parallel.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

std::string state_name(const layers::Sequential& model, int layer, const std::string& name) {
  return model.qualified_name(layer, name);
}

namespace {

// The name a parameter is saved under: its own, or a tied copy's owner's.
std::string parameter_name(layers::Sequential& model, int layer, const layers::Parameter* p) {
  for (const layers::Tie& t : model.ties()) {
    if (t.copy == p) return state_name(model, t.owner_layer, t.owner->name);
  }
  return state_name(model, layer, p->name);
}

Tensor host_copy(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
  copy_tensor(t, out);
  return out;
}

// Copies a checkpoint's host tensor into a tensor of the model, on its device.
void restore_into(const std::string& name, const Tensor& saved, Tensor& into, const std::string& what) {
  if (!into.defined()) {
    into = host_copy(saved);
    return;
  }
  if (saved.shape() != into.shape() || saved.dtype() != into.dtype()) {
    throw UserError("the checkpoint's " + what + " " + name + " is " + saved.str() + " but the model's is " +
                    into.str() + "; resume with the config the checkpoint was saved with");
  }
  copy_tensor(saved, into);
}

const Tensor& find_state(const std::map<std::string, Tensor>& m, const std::string& name, const std::string& what) {
  auto it = m.find(name);
  if (it == m.end()) {
    throw UserError("the checkpoint has no " + what + " " + name + "; it was saved from another model (or another "
                    "optimizer.type); resume with the config it was saved with");
  }
  return it->second;
}

}  // namespace

StageStateNames Executor::state_names(int k) const {
  StageStateNames out;
  const auto suffixes = layers::optimizer_slot_suffixes(options_.optimizer);
  for (int c : schedule_.cells.at(k)) {
    for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) {
        const std::string name = parameter_name(model_, i, p);
        std::vector<std::string> opt{name + ".step"};
        for (const auto& s : suffixes) opt.push_back(name + s);
        out.model_needed.push_back(name);
        out.optimizer_needed.insert(out.optimizer_needed.end(), opt.begin(), opt.end());
        if (model_.is_tied_copy(p)) continue;  // its owner's stage saves it
        out.model.push_back(name);
        out.optimizer.insert(out.optimizer.end(), opt.begin(), opt.end());
      }
      for (const layers::Buffer& b : model_.layer(i).buffers()) {
        out.model.push_back(state_name(model_, i, b.name));
        out.model_needed.push_back(state_name(model_, i, b.name));
      }
    }
  }
  return out;
}

StageState Executor::save_state(int k) {
  // A step that failed may have updated weights on a device without counting the step
  // (the count follows the step's end): what it left is not a state to save.
  if (failed_) throw Error("the pipeline stopped after a failure; its state is not saved (the last checkpoint is)");
  StageRuntime& rt = *runtimes_.at(k);
  GPIPE_CHECK(rt.local, "stage " + std::to_string(k) + " runs in another process");
  rt.backend->synchronize();  // between steps: no worker holds the device
  StageState out;
  const auto& params = rt.params;
  const Tensor steps = Tensor::from_vector<double>({static_cast<double>(rt.optimizer->steps())}, {});
  std::vector<std::string> names(params.size());  // per parameter, for a sharded optimizer's slots
  size_t index = 0;
  for (int c : rt.cells) {
    for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) {
        GPIPE_CHECK(index < params.size() && params[index] == p, "optimizer parameters out of layer order");
        const size_t slot_of = index++;
        names[slot_of] = parameter_name(model_, i, p);
        if (model_.is_tied_copy(p)) continue;
        const std::string name = parameter_name(model_, i, p);
        out.model[name] = host_copy(p->value);
        out.optimizer[name + ".step"] = steps;
        if (rt.sharding) continue;  // its slots whole, below
        for (const layers::OptimizerSlot& s : rt.optimizer->slots(slot_of)) {
          out.optimizer[name + s.suffix] = host_copy(*s.value);
        }
      }
      for (const layers::Buffer& b : model_.layer(i).buffers()) out.model[state_name(model_, i, b.name)] = host_copy(*b.value);
    }
  }
  if (rt.sharding) save_sharded_optimizer(rt, names, out);  // a collective over the replicas
  if (tensor_collectives_ != nullptr) join_split_state(rt, out);  // a collective over the tensor group
  return out;
}

// A stage split over a tensor group saves each split parameter whole, by its name, as
// the unsplit model would (any T resumes it): every member's block of the value and of
// each optimizer slot gathered over the group and put together (layers::join_blocks).
void Executor::join_split_state(StageRuntime& rt, StageState& out) {
  ReplicaGroup& group = *options_.tensor_group;
  const int T = group.size();
  const auto suffixes = layers::optimizer_slot_suffixes(options_.optimizer);
  auto join = [&](const layers::Parameter& p, Tensor& block) {
    const int64_t n = block.numel();
    Tensor mine = block.reshape({n});
    Tensor all = Tensor::empty({n * T}, block.dtype(), Device::cpu());
    group.all_gather(mine, all);
    // The members' blocks, one per distinct block: a block R members hold alike
    // (Parameter::shard_replicas) is taken from the first of them, members 0, R, 2R, ...
    std::vector<Tensor> blocks;
    for (int r = 0; r < T; r += p.shard_replicas) blocks.push_back(all.narrow_rows(r * n, n).reshape(block.shape()));
    block = layers::join_blocks(blocks, p.shard_dim, p.shard_groups, p.whole);
  };
  for (int c : rt.cells) {
    for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) {
        if (p->shard_count <= 1 || model_.is_tied_copy(p)) continue;
        const std::string name = parameter_name(model_, i, p);
        join(*p, out.model.at(name));
        for (const std::string& suffix : suffixes) join(*p, out.optimizer.at(name + suffix));
      }
    }
  }
}

// The reverse, on restore: this member's block of each split parameter's whole value and
// slots (a copy of the maps with those entries cut). A whole tensor of another shape
// than the model's is named as restore_into names it.
void Executor::cut_split_state(StageRuntime& rt, std::map<std::string, Tensor>& model,
                               std::map<std::string, Tensor>& optimizer) {
  const auto suffixes = layers::optimizer_slot_suffixes(options_.optimizer);
  std::set<std::string> done;  // a tied weight's owner and copy on one stage: cut once
  auto cut = [&](const layers::Parameter& p, std::map<std::string, Tensor>& m, const std::string& name,
                 const char* what) {
    auto it = m.find(name);
    if (it == m.end() || !done.insert(name).second) return;  // missing: named by restore's own check
    if (it->second.shape() != p.whole) {
      throw UserError("the checkpoint's " + std::string(what) + " " + name + " is " + it->second.str() +
                      " but the model's (whole, before its split over pipeline.tensor_parallel = " +
                      std::to_string(p.shard_count) + ") is " + shape_str(p.whole) +
                      "; resume with the config the checkpoint was saved with");
    }
    it->second = layers::cut_block(it->second, p.shard_dim, p.shard_rank, p.shard_count, p.shard_groups);
  };
  for (int c : rt.cells) {
    for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) {
        if (p->shard_count <= 1) continue;
        const std::string name = parameter_name(model_, i, p);  // a tied copy: its owner's, whole
        cut(*p, model, name, "parameter");
        for (const std::string& suffix : suffixes) cut(*p, optimizer, name + suffix, "optimizer state");
      }
    }
  }
}

void Executor::restore_state(int k, const std::map<std::string, Tensor>& whole_model,
                             const std::map<std::string, Tensor>& whole_optimizer) {
  StageRuntime& rt = *runtimes_.at(k);
  GPIPE_CHECK(rt.local, "stage " + std::to_string(k) + " runs in another process");
  // Split parameters (a tensor group's member): this member's blocks of the whole ones.
  std::map<std::string, Tensor> model = whole_model, optimizer = whole_optimizer;
  cut_split_state(rt, model, optimizer);
  const auto& params = rt.params;
  std::vector<std::string> names(params.size());
  size_t index = 0;
  int64_t steps = -1;
  for (int c : rt.cells) {
    for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
      for (layers::Parameter* p : model_.layer(i).parameters()) {
        const size_t slot_of = index++;
        const std::string name = parameter_name(model_, i, p);
        restore_into(name, find_state(model, name, "parameter"), p->value, "parameter");
        const Tensor& s = find_state(optimizer, name + ".step", "optimizer step count");
        const int64_t n = s.numel() == 1 && s.dtype() == DType::kF64 ? static_cast<int64_t>(s.data<double>()[0]) : -1;
        if (n < 0 || (steps >= 0 && n != steps)) {
          throw UserError("the checkpoint's optimizer step count " + name + ".step is " + s.str() +
                          (steps >= 0 ? " where the stage's other parameters have " + std::to_string(steps) : "") +
                          "; the checkpoint is corrupt or mixes runs");
        }
        steps = n;
        names[slot_of] = name;
        if (rt.sharding) continue;  // this replica's pieces, below
        for (const layers::OptimizerSlot& slot : rt.optimizer->slots(slot_of)) {
          restore_into(name + slot.suffix, find_state(optimizer, name + slot.suffix, "optimizer state"), *slot.value,
                       "optimizer state");
        }
      }
      for (const layers::Buffer& b : model_.layer(i).buffers()) {
        restore_into(state_name(model_, i, b.name), find_state(model, state_name(model_, i, b.name), "buffer"), *b.value, "buffer");
      }
    }
  }
  GPIPE_CHECK(index == params.size(), "optimizer parameters out of layer order");
  layers::refresh_all(*rt.backend, params);  // a bf16 or fp16 model's working copies
  if (rt.sharding) restore_sharded_optimizer(rt, names, optimizer);
  if (steps >= 0) rt.optimizer->set_steps(steps);
  // A captured step (pipeline.capture) read the state it was captured with in place;
  // restored values are copied into the same tensors, but the next steps run op by op
  // and capture again, so that nothing a restore makes anew is missed. Stages captured
  // together (CaptureGroup) capture again together.
  for (auto& other : runtimes_) {
    if (other.get() != &rt && (capture_group_ == nullptr || !other->local)) continue;
    other->captured.reset();
    other->fixed_inputs.clear();
    other->fixed_targets.clear();
    other->warmed_up = false;
  }
}

}  // namespace pipeline
}  // namespace gpipe
