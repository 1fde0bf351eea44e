// Layers written as forward only (layers/derived.h): the tape, the derived backward and
// the derived cost. Layout: the tape's nodes; Exec, which runs a kernel on the backend
// and/or counts it; the Graph's ops (forward); the gradient rules (B and W); the layer.
#include "layers/derived.h"

#include <algorithm>
#include <sstream>

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

enum class OpKind { kInput, kParam, kLinear, kBinary, kAddScalar, kMulScalar, kUnary, kReduce, kSoftmax, kDropout };

// One value of the forward and the op that made it.
struct Node {
  OpKind kind = OpKind::kInput;
  int a = -1, b = -1;          // the op's inputs (values)
  Parameter* param = nullptr;  // kParam: the parameter; kLinear: the weight
  Parameter* bias = nullptr;   // kLinear, or none
  Binary binary = Binary::kAdd;
  Unary unary = Unary::kRelu;
  Reduce reduce = Reduce::kSum;
  double scalar = 0;  // kAddScalar, kMulScalar: the constant; kDropout: p
  DropoutKey key;     // kDropout: the mask's key and the batch's first sample
  int64_t offset = 0;
  Shape shape;              // (batch, ...)
  bool reaches_param = false;  // computed from a parameter: its gradient flows on to W
  int saved = -1;           // the value's index in Context::saved; -1: not kept
};

struct Tape {
  std::vector<Node> nodes;  // in forward order; node 0 is the input
  int output = -1;
  size_t forward_saved = 0;  // Context::saved after forward; B's kept output gradients follow
};

namespace {

// Whether W has work at this node: it reads a parameter.
bool reads_parameter(const Tape& t, const Node& n) {
  if (n.kind == OpKind::kLinear) return true;
  auto is_param = [&](int v) { return v >= 0 && t.nodes[v].kind == OpKind::kParam; };
  return is_param(n.a) || is_param(n.b);
}

// Whether two tapes are the same program op for op (one define run on two micro-batches),
// so that a batched W may read the same saved slots in both.
bool same_program(const Tape& a, const Tape& b) {
  if (a.nodes.size() != b.nodes.size() || a.forward_saved != b.forward_saved || a.output != b.output) return false;
  for (size_t i = 0; i < a.nodes.size(); ++i) {
    const Node &x = a.nodes[i], &y = b.nodes[i];
    if (x.kind != y.kind || x.a != y.a || x.b != y.b || x.param != y.param || x.bias != y.bias ||
        x.saved != y.saved) {
      return false;
    }
  }
  return true;
}

// A value as the kernels see it: its shape and type always, its tensor when running.
struct Val {
  Shape shape;
  DType dtype = DType::kF32;
  Tensor t;
  bool present = false;  // a gradient that exists (B: reached from the output)
};

// Runs kernels on `be` (when set) and counts each into `cost` (when set): the one place
// where the derived forward, B and W are both executed and priced, so that the cost is
// what runs.
struct Exec {
  Backend* be = nullptr;
  LayerCost* cost = nullptr;
  enum Phase { kForward, kB, kW } phase = kForward;
  bool into_input = false;  // B: this gradient is the input's (skipped for the first layer)

  static double bytes(const Val& v) { return static_cast<double>(shape_numel(v.shape) * dtype_size(v.dtype)); }
  static double n(const Val& v) { return static_cast<double>(shape_numel(v.shape)); }

  void count(double flops, double moved) {
    if (cost == nullptr) return;
    if (phase == kForward) {
      cost->forward_flops += flops;
      cost->forward_bytes += moved;
      return;
    }
    cost->backward_flops += flops;
    cost->backward_bytes += moved;
    if (phase == kW) {
      cost->weight_grad_flops += flops;
      cost->weight_grad_bytes += moved;
    }
    if (into_input) cost->input_grad_flops += flops;
    cost->backward_parts.push_back({phase == kW, flops, moved});
  }
  Val make(const Shape& shape, DType dtype) {
    Val v{shape, dtype, {}, true};
    if (be != nullptr) v.t = be->empty(shape, dtype);
    return v;
  }
  Tensor constant(double c, DType dtype) {
    Tensor t = be->empty({1}, dtype);
    be->fill(t, c);
    return t;
  }

