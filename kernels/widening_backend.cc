#include "kernels/widening_backend.h"

#include <cstdio>
#include <string>

#include <algorithm>
#include <array>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/op_log.h"
#include "runtime/logging.h"

namespace gpipe {

namespace {

template <typename... Ts>
bool any_narrow(const Ts&... t) {
  return (is_narrow(t.dtype()) || ...);
}

// The float32 stand-ins of one op's narrow operands: in() widens one the op reads,
// out() gives a fresh one the op writes, inout() widens one the op adds into; store()
// rounds what was written back into the narrow operands. Other operands (float32,
// int32, undefined) pass through as they are.
class Widen {
 public:
  explicit Widen(Backend& be) : be_(be) {}
  const Tensor& in(const Tensor& t) { return is_narrow(t.dtype()) ? widened(t) : t; }
  Tensor& out(Tensor& t) {
    if (!is_narrow(t.dtype())) return t;
    temps_.push_back(be_.empty(t.shape(), DType::kF32));
    stores_.emplace_back(&t, &temps_.back());
    return temps_.back();
  }
  Tensor& inout(Tensor& t) {
    if (!is_narrow(t.dtype())) return t;
    Tensor& w = widened(t);
    stores_.emplace_back(&t, &w);
    return w;
  }
  void store() {
    for (auto& [narrow, wide] : stores_) be_.cast(*wide, *narrow);
  }

