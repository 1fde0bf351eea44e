#include "kernels/widening_backend.h"

#include <algorithm>
#include <deque>
#include <initializer_list>
#include <utility>
#include <vector>

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

// Whether the wrapped backend computes this call itself (Backend::computes_narrow):
// every operand of one narrow type t, and the backend says it computes `op` in t.
template <typename... Ts>
bool native(const Backend& inner, Backend::NarrowOp op, const Tensor& first, const Ts&... rest) {
  const DType t = first.dtype();
  return is_narrow(t) && ((rest.dtype() == t) && ...) && inner.computes_narrow(op, t);
}

// The same for a product: a and b of one narrow type t, c of type t or float32.
bool native_matmul(const Backend& inner, const Tensor& a, const Tensor& b, const Tensor& c) {
  const DType t = a.dtype();
  return is_narrow(t) && b.dtype() == t && (c.dtype() == t || c.dtype() == DType::kF32) &&
         inner.computes_narrow(Backend::NarrowOp::kMatmul, t);
}

}  // namespace

void WideningBackend::matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha,
                             double beta) {
  if (!any_narrow(a, b, c) || native_matmul(*inner_, a, b, c)) return inner_->matmul(a, ta, b, tb, c, alpha, beta);
  Widen w(*inner_);
  inner_->matmul(w.in(a), ta, w.in(b), tb, beta != 0.0 ? w.inout(c) : w.out(c), alpha, beta);
  w.store();
}

void WideningBackend::matmul_weight(const Tensor& a, bool ta, const Tensor& wt, bool tw, Tensor& c, double alpha,
                                    double beta) {
  if (!any_narrow(a, wt, c) || native_matmul(*inner_, a, wt, c)) {
    return inner_->matmul_weight(a, ta, wt, tw, c, alpha, beta);
  }
  // Not matmul_weight: a backend may keep a copy of its weight operand keyed on where it
  // lives, and the widened weight is a temporary.
  matmul(a, ta, wt, tw, c, alpha, beta);
}

void WideningBackend::add_bias(Tensor& y, const Tensor& bias) {
  if (!any_narrow(y, bias) || native(*inner_, NarrowOp::kAddBias, y, bias)) return inner_->add_bias(y, bias);
  Widen w(*inner_);
  inner_->add_bias(w.inout(y), w.in(bias));
  w.store();
}

void WideningBackend::bias_grad(const Tensor& dy, Tensor& db, double beta) {
  if (!any_narrow(dy, db)) return inner_->bias_grad(dy, db, beta);
  Widen w(*inner_);
  inner_->bias_grad(w.in(dy), beta != 0.0 ? w.inout(db) : w.out(db), beta);
  w.store();
}

void WideningBackend::relu(const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y) || native(*inner_, NarrowOp::kRelu, x, y)) return inner_->relu(x, y);
  Widen w(*inner_);
  inner_->relu(w.in(x), w.out(y));
  w.store();
}

void WideningBackend::relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  if (!any_narrow(y, dy, dx) || native(*inner_, NarrowOp::kReluBackward, y, dy, dx)) {
    return inner_->relu_backward(y, dy, dx);
  }
  Widen w(*inner_);
  inner_->relu_backward(w.in(y), w.in(dy), w.out(dx));
  w.store();
}

void WideningBackend::gelu(const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y) || native(*inner_, NarrowOp::kGelu, x, y)) return inner_->gelu(x, y);
  Widen w(*inner_);
  inner_->gelu(w.in(x), w.out(y));
  w.store();
}

void WideningBackend::gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  if (!any_narrow(x, dy, dx) || native(*inner_, NarrowOp::kGeluBackward, x, dy, dx)) {
    return inner_->gelu_backward(x, dy, dx);
  }
  Widen w(*inner_);
  inner_->gelu_backward(w.in(x), w.in(dy), w.out(dx));
  w.store();
}

void WideningBackend::softmax_xent(const Tensor& logits, const Tensor& labels, double scale, int ignore_index,
                                   Tensor& probs, Tensor& loss) {
  if (!any_narrow(logits, probs, loss)) return inner_->softmax_xent(logits, labels, scale, ignore_index, probs, loss);
  Widen w(*inner_);
  inner_->softmax_xent(w.in(logits), labels, scale, ignore_index, w.out(probs), w.out(loss));
  w.store();
}