  Val binary(Binary op, const Val& a, const Val& b, DType dtype) {
    Val y = make(ops::broadcast_shape(a.shape, b.shape, binary_name(op)), dtype);
    count(n(y), bytes(a) + bytes(b) + bytes(y));
    if (be != nullptr) be->binary(op, a.t, b.t, y.t);
    return y;
  }
  Val binary_scalar(Binary op, const Val& a, double c, DType dtype) {
    Val y = make(a.shape, dtype);
    count(n(y), bytes(a) + bytes(y));
    if (be != nullptr) be->binary(op, a.t, constant(c, a.dtype), y.t);
    return y;
  }
  // g summed to `shape` (the gradient of a broadcast operand) in `dtype`: itself where
  // nothing is summed or converted.
  Val reduce_to(const Val& g, const Shape& shape, DType dtype) {
    if (g.shape == shape && g.dtype == dtype) return g;
    Val y = make(shape, dtype);
    count(g.shape == shape ? 0 : n(g), bytes(g) + bytes(y));
    if (be != nullptr) {
      if (g.shape == shape) {
        be->cast(g.t, y.t);
      } else {
        be->sum_to(g.t, y.t);
      }
    }
    return y;
  }
  Val negate(const Val& g) { return binary_scalar(Binary::kMul, g, -1.0, g.dtype); }
  // grad += g (both of the parameter's master type and shape).
  void accumulate(const Val& g, Tensor& grad) {
    count(2 * n(g), 3 * bytes(g));
    if (be != nullptr) be->axpy(1.0, g.t, grad);
  }
};

}  // namespace

// ---------------------------------------------------------------------------------
// The Graph: each op checks its shapes, adds its node, runs (or counts) its forward and
// decides what its gradient will need kept.

struct Graph::Impl {
  const DerivedLayer& layer;
  const std::deque<Parameter>& params;
  const std::vector<Shape>& param_shapes;
  DType dtype;  // the layer's: every value's
  ForwardArgs args;
  uint64_t seed;
  Exec exec;
  bool keep;  // a context is kept: mark what backward needs
  Tape tape;
  std::vector<Val> values;
  std::vector<bool> kept;
  int dropouts = 0;

  std::string who() const { return layer.describe(); }

  Val value(int v) {
    const Node& n = tape.nodes[v];
    if (n.kind == OpKind::kParam) {
      Val p{n.shape, dtype, {}, true};
      if (exec.be != nullptr) p.t = n.param->compute();
      return p;
    }
    return values[v];
  }
  const Shape& param_shape(const Parameter& p, const char* op) const {
    for (size_t i = 0; i < params.size(); ++i) {
      if (&params[i] == &p) return param_shapes[i];
    }
    throw UserError(who() + ": " + op + ": parameter '" + p.name +
                    "' is not this layer's own; create it with add_parameter in the layer's constructor");
  }
  void check(Var v, const char* op) const {
    if (v.id() < 0 || v.id() >= static_cast<int>(tape.nodes.size())) {
      throw UserError(who() + ": " + op + ": a Var that is not a value of this forward (made by another Graph, or default-constructed)");
    }
  }
  // A reduction over the last axis must not reduce over the batch: samples stay apart,
  // so that any micro-batch split computes the same.
  void check_per_sample(Var v, const char* op) const {
    if (tape.nodes[v.id()].kind != OpKind::kParam && tape.nodes[v.id()].shape.size() < 2) {
      throw UserError(who() + ": " + op + " over the last axis of " + shape_str(tape.nodes[v.id()].shape) +
                      " would reduce over the batch; a value needs a dimension per sample");
    }
  }
  // What a node's gradient will read: its tensor goes into the context (a parameter is
  // read live instead).
  void keep_value(int v) {
    if (keep && v >= 0 && tape.nodes[v].kind != OpKind::kParam) kept[v] = true;
  }
  Var add_node(Node n, Val y) {
    n.shape = y.shape;
    n.reaches_param = n.kind == OpKind::kParam || n.kind == OpKind::kLinear ||
                      (n.a >= 0 && tape.nodes[n.a].reaches_param) || (n.b >= 0 && tape.nodes[n.b].reaches_param);
    tape.nodes.push_back(std::move(n));
    values.push_back(std::move(y));
    kept.push_back(false);
    return Var(static_cast<int>(tape.nodes.size()) - 1);
  }
  // Runs f, turning a kernel's argument error (which begins with the op's name) into one
  // that names the layer.
  template <typename F>
  Val run(F&& f) {
    try {
      return f();
    } catch (const UserError&) {
      throw;
    } catch (const Error& e) {
      throw UserError(who() + ": " + e.what());
    }
  }
};

