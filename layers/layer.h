// The layer API. A layer has a forward that returns what its backward needs (a
// Context), a backward that accumulates parameter gradients and returns the input
// gradient, its parameters, and an exact cost estimate for a given input shape.
//
// Public non-virtual forward/backward validate their arguments and call the virtual
// *_impl, so every layer rejects a bad shape with the same kind of message.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace layers {

struct Parameter {
  std::string name;  // "weight", "bias"; the model prefixes the layer index
  // The parameter itself: what the optimizer steps and checkpoints keep. float32 in a
  // model of a narrow storage type (bfloat16, float16): the master weights.
  Tensor value;
  Tensor grad;  // shaped and typed like value; accumulated by backward (in float32 for a narrow model)
  // In a model of a narrow storage type: value rounded to it, which forward and backward
  // read. Whoever changes value calls refresh() (the executor after each optimizer step
  // and checkpoint load). Undefined otherwise.
  Tensor working;
  // What a layer computes with: the working copy, or value itself.
  const Tensor& compute() const { return working.defined() ? working : value; }
  // A tensor-parallel layer's shard of a whole parameter (layers/tensor_parallel.h):
  // value is block `shard_rank` of `shard_count` equal blocks along dimension
  // `shard_dim` of a tensor shaped `whole`, initialised as that block of the whole
  // tensor's values. shard_dim -1: the whole parameter (on every member of a split
  // layer's group, a replica).
  // With shard_groups > 1 the dimension is that many equal parts side by side, and value
  // holds block shard_rank of each part (TensorSplit::groups).
  int shard_dim = -1;
  int shard_rank = 0, shard_count = 1, shard_groups = 1;
  Shape whole;
  // A block (or a whole parameter) that this many members of the group hold alike: a
  // grouped-query attention's key/value heads over a group larger than they are. Its
  // layer sums its gradient over those members; the gradient norm and checkpoints count
  // it once. 1: held by one member (or, whole, by every member of a split layer alike).
  int shard_replicas = 1;
  // A whole parameter of a layer that holds only its member's positions under sequence
  // parallelism (a norm's weight, a position table; layers/tensor_parallel.h): its
  // gradient here is a partial sum over the member's positions, and the executor adds
  // it over the tensor group once it is final, before anything reads it.
  bool sequence_partial = false;
  // Rounds value into the working copy (nothing without one), on `be`'s stream.
  void refresh(Backend& be) {
    if (working.defined()) be.cast(value, working);
  }
};

// Marks `params` sequence_partial (above) when `partial`: the parameters of a layer
// that runs on a member's positions.
void mark_sequence_partial(const std::vector<Parameter*>& params, bool partial);

// refresh() for each of `params` in one multi-tensor call (one launch on a GPU); those
// without a working copy are skipped.
void refresh_all(Backend& be, const std::vector<Parameter*>& params);

// State a layer keeps that nothing trains but the model needs (BatchNorm's running
// statistics): saved in checkpoints beside the parameters, under names built like
// theirs ("running_mean", "bn1.running_mean").
struct Buffer {
  std::string name;
  Tensor* value = nullptr;
};

// One kernel of a layer's backward (a matrix product, a layer norm's pass, an
// elementwise map), with its own counts. The planner charges each part its own roofline
// time, max(flops / rate, bytes / bandwidth), to split backward's time between B and W:
// a roofline over a composite layer's sums would charge the bytes-bound work at the
// large products' rate. Device-independent, like the totals.
struct CostPart {
  bool weight = false;  // W's (a weight gradient, backward_weight_impl) or B's
  double flops = 0;
  double bytes = 0;
};