 private:
  Tensor& widened(const Tensor& t) {
    temps_.push_back(be_.empty(t.shape(), DType::kF32));
    be_.cast(t, temps_.back());
    return temps_.back();
  }
  Backend& be_;
  std::deque<Tensor> temps_;  // a deque: references to its elements stay valid
  std::vector<std::pair<Tensor*, Tensor*>> stores_;
};

// The same for a product: a and b of one narrow type t, c of type t or float32.
bool native_matmul(const Backend& inner, const Tensor& a, const Tensor& b, const Tensor& c) {
  const DType t = a.dtype();
  return is_narrow(t) && b.dtype() == t && (c.dtype() == t || c.dtype() == DType::kF32) &&
         inner.computes_narrow(Backend::NarrowOp::kMatmul, t);
}

// The marks of kernels/backend_ops.inc's calls: what an op does with a tensor operand.
struct In {
  explicit In(const Tensor& t) : t(t) {}
  const Tensor& t;
};
struct Out {
  explicit Out(Tensor& t) : t(t) {}
  Tensor& t;
};
struct InOut {
  explicit InOut(Tensor& t) : t(t) {}
  Tensor& t;
};

const Tensor* marked(const In& a) { return &a.t; }
const Tensor* marked(const Out& a) { return &a.t; }
const Tensor* marked(const InOut& a) { return &a.t; }
template <typename A>
const Tensor* marked(const A&) {
  return nullptr;
}

const Tensor& unmarked(const In& a) { return a.t; }
Tensor& unmarked(const Out& a) { return a.t; }
Tensor& unmarked(const InOut& a) { return a.t; }
template <typename A>
const A& unmarked(const A& a) {
  return a;
}

const Tensor& stand_in(Widen& w, const In& a) { return w.in(a.t); }
Tensor& stand_in(Widen& w, const Out& a) { return w.out(a.t); }
Tensor& stand_in(Widen& w, const InOut& a) { return w.inout(a.t); }
template <typename A>
const A& stand_in(Widen&, const A& a) {
  return a;
}

// ---- OpLog (kernels/op_log.h): each call's arguments as text, tensors by type and shape.
void describe(std::string& out, const Tensor& t) {
  if (!t.defined()) {
    out += "-";
    return;
  }
  out += dtype_name(t.dtype());
  out += "[";
  for (int d = 0; d < t.dim(); ++d) out += (d > 0 ? "," : "") + std::to_string(t.size(d));
  out += "]";
}
void describe(std::string& out, const std::vector<Tensor>& ts) {
  out += "{";
  for (const Tensor& t : ts) describe(out, t);
  out += "}";
}
void describe(std::string& out, double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%a", v);  // exact
  out += buf;
}
void describe(std::string& out, const AdamParams& p) {
  for (double v : {p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.decoupled ? 1.0 : 0.0}) describe(out, v), out += "/";
}
void describe(std::string& out, const SgdParams& p) {
  for (double v : {p.lr, p.momentum, p.weight_decay, p.nesterov ? 1.0 : 0.0}) describe(out, v), out += "/";
}
void describe(std::string& out, const DropoutKey& k) {
  if (k.multiplier == 0) {
    out += "key=" + std::to_string(k.key);
    return;
  }
  out += "key(" + std::to_string(k.base) + "," + std::to_string(k.multiplier) + ",";
  if (k.from_device()) {
    describe(out, k.scalars);  // the step read on the device
  } else {
    out += "step=" + std::to_string(k.step);
  }
  out += ")";
}
void describe(std::string& out, const LossScale& s) {
  if (s.from_device()) {
    out += "scale(";
    describe(out, s.scalars);  // read on the device
    out += ")";
  } else {
    describe(out, s.value);
  }
}
void describe(std::string& out, const In& a) { describe(out, a.t); }
void describe(std::string& out, const Out& a) { describe(out, a.t); }
void describe(std::string& out, const InOut& a) { describe(out, a.t); }
template <typename A>
void describe(std::string& out, const A& a) {
  if constexpr (std::is_enum_v<A>) {
    out += std::to_string(static_cast<long long>(a));
  } else if constexpr (std::is_same_v<A, bool>) {
    out += a ? "true" : "false";
  } else {
    static_assert(std::is_integral_v<A>, "OpLog: describe this argument type");
    out += std::to_string(a);
  }
}

// The arguments of a call as the OpLog records them (OpCall: counted once, recorded at its
// end when it is the thread's outermost and a log is alive).
template <typename... A>
void describe_call(OpCall& call, const A&... args) {
  if (call.recording()) ((describe(call.args(), args), call.args() += " "), ...);
}

// The body of every generated op: `op` on the wrapped backend with the marked call's
// arguments. As they are when no marked operand is narrow, or when the wrapped backend
// computes `narrow` itself in the one narrow type of every defined marked operand;
// else on float32 stand-ins of the narrow ones (Widen), rounded back after.
template <typename R, typename... P, typename... A>
R widening_call(Backend& inner, std::optional<Backend::NarrowOp> narrow, R (Backend::*op)(P...), const A&... args) {
  std::array<const Tensor*, sizeof...(A)> defined{marked(args)...};
  const auto end = std::remove_if(defined.begin(), defined.end(), [](const Tensor* t) { return t == nullptr || !t->defined(); });
  const bool any = std::any_of(defined.begin(), end, [](const Tensor* t) { return is_narrow(t->dtype()); });
  bool native = false;
  if (any && narrow) {
    const DType t = defined.front()->dtype();
    native = std::all_of(defined.begin(), end, [&](const Tensor* x) { return x->dtype() == t; }) &&
             inner.computes_narrow(*narrow, t);
  }
  if (!any || native) return (inner.*op)(unmarked(args)...);
  Widen w(inner);
  if constexpr (std::is_void_v<R>) {
    (inner.*op)(stand_in(w, args)...);
    w.store();
  } else {
    R result = (inner.*op)(stand_in(w, args)...);
    w.store();
    return result;
  }
}

}  // namespace

void WideningBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha,
                             double beta) {
  OpCall op_call("matmul", false);
  describe_call(op_call, a, ta, b, tb, c, alpha, beta);
  if (capturing_here()) return capture("matmul", [=]() mutable { matmul(a, ta, b, tb, c, alpha, beta); });
  if (!any_narrow(a, b, c) || native_matmul(*inner_, a, b, c)) return inner_->matmul(a, ta, b, tb, c, alpha, beta);
  Widen w(*inner_);
  inner_->matmul(w.in(a), ta, w.in(b), tb, beta != 0.0 ? w.inout(c) : w.out(c), alpha, beta);
  w.store();
}

void WideningBackend::matmul_weight(const Tensor& a, bool ta, const Tensor& wt, bool tw, Tensor& c, double alpha,
                                    double beta) {
  OpCall op_call("matmul_weight", false);
  describe_call(op_call, a, ta, wt, tw, c, alpha, beta);
  if (capturing_here()) return capture("matmul_weight", [=]() mutable { matmul_weight(a, ta, wt, tw, c, alpha, beta); });
  if (!any_narrow(a, wt, c) || native_matmul(*inner_, a, wt, c)) {
    return inner_->matmul_weight(a, ta, wt, tw, c, alpha, beta);
  }
  // Not matmul_weight: a backend may keep a copy of its weight operand keyed on where it
  // lives, and the widened weight is a temporary.
  matmul(a, ta, wt, tw, c, alpha, beta);
}

