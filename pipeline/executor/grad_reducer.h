// Data parallelism: sums one stage's gradients over its replicas in buckets, as
// PyTorch's DistributedDataParallel does, so that the reductions of the layers whose
// gradients are final start while the earlier layers are still in backward.
//
// In GPipe a parameter's gradient is final after the stage's last backward of the
// mini-batch, and that backward runs the cell's layers last to first: the executor
// marks each layer's parameters ready as that backward leaves the layer. A bucket
// (a flat buffer on the stage's device) starts its reduction once it holds
// bucket_bytes; finish() starts the rest, waits, and writes the sums back (each
// replica scaled its loss by the whole mini-batch's target count, so the sum is the
// mini-batch's gradient).
//
//   last backward:  layer 5 | layer 4 | layer 3 | layer 2 | layer 1 | layer 0 | opt
//   reductions:            [ bucket 0 (5, 4)   ][ bucket 1 (3, 2, 1)     ][b2]
#pragma once

#include <cstdint>
#include <unordered_set>
#include <vector>

#include "layers/layer.h"
#include "runtime/transport.h"

namespace gpipe {
namespace pipeline {

class GradReducer {
 public:
  // group: the stage's replicas (not owned). bucket_bytes: how much to gather before a
  // reduction starts; 0 starts one per parameter.
  GradReducer(ReplicaGroup& group, Backend& be, int64_t bucket_bytes);
  // p's gradient is final for this step. Every replica marks the same parameters in
  // the same order.
  void ready(layers::Parameter* p);
  // Lets started reductions advance; cheap, call it between layers.
  void progress() { group_.progress(); }
  // Marks every parameter of `all` not yet ready, waits for every reduction and
  // leaves each gradient summed over the replicas. Ends the step.
  void finish(const std::vector<layers::Parameter*>& all);
  // Reductions started so far in this step (for tests and logs).
  int buckets_started() const { return started_; }

 private:
  struct Bucket {
    std::vector<layers::Parameter*> params;
    int64_t bytes = 0;
    Tensor flat;  // the gradients back to back, on the stage's device
  };
  void start(Bucket& b);

  ReplicaGroup& group_;
  Backend& be_;
  int64_t bucket_bytes_;
  std::vector<Bucket> buckets_;  // this step's; the last one is open while not started
  std::unordered_set<const layers::Parameter*> marked_;  // ready this step
  bool open_ = false;
  int started_ = 0;
};

}  // namespace pipeline
}  // namespace gpipe