// Graph's ops call into its Impl through these (Graph is a thin handle).
Var Graph::param(Parameter& p) {
  Node n;
  n.kind = OpKind::kParam;
  n.param = &p;
  return impl_.add_node(n, Val{impl_.param_shape(p, "param"), impl_.dtype, {}, true});
}

Var Graph::linear(Var x, Parameter& w, Parameter* bias) {
  impl_.check(x, "linear");
  impl_.check_per_sample(x, "linear");
  const Shape& ws = impl_.param_shape(w, "linear");
  const Val vx = impl_.value(x.id());
  if (ws.size() != 2 || vx.shape.back() != ws[1]) {
    throw UserError(impl_.who() + ": linear: input " + shape_str(vx.shape) + " and weight '" + w.name + "' " +
                    shape_str(ws) + " do not fit: the weight must be (out, in) with in = the input's last dimension");
  }
  if (bias != nullptr && impl_.param_shape(*bias, "linear") != Shape{ws[0]}) {
    throw UserError(impl_.who() + ": linear: bias '" + bias->name + "' must be (" + std::to_string(ws[0]) + ")");
  }
  Node n;
  n.kind = OpKind::kLinear;
  n.a = x.id();
  n.param = &w;
  n.bias = bias;
  const int64_t in = ws[1], out = ws[0], rows = shape_numel(vx.shape) / std::max<int64_t>(in, 1);
  Shape ys = vx.shape;
  ys.back() = out;
  Exec& e = impl_.exec;
  Val y = e.make(ys, impl_.dtype);
  const double es = static_cast<double>(dtype_size(impl_.dtype));
  e.count(2.0 * rows * in * out + (bias != nullptr ? rows * out : 0), es * (rows * in + in * out + rows * out));
  if (e.be != nullptr) {
    Tensor y2 = y.t.reshape({rows, out});
    impl_.run([&] {
      e.be->matmul_weight(vx.t.reshape({rows, in}), false, w.compute(), true, y2);
      if (bias != nullptr) e.be->add_bias(y2, bias->compute());
      return y;
    });
  }
  impl_.keep_value(x.id());  // dW = dy^T x
  return impl_.add_node(n, y);
}

namespace {
Var binary_op(Graph::Impl& g, Binary op, Var a, Var b) {
  g.check(a, binary_name(op));
  g.check(b, binary_name(op));
  Node n;
  n.kind = OpKind::kBinary;
  n.binary = op;
  n.a = a.id();
  n.b = b.id();
  const Val y = g.run([&] { return g.exec.binary(op, g.value(a.id()), g.value(b.id()), g.dtype); });
  // Every value depends on the input or a parameter, so both sides get gradients.
  if (op == Binary::kMul) {
    g.keep_value(a.id());  // b's gradient: dy a
    g.keep_value(b.id());  // a's: dy b
  }
  if (op == Binary::kDiv) g.keep_value(b.id());  // a's: dy / b
  Var v = g.add_node(n, y);
  if (op == Binary::kDiv) g.keep_value(v.id());  // b's: -dy y / b
  return v;
}
}  // namespace

Var Graph::add(Var a, Var b) { return binary_op(impl_, Binary::kAdd, a, b); }
Var Graph::sub(Var a, Var b) { return binary_op(impl_, Binary::kSub, a, b); }
Var Graph::mul(Var a, Var b) { return binary_op(impl_, Binary::kMul, a, b); }
Var Graph::div(Var a, Var b) { return binary_op(impl_, Binary::kDiv, a, b); }

namespace {
// a op c for a constant c (add or mul): kAddScalar or kMulScalar.
Var scalar_op(Graph::Impl& g, OpKind kind, Binary op, Var a, double c) {
  g.check(a, binary_name(op));
  Node n;
  n.kind = kind;
  n.a = a.id();
  n.scalar = c;
  return g.add_node(n, g.run([&] { return g.exec.binary_scalar(op, g.value(a.id()), c, g.dtype); }));
}
}  // namespace

Var Graph::add(Var a, double c) { return scalar_op(impl_, OpKind::kAddScalar, Binary::kAdd, a, c); }
Var Graph::mul(Var a, double c) { return scalar_op(impl_, OpKind::kMulScalar, Binary::kMul, a, c); }

