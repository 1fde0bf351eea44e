// Sharded optimizer state (pipeline.shard_optimizer: optimizer, ZeRO-1): each of a
// stage's D replicas keeps the optimizer state of, and updates, only its shard of the
// stage's flattened parameters (shard_partition.h). The program's RS reduce-scatters
// the gradients, so each replica gets the sum of its shard only; NORM sums the shards'
// squares over the replicas and then the stages; OPT steps the shard; AG all-gathers
// the updated shards, so every replica holds the whole stage again.
//
//   replica d:  backward ... | TIE | RS: flat (D x block) -> grad_block | NORM | OPT(shard) | AG: value_block -> flat -> parameters
//
// Checkpoints stay whole and by name: saving gathers each optimizer slot over the
// replicas (every replica takes part; replica 0 writes), restoring takes this
// replica's pieces of the whole tensors, so a run resumes at any D, sharded or not.
#include <cmath>

#include "pipeline/executor/executor.h"
#include "pipeline/executor/stage_runtime.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

namespace {
// A parameter's elements as one row (its tensors are contiguous).
Tensor flat_view(const Tensor& t) { return t.reshape({t.numel()}); }
}  // namespace

void Executor::make_sharding(StageRuntime& rt) {
  ReplicaGroup& group = *options_.replicas;
  auto sh = std::make_unique<StageRuntime::Sharding>();
  std::vector<int64_t> numels;
  DType dtype = master_dtype(model_.dtype());  // what the optimizer steps: a bf16 or fp16 model's float32 masters
  for (const layers::Parameter* p : rt.params) {
    GPIPE_CHECK(p->value.is_contiguous() && p->grad.is_contiguous(), "parameter " + p->name + " is not contiguous");
    if (p->value.dtype() != dtype) {
      throw UserError("pipeline.shard_optimizer needs one element type per stage; stage " + std::to_string(rt.index) +
                      " holds " + p->value.str() + " beside " + dtype_name(dtype) +
                      " parameters; set pipeline.shard_optimizer: none");
    }
    numels.push_back(p->value.numel());
  }
  sh->partition = shard_partition(numels, group.size());
  sh->replica = group.rank();
  GPIPE_CHECK(sh->replica >= 0 && sh->replica < group.size(), "replica rank out of range");
  for (int d = 0; d < group.size(); ++d) sh->pieces.push_back(sh->partition.pieces(d));
  const int64_t B = sh->partition.block();
  Backend& be = *rt.backend;
  sh->flat = be.zeros({B * group.size()}, dtype);  // the padding stays zero
  sh->grad_block = be.zeros({B}, dtype);
  sh->value_block = be.zeros({B}, dtype);
  const std::vector<ShardPiece>& mine = sh->pieces[sh->replica];
  sh->views.reserve(mine.size());  // the optimizer keeps pointers to them
  std::vector<layers::Parameter*> views;
  for (const ShardPiece& piece : mine) {
    const layers::Parameter* p = rt.params[piece.param];
    layers::Parameter v;
    v.name = p->name;
    v.value = flat_view(p->value).narrow_rows(piece.param_offset, piece.length);
    v.grad = sh->grad_block.narrow_rows(piece.shard_offset, piece.length);
    sh->views.push_back(std::move(v));
    views.push_back(&sh->views.back());
  }
  rt.optimizer = layers::make_optimizer(views, options_.optimizer);
  rt.sharding = std::move(sh);
}