void WideningBackend::softmax_xent_backward(const Tensor& probs, const Tensor& labels, double scale, int ignore_index,
                                            Tensor& dlogits) {
  if (!any_narrow(probs, dlogits)) return inner_->softmax_xent_backward(probs, labels, scale, ignore_index, dlogits);
  Widen w(*inner_);
  inner_->softmax_xent_backward(w.in(probs), labels, scale, ignore_index, w.out(dlogits));
  w.store();
}

int64_t WideningBackend::argmax_correct(const Tensor& logits, const Tensor& labels, int ignore_index) {
  if (!any_narrow(logits)) return inner_->argmax_correct(logits, labels, ignore_index);
  Widen w(*inner_);
  return inner_->argmax_correct(w.in(logits), labels, ignore_index);
}

void WideningBackend::fill(Tensor& x, double value) {
  if (!any_narrow(x)) return inner_->fill(x, value);
  Widen w(*inner_);
  inner_->fill(w.out(x), value);
  w.store();
}

void WideningBackend::scale(Tensor& x, double alpha) {
  if (!any_narrow(x)) return inner_->scale(x, alpha);
  Widen w(*inner_);
  inner_->scale(w.inout(x), alpha);
  w.store();
}

void WideningBackend::axpy(double alpha, const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y) || native(*inner_, NarrowOp::kAxpy, x, y)) return inner_->axpy(alpha, x, y);
  Widen w(*inner_);
  inner_->axpy(alpha, w.in(x), w.inout(y));
  w.store();
}

void WideningBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p, bool first_step) {
  if (!any_narrow(param, grad, buf)) return inner_->sgd_step(param, grad, buf, p, first_step);
  Widen w(*inner_);
  inner_->sgd_step(w.inout(param), w.in(grad), w.inout(buf), p, first_step);
  w.store();
}

void WideningBackend::adam_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p,
                                int64_t step) {
  if (!any_narrow(param, grad, m, v)) return inner_->adam_step(param, grad, m, v, p, step);
  Widen w(*inner_);
  inner_->adam_step(w.inout(param), w.in(grad), w.inout(m), w.inout(v), p, step);
  w.store();
}

double WideningBackend::sum_squares(const Tensor& x) {
  if (!any_narrow(x)) return inner_->sum_squares(x);
  Widen w(*inner_);
  return inner_->sum_squares(w.in(x));
}

double WideningBackend::sum_squares_all(const std::vector<Tensor>& xs) {
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
  if (!any_narrow(x, g, y, rstd) || native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &g, &y}, {&rstd})) {
    return inner_->rmsnorm(x, g, eps, y, rstd);
  }
  Backend::rmsnorm(x, g, eps, y, rstd);
}

void WideningBackend::rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                                       Tensor& dx) {
  if (!any_narrow(dy, x, g, rstd, dx) ||
      native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &dy, &g, &dx}, {&rstd})) {
    return inner_->rmsnorm_backward(dy, x, g, rstd, dx);
  }
  Backend::rmsnorm_backward(dy, x, g, rstd, dx);
}

void WideningBackend::rmsnorm_weight_grad(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dg) {
  if (!any_narrow(dy, x, rstd, dg) || native_fused(*inner_, NarrowOp::kRmsNorm, {&x, &dy}, {&rstd, &dg})) {
    return inner_->rmsnorm_weight_grad(dy, x, rstd, dg);
  }
  Backend::rmsnorm_weight_grad(dy, x, rstd, dg);
}

void WideningBackend::swiglu(const Tensor& a, const Tensor& b, Tensor& y) {
  if (!any_narrow(a, b, y) || native_fused(*inner_, NarrowOp::kSwiglu, {&a, &b, &y}, {})) {
    return inner_->swiglu(a, b, y);
  }
  Backend::swiglu(a, b, y);
}

void WideningBackend::swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db) {
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
                                   const std::vector<Tensor>& bufs, const SgdParams& p, bool first_step) {
  if (any_narrow_in(params, grads, bufs)) return Backend::sgd_step_all(params, grads, bufs, p, first_step);
  inner_->sgd_step_all(params, grads, bufs, p, first_step);
}

void WideningBackend::adam_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                    const std::vector<Tensor>& m, const std::vector<Tensor>& v, const AdamParams& p,
                                    int64_t step) {
  if (any_narrow_in(params, grads, m, v)) return Backend::adam_step_all(params, grads, m, v, p, step);
  inner_->adam_step_all(params, grads, m, v, p, step);
}