namespace {

// The flops per element of each function forward and of its backward (the slope and
// the product with dy), as the built-in layers count them (docs/WRITING_LAYERS.md):
// an exponential or tanh 25, sigmoid 28, silu 29, GELU 48 (78 back).
std::pair<double, double> unary_flops(Unary f) {
  switch (f) {
    case Unary::kRelu: return {1, 1};
    case Unary::kGelu: return {48, 78};
    case Unary::kSilu: return {29, 33};
    case Unary::kSigmoid: return {28, 31};
    case Unary::kTanh: return {25, 28};
    case Unary::kExp: return {25, 26};
    case Unary::kSquare: return {1, 2};
    case Unary::kRsqrt: return {2, 5};
  }
  return {1, 1};
}

}  // namespace

Var Graph::unary(Unary f, Var x) {
  impl_.check(x, unary_name(f));
  Node n;
  n.kind = OpKind::kUnary;
  n.unary = f;
  n.a = x.id();
  Exec& e = impl_.exec;
  const Val vx = impl_.value(x.id());
  Val y = e.make(vx.shape, impl_.dtype);
  e.count(unary_flops(f).first * Exec::n(y), Exec::bytes(vx) + Exec::bytes(y));
  impl_.run([&] {
    if (e.be != nullptr) e.be->unary(f, vx.t, y.t);
    return y;
  });
  impl_.keep_value(x.id());  // dx = dy f'(x)
  return impl_.add_node(n, y);
}

Var Graph::reduce(Reduce op, Var x) {
  impl_.check(x, reduce_name(op));
  impl_.check_per_sample(x, reduce_name(op));
  Node n;
  n.kind = OpKind::kReduce;
  n.reduce = op;
  n.a = x.id();
  Exec& e = impl_.exec;
  const Val vx = impl_.value(x.id());
  Shape ys = vx.shape;
  ys.back() = 1;
  Val y = e.make(ys, impl_.dtype);
  e.count((op == Reduce::kNorm ? 2 : 1) * Exec::n(vx), Exec::bytes(vx) + Exec::bytes(y));
  impl_.run([&] {
    if (e.be != nullptr) e.be->reduce_rows(op, vx.t, y.t);
    return y;
  });
  Var v = impl_.add_node(n, y);
  if (op == Reduce::kMax || op == Reduce::kNorm) {  // sum's and mean's gradients need neither
    impl_.keep_value(x.id());
    impl_.keep_value(v.id());
  }
  return v;
}

Var Graph::softmax(Var x) {
  impl_.check(x, "softmax");
  impl_.check_per_sample(x, "softmax");
  Node n;
  n.kind = OpKind::kSoftmax;
  n.a = x.id();
  Exec& e = impl_.exec;
  const Val vx = impl_.value(x.id());
  Val y = e.make(vx.shape, impl_.dtype);
  // max, exp (25) and its sum, the scaling: 28 per element.
  e.count(28 * Exec::n(y), Exec::bytes(vx) + Exec::bytes(y));
  impl_.run([&] {
    if (e.be != nullptr) e.be->softmax(vx.t, y.t);
    return y;
  });
  Var v = impl_.add_node(n, y);
  impl_.keep_value(v.id());  // dx from y
  return v;
}

Var Graph::dropout(Var x, double p) {
  impl_.check(x, "dropout");
  if (!(p >= 0.0 && p < 1.0)) {
    throw UserError(impl_.who() + ": dropout: p = " + std::to_string(p) + " must be in [0, 1)");
  }
  const int index = impl_.dropouts++;
  if (!impl_.args.training || p == 0.0) return x;  // the identity
  Node n;
  n.kind = OpKind::kDropout;
  n.a = x.id();
  n.scalar = p;
  // mix_seed(seed, "drop", index, step), the step mixed in last (from the step's scalars
  // when the executor gives them: DropoutKey). The tape keeps the key for B, which runs in
  // the same step (the executor keeps no context from one step to the next).
  n.key = DropoutKey::of_step(mix_seed_base(impl_.seed, 0x64726f70u /* "drop" */, static_cast<uint64_t>(index)),
                              kMixC, impl_.args.step, impl_.args.step_scalars);
  n.offset = impl_.args.sample_offset;
  Exec& e = impl_.exec;
  const Val vx = impl_.value(x.id());
  Val y = e.make(vx.shape, impl_.dtype);
  e.count(Exec::n(y), Exec::bytes(vx) + Exec::bytes(y));
  impl_.run([&] {
    if (e.be != nullptr) e.be->dropout(vx.t, p, n.key, n.offset, 0, y.t);
    return y;
  });
  return impl_.add_node(n, y);
}