// Exact counts for one call with a batch of `batch` samples.
struct LayerCost {
  double forward_flops = 0;
  double backward_flops = 0;  // input and parameter gradients
  double input_grad_flops = 0;  // the part of backward_flops that computes dx (skipped for the model's first layer)
  // The part of backward that a layer splitting its backward does in W
  // (backward_weight_impl: its weight gradients); B does the rest. 0 for a layer that
  // does not split.
  double weight_grad_flops = 0;
  double forward_bytes = 0;   // memory traffic: inputs, outputs and parameters read/written
  double backward_bytes = 0;
  double weight_grad_bytes = 0;  // the part of backward_bytes that W moves
  int64_t param_bytes = 0;  // as forward reads them: a bfloat16 layer's working copies (master_param_bytes)
  int64_t output_bytes = 0;  // the activation this layer produces
  int64_t saved_bytes = 0;   // what forward keeps for backward without rematerialization
  // Backward's kernels one by one; their flops and bytes sum to backward_flops and
  // backward_bytes, the W parts' to weight_grad_flops and weight_grad_bytes (check_cost
  // checks). Empty means one kernel per phase: the totals' B and W (backward_parts below),
  // which is what a leaf layer whose backward is one pass per phase lists. A composite
  // layer gets its sub-layers' parts from operator+= and adds a part for its own work.
  std::vector<CostPart> backward_parts;
};

// The bytes of a layer's parameters in their master type, from `param_bytes`
// (LayerCost::param_bytes: what a layer of `dtype` reads, a bf16 or fp16 layer's working
// copies): what its gradients, its optimizer state and its checkpoint hold, and what
// replicas reduce. float32 for a narrow layer.
inline int64_t master_param_bytes(int64_t param_bytes, DType dtype) {
  return param_bytes / static_cast<int64_t>(dtype_size(dtype)) * static_cast<int64_t>(dtype_size(master_dtype(dtype)));
}
// What a layer's weights hold: the masters, and beside them a narrow layer's working copies.
inline int64_t weight_bytes(int64_t param_bytes, DType dtype) {
  return master_param_bytes(param_bytes, dtype) + (is_narrow(dtype) ? param_bytes : 0);
}

// c.backward_parts, or for a cost that lists none, B's totals and W's as one part each
// (a phase with no flops and no bytes has no part).
std::vector<CostPart> backward_parts(const LayerCost& c);

// Adds every count of `part` into `total`: the cost of a composite layer is the sum of
// its sub-layers' and its own. The backward parts are concatenated (a side that lists
// none contributes its totals' parts), so a composite keeps its sub-layers' kernels.
inline LayerCost& operator+=(LayerCost& total, const LayerCost& part) {
  std::vector<CostPart> parts = backward_parts(total);
  for (const CostPart& p : backward_parts(part)) parts.push_back(p);
  total.backward_parts = std::move(parts);
  total.forward_flops += part.forward_flops;
  total.backward_flops += part.backward_flops;
  total.input_grad_flops += part.input_grad_flops;
  total.weight_grad_flops += part.weight_grad_flops;
  total.forward_bytes += part.forward_bytes;
  total.backward_bytes += part.backward_bytes;
  total.weight_grad_bytes += part.weight_grad_bytes;
  total.param_bytes += part.param_bytes;
  total.output_bytes += part.output_bytes;
  total.saved_bytes += part.saved_bytes;
  return total;
}

// The cost of a backward that need not compute dx (the model's first layer): its
// input_grad_flops come out of B, where dx is computed, and B's bytes shrink in the
// same proportion; W is unchanged. Every B part shrinks in that proportion too (which
// kernel the skipped dx was is not recorded), so the parts still sum to the totals.
LayerCost without_input_grad(LayerCost c);

struct Tape;  // a derived layer's record of its forward (layers/derived.h)

// What forward keeps for backward; a composite layer keeps one child per sub-layer.
struct Context {
  std::vector<Tensor> saved;
  std::vector<Context> children;
  std::shared_ptr<const Tape> tape;  // a derived layer's: which op each saved tensor serves
};

// The contexts' children at `index`, for a composite layer's batched weight gradient.
std::vector<Context*> children_at(const std::vector<Context*>& ctxs, size_t index);
// A batched W's operand: every context's saved[i] stacked along the first (batch)
// dimension into one new contiguous tensor; all of one dtype and device, with equal
// trailing dimensions. A context without it is a W before its backward_input: an
// error naming `who`.
Tensor concat_saved(Backend& be, const std::vector<Context*>& ctxs, size_t i, const std::string& who);