void WideningBackend::bias_grad(const Tensor& dy, Tensor& db, double beta) {
  OpCall op_call("bias_grad", false);
  describe_call(op_call, dy, db, beta);
  if (capturing_here()) return capture("bias_grad", [=]() mutable { bias_grad(dy, db, beta); });
  if (!any_narrow(dy, db)) return inner_->bias_grad(dy, db, beta);
  Widen w(*inner_);
  inner_->bias_grad(w.in(dy), beta != 0.0 ? w.inout(db) : w.out(db), beta);
  w.store();
}

double WideningBackend::sum_squares_all(const std::vector<Tensor>& xs) {
  OpCall op_call("sum_squares_all", true);
  describe_call(op_call, xs);
  if (capturing_here()) throw CaptureError("sum_squares_all hands the host a value");
  for (const Tensor& x : xs) {
    if (any_narrow(x)) return Backend::sum_squares_all(xs);  // each widened on its own
  }
  return inner_->sum_squares_all(xs);
}

namespace {
// Whether the wrapped backend computes a fused op itself: its activations `acts` of one
// narrow type t, its statistics and weight gradients `masters` float32.
bool native_fused(const Backend& inner, Backend::NarrowOp op, std::initializer_list<const Tensor*> acts,
                  std::initializer_list<const Tensor*> masters) {
  const DType t = (*acts.begin())->dtype();
  if (!is_narrow(t) || !inner.computes_narrow(op, t)) return false;
  for (const Tensor* a : acts) {
    if (a->dtype() != t) return false;
  }
  for (const Tensor* m : masters) {
    if (m->dtype() != DType::kF32) return false;
  }
  return true;
}
}  // namespace

void WideningBackend::rmsnorm(const Tensor& x, const Tensor& g, double eps, Tensor& y, Tensor& rstd) {
  OpCall op_call("rmsnorm", false);
  describe_call(op_call, x, g, eps, y, rstd);
  if (capturing_here()) return capture("rmsnorm", [=]() mutable { rmsnorm(x, g, eps, y, rstd); });
  if (!any_narrow(x, g, y, rstd) || native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &g, &y}, {&rstd})) {
    return inner_->rmsnorm(x, g, eps, y, rstd);
  }
  Backend::rmsnorm(x, g, eps, y, rstd);
}

void WideningBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                                       Tensor& dx) {
  OpCall op_call("rmsnorm_backward", false);
  describe_call(op_call, dy, x, g, rstd, dx);
  if (capturing_here()) return capture("rmsnorm_backward", [=]() mutable { rmsnorm_backward(dy, x, g, rstd, dx); });
  if (!any_narrow(dy, x, g, rstd, dx) ||
      native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &dy, &g, &dx}, {&rstd})) {
    return inner_->rmsnorm_backward(dy, x, g, rstd, dx);
  }
  Backend::rmsnorm_backward(dy, x, g, rstd, dx);
}

void WideningBackend::rmsnorm_weight_grad(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dg) {
  OpCall op_call("rmsnorm_weight_grad", false);
  describe_call(op_call, dy, x, rstd, dg);
  if (capturing_here()) return capture("rmsnorm_weight_grad", [=]() mutable { rmsnorm_weight_grad(dy, x, rstd, dg); });
  if (!any_narrow(dy, x, rstd, dg) || native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &dy}, {&rstd, &dg})) {
    return inner_->rmsnorm_weight_grad(dy, x, rstd, dg);
  }
  Backend::rmsnorm_weight_grad(dy, x, rstd, dg);
}

void WideningBackend::linear_bias(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  OpCall op_call("linear_bias", false);
  describe_call(op_call, x, w, bias, y);
  if (capturing_here()) return capture("linear_bias", [=]() mutable { linear_bias(x, w, bias, y); });
  if (!any_narrow(x, w, bias, y) || native_fused(*inner_, NarrowOp::kLinear, {&x, &w, &bias, &y}, {})) {
    return inner_->linear_bias(x, w, bias, y);
  }
  Backend::linear_bias(x, w, bias, y);  // this backend's matmul_weight and add_bias
}