void WideningBackend::scale_all(const std::vector<Tensor>& xs, double alpha) {
  if (any_narrow_in(xs)) return Backend::scale_all(xs, alpha);
  inner_->scale_all(xs, alpha);
}

void WideningBackend::fill_all(const std::vector<Tensor>& xs, double value) {
  if (any_narrow_in(xs)) return Backend::fill_all(xs, value);
  inner_->fill_all(xs, value);
}

void WideningBackend::embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, Tensor& out) {
  const bool native_here = pos.defined() ? native(*inner_, NarrowOp::kEmbedding, table, pos, out)
                                         : native(*inner_, NarrowOp::kEmbedding, table, out);
  if (!any_narrow(table, pos, out) || native_here) return inner_->embedding(ids, table, pos, out);
  Widen w(*inner_);
  inner_->embedding(ids, w.in(table), w.in(pos), w.out(out));
  w.store();
}

void WideningBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, Tensor& dpos) {
  if (!any_narrow(dout, dtable, dpos)) return inner_->embedding_backward(ids, dout, dtable, dpos);
  Widen w(*inner_);
  inner_->embedding_backward(ids, w.in(dout), w.inout(dtable), w.inout(dpos));
  w.store();
}

void WideningBackend::layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                                Tensor& mean, Tensor& rstd) {
  if (!any_narrow(x, gamma, beta, y, mean, rstd)) return inner_->layernorm(x, gamma, beta, eps, y, mean, rstd);
  Widen w(*inner_);
  inner_->layernorm(w.in(x), w.in(gamma), w.in(beta), eps, w.out(y), w.out(mean), w.out(rstd));
  w.store();
}

void WideningBackend::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                         const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  if (!any_narrow(dy, x, gamma, mean, rstd, dx, dgamma, dbeta)) {
    return inner_->layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
  }
  Widen w(*inner_);
  inner_->layernorm_backward(w.in(dy), w.in(x), w.in(gamma), w.in(mean), w.in(rstd), w.out(dx), w.inout(dgamma),
                             w.inout(dbeta));
  w.store();
}

void WideningBackend::attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) {
  if (!any_narrow(qkv, probs, out)) return inner_->attention(qkv, heads, probs, out);
  Widen w(*inner_);
  inner_->attention(w.in(qkv), heads, w.out(probs), w.out(out));
  w.store();
}

void WideningBackend::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                                         Tensor& dqkv) {
  if (!any_narrow(dout, qkv, probs, dqkv)) return inner_->attention_backward(dout, qkv, probs, heads, dqkv);
  Widen w(*inner_);
  inner_->attention_backward(w.in(dout), w.in(qkv), w.in(probs), heads, w.out(dqkv));
  w.store();
}

void WideningBackend::dropout(const Tensor& x, double p, uint64_t key, int64_t sample_offset, Tensor& y) {
  if (!any_narrow(x, y)) return inner_->dropout(x, p, key, sample_offset, y);
  Widen w(*inner_);
  inner_->dropout(w.in(x), p, key, sample_offset, w.out(y));
  w.store();
}

void WideningBackend::dropout_backward(const Tensor& dy, double p, uint64_t key, int64_t sample_offset, Tensor& dx) {
  if (!any_narrow(dy, dx)) return inner_->dropout_backward(dy, p, key, sample_offset, dx);
  Widen w(*inner_);
  inner_->dropout_backward(w.in(dy), p, key, sample_offset, w.out(dx));
  w.store();
}

void WideningBackend::conv2d(const Tensor& x, const Tensor& wt, int stride, int pad, Tensor& y) {
  if (!any_narrow(x, wt, y)) return inner_->conv2d(x, wt, stride, pad, y);
  Widen w(*inner_);
  inner_->conv2d(w.in(x), w.in(wt), stride, pad, w.out(y));
  w.store();
}

void WideningBackend::conv2d_backward(const Tensor& dy, const Tensor& x, const Tensor& wt, int stride, int pad,
                                      Tensor& dx, Tensor& dw) {
  if (!any_narrow(dy, x, wt, dx, dw)) return inner_->conv2d_backward(dy, x, wt, stride, pad, dx, dw);
  Widen w(*inner_);
  inner_->conv2d_backward(w.in(dy), w.in(x), w.in(wt), stride, pad, w.out(dx), w.inout(dw));
  w.store();
}

