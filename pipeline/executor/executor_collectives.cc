// The collectives of a step, instructions of the program before OPT: RG (the replicas'
// gradient sum and their statistics), TIE (a tied weight's gradient across two stages)
// and NORM (the global gradient norm for clipping).
#include "pipeline/executor/executor.h"

#include <cmath>
#include <map>

#include "pipeline/executor/stage_runtime.h"
#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

// The replicas' sum (RG): waits for the gradient buckets still in flight (the others
// were summed during the backwards) and, in a step that applies the optimizer, folds
// the layers' statistics over the replicas. Returns the bytes of gradients summed.
int64_t Executor::reduce_gradients(StageRuntime& rt) {
  GPIPE_CHECK(rt.reducer != nullptr, "RG on a stage without replicas");
  rt.reducer->finish(rt.params);  // its device is not shared (checked)
  int64_t bytes = 0;
  for (auto* p : rt.params) bytes += static_cast<int64_t>(p->grad.nbytes());
  if (cur_.apply_optimizer) fold_statistics(rt);
  return bytes;
}

void Executor::fold_statistics(StageRuntime& rt) {
  for (int c : rt.cells) {
    for (int i = cells_[c].first_layer; i < cells_[c].first_layer + cells_[c].num_layers; ++i) {
      model_.layer(i).end_step(*rt.backend, rt.replica_sum);
    }
  }
  rt.statistics_folded = true;
}

// TIE: both copies of a tied weight on two stages get the sum of their gradients: the
// copy's stage sends its gradient to the owner's, which adds it and sends the sum back.
// Both send copies: a send may still read its tensor when the sender overwrites or
// clears its gradient. Returns the bytes this stage sent.
int64_t Executor::exchange_tied_gradient(StageRuntime& rt, int tie) {
  const int k = rt.index;
  Backend& be = *rt.backend;
  const layers::Tie& t = model_.ties().at(static_cast<size_t>(tie));
  const int owner_stage = stage_of_layer(t.owner_layer), copy_stage = stage_of_layer(t.copy_layer);
  const MessageTag tag{MessageKind::kTiedGradient, tie};
  if (copy_stage == k) {
    Tensor mine = be.empty(t.copy->grad.shape(), t.copy->grad.dtype());  // the send may outlive the next line
    {
      auto turn = device_turn(k);
      be.copy(t.copy->grad, mine);
    }
    transport_.send(k, owner_stage, tag, mine);
    Tensor sum = transport_.recv(k, owner_stage, tag, rt.device);
    auto turn = device_turn(k);
    be.copy(sum, t.copy->grad);
    return static_cast<int64_t>(mine.nbytes());
  }
  GPIPE_CHECK(owner_stage == k, "TIE on a stage holding neither copy");
  Tensor other = transport_.recv(k, copy_stage, tag, rt.device);
  Tensor sum = be.empty(t.owner->grad.shape(), t.owner->grad.dtype());
  {
    auto turn = device_turn(k);
    be.axpy(1.0, other, t.owner->grad);
    be.copy(t.owner->grad, sum);
  }
  transport_.send(k, copy_stage, tag, sum);
  return static_cast<int64_t>(sum.nbytes());
}

// NORM: the global gradient norm, the squares of every stage's gradients summed over
// the stages (a tied weight counted once), for clipping in the optimizer step. Under
// tensor parallelism a split parameter's squares are summed over the stage's tensor
// group (each member holds its block), a whole one's counted once (every member holds
// the same gradient). Skipped by every stage alike in a step that keeps its gradients
// for inspection.
//
// One stage with no group to sum over (K = 1, no replicas, no tensor group) leaves the
// norm on its device, in the step's scalars (kernels/step_scalars.h): the host neither
// waits nor reads before OPT. Otherwise the host sums one number per stage, replica and
// member, and writes the total into the scalars for OPT.
//
// Stages captured together on one device (CaptureGroup) leave it there too: each its own
// sum, then each the total of all, in stage order (sum_group_norm).
bool Executor::norm_on_device() const {
  if (capture_group_ != nullptr) return true;
  return schedule_.num_stages == 1 && tensor_collectives_ == nullptr &&
         (options_.replicas == nullptr || options_.replicas->size() == 1);
}

int64_t Executor::reduce_gradient_norm(StageRuntime& rt) {
  if (!cur_.apply_optimizer) return 0;
  const int k = rt.index;
  sum_local_ties(rt);
  if (norm_on_device()) {
    std::vector<Tensor> grads;
    for (layers::Parameter* p : rt.params) {
      if (!model_.is_tied_copy(p)) grads.push_back(p->grad);  // a tied weight counts once
    }
    if (capture_group_ != nullptr) {
      sum_group_norm(rt, grads);
      return static_cast<int64_t>(sizeof(double));
    }
    auto turn = device_turn(k);
    const size_t slot = rt.trace.ops.size() - 1;  // run_stage's, reserved for this instruction
    rt.clock->before(rt.backend->stream(), slot);  // device time on a GPU, as OPT's
    rt.backend->sum_squares_all_to(grads, rt.scalars);
    rt.clock->after(rt.backend->stream(), slot);
    return static_cast<int64_t>(sizeof(double));
  }
  SumSquares local;
  if (rt.sharding) {
    // Each replica holds its shard of the summed gradients: the squares over the
    // replicas, then over the stages.
    local = shard_sum_squares(rt);
    if (tensor_collectives_ != nullptr) local.split = options_.replicas->all_reduce_sum(local.split);
    local.whole = options_.replicas->all_reduce_sum(local.whole);
  } else {
    // Split blocks by how many members hold each alike (Parameter::shard_replicas): each
    // holder counts 1 / R of such a block's squares, so the group's sum counts it once.
    std::map<int, std::vector<Tensor>> split;
    std::vector<Tensor> whole;
    for (layers::Parameter* p : rt.params) {
      if (model_.is_tied_copy(p)) continue;  // a tied weight counts once
      if (p->shard_count > 1) {
        split[p->shard_replicas].push_back(p->grad);
      } else {
        whole.push_back(p->grad);
      }
    }
    auto turn = device_turn(k);
    // One wait for the device per kind, not one a parameter.
    for (const auto& [replicas, grads] : split) local.split += rt.backend->sum_squares_all(grads) / replicas;
    local.whole = whole.empty() ? 0.0 : rt.backend->sum_squares_all(whole);
  }
  if (tensor_collectives_ != nullptr) local.split = options_.tensor_group->all_reduce_sum(local.split);
  rt.written[kStepNormSquared] = transport_.all_reduce_sum(k, local.split + local.whole);
  auto turn = device_turn(k);
  rt.backend->write_step_scalars(rt.written, rt.scalars);  // nothing on the device wrote them yet
  return static_cast<int64_t>(sizeof(double));
}

}  // namespace pipeline
}  // namespace gpipe