// What a forward may need besides its input. Dropout keys its mask on (seed, step)
// and counts samples from the first sample of the mini-batch, so masks do not depend
// on the micro-batch split and a recompute reproduces them.
struct ForwardArgs {
  bool training = true;
  bool recompute = false;     // a rematerialization of a forward that already ran
  uint64_t step = 0;          // the optimizer step this forward belongs to
  int64_t sample_offset = 0;  // index of the input's first sample in the mini-batch
  // The executor's training steps: the step's scalars on the stage's device
  // (kernels/step_scalars.h), whose kStepIndex holds `step`. A dropout mask's key takes
  // the step from there when the op runs (DropoutKey), so that the step's calls are the
  // same at every step. Undefined elsewhere: the key takes `step`. The same mask either way.
  Tensor step_scalars;
};

// Sums `values` in place over the data-parallel replicas of a stage; empty without
// replicas.
using ReplicaSum = std::function<void(std::vector<double>& values)>;

class TensorCollectives;  // layers/tensor_parallel.h

class Layer {
 public:
  virtual ~Layer() = default;

  // x: (batch, *input_shape()). With ctx == nullptr nothing is kept for backward (the
  // no-grad forward of a checkpointed micro-batch). What forward_impl returns must be
  // (batch, *output_shape()) of dtype() on the backend's device, or this throws a
  // UserError naming the layer.
  Tensor forward(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args = {});
  // dy: (batch, *output_shape()). Adds parameter gradients into Parameter::grad and
  // returns dx, or an undefined tensor when need_dx is false (the first layer) or the
  // input is not differentiable (token ids). A dx that is not shaped like x is a
  // UserError naming the layer.
  Tensor backward(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx = true);
  // The same backward in two halves, for zero-bubble schedules: backward_input (B, on
  // the pipeline's critical path) returns dx and keeps in ctx what the weight
  // gradients need; backward_weight (W, run later in a bubble) adds them. A layer that
  // does not split (splits_backward() false) does all its work in backward_input and
  // nothing in backward_weight, so every layer runs under every schedule.
  Tensor backward_input(Backend& be, const Tensor& dy, Context& ctx, bool need_dx = true);
  void backward_weight(Backend& be, Context& ctx) { backward_weight_impl(be, ctx); }
  // W over several micro-batches at once (a batched weight gradient): the same sums as
  // backward_weight on each context in turn, in as few kernels as the layer can. Linear
  // and Conv2d concatenate the micro-batches' inputs and output gradients along the
  // batch and take one product (one GEMM over all their rows instead of one per
  // micro-batch); the layers built of them pass their children's contexts down; any
  // other layer runs its backward_weight_impl on each.
  void backward_weight(Backend& be, const std::vector<Context*>& ctxs);
  virtual bool splits_backward() const { return false; }