void WideningBackend::linear_weight_grad(const Tensor& dy, const Tensor& x, Tensor& dw, Tensor& db) {
  OpCall op_call("linear_weight_grad", false);
  describe_call(op_call, dy, x, dw, db);
  if (capturing_here()) return capture("linear_weight_grad", [=]() mutable { linear_weight_grad(dy, x, dw, db); });
  if (!any_narrow(dy, x, dw, db) || native_fused(*inner_, NarrowOp::kLinear, {&dy, &x}, {&dw, &db})) {
    return inner_->linear_weight_grad(dy, x, dw, db);
  }
  Backend::linear_weight_grad(dy, x, dw, db);  // this backend's matmul and bias_grad
}

void WideningBackend::linear_residual(const Tensor& x, const Tensor& w, const Tensor& residual, Tensor& y) {
  OpCall op_call("linear_residual", false);
  describe_call(op_call, x, w, residual, y);
  if (capturing_here()) return capture("linear_residual", [=]() mutable { linear_residual(x, w, residual, y); });
  if (!any_narrow(x, w, residual, y) || native_fused(*inner_, NarrowOp::kLinear, {&x, &w, &residual, &y}, {})) {
    return inner_->linear_residual(x, w, residual, y);
  }
  Backend::linear_residual(x, w, residual, y);  // this backend's matmul_weight and axpy
}

void WideningBackend::linear_input_grad_add(const Tensor& dy, const Tensor& w, Tensor& dx) {
  OpCall op_call("linear_input_grad_add", false);
  describe_call(op_call, dy, w, dx);
  if (capturing_here()) return capture("linear_input_grad_add", [=]() mutable { linear_input_grad_add(dy, w, dx); });
  if (!any_narrow(dy, w, dx) || native_matmul(*inner_, dy, w, dx)) {
    return inner_->linear_input_grad_add(dy, w, dx);
  }
  Backend::linear_input_grad_add(dy, w, dx);  // this backend's matmul_weight and axpy
}

void WideningBackend::rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                                           const Tensor& residual, Tensor& dx) {
  OpCall op_call("rmsnorm_backward_add", false);
  describe_call(op_call, dy, x, g, rstd, residual, dx);
  if (capturing_here()) {
    return capture("rmsnorm_backward_add",
                   [=]() mutable { rmsnorm_backward_add(dy, x, g, rstd, residual, dx); });
  }
  if (!any_narrow(dy, x, g, rstd, residual, dx) ||
      native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &dy, &g, &residual, &dx}, {&rstd})) {
    return inner_->rmsnorm_backward_add(dy, x, g, rstd, residual, dx);
  }
  Backend::rmsnorm_backward_add(dy, x, g, rstd, residual, dx);  // this backend's rmsnorm_backward and axpy
}

void WideningBackend::swiglu(const Tensor& a, const Tensor& b, Tensor& y) {
  OpCall op_call("swiglu", false);
  describe_call(op_call, a, b, y);
  if (capturing_here()) return capture("swiglu", [=]() mutable { swiglu(a, b, y); });
  if (!any_narrow(a, b, y) || native_fused(*inner_, NarrowOp::kSwiglu, {&a, &b, &y}, {})) {
    return inner_->swiglu(a, b, y);
  }
  Backend::swiglu(a, b, y);
}

void WideningBackend::swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) {
  OpCall op_call("swiglu_backward", false);
  describe_call(op_call, dy, a, b, da, db);
  if (capturing_here()) return capture("swiglu_backward", [=]() mutable { swiglu_backward(dy, a, b, da, db); });
  if (!any_narrow(dy, a, b, da, db) || native_fused(*inner_, NarrowOp::kSwiglu, {&dy, &a, &b, &da, &db}, {})) {
    return inner_->swiglu_backward(dy, a, b, da, db);
  }
  Backend::swiglu_backward(dy, a, b, da, db);
}

