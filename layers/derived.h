// Layers written as forward only. A DerivedLayer's forward composes backend ops on Vars
// through a Graph, which records them; its backward, its B/W split for zero-bubble
// schedules, its batched weight gradient and its exact cost are derived from that
// record:
//
//   class DerivedRmsNorm : public gpipe::layers::DerivedLayer {
//    public:
//     DerivedRmsNorm(int64_t dim, DType dtype, uint64_t seed)
//         : DerivedLayer("derived_rmsnorm", {dim}, {dim}, dtype, seed),
//           g_(add_constant_parameter("weight", {dim}, 1.0)) {}
//     Var define(Graph& g, Var x) const override {
//       Var inv = g.rsqrt(g.add(g.mean(g.square(x)), 1e-6));  // (..., 1)
//       return g.mul(g.mul(x, inv), g.param(g_));             // broadcast over the last axis
//     }
//    private:
//     Parameter& g_;
//   };
//
// How it runs:
//   forward   each op runs on the backend as it is called and, when the executor keeps
//             a context, the op's node goes on a tape in Context::tape and the tensors
//             its gradient needs in Context::saved (never a parameter: those are read
//             live). A rematerialised forward records the same tape again; dropout's
//             mask is keyed on (the layer's seed, its place, the step) and the sample
//             offset, so a recompute reproduces it.
//   B         the tape in reverse: the gradient of every value that leads to the input;
//             at each op that reads a parameter, the op's output gradient is kept for W.
//   W         the parameter gradients, from the kept output gradients and the saved
//             tensors, added into Parameter::grad; batched W stacks the micro-batches'
//             linear() operands into one product per weight.
//   cost      the same forward run on shapes alone: every kernel that forward, B and W
//             would issue, counted as it would run (flops, bytes, one CostPart each).
// A layer that needs more speed than the derived backward gives can still implement
// Layer's backward by hand.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

class Graph;

// A value in a derived layer's forward: a tensor of (batch, ...) in the layer's dtype.
class Var {
 public:
  Var() = default;
  int id() const { return id_; }

 private:
  friend class Graph;
  friend class DerivedLayer;
  explicit Var(int id) : id_(id) {}
  int id_ = -1;
};

// What a derived layer's forward is written with. Every op makes a new value (nothing
// is written in place); shapes include the batch dimension. Elementwise ops broadcast as
// NumPy does (shapes aligned at the last dimension, sizes equal or 1); reductions are
// over the last axis and keep it, with size 1. Errors name the layer and the op.
class Graph {
 public:
  // A parameter (add_parameter) as a value: its working copy, read when an op uses it.
  Var param(Parameter& p);
  // x (..., in) @ w^T (+ b): w (out, in), b (out): a linear map over the last axis.
  Var linear(Var x, Parameter& w, Parameter* bias = nullptr);
  Var add(Var a, Var b);
  Var sub(Var a, Var b);
  Var mul(Var a, Var b);
  Var div(Var a, Var b);
  Var add(Var a, double c);  // a + c
  Var mul(Var a, double c);  // a * c
  // y = f(x) (kernels/unary.h), and the shorthands.
  Var unary(Unary f, Var x);
  Var relu(Var x) { return unary(Unary::kRelu, x); }
  Var gelu(Var x) { return unary(Unary::kGelu, x); }
  Var silu(Var x) { return unary(Unary::kSilu, x); }
  Var sigmoid(Var x) { return unary(Unary::kSigmoid, x); }
  Var tanh(Var x) { return unary(Unary::kTanh, x); }
  Var exp(Var x) { return unary(Unary::kExp, x); }
  Var square(Var x) { return unary(Unary::kSquare, x); }
  Var rsqrt(Var x) { return unary(Unary::kRsqrt, x); }
  // Over the last axis, (..., C) -> (..., 1).
  Var reduce(Reduce op, Var x);
  Var sum(Var x) { return reduce(Reduce::kSum, x); }
  Var mean(Var x) { return reduce(Reduce::kMean, x); }
  Var max(Var x) { return reduce(Reduce::kMax, x); }
  Var norm(Var x) { return reduce(Reduce::kNorm, x); }
  Var softmax(Var x);  // over the last axis
  // Inverted dropout with probability p while training, the identity otherwise; each call
  // draws its own mask.
  Var dropout(Var x, double p);
  // The value's shape, (batch, ...).
  const Shape& shape(Var v) const;

  struct Impl;
  explicit Graph(Impl& impl) : impl_(impl) {}

 private:
  Impl& impl_;
};

class DerivedLayer : public Layer {
 public:
  // The names a layer written outside gpipe's namespace uses, first in the class.
  using Var = layers::Var;
  using Graph = layers::Graph;
  using Parameter = layers::Parameter;

  std::string type() const override { return type_; }
  std::string describe() const override;  // "derived_rmsnorm(64) -> (64)"
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;
  // B and W apart when the layer has parameters (their gradients are W's).
  bool splits_backward() const override { return !params_.empty(); }

 protected:
  // type: the name in configs and messages; shapes per sample; dtype: the layer's (a
  // factory's `dtype`); seed: the factory's `seed`, from which dropout draws its masks
  // (two layers of one seed would draw the same).
  DerivedLayer(std::string type, Shape input_shape, Shape output_shape, DType dtype, uint64_t seed);
  // The layer's forward, written once (named define so that it does not hide
  // Layer::forward); x is (batch, *input_shape()) and what it returns
  // must be (batch, *output_shape()).
  virtual Var define(Graph& g, Var x) const = 0;
  // A parameter the layer owns, uniform in [-bound, bound] (Layer::make_parameter), or
  // every element `value`; the reference stays valid for the layer's life. Names as in
  // checkpoints ("weight", "gate.weight").
  Parameter& add_parameter(const std::string& name, const Shape& shape, double bound, uint64_t seed);
  Parameter& add_constant_parameter(const std::string& name, const Shape& shape, double value);

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  // The tape of one forward: its nodes, on shapes alone (cost) or running on `be`.
  std::shared_ptr<const Tape> record(Backend* be, const Tensor& x, int64_t batch, const ForwardArgs& args,
                               Context* ctx, Tensor* out, LayerCost* cost) const;

  std::string type_;
  uint64_t seed_;
  std::deque<Parameter> params_;  // a deque: references stay valid
  std::vector<Shape> param_shapes_;
};

}  // namespace layers
}  // namespace gpipe