void WideningBackend::add_channel_bias(Tensor& y, const Tensor& bias) {
  if (!any_narrow(y, bias)) return inner_->add_channel_bias(y, bias);
  Widen w(*inner_);
  inner_->add_channel_bias(w.inout(y), w.in(bias));
  w.store();
}

void WideningBackend::channel_bias_grad(const Tensor& dy, Tensor& db) {
  if (!any_narrow(dy, db)) return inner_->channel_bias_grad(dy, db);
  Widen w(*inner_);
  inner_->channel_bias_grad(w.in(dy), w.inout(db));
  w.store();
}

void WideningBackend::batchnorm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                                      Tensor& mean, Tensor& var) {
  if (!any_narrow(x, gamma, beta, y, mean, var)) return inner_->batchnorm_train(x, gamma, beta, eps, y, mean, var);
  Widen w(*inner_);
  inner_->batchnorm_train(w.in(x), w.in(gamma), w.in(beta), eps, w.out(y), w.out(mean), w.out(var));
  w.store();
}

void WideningBackend::batchnorm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                                     const Tensor& var, double eps, Tensor& y) {
  if (!any_narrow(x, gamma, beta, mean, var, y)) return inner_->batchnorm_eval(x, gamma, beta, mean, var, eps, y);
  Widen w(*inner_);
  inner_->batchnorm_eval(w.in(x), w.in(gamma), w.in(beta), w.in(mean), w.in(var), eps, w.out(y));
  w.store();
}

void WideningBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                         const Tensor& var, double eps, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  if (!any_narrow(dy, x, gamma, mean, var, dx, dgamma, dbeta)) {
    return inner_->batchnorm_backward(dy, x, gamma, mean, var, eps, dx, dgamma, dbeta);
  }
  Widen w(*inner_);
  inner_->batchnorm_backward(w.in(dy), w.in(x), w.in(gamma), w.in(mean), w.in(var), eps, w.out(dx), w.inout(dgamma),
                             w.inout(dbeta));
  w.store();
}

void WideningBackend::maxpool2d(const Tensor& x, int kernel, int stride, int pad, Tensor& y, Tensor& argmax) {
  if (!any_narrow(x, y)) return inner_->maxpool2d(x, kernel, stride, pad, y, argmax);
  Widen w(*inner_);
  inner_->maxpool2d(w.in(x), kernel, stride, pad, w.out(y), argmax);
  w.store();
}

void WideningBackend::maxpool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) {
  if (!any_narrow(dy, dx)) return inner_->maxpool2d_backward(dy, argmax, dx);
  Widen w(*inner_);
  inner_->maxpool2d_backward(w.in(dy), argmax, w.out(dx));
  w.store();
}

void WideningBackend::avgpool2d(const Tensor& x, int kernel, int stride, Tensor& y) {
  if (!any_narrow(x, y)) return inner_->avgpool2d(x, kernel, stride, y);
  Widen w(*inner_);
  inner_->avgpool2d(w.in(x), kernel, stride, w.out(y));
  w.store();
}

void WideningBackend::avgpool2d_backward(const Tensor& dy, int kernel, int stride, Tensor& dx) {
  if (!any_narrow(dy, dx)) return inner_->avgpool2d_backward(dy, kernel, stride, dx);
  Widen w(*inner_);
  inner_->avgpool2d_backward(w.in(dy), kernel, stride, w.out(dx));
  w.store();
}

void WideningBackend::unary_impl(Unary f, const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y)) return inner_->unary_impl(f, x, y);
  Widen w(*inner_);
  inner_->unary_impl(f, w.in(x), w.out(y));
  w.store();
}

void WideningBackend::unary_backward_impl(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) {
  if (!any_narrow(x, dy, dx)) return inner_->unary_backward_impl(f, x, dy, dx);
  Widen w(*inner_);
  inner_->unary_backward_impl(f, w.in(x), w.in(dy), w.out(dx));
  w.store();
}

void WideningBackend::mul(const Tensor& a, const Tensor& b, Tensor& y) {
  if (!any_narrow(a, b, y)) return inner_->mul(a, b, y);
  Widen w(*inner_);
  inner_->mul(w.in(a), w.in(b), w.out(y));
  w.store();
}

void WideningBackend::scale_rows(const Tensor& x, const Tensor& s, Tensor& y) {
  if (!any_narrow(x, s, y)) return inner_->scale_rows(x, s, y);
  Widen w(*inner_);
  inner_->scale_rows(w.in(x), w.in(s), w.out(y));
  w.store();
}