// RS: every replica packs its accumulated gradients shard by shard into the flat
// buffer (block d holds shard d) and keeps the sum of its own block. The ties within
// the stage are summed first, as the copies' pieces may lie in other replicas' shards;
// the TIEs across stages ran before (their sum is linear too).
int64_t Executor::reduce_scatter_gradients(StageRuntime& rt) {
  GPIPE_CHECK(rt.sharding != nullptr, "RS on a stage whose optimizer state is not sharded");
  StageRuntime::Sharding& sh = *rt.sharding;
  sum_local_ties(rt);
  const int64_t B = sh.partition.block();
  {
    auto turn = device_turn(rt.index);
    for (size_t d = 0; d < sh.pieces.size(); ++d) {
      for (const ShardPiece& piece : sh.pieces[d]) {
        Tensor into = sh.flat.narrow_rows(static_cast<int64_t>(d) * B + piece.shard_offset, piece.length);
        rt.backend->copy(flat_view(rt.params[piece.param]->grad).narrow_rows(piece.param_offset, piece.length), into);
      }
    }
  }
  options_.replicas->reduce_scatter_sum(sh.flat, sh.grad_block);
  if (cur_.apply_optimizer) fold_statistics(rt);
  return static_cast<int64_t>(sh.flat.nbytes());
}

// NORM's share of a replica: the squares of its shard of the summed gradients (a tied
// copy's pieces left out: its weight counts once, at its owner).
Executor::SumSquares Executor::shard_sum_squares(StageRuntime& rt) {
  StageRuntime::Sharding& sh = *rt.sharding;
  const std::vector<ShardPiece>& mine = sh.pieces[sh.replica];
  SumSquares local;
  auto turn = device_turn(rt.index);
  for (size_t i = 0; i < mine.size(); ++i) {
    const layers::Parameter* p = rt.params[mine[i].param];
    if (model_.is_tied_copy(p)) continue;
    const double squares = rt.backend->sum_squares(sh.views[i].grad);
    // A block several members hold alike (Parameter::shard_replicas): once in the group's sum.
    if (p->shard_count > 1) {
      local.split += squares / p->shard_replicas;
    } else {
      local.whole += squares;
    }
  }
  return local;
}

// AG: after the step, each replica's updated shard to every replica, unpacked into the
// parameters. Skipped by every replica alike in a step that keeps its gradients.
int64_t Executor::gather_parameters(StageRuntime& rt) {
  GPIPE_CHECK(rt.sharding != nullptr, "AG on a stage whose optimizer state is not sharded");
  if (!cur_.apply_optimizer) return 0;
  StageRuntime::Sharding& sh = *rt.sharding;
  const std::vector<ShardPiece>& mine = sh.pieces[sh.replica];
  const int64_t B = sh.partition.block();
  {
    auto turn = device_turn(rt.index);
    for (size_t i = 0; i < mine.size(); ++i) {
      Tensor into = sh.value_block.narrow_rows(mine[i].shard_offset, mine[i].length);
      rt.backend->copy(sh.views[i].value, into);
    }
  }
  options_.replicas->all_gather(sh.value_block, sh.flat);
  auto turn = device_turn(rt.index);
  for (size_t from = 0; from < sh.pieces.size(); ++from) {  // every replica's shard (its own included: unchanged)
    for (const ShardPiece& piece : sh.pieces[from]) {
      Tensor into = flat_view(rt.params[piece.param]->value).narrow_rows(piece.param_offset, piece.length);
      rt.backend->copy(sh.flat.narrow_rows(static_cast<int64_t>(from) * B + piece.shard_offset, piece.length), into);
    }
  }
  layers::refresh_all(*rt.backend, rt.params);  // a bf16 or fp16 model's working copies
  return static_cast<int64_t>(sh.value_block.nbytes());
}

int64_t state_bytes(layers::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (size_t i = 0; i < optimizer.params().size(); ++i) {
    for (const layers::OptimizerSlot& s : optimizer.slots(i)) {
      if (s.value->defined()) bytes += static_cast<int64_t>(s.value->nbytes());
    }
  }
  return bytes;
}

int64_t Executor::optimizer_state_bytes(int k) {
  StageRuntime& rt = *runtimes_.at(k);
  GPIPE_CHECK(rt.local, "stage " + std::to_string(k) + " runs in another process");
  return state_bytes(*rt.optimizer);
}