const Shape& Graph::shape(Var v) const {
  impl_.check(v, "shape");
  return impl_.tape.nodes[v.id()].shape;
}

// ---------------------------------------------------------------------------------
// The gradient rules. B and W read the forward's values through `Values`, which takes
// them from the context (or, counting, their shapes alone) and parameters live.

namespace {

struct Values {
  const Tape& tape;
  const Context* ctx;  // null: counting
  DType dtype;
  Val operator()(int v) const {
    const Node& n = tape.nodes[v];
    Val out{n.shape, dtype, {}, true};
    if (ctx == nullptr) return out;
    if (n.kind == OpKind::kParam) {
      out.t = n.param->compute();
    } else {
      GPIPE_CHECK(n.saved >= 0 && static_cast<size_t>(n.saved) < ctx->saved.size(),
                  "derived layer: a value its gradient needs was not kept");
      out.t = ctx->saved[static_cast<size_t>(n.saved)];
    }
    return out;
  }
};

// The gradient, of dtype `dt`, of node i's input in `slot` (0: a, 1: b) from the node's
// output gradient dy. Not for linear's weight and bias (W's products).
Val input_grad(Exec& e, const Tape& t, const Values& val, int i, int slot, const Val& dy, DType dt) {
  const Node& n = t.nodes[i];
  const int v = slot == 0 ? n.a : n.b;
  const Shape& target = t.nodes[v].shape;
  switch (n.kind) {
    case OpKind::kLinear: {  // dx = dy W
      const int64_t out = n.shape.back(), in = target.back(), rows = shape_numel(target) / std::max<int64_t>(in, 1);
      Val dx = e.make(target, dt);
      const double es = static_cast<double>(dtype_size(dt));
      e.count(2.0 * rows * in * out, es * (rows * out + in * out + rows * in));
      if (e.be != nullptr) {
        Tensor dx2 = dx.t.reshape({rows, in});
        e.be->matmul(dy.t.reshape({rows, out}), false, n.param->compute(), false, dx2);
      }
      return dx;
    }
    case OpKind::kBinary: {
      switch (n.binary) {
        case Binary::kAdd: return e.reduce_to(dy, target, dt);
        case Binary::kSub: return slot == 0 ? e.reduce_to(dy, target, dt) : e.negate(e.reduce_to(dy, target, dt));
        case Binary::kMul: return e.reduce_to(e.binary(Binary::kMul, dy, val(slot == 0 ? n.b : n.a), dt), target, dt);
        case Binary::kDiv: {
          Val q = e.binary(Binary::kDiv, dy, val(n.b), dt);  // dy / b: a's gradient
          if (slot == 0) return e.reduce_to(q, target, dt);
          return e.negate(e.reduce_to(e.binary(Binary::kMul, q, val(i), dt), target, dt));  // -dy y / b
        }
      }
      break;
    }
    case OpKind::kAddScalar: return e.reduce_to(dy, target, dt);
    case OpKind::kMulScalar: return e.binary_scalar(Binary::kMul, dy, n.scalar, dt);
    case OpKind::kUnary: {
      Val dx = e.make(target, dt);
      e.count(unary_flops(n.unary).second * Exec::n(dx), Exec::bytes(dy) + 2 * Exec::bytes(dx));
      if (e.be != nullptr) e.be->unary_backward(n.unary, val(n.a).t, dy.t, dx.t);
      return dx;
    }
    case OpKind::kReduce: {
      Val dx = e.make(target, dt);
      e.count(Exec::n(dx), 2 * Exec::bytes(dx) + 2 * Exec::bytes(dy));
      if (e.be != nullptr) {
        if (n.reduce == Reduce::kSum || n.reduce == Reduce::kMean) {
          e.be->reduce_rows_backward(n.reduce, dx.t, dy.t, dy.t, dx.t);  // x and y not kept, nor read
        } else {
          e.be->reduce_rows_backward(n.reduce, val(n.a).t, val(i).t, dy.t, dx.t);
        }
      }
      return dx;
    }
    case OpKind::kSoftmax: {
      Val dx = e.make(target, dt);
      e.count(4 * Exec::n(dx), Exec::bytes(dy) + 2 * Exec::bytes(dx));
      if (e.be != nullptr) e.be->softmax_backward(val(i).t, dy.t, dx.t);
      return dx;
    }
    case OpKind::kDropout: {
      Val dx = e.make(target, dt);
      e.count(Exec::n(dx), Exec::bytes(dy) + Exec::bytes(dx));
      if (e.be != nullptr) e.be->dropout_backward(dy.t, n.scalar, n.key, n.offset, 0, dx.t);
      return dx;
    }
    case OpKind::kInput:
    case OpKind::kParam: break;
  }
  throw Error("derived layer: no gradient rule for this node");
}

// B: the gradients of the values that lead to the input, node by node in reverse; the
// output gradient of each node that reads a parameter is appended to `kept` (an
// undefined tensor where none reached it) for W. Returns the input's gradient.
Val derived_backward_input(Exec& e, const Tape& t, const Values& val, const Val& dy, bool need_dx, DType dtype,
                   std::vector<Tensor>* kept) {
  std::vector<Val> grads(t.nodes.size());
  grads[static_cast<size_t>(t.output)] = dy;
  for (int i = static_cast<int>(t.nodes.size()) - 1; i >= 0; --i) {
    const Node& n = t.nodes[static_cast<size_t>(i)];
    if (n.kind == OpKind::kInput || n.kind == OpKind::kParam) continue;
    const Val& g = grads[static_cast<size_t>(i)];
    if (reads_parameter(t, n) && kept != nullptr) kept->push_back(g.present ? g.t : Tensor());
    if (!g.present) continue;
    for (int slot = 0; slot < 2; ++slot) {
      const int v = slot == 0 ? n.a : n.b;
      if (v < 0 || t.nodes[v].kind == OpKind::kParam) continue;
      // A value not computed from a parameter passes its gradient on to x alone: dx's
      // work, skipped for the model's first layer.
      const bool only_dx = !t.nodes[v].reaches_param;
      if (only_dx && !need_dx) continue;
      e.into_input = only_dx;
      Val d = input_grad(e, t, val, i, slot, g, dtype);
      Val& acc = grads[static_cast<size_t>(v)];
      acc = acc.present ? e.binary(Binary::kAdd, acc, d, dtype) : d;  // never in place: d may be another's
      e.into_input = false;
    }
    grads[static_cast<size_t>(i)] = Val();  // W has what it needs in `kept`
  }
  return grads[0];
}

// W for node i with output gradient dy: its parameters' gradients, added into their
// Parameter::grad (the master type).
void weight_grads(Exec& e, const Tape& t, const Values& val, int i, const Val& dy) {
  const Node& n = t.nodes[static_cast<size_t>(i)];
  if (n.kind == OpKind::kLinear) {
    Parameter& w = *n.param;
    const Val x = val(n.a);
    const int64_t out = n.shape.back(), in = x.shape.back(), rows = shape_numel(x.shape) / std::max<int64_t>(in, 1);
    const double es = static_cast<double>(dtype_size(dy.dtype));
    const double ms = static_cast<double>(dtype_size(master_dtype(dy.dtype)));
    e.count(2.0 * rows * in * out + in * out, es * (rows * out + rows * in) + ms * 2 * in * out);
    if (e.be != nullptr) e.be->matmul(dy.t.reshape({rows, out}), true, x.t.reshape({rows, in}), false, w.grad, 1.0, 1.0);
    if (n.bias != nullptr) {
      e.count(static_cast<double>(rows * out), es * rows * out + ms * 2 * out);
      if (e.be != nullptr) e.be->bias_grad(dy.t.reshape({rows, out}), n.bias->grad, 1.0);
    }
    return;
  }
  for (int slot = 0; slot < 2; ++slot) {
    const int v = slot == 0 ? n.a : n.b;
    if (v < 0 || t.nodes[v].kind != OpKind::kParam) continue;
    Parameter& p = *t.nodes[v].param;
    const Val g = input_grad(e, t, val, i, slot, dy, master_dtype(dy.dtype));
    e.accumulate(g, p.grad);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------
// The layer

DerivedLayer::DerivedLayer(std::string type, Shape input_shape, Shape output_shape, DType dtype, uint64_t seed)
    : Layer(std::move(input_shape), std::move(output_shape), dtype), type_(std::move(type)), seed_(seed) {}

std::string DerivedLayer::describe() const {
  return type_ + shape_str(input_shape_) + " -> " + shape_str(output_shape_);
}

Parameter& DerivedLayer::add_parameter(const std::string& name, const Shape& shape, double bound, uint64_t seed) {
  params_.push_back(make_parameter(name, shape, bound, seed));
  param_shapes_.push_back(shape);
  return params_.back();
}

Parameter& DerivedLayer::add_constant_parameter(const std::string& name, const Shape& shape, double value) {
  params_.push_back(constant_parameter(name, shape, value));
  param_shapes_.push_back(shape);
  return params_.back();
}

std::vector<Parameter*> DerivedLayer::parameters() {
  std::vector<Parameter*> out;
  for (Parameter& p : params_) out.push_back(&p);
  return out;
}

std::shared_ptr<const Tape> DerivedLayer::record(Backend* be, const Tensor& x, int64_t batch, const ForwardArgs& args,
                                                 Context* ctx, Tensor* out, LayerCost* cost) const {
  Graph::Impl impl{*this, params_, param_shapes_, dtype_, args, seed_, Exec{be, cost}, ctx != nullptr || cost != nullptr,
                   {}, {}, {}, 0};
  Shape xs{batch};
  xs.insert(xs.end(), input_shape_.begin(), input_shape_.end());
  Node in;
  in.kind = OpKind::kInput;
  impl.add_node(in, Val{xs, dtype_, x, true});
  Graph g(impl);
  const Var y = define(g, Var(0));
  impl.check(y, "the value forward returned");
  Shape want{batch};
  want.insert(want.end(), output_shape_.begin(), output_shape_.end());
  if (impl.tape.nodes[y.id()].shape != want) {
    throw UserError(describe() + ": forward returned a value of shape " + shape_str(impl.tape.nodes[y.id()].shape) +
                    ", not " + shape_str(want) + " (batch, output shape)");
  }
  impl.tape.output = y.id();
  if (out != nullptr) *out = impl.value(y.id()).t;
  auto tape = std::make_shared<Tape>(std::move(impl.tape));
  for (size_t v = 0; v < tape->nodes.size(); ++v) {
    if (!impl.kept[v]) continue;
    const Val& kept = impl.values[v];
    if (cost != nullptr) cost->saved_bytes += static_cast<int64_t>(Exec::bytes(kept));
    if (ctx != nullptr) {
      tape->nodes[v].saved = static_cast<int>(ctx->saved.size());
      ctx->saved.push_back(kept.t);
    }
  }
  tape->forward_saved = ctx != nullptr ? ctx->saved.size() : 0;
  return tape;
}

Tensor DerivedLayer::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  if (ctx != nullptr) ctx->saved.clear();
  Tensor y;
  std::shared_ptr<const Tape> tape = record(&be, x, x.size(0), args, ctx, &y, nullptr);
  if (ctx != nullptr) ctx->tape = std::move(tape);
  return y;
}

Tensor DerivedLayer::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  // B then W on a copy of the context, with or without parameters (Layer's default
  // asks for splits_backward(), which a layer without parameters does not claim).
  Context copy = ctx;
  Tensor dx = backward_input_impl(be, dy, copy, need_dx);
  backward_weight_impl(be, copy);
  return dx;
}

Tensor DerivedLayer::backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  GPIPE_CHECK(ctx.tape != nullptr, describe() + ": backward without a recorded forward");
  const Tape& t = *ctx.tape;
  GPIPE_CHECK(ctx.saved.size() == t.forward_saved, describe() + ": backward_input twice on one context");
  Exec e{&be, nullptr, Exec::kB};
  const Values val{t, &ctx, dtype_};
  std::vector<Tensor> kept;
  const Val dx = derived_backward_input(e, t, val, Val{t.nodes[t.output].shape, dtype_, dy, true}, need_dx, dtype_, &kept);
  // Until W the context holds only what W reads (the tensors of the ops that read a
  // parameter) and the kept output gradients: what only B read is freed now.
  std::vector<bool> for_w(t.nodes.size(), false);
  for (const Node& n : t.nodes) {
    if (n.kind == OpKind::kInput || !reads_parameter(t, n)) continue;
    for (int v : {n.a, n.b, static_cast<int>(&n - t.nodes.data())}) {
      if (v >= 0) for_w[static_cast<size_t>(v)] = true;
    }
  }
  for (size_t v = 0; v < t.nodes.size(); ++v) {
    if (t.nodes[v].saved >= 0 && !for_w[v]) ctx.saved[static_cast<size_t>(t.nodes[v].saved)] = Tensor();
  }
  for (Tensor& k : kept) ctx.saved.push_back(std::move(k));
  if (!need_dx) return Tensor();
  if (!dx.present) return be.zeros(t.nodes[0].shape, dtype_);  // a forward whose output does not depend on x
  return dx.t;
}