namespace {
template <typename... Lists>
bool any_narrow_in(const Lists&... lists) {
  return ((std::any_of(lists.begin(), lists.end(), [](const Tensor& t) { return is_narrow(t.dtype()); })) || ...);
}
}  // namespace

void WideningBackend::sgd_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                   const std::vector<Tensor>& bufs, const SgdParams& p, const Tensor& scalars) {
  OpCall op_call("sgd_step_all", false);
  describe_call(op_call, params, grads, bufs, p, scalars);
  if (capturing_here()) return capture("sgd_step_all", [=]() mutable { sgd_step_all(params, grads, bufs, p, scalars); });
  if (any_narrow_in(params, grads, bufs)) return Backend::sgd_step_all(params, grads, bufs, p, scalars);
  inner_->sgd_step_all(params, grads, bufs, p, scalars);
}

void WideningBackend::adam_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                    const std::vector<Tensor>& m, const std::vector<Tensor>& v, const AdamParams& p,
                                    const Tensor& scalars) {
  OpCall op_call("adam_step_all", false);
  describe_call(op_call, params, grads, m, v, p, scalars);
  if (capturing_here()) return capture("adam_step_all", [=]() mutable { adam_step_all(params, grads, m, v, p, scalars); });
  if (any_narrow_in(params, grads, m, v)) return Backend::adam_step_all(params, grads, m, v, p, scalars);
  inner_->adam_step_all(params, grads, m, v, p, scalars);
}

void WideningBackend::scale_all(const std::vector<Tensor>& xs, double alpha) {
  OpCall op_call("scale_all", false);
  describe_call(op_call, xs, alpha);
  if (capturing_here()) return capture("scale_all", [=]() mutable { scale_all(xs, alpha); });
  if (any_narrow_in(xs)) return Backend::scale_all(xs, alpha);
  inner_->scale_all(xs, alpha);
}

void WideningBackend::sum_squares_all_to(const std::vector<Tensor>& xs, Tensor& scalars) {
  OpCall op_call("sum_squares_all_to", false);
  describe_call(op_call, xs, scalars);
  if (capturing_here()) return capture("sum_squares_all_to", [=]() mutable { sum_squares_all_to(xs, scalars); });
  if (any_narrow_in(xs)) return Backend::sum_squares_all_to(xs, scalars);  // each widened on its own
  inner_->sum_squares_all_to(xs, scalars);
}

void WideningBackend::step_grad_scale(Tensor& scalars, double max_norm, bool skip_nonfinite) {
  OpCall op_call("step_grad_scale", false);
  describe_call(op_call, scalars, max_norm, skip_nonfinite);
  if (capturing_here()) return capture("step_grad_scale", [=]() mutable { step_grad_scale(scalars, max_norm, skip_nonfinite); });
  inner_->step_grad_scale(scalars, max_norm, skip_nonfinite);
}

void WideningBackend::scale_all_by(const std::vector<Tensor>& xs, const Tensor& scalars) {
  OpCall op_call("scale_all_by", false);
  describe_call(op_call, xs, scalars);
  if (capturing_here()) return capture("scale_all_by", [=]() mutable { scale_all_by(xs, scalars); });
  if (any_narrow_in(xs)) return Backend::scale_all_by(xs, scalars);
  inner_->scale_all_by(xs, scalars);
}

void WideningBackend::fill_all(const std::vector<Tensor>& xs, double value) {
  OpCall op_call("fill_all", false);
  describe_call(op_call, xs, value);
  if (capturing_here()) return capture("fill_all", [=]() mutable { fill_all(xs, value); });
  if (any_narrow_in(xs)) return Backend::fill_all(xs, value);
  inner_->fill_all(xs, value);
}

// ---- The generated ops: one definition per line of kernels/backend_ops.inc.

#define GPIPE_UNPAREN(...) __VA_ARGS__
// While this thread captures on the CPU (WideningBackend::begin_capture), the call is
// captured with copies of its operands (tensors share their buffers), to run at each
// replay as it would have run now; an op that returns a value cannot be.
#define GPIPE_CAPTURE_GENERATED(R, name, call, narrow)                                \
  if (capturing_here()) {                                                           \
    capture_as<R>(#name, [=]() mutable {                                            \
      OpCall replayed(#name, false);                                                \
      describe_call(replayed, GPIPE_UNPAREN call);                                  \
      widening_call(*inner_, narrow, &Backend::name, GPIPE_UNPAREN call);           \
    });                                                                             \
    return R();                                                                     \
  }