// Each slot of the optimizer, whole: this replica's pieces packed into its block,
// all-gathered (every replica calls this, in the same order), cut into parameters.
void Executor::save_sharded_optimizer(StageRuntime& rt, const std::vector<std::string>& names, StageState& out) {
  StageRuntime::Sharding& sh = *rt.sharding;
  const std::vector<ShardPiece>& mine = sh.pieces[sh.replica];
  const int64_t B = sh.partition.block();
  const auto suffixes = layers::optimizer_slot_suffixes(options_.optimizer);
  Backend& be = *rt.backend;
  for (size_t j = 0; j < suffixes.size(); ++j) {
    Tensor block = be.zeros({B}, master_dtype(model_.dtype()));
    for (size_t i = 0; i < mine.size(); ++i) {
      const std::vector<layers::OptimizerSlot> slots = rt.optimizer->slots(i);
      GPIPE_CHECK(j < slots.size() && slots[j].suffix == suffixes[j], "optimizer slots out of order");
      if (!slots[j].value->defined()) continue;  // not yet created: zeros
      Tensor into = block.narrow_rows(mine[i].shard_offset, mine[i].length);
      be.copy(slots[j].value->reshape({mine[i].length}), into);
    }
    Tensor flat = be.empty({B * sh.partition.replicas}, master_dtype(model_.dtype()));
    options_.replicas->all_gather(block, flat);
    Tensor host = Tensor::empty(flat.shape(), flat.dtype(), Device::cpu());
    copy_tensor(flat, host);
    std::vector<Tensor> whole(rt.params.size());
    for (size_t d = 0; d < sh.pieces.size(); ++d) {
      for (const ShardPiece& piece : sh.pieces[d]) {
        Tensor& w = whole[piece.param];
        if (!w.defined()) w = Tensor::empty(rt.params[piece.param]->value.shape(), master_dtype(model_.dtype()), Device::cpu());
        Tensor into = flat_view(w).narrow_rows(piece.param_offset, piece.length);
        copy_tensor(host.narrow_rows(static_cast<int64_t>(d) * B + piece.shard_offset, piece.length), into);
      }
    }
    for (size_t i = 0; i < rt.params.size(); ++i) {
      if (model_.is_tied_copy(rt.params[i])) continue;  // its owner's stage saves it
      out.optimizer[names[i] + suffixes[j]] = whole[i].defined() ? whole[i]
                                                                 : Tensor::zeros_cpu(rt.params[i]->value.shape(), master_dtype(model_.dtype()));
    }
  }
}

// This replica's pieces of each whole slot in the checkpoint (saved at any D, sharded
// or not).
void Executor::restore_sharded_optimizer(StageRuntime& rt, const std::vector<std::string>& names,
                                         const std::map<std::string, Tensor>& optimizer) {
  StageRuntime::Sharding& sh = *rt.sharding;
  const std::vector<ShardPiece>& mine = sh.pieces[sh.replica];
  for (size_t i = 0; i < mine.size(); ++i) {
    const layers::Parameter* p = rt.params[mine[i].param];
    for (const layers::OptimizerSlot& slot : rt.optimizer->slots(i)) {
      const std::string name = names[mine[i].param] + slot.suffix;
      auto it = optimizer.find(name);
      if (it == optimizer.end()) {
        throw UserError("the checkpoint has no optimizer state " + name + "; it was saved from another model (or "
                        "another optimizer.type); resume with the config it was saved with");
      }
      const Tensor& saved = it->second;
      if (saved.shape() != p->value.shape() || saved.dtype() != p->value.dtype()) {
        throw UserError("the checkpoint's optimizer state " + name + " is " + saved.str() + " but the model's is " +
                        p->value.str() + "; resume with the config the checkpoint was saved with");
      }
      Tensor piece = flat_view(saved).narrow_rows(mine[i].param_offset, mine[i].length);
      if (!slot.value->defined()) *slot.value = rt.backend->zeros({mine[i].length}, p->value.dtype());
      copy_tensor(piece, *slot.value);
    }
  }
}

}  // namespace pipeline
}  // namespace gpipe