void DerivedLayer::backward_weight_impl(Backend& be, Context& ctx) {
  if (params_.empty()) return;  // nothing to do (and the executor may have dropped the context)
  GPIPE_CHECK(ctx.tape != nullptr, describe() + ": weight gradient without a recorded forward");
  const Tape& t = *ctx.tape;
  Exec e{&be, nullptr, Exec::kW};
  const Values val{t, &ctx, dtype_};
  size_t k = t.forward_saved;
  for (int i = static_cast<int>(t.nodes.size()) - 1; i >= 0; --i) {
    if (!reads_parameter(t, t.nodes[static_cast<size_t>(i)]) || t.nodes[i].kind == OpKind::kInput) continue;
    GPIPE_CHECK(k < ctx.saved.size(), describe() + ": weight gradient without its backward_input");
    const Tensor& dy = ctx.saved[k++];
    if (!dy.defined()) continue;
    weight_grads(e, t, val, i, Val{t.nodes[i].shape, dtype_, dy, true});
  }
}

void DerivedLayer::backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) {
  // One product per linear weight over all the micro-batches' rows; every other W node
  // context by context. The tapes are the same op for op (one forward, run once per
  // micro-batch); where they are not (a forward that branched), each context alone.
  if (params_.empty()) return;
  for (const Context* c : ctxs) {
    GPIPE_CHECK(c->tape != nullptr, describe() + ": weight gradient without a recorded forward");
  }
  const Tape& first = *ctxs.front()->tape;
  for (const Context* c : ctxs) {
    if (!same_program(*c->tape, first)) {
      for (Context* each : ctxs) backward_weight_impl(be, *each);
      return;
    }
  }
  Exec e{&be, nullptr, Exec::kW};
  size_t k = first.forward_saved;
  for (int i = static_cast<int>(first.nodes.size()) - 1; i >= 0; --i) {
    const Node& n = first.nodes[static_cast<size_t>(i)];
    if (n.kind == OpKind::kInput || !reads_parameter(first, n)) continue;
    const size_t slot = k++;
    bool all = true;
    for (const Context* c : ctxs) all = all && slot < c->saved.size() && c->saved[slot].defined();
    if (n.kind == OpKind::kLinear && all) {
      const Tensor x = concat_saved(be, ctxs, static_cast<size_t>(first.nodes[n.a].saved), describe());
      const Tensor dy = concat_saved(be, ctxs, slot, describe());
      Context joined;
      joined.saved = {x};
      Tape t = first;  // the same nodes over the stacked rows
      t.nodes[n.a].saved = 0;
      t.nodes[n.a].shape[0] = x.size(0);
      t.nodes[i].shape[0] = dy.size(0);
      const Values val{t, &joined, dtype_};
      weight_grads(e, t, val, i, Val{t.nodes[i].shape, dtype_, dy, true});
      continue;
    }
    for (Context* c : ctxs) {
      GPIPE_CHECK(slot < c->saved.size(), describe() + ": weight gradient without its backward_input");
      if (!c->saved[slot].defined()) continue;
      const Values val{*c->tape, c, dtype_};
      weight_grads(e, *c->tape, val, i, Val{c->tape->nodes[i].shape, dtype_, c->saved[slot], true});
    }
  }
}