#define GPIPE_OP(R, name, params, call)                                              \
  R WideningBackend::name params {                                                   \
    OpCall op_call(#name, !std::is_void_v<R>);                                       \
    describe_call(op_call, GPIPE_UNPAREN call);                                      \
    GPIPE_CAPTURE_GENERATED(R, name, call, std::nullopt)                             \
    return widening_call(*inner_, std::nullopt, &Backend::name, GPIPE_UNPAREN call); \
  }
#define GPIPE_NARROW_OP(R, name, params, call, narrow)                                   \
  R WideningBackend::name params {                                                       \
    OpCall op_call(#name, !std::is_void_v<R>);                                           \
    describe_call(op_call, GPIPE_UNPAREN call);                                          \
    GPIPE_CAPTURE_GENERATED(R, name, call, NarrowOp::narrow)                             \
    return widening_call(*inner_, NarrowOp::narrow, &Backend::name, GPIPE_UNPAREN call); \
  }
#define GPIPE_OWN_OP(R, name, params)
#include "kernels/backend_ops.inc"
#undef GPIPE_UNPAREN
#undef GPIPE_CAPTURE_GENERATED

// ---- As they are: the wrapped backend takes 16-bit operands of these itself.

void WideningBackend::fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                                      Tensor& stats) {
  OpCall op_call("fused_attention", false);
  describe_call(op_call, q, k, v, heads, out, stats);
  if (capturing_here()) return capture("fused_attention", [=]() mutable { fused_attention(q, k, v, heads, out, stats); });
  inner_->fused_attention(q, k, v, heads, out, stats);
}

void WideningBackend::fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& out, const Tensor& stats, int heads, Tensor& dq,
                                               Tensor& dk, Tensor& dv) {
  OpCall op_call("fused_attention_backward", false);
  describe_call(op_call, dout, q, k, v, out, stats, heads, dq, dk, dv);
  if (capturing_here()) return capture("fused_attention_backward", [=]() mutable { fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv); });
  inner_->fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv);
}

void WideningBackend::cast_all(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts) {
  OpCall op_call("cast_all", false);
  describe_call(op_call, srcs, dsts);
  if (capturing_here()) return capture("cast_all", [=]() mutable { cast_all(srcs, dsts); });
  inner_->cast_all(srcs, dsts);
}

// A copy to the host waits for the device and hands the host its values.
void WideningBackend::copy(const Tensor& src, Tensor& dst) {
  OpCall op_call("copy", dst.device().is_cpu() && !src.device().is_cpu());
  describe_call(op_call, src, dst);
  if (capturing_here()) {
    if (dst.device().is_cpu() && !src.device().is_cpu()) throw CaptureError("a copy to the host hands it values");
    return capture("copy", [=]() mutable { copy(src, dst); });
  }
  inner_->copy(src, dst);
}
void WideningBackend::cast(const Tensor& src, Tensor& dst) {
  OpCall op_call("cast", false);
  describe_call(op_call, src, dst);
  if (capturing_here()) return capture("cast", [=]() mutable { cast(src, dst); });
  inner_->cast(src, dst);
}
void WideningBackend::transpose_blocks(const Tensor& src, int64_t rows, int64_t cols, Tensor& dst) {
  OpCall op_call("transpose_blocks", false);
  describe_call(op_call, src, rows, cols, dst);
  if (capturing_here()) return capture("transpose_blocks", [=]() mutable { transpose_blocks(src, rows, cols, dst); });
  inner_->transpose_blocks(src, rows, cols, dst);
}
void WideningBackend::synchronize() {
  OpCall op_call("synchronize", true);
  if (capturing_here()) throw CaptureError("synchronize waits for the device");
  inner_->synchronize();
}

// ---- Capture on the CPU (the header's begin_capture): the calls of one thread.