void WideningBackend::scale_columns(const Tensor& x, const Tensor& s, Tensor& y) {
  if (!any_narrow(x, s, y)) return inner_->scale_columns(x, s, y);
  Widen w(*inner_);
  inner_->scale_columns(w.in(x), w.in(s), w.out(y));
  w.store();
}

void WideningBackend::row_dot(const Tensor& a, const Tensor& b, double alpha, Tensor& out) {
  if (!any_narrow(a, b, out)) return inner_->row_dot(a, b, alpha, out);
  Widen w(*inner_);
  inner_->row_dot(w.in(a), w.in(b), alpha, w.out(out));
  w.store();
}

void WideningBackend::row_inverse_rms(const Tensor& x, double eps, Tensor& out) {
  if (!any_narrow(x, out)) return inner_->row_inverse_rms(x, eps, out);
  Widen w(*inner_);
  inner_->row_inverse_rms(w.in(x), eps, w.out(out));
  w.store();
}

void WideningBackend::binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) {
  if (!any_narrow(a, b, y)) return inner_->binary(op, a, b, y);
  Widen w(*inner_);
  inner_->binary(op, w.in(a), w.in(b), w.out(y));
  w.store();
}

void WideningBackend::sum_to(const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y)) return inner_->sum_to(x, y);
  Widen w(*inner_);
  inner_->sum_to(w.in(x), w.out(y));
  w.store();
}

void WideningBackend::reduce_rows(Reduce op, const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y)) return inner_->reduce_rows(op, x, y);
  Widen w(*inner_);
  inner_->reduce_rows(op, w.in(x), w.out(y));
  w.store();
}

void WideningBackend::reduce_rows_backward(Reduce op, const Tensor& x, const Tensor& y, const Tensor& dy,
                                           Tensor& dx) {
  if (!any_narrow(x, y, dy, dx)) return inner_->reduce_rows_backward(op, x, y, dy, dx);
  Widen w(*inner_);
  inner_->reduce_rows_backward(op, w.in(x), w.in(y), w.in(dy), w.out(dx));
  w.store();
}

void WideningBackend::softmax(const Tensor& x, Tensor& y) {
  if (!any_narrow(x, y)) return inner_->softmax(x, y);
  Widen w(*inner_);
  inner_->softmax(w.in(x), w.out(y));
  w.store();
}

void WideningBackend::softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  if (!any_narrow(y, dy, dx)) return inner_->softmax_backward(y, dy, dx);
  Widen w(*inner_);
  inner_->softmax_backward(w.in(y), w.in(dy), w.out(dx));
  w.store();
}

double WideningBackend::item(const Tensor& x) {
  if (!any_narrow(x)) return inner_->item(x);
  Widen w(*inner_);
  return inner_->item(w.in(x));
}

}  // namespace gpipe

// ==== LLaMA ops: the float32 op on the widened operands, rounded once. A separate
// block, so that it merges apart from the rest.

namespace gpipe {

void WideningBackend::rope(const Tensor& x, int heads, double base, Tensor& y) {
  if (!any_narrow(x, y) || native(*inner_, NarrowOp::kRope, x, y)) return inner_->rope(x, heads, base, y);
  Widen w(*inner_);
  inner_->rope(w.in(x), heads, base, w.out(y));
  w.store();
}

void WideningBackend::rope_backward(const Tensor& dy, int heads, double base, Tensor& dx) {
  if (!any_narrow(dy, dx) || native(*inner_, NarrowOp::kRope, dy, dx)) {
    return inner_->rope_backward(dy, heads, base, dx);
  }
  Widen w(*inner_);
  inner_->rope_backward(w.in(dy), heads, base, w.out(dx));
  w.store();
}

void WideningBackend::pack_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& qkv) {
  if (!any_narrow(q, k, v, qkv)) return inner_->pack_qkv(q, k, v, heads, qkv);
  Widen w(*inner_);
  inner_->pack_qkv(w.in(q), w.in(k), w.in(v), heads, w.out(qkv));
  w.store();
}

void WideningBackend::pack_qkv_backward(const Tensor& dqkv, int heads, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (!any_narrow(dqkv, dq, dk, dv)) return inner_->pack_qkv_backward(dqkv, heads, dq, dk, dv);
  Widen w(*inner_);
  inner_->pack_qkv_backward(w.in(dqkv), heads, w.out(dq), w.out(dk), w.out(dv));
  w.store();
}

}  // namespace gpipe