LayerCost DerivedLayer::cost(int64_t batch) const {
  LayerCost c;
  ForwardArgs args;  // training, with dropout
  std::shared_ptr<const Tape> tape = record(nullptr, Tensor(), batch, args, nullptr, nullptr, &c);
  Exec b{nullptr, &c, Exec::kB};
  const Values shapes{*tape, nullptr, dtype_};
  derived_backward_input(b, *tape, shapes, Val{tape->nodes[tape->output].shape, dtype_, {}, true}, true, dtype_, nullptr);
  Exec w{nullptr, &c, Exec::kW};
  for (int i = static_cast<int>(tape->nodes.size()) - 1; i >= 0; --i) {
    const Node& n = tape->nodes[static_cast<size_t>(i)];
    if (n.kind == OpKind::kInput || !reads_parameter(*tape, n)) continue;
    weight_grads(w, *tape, shapes, i, Val{n.shape, dtype_, {}, true});
  }
  for (const Shape& s : param_shapes_) c.param_bytes += shape_numel(s) * static_cast<int64_t>(dtype_size(dtype_));
  c.output_bytes = static_cast<int64_t>(Exec::bytes(Val{tape->nodes[tape->output].shape, dtype_, {}, true}));
  return c;
}

}  // namespace layers
}  // namespace gpipe
