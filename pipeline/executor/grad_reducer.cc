#include "pipeline/executor/grad_reducer.h"

#include "runtime/error.h"

namespace gpipe {
namespace pipeline {

GradReducer::GradReducer(ReplicaGroup& group, Backend& be, int64_t bucket_bytes)
    : group_(group), be_(be), bucket_bytes_(bucket_bytes) {}

void GradReducer::ready(layers::Parameter* p) {
  GPIPE_CHECK(marked_.insert(p).second, "gradient of " + p->name + " marked ready twice in one step");
  // One element type per bucket: a parameter of another type closes the open one.
  if (open_ && buckets_.back().params.front()->grad.dtype() != p->grad.dtype()) start(buckets_.back());
  if (!open_) {
    buckets_.emplace_back();
    open_ = true;
  }
  Bucket& b = buckets_.back();
  b.params.push_back(p);
  b.bytes += static_cast<int64_t>(p->grad.nbytes());
  if (b.bytes >= bucket_bytes_) start(b);
}

void GradReducer::start(Bucket& b) {
  int64_t numel = 0;
  for (const layers::Parameter* p : b.params) numel += p->grad.numel();
  const DType dtype = b.params.front()->grad.dtype();
  b.flat = be_.empty({numel}, dtype);  // (numel) on the stage's device
  int64_t offset = 0;
  for (const layers::Parameter* p : b.params) {
    Tensor slice = b.flat.narrow_rows(offset, p->grad.numel()).reshape(p->grad.shape());
    be_.copy(p->grad, slice);
    offset += p->grad.numel();
  }
  // Summed: each replica's loss was scaled by the whole mini-batch's target count, so
  // the sum over replicas is the mini-batch's gradient.
  group_.start_all_reduce_sum(b.flat);
  open_ = false;
  ++started_;
}

void GradReducer::finish(const std::vector<layers::Parameter*>& all) {
  for (layers::Parameter* p : all) {
    if (marked_.count(p) == 0) ready(p);
  }
  if (open_) start(buckets_.back());
  group_.wait_all();
  for (Bucket& b : buckets_) {
    int64_t offset = 0;
    for (layers::Parameter* p : b.params) {
      be_.copy(b.flat.narrow_rows(offset, p->grad.numel()).reshape(p->grad.shape()), p->grad);
      offset += p->grad.numel();
    }
  }
  buckets_.clear();
  marked_.clear();
  started_ = 0;
}

}  // namespace pipeline
}  // namespace gpipe