// The calls of the threads that capture on one backend: the beginning one's and those
// that joined it, in the order they were made (each under the lock).
struct CpuCapture {
  const WideningBackend* backend = nullptr;
  std::thread::id owner = std::this_thread::get_id();  // the thread that began it
  struct Call {
    const char* op;  // nullptr: host work or an event's record
    std::function<void()> run;
    int stage = thread_stage();  // the stage whose thread captured it (runtime/logging.h)
  };
  std::mutex mu;
  std::vector<Call> calls;
  std::function<void(std::function<void()>)> events;  // the CPU events' hook (runtime/stream.h)
  void add(const char* op, std::function<void()> run) {
    std::lock_guard<std::mutex> lock(mu);
    calls.push_back({op, std::move(run), thread_stage()});
  }
};

namespace {
thread_local CpuCapture* t_capture = nullptr;

class CpuCapturedOps : public CapturedOps {
 public:
  explicit CpuCapturedOps(std::vector<CpuCapture::Call> calls)
      : calls_(std::move(calls)), thread_(std::this_thread::get_id()) {}
  void replay() override {
    GPIPE_CHECK(std::this_thread::get_id() == thread_, "a captured step replayed on another thread than its own");
    failed_stage_ = -1;
    for (auto& c : calls_) {
      try {
        c.run();
      } catch (...) {
        failed_stage_ = c.stage;
        throw;
      }
    }
  }
  int failed_stage() const override { return failed_stage_; }
  int64_t nodes() const override {
    return static_cast<int64_t>(
        std::count_if(calls_.begin(), calls_.end(), [](const CpuCapture::Call& c) { return c.op != nullptr; }));
  }

 private:
  std::vector<CpuCapture::Call> calls_;
  std::thread::id thread_;
  int failed_stage_ = -1;
};
}  // namespace

bool WideningBackend::capturing_here() const { return t_capture != nullptr && t_capture->backend == this; }

void WideningBackend::capture(const char* op, std::function<void()> run) { t_capture->add(op, std::move(run)); }

void WideningBackend::begin_capture() {
  if (!inner_->device().is_cpu()) return inner_->begin_capture();
  if (t_capture != nullptr) throw CaptureError("this thread is capturing already");
  if (cpu_capture_.load() != nullptr) throw CaptureError("the backend of " + device().str() + " is capturing already");
  auto* c = new CpuCapture;
  c->backend = this;
  c->events = [c](std::function<void()> record) { c->add(nullptr, std::move(record)); };
  t_capture = c;
  cpu_capture_.store(c);
  set_cpu_event_capture(&c->events);
}

std::unique_ptr<CapturedOps> WideningBackend::end_capture() {
  if (!inner_->device().is_cpu()) return inner_->end_capture();
  if (!capturing_here() || t_capture->owner != std::this_thread::get_id()) {
    throw CaptureError("end_capture without begin_capture on this thread");
  }
  std::unique_ptr<CpuCapture> c(t_capture);
  t_capture = nullptr;
  cpu_capture_.store(nullptr);
  set_cpu_event_capture(nullptr);
  return std::make_unique<CpuCapturedOps>(std::move(c->calls));
}

void WideningBackend::abort_capture() noexcept {
  if (!inner_->device().is_cpu()) return inner_->abort_capture();
  if (!capturing_here() || t_capture->owner != std::this_thread::get_id()) return;  // only the beginning thread drops it
  delete t_capture;
  t_capture = nullptr;
  cpu_capture_.store(nullptr);
  set_cpu_event_capture(nullptr);
}

void WideningBackend::join_capture() {
  if (!inner_->device().is_cpu()) return inner_->join_capture();
  CpuCapture* c = cpu_capture_.load();
  if (c == nullptr) throw CaptureError("the backend of " + device().str() + " is not capturing: nothing to join");
  if (t_capture != nullptr) throw CaptureError("this thread is capturing already");
  t_capture = c;
  set_cpu_event_capture(&c->events);
}

void WideningBackend::leave_capture() noexcept {
  if (!inner_->device().is_cpu()) return inner_->leave_capture();
  if (!capturing_here() || t_capture->owner == std::this_thread::get_id()) return;  // the beginning thread ends it
  t_capture = nullptr;
  set_cpu_event_capture(nullptr);
}

bool WideningBackend::capturing() const {
  return inner_->device().is_cpu() ? capturing_here() : inner_->capturing();
}

void WideningBackend::host_step(const std::function<void()>& work) {
  if (capturing_here()) return capture(nullptr, work);
  work();
}

}  // namespace gpipe