  // "linear", "relu", ... as named in configs.
  virtual std::string type() const = 0;
  // "linear(784 -> 1024)"
  virtual std::string describe() const = 0;
  // Per-sample shapes.
  const Shape& input_shape() const { return input_shape_; }
  const Shape& output_shape() const { return output_shape_; }
  // Exact counts for a batch of `batch` samples: the balancer splits the model by them.
  // Checked when a model's costs are taken (see check_cost below).
  virtual LayerCost cost(int64_t batch) const = 0;
  virtual std::vector<Parameter*> parameters() { return {}; }
  virtual std::vector<Buffer> buffers() { return {}; }
  // Called once per mini-batch on the stage's thread, after the optimizer step: layers
  // that gather statistics over the micro-batches (BatchNorm's running statistics)
  // fold them in here, as if they had seen the whole mini-batch at once. With
  // data-parallel replicas, `replicas` sums statistics over them, so that every replica
  // folds in those of the whole mini-batch; every replica calls it.
  void end_step(Backend& be, const ReplicaSum& replicas = {}) { end_step_impl(be, replicas); }
  // Whether a training step through this layer can be captured once and replayed
  // (pipeline.capture): a replay runs the step's ops and no host code, so a layer whose
  // step keeps or computes host state (BatchNorm's statistics, folded on the host at
  // end_step) says false, and its stage's steps run op by op.
  virtual bool capturable() const { return true; }
  // Moves parameters (and fresh zero gradients) to `device`.
  void to(Device device);
  // The tensor group a layer split over its stage's devices sums over (not owned;
  // layers/tensor_parallel.h). Nothing for a layer that is not split; a composite
  // layer passes it to its split parts.
  virtual void set_collectives(TensorCollectives* /*group*/) {}
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }              // parameters and output
  DType input_dtype() const { return input_dtype_; }  // int32 for token ids

 protected:
  Layer(Shape input_shape, Shape output_shape, DType dtype)
      : input_shape_(std::move(input_shape)), output_shape_(std::move(output_shape)), dtype_(dtype),
        input_dtype_(dtype) {}
  virtual Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) = 0;
  // A layer implements backward_impl, or (splitting its backward) backward_input_impl
  // and backward_weight_impl with splits_backward() true; each default is written in
  // terms of the other: the whole backward is the two halves on a copy of the context.
  virtual Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx);
  virtual Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
    return backward_impl(be, dy, ctx, need_dx);
  }
  virtual void backward_weight_impl(Backend&, Context&) {}
  // Called with two or more contexts; the default runs backward_weight_impl on each.
  virtual void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
    for (Context* c : ctxs) backward_weight_impl(be, *c);
  }
  virtual void end_step_impl(Backend&, const ReplicaSum&) {}
  // Creates a parameter on the CPU, initialised uniform in [-bound, bound], with a zero
  // gradient; under a ShapesOnly (runtime/tensor.h), one of shapes without data. In a layer of a
  // narrow storage type (bfloat16, float16) value and gradient are float32, initialised as a
  // float32 layer's, and the working copy is value rounded.
  Parameter make_parameter(const std::string& name, const Shape& shape, double bound, uint64_t seed);
  // Block `rank` of `count` along dimension `dim` of the parameter make_parameter would
  // make shaped `whole` (of each of `groups` equal parts of that dimension): the same
  // values, drawn for this block only (Parameter::shard_dim).
  Parameter make_parameter_block(const std::string& name, const Shape& whole, int dim, int rank, int count,
                                 int groups, double bound, uint64_t seed);
  // The same, every element `value` (a norm's scale 1 or shift 0).
  Parameter constant_parameter(const std::string& name, const Shape& shape, double value);

  Shape input_shape_, output_shape_;
  DType dtype_;
  DType input_dtype_;
  Device device_ = Device::cpu();

 private:
  friend class Sequential;
  friend void check_cost(Layer& layer, int64_t batch, const LayerCost& cost);
  // "layer 3 'norm.1' (rmsnorm(64), type 'rmsnorm')"; the index is the layer's place in
  // its model and the name the one it was given there (Sequential::add,
  // set_layer_name), each absent where there is none (a sub-layer, a layer on its own).
  std::string name_for_errors() const;
  int index_ = -1;
  std::string name_;
};

// Checks a layer's cost(batch) against what can be known exactly, and throws a
// UserError naming the layer, the count and the fix otherwise. The rule: every count is
// finite and non-negative; param_bytes equals the bytes of parameters(); output_bytes
// equals batch x output elements x the dtype's size; a layer with parameters counts
// forward and backward FLOPs (> 0; a forward that only moves data, a table lookup, may
// count 0 FLOPs and its bytes, at least twice output_bytes); input_grad_flops <= backward_flops; a layer that
// does not split its backward counts no weight_grad_flops or weight_grad_bytes, one
// with parameters that splits counts weight_grad_flops > 0, and input_grad_flops +
// weight_grad_flops <= backward_flops, weight_grad_bytes <= backward_bytes; listed
// backward_parts are finite and non-negative and sum to backward_flops and
// backward_bytes, the W parts to weight_grad_flops and weight_grad_bytes.
void check_cost(Layer& layer, int64_t batch, const LayerCost& cost);

// Fills a float32 or float64 host tensor with uniform values in [-bound, bound], element
// i the i-th draw of Rng(seed), as make_parameter initialises a weight; a large tensor is
// filled by every core at once (Rng::discard), with the same values.
void fill_uniform(Tensor& t, double bound, uint64_t seed);

// (batch, *sample): the shape of a batch of samples.
Shape batched(int64_t batch, const Shape& sample);

// Checks that x is (batch, *sample) of the given dtype; the message names the layer.
void check_batch(const Tensor& x, const Shape& sample, DType dtype, const std::string& who, const char* what);

}  // namespace layers
}  // namespace gpipe
