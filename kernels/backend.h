// The backend interface: every numerical op the layers need, with one CPU
// implementation (the reference, on OpenBLAS) and one CUDA implementation (cuBLAS and
// small kernels) that have the same semantics. Layers call only this; they never call
// BLAS, CUDA or NCCL themselves.
//
// Conventions: tensors are contiguous and row-major; matrices are 2-D (rows, cols);
// floating-point ops accept float32 and float64 (float64 exists for finite-difference
// and exact-equality tests), and all operands of one call share a dtype and device.
// Outputs are written, never resized: the caller allocates them with empty()/zeros().
#pragma once

#include <memory>
#include <vector>

#include "kernels/broadcast.h"
#include "kernels/unary.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace gpipe {

struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  // false: Adam with L2 in the gradient; true: AdamW
};

struct SgdParams {
  double lr = 0.01;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual Stream& stream() = 0;

  Tensor empty(const Shape& shape, DType dtype) { return Tensor::empty(shape, dtype, device()); }
  Tensor zeros(const Shape& shape, DType dtype);

  // c = alpha * op(a) @ op(b) + beta * c, op(x) = x or x^T.
  //   a: (M, K) or (K, M) if trans_a;  b: (K, N) or (N, K) if trans_b;  c: (M, N)
  virtual void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                      double alpha = 1.0, double beta = 0.0) = 0;
  // The same product with b a layer's weight (a parameter, contiguous). Inside a
  // FrozenWeights window on the calling thread, a backend may reuse a copy of b in the
  // layout its matrix library prefers (the CPU backend's oneDNN path), made by an
  // earlier call in the window.
  virtual void matmul_weight(const Tensor& a, bool trans_a, const Tensor& w, bool trans_w, Tensor& c,
                             double alpha = 1.0, double beta = 0.0) {
    matmul(a, trans_a, w, trans_w, c, alpha, beta);
  }
  // The ops a backend computes itself on narrow operands (bfloat16, float16: is_narrow):
  // it loads them into float32, computes in float32 and rounds what it stores once, to
  // nearest even, which is what WideningBackend does around the float32 op, less the
  // float32 temporaries. WideningBackend hands such a call to the backend as it is.
  //   kMatmul (matmul, matmul_weight): a and b of type t, c of type t or float32;
  //   the others: every floating-point operand of type t.
  // The CPU reference computes none (the widening is the reference); the CUDA backend
  // computes the products (cublasGemmEx) and the elementwise ops below.
  //   kAxpy, kRope (rope and rope_backward): x and y of type t; kEmbedding (embedding):
  //   table, pos and out of type t; the fused ops (kRmsNorm: rmsnorm and its two backward
  //   ops; kSwiglu: swiglu and swiglu_backward): their activations of type t, their
  //   per-row statistics and the weight gradient of the master type (float32).
  enum class NarrowOp {
    kMatmul, kAddBias, kRelu, kReluBackward, kGelu, kGeluBackward, kAxpy, kRmsNorm, kSwiglu, kRope, kEmbedding
  };
  virtual bool computes_narrow(NarrowOp op, DType t) const {
    (void)op;
    (void)t;
    return false;
  }
  // y: (R, C) += bias: (C) broadcast over rows.
  virtual void add_bias(Tensor& y, const Tensor& bias) = 0;
  // db: (C) = beta * db + sum over rows of dy: (R, C).
  virtual void bias_grad(const Tensor& dy, Tensor& db, double beta) = 0;

  // Elementwise functions with their derivatives (kernels/unary.h lists them, with f and
  // f'; kernels/unary_math.h has the formulas both backends compute):
  //   unary:          y = f(x)
  //   unary_backward: dx = dy * f'(x), from the input x (keep x for backward)
  // x, y, dy, dx: one float type and shape; y may be x, dx may be dy. kRelu and kGelu are
  // the relu and gelu ops below (relu_backward from x: x > 0 exactly where relu(x) > 0).
  void unary(Unary f, const Tensor& x, Tensor& y) {
    if (f == Unary::kRelu) return relu(x, y);
    if (f == Unary::kGelu) return gelu(x, y);
    unary_impl(f, x, y);
  }
  void unary_backward(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) {
    if (f == Unary::kRelu) return relu_backward(x, dy, dx);
    if (f == Unary::kGelu) return gelu_backward(x, dy, dx);
    unary_backward_impl(f, x, dy, dx);
  }
  // What unary and unary_backward call for the other functions.
  virtual void unary_impl(Unary f, const Tensor& x, Tensor& y) = 0;
  virtual void unary_backward_impl(Unary f, const Tensor& x, const Tensor& dy, Tensor& dx) = 0;

  // y = max(x, 0); dx = dy * (y > 0). x, y, dy, dx: same shape.
  virtual void relu(const Tensor& x, Tensor& y) = 0;
  virtual void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  // Exact GELU: y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)); dx = dy * (Phi(x) + x phi(x)).
  virtual void gelu(const Tensor& x, Tensor& y) = 0;
  virtual void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) = 0;

  // Softmax cross-entropy over the rows of logits (B, C) against int32 labels (B).
  // probs (B, C) receives softmax(logits); loss (1) receives
  //   scale * sum_i -log probs[i, labels[i]]   over rows whose label != ignore_index.
  // A label outside [0, C) that is not ignore_index is an error.
  virtual void softmax_xent(const Tensor& logits, const Tensor& labels, double scale, int ignore_index,
                            Tensor& probs, Tensor& loss) = 0;
  // dlogits = scale * (probs - onehot(labels)); rows with ignore_index get 0.
  virtual void softmax_xent_backward(const Tensor& probs, const Tensor& labels, double scale,
                                     int ignore_index, Tensor& dlogits) = 0;
  // How many rows of logits (B, C) have their largest entry (the first one on ties) at
  // column labels[r], over rows whose label != ignore_index; labels int32 (B). A label
  // outside [0, C) never matches. A host value (waits for queued work): evaluation
  // scores on the device and brings back only this count. Rows holding NaN may count
  // differently on the GPU (its search is a tree, the CPU's a scan).
  virtual int64_t argmax_correct(const Tensor& logits, const Tensor& labels, int ignore_index) = 0;

  virtual void fill(Tensor& x, double value) = 0;
  virtual void scale(Tensor& x, double alpha) = 0;                   // x *= alpha
  virtual void axpy(double alpha, const Tensor& x, Tensor& y) = 0;  // y += alpha * x

  // One SGD step with PyTorch's semantics (dampening 0):
  //   g = grad + weight_decay * param
  //   buf = g on the first step, else momentum * buf + g      (skipped when momentum == 0)
  //   param -= lr * (nesterov ? g + momentum * buf : buf)
  virtual void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, const SgdParams& p,
                        bool first_step) = 0;

  // Adam with PyTorch's semantics; `step` counts from 1.
  //   decoupled (AdamW): param *= 1 - lr * weight_decay;  g = grad
  //   otherwise (Adam):  g = grad + weight_decay * param
  //   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
  //   param -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
  virtual void adam_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p,
                         int64_t step) = 0;
  // Sum of the squares of all elements, on the host (waits for queued work).
  virtual double sum_squares(const Tensor& x) = 0;
  // The sum of sum_squares over `xs` (a stage's gradient norm), read on the host once:
  // the default adds each tensor's in order; the CUDA backend sums each on the device and
  // copies one number back, so a stage's norm waits for its device once, not once a tensor.
  virtual double sum_squares_all(const std::vector<Tensor>& xs);

  // ---- Multi-tensor ops: one call over a stage's tensors (its parameters, their
  // gradients and optimizer state), equal to the single-tensor op on each, in order.
  // The lists are parallel (entry i of each belongs to tensor i) and of one length; an
  // SGD step without momentum passes undefined buffers. The defaults loop over the
  // single-tensor op; the CUDA backend launches one kernel per call for tensors of one
  // element type, so a stage's optimizer step, clipping, zeroing and refresh cost a
  // launch each rather than one per parameter, with the single-tensor kernels' element
  // arithmetic (bit for bit the same results).
  virtual void sgd_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                            const std::vector<Tensor>& momentum_bufs, const SgdParams& p, bool first_step);
  virtual void adam_step_all(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& m, const std::vector<Tensor>& v, const AdamParams& p,
                             int64_t step);
  // x *= alpha and x = value for each x; dsts[i] = srcs[i] in dsts[i]'s type (cast).
  virtual void scale_all(const std::vector<Tensor>& xs, double alpha);
  virtual void fill_all(const std::vector<Tensor>& xs, double value);
  virtual void cast_all(const std::vector<Tensor>& srcs, const std::vector<Tensor>& dsts);

  // ---- Transformer ops. Shapes use B (batch), T (positions), C (channels), V
  // (vocabulary), H (heads), D = C / H (head width).

  // out (B, T, C) = table[ids[b, t]] + pos[t]; ids int32 (B, T) with values in [0, V)
  // (anything else is a UserError naming the id and its position); table (V, C); pos
  // (P >= T, C), or an undefined tensor for no positions.
  virtual void embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, Tensor& out) = 0;
  // dtable[ids[b, t]] += dout[b, t];  dpos[t] += sum_b dout[b, t] (when dpos is defined).
  virtual void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, Tensor& dpos) = 0;

  // Layer normalisation over the last dimension of x viewed as (R, C):
  //   mean[r], rstd[r] = 1 / sqrt(var[r] + eps)  (biased variance), both (R);
  //   y = (x - mean) * rstd * gamma + beta;  gamma, beta (C).
  virtual void layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                         Tensor& mean, Tensor& rstd) = 0;
  // dx = rstd * (dy*gamma - mean_c(dy*gamma) - xhat * mean_c(dy*gamma*xhat)),
  // dgamma += sum_r dy * xhat, dbeta += sum_r dy.
  virtual void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                  const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) = 0;

  // Causal multi-head self-attention on fused projections. qkv (B, T, 3C) holds q, k
  // and v side by side, head h in columns [h D, (h + 1) D) of each. probs (B, H, T, T)
  // receives softmax_s(q_t . k_s / sqrt(D)) over s <= t, zero for s > t, and is kept
  // for backward; out (B, T, C) = probs @ v per head, heads side by side.
  virtual void attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) = 0;
  // dqkv (B, T, 3C), overwritten.
  virtual void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                                  Tensor& dqkv) = 0;

  // Fused causal grouped-query self-attention, as flash attention keeps it: the output
  // and one log-sum-exp per row and query head, never the (B, H, T, T) probabilities, so
  // what backward keeps is about T / D times smaller. q (B, T, H D), k and v (B, T, KV D)
  // with KV dividing H (query head h reads key/value head h / (H / KV), nothing repeated);
  // out (B, T, H D) = softmax_s(q_t . k_s / sqrt(D), s <= t) v per head; stats (B, H, T)
  // float32 = log sum_{s <= t} exp(q_t . k_s / sqrt(D)). The same function as pack_qkv
  // then attention. A backend says for which element type and shape it runs it
  // (has_fused_attention, asked before each use; a GPU prepares the shape's kernels then,
  // and says no, once with a warning, where it cannot); the CPU reference runs none (a
  // layer then takes pack_qkv and attention), the CUDA backend bfloat16 and float16
  // through cuDNN's fused SDPA where built with cuDNN's frontend (float32 keeps the exact
  // path, the reference).
  struct AttentionSizes {
    int64_t batch, seq, heads, kv_heads, head_dim;
  };
  virtual bool has_fused_attention(DType t, const AttentionSizes& dims) {
    (void)t;
    (void)dims;
    return false;
  }
  virtual void fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                               Tensor& stats);
  // dq (B, T, H D), dk and dv (B, T, KV D), overwritten, from the forward's out and stats.
  virtual void fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& stats, int heads, Tensor& dq, Tensor& dk,
                                        Tensor& dv);

  // Inverted dropout with a counter-based mask. x, y: (N, ...) with E elements per
  // sample. Element e of row i is kept iff philox_uniform(key, sample_offset + i, e)
  // >= p (runtime/philox.h), and kept values are scaled by 1 / (1 - p); the mask does
  // not depend on how the batch was split, and a recomputation reproduces it.
  virtual void dropout(const Tensor& x, double p, uint64_t key, int64_t sample_offset, Tensor& y) = 0;
  // dx = dy * mask / (1 - p), regenerating the same mask.
  virtual void dropout_backward(const Tensor& dy, double p, uint64_t key, int64_t sample_offset, Tensor& dx) = 0;

  // ---- LLaMA ops: rotary position embeddings and grouped-query attention's keys and
  // values. x viewed as (B, T, H, D) with H = heads and D = C / H, which must be even.

  // Rotary position embeddings in Hugging Face LLaMA's rotate_half convention: in each
  // head, element i < D/2 pairs with i + D/2 and the pair turns by angle t theta_i,
  // theta_i = base^(-2i/D), t the row's index within T (kernels/llama_math.h):
  //   y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin.
  // Angles and products in double. x, y (B, T, H D); y may be x.
  virtual void rope(const Tensor& x, int heads, double base, Tensor& y) = 0;
  // dx = the inverse rotation of dy (the same with -sin). dy, dx (B, T, H D); dx may be dy.
  virtual void rope_backward(const Tensor& dy, int heads, double base, Tensor& dx) = 0;
  // The fused (B, T, 3C) operand of attention() from separate projections with fewer key
  // and value heads: q (B, T, H D) goes to columns [0, C); k and v (B, T, KV D), KV
  // dividing H, go to [C, 2C) and [2C, 3C) with key/value head j repeated for query heads
  // j H/KV .. (j + 1) H/KV - 1. KV == H is a plain concatenation.
  virtual void pack_qkv(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& qkv) = 0;
  // The gradients through pack_qkv, overwritten: dq = dqkv's q columns; dk and dv sum
  // their key/value head's H/KV copies.
  virtual void pack_qkv_backward(const Tensor& dqkv, int heads, Tensor& dq, Tensor& dk, Tensor& dv) = 0;

  // ---- Convolution ops, on NCHW images: x (N, C, H, W), weights (K, C, R, S), outputs
  // (N, K, P, Q) with P = (H + 2 pad - R) / stride + 1 and Q likewise.

  // y = cross-correlation of x with w (as torch.nn.functional.conv2d), zero padding.
  virtual void conv2d(const Tensor& x, const Tensor& w, int stride, int pad, Tensor& y) = 0;
  // dx = the input gradient; dw += the weight gradient. Either is skipped when undefined
  // (a zero-bubble schedule computes them at different times).
  virtual void conv2d_backward(const Tensor& dy, const Tensor& x, const Tensor& w, int stride, int pad, Tensor& dx,
                               Tensor& dw) = 0;
  // y (N, K, ...) += bias[k] over every position; db (K) += sum over N and positions.
  virtual void add_channel_bias(Tensor& y, const Tensor& bias) = 0;
  virtual void channel_bias_grad(const Tensor& dy, Tensor& db) = 0;

  // Batch normalisation over (N, H, W) for each channel of x (N, C, H, W), with the
  // statistics of this batch: mean (C) and biased var (C) are written (and kept for
  // backward and for the running statistics); y = (x - mean) / sqrt(var + eps) * gamma + beta.
  virtual void batchnorm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                               Tensor& mean, Tensor& var) = 0;
  // The same with given statistics (evaluation: the running mean and variance).
  virtual void batchnorm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                              const Tensor& var, double eps, Tensor& y) = 0;
  // Backward of batchnorm_train: dx overwritten, dgamma and dbeta (C) accumulated.
  virtual void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                  const Tensor& var, double eps, Tensor& dx, Tensor& dgamma, Tensor& dbeta) = 0;

  // Max pooling with a kernel x kernel window, stride and padding (padded positions
  // count as -infinity, as in PyTorch). argmax (N, C, P, Q) int32 receives the flat index h W + w
  // of each maximum within its (n, c) plane (the first one on ties).
  virtual void maxpool2d(const Tensor& x, int kernel, int stride, int pad, Tensor& y, Tensor& argmax) = 0;
  // dx overwritten: each dy goes to its argmax.
  virtual void maxpool2d_backward(const Tensor& dy, const Tensor& argmax, Tensor& dx) = 0;
  // Average pooling without padding: y = mean of each kernel x kernel window.
  virtual void avgpool2d(const Tensor& x, int kernel, int stride, Tensor& y) = 0;
  virtual void avgpool2d_backward(const Tensor& dy, int kernel, int stride, Tensor& dx) = 0;

  // ---- Generic elementwise and row ops, the building blocks of layers of one's own
  // (an RMSNorm, a gated unit; see examples/custom_layer). Row ops view x as (R, C), C
  // its last dimension; a per-row or per-column factor is any contiguous tensor of R or
  // C elements of x's dtype. Outputs may alias inputs. Row sums accumulate in double.

  // y = a * b elementwise; a, b, y: same shape.
  virtual void mul(const Tensor& a, const Tensor& b, Tensor& y) = 0;
  // y[r, c] = x[r, c] * s[r]; s: R elements.
  virtual void scale_rows(const Tensor& x, const Tensor& s, Tensor& y) = 0;
  // y[r, c] = x[r, c] * s[c]; s: C elements.
  virtual void scale_columns(const Tensor& x, const Tensor& s, Tensor& y) = 0;
  // out[r] = alpha * sum_c a[r, c] * b[r, c]; a, b: same shape; out: R elements.
  virtual void row_dot(const Tensor& a, const Tensor& b, double alpha, Tensor& out) = 0;
  // out[r] = 1 / sqrt(mean_c x[r, c]^2 + eps); out: R elements.
  virtual void row_inverse_rms(const Tensor& x, double eps, Tensor& out) = 0;

  // ---- Fused ops of the built-in LLaMA layers (RMSNorm, SwiGLU). A GPU computes each in
  // one kernel (for bfloat16 and float16 in float32, rounding once on store); the
  // defaults compose the generic ops above in the order the layers used to call them,
  // which is the CPU reference, so CPU results are those of the composition bit for bit.
  // x, dy viewed as (R, C), C the last dimension; g (C) of x's type; rstd (R) and dg (C)
  // of the master type (master_dtype: float32 for a 16-bit x).

  // rstd[r] = 1 / sqrt(mean_c x[r, c]^2 + eps);  y[r, c] = x[r, c] rstd[r] g[c].
  virtual void rmsnorm(const Tensor& x, const Tensor& g, double eps, Tensor& y, Tensor& rstd);
  // The input gradient, from the forward's rstd: with xhat = x rstd and gdy = dy g,
  //   dx = rstd (gdy - xhat mean_c(gdy xhat)).   dx overwritten; it may not alias.
  virtual void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd, Tensor& dx);
  // The weight gradient, accumulated: dg[c] += sum_r dy[r, c] x[r, c] rstd[r].
  virtual void rmsnorm_weight_grad(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dg);
  // SwiGLU's gate: y = silu(a) * b (a, b, y: one shape and type; y may alias a or b).
  virtual void swiglu(const Tensor& a, const Tensor& b, Tensor& y);
  // Its gradients, overwritten: da = dy b silu'(a), db = dy silu(a). da and db may not
  // alias the inputs or each other.
  virtual void swiglu_backward(const Tensor& dy, const Tensor& a, const Tensor& b, Tensor& da, Tensor& db);

  // ---- Broadcasting binary ops, reductions over the last axis and softmax: what a layer
  // written as forward only composes (layers/derived.h), each with what its gradient
  // needs. Shapes and names: kernels/broadcast.h. One float dtype throughout, contiguous;
  // sums accumulate in double.

  // y = a op b with NumPy broadcasting (shapes aligned at the last dimension, each size
  // equal or 1); y has the broadcast shape and may alias an operand of that shape.
  virtual void binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) = 0;
  // y = x summed over every dimension along which y's shape broadcasts to x's (the
  // gradient of an operand that was broadcast): x (4, 3, 5) into y (3, 1) sums over the
  // first and the last dimension.
  virtual void sum_to(const Tensor& x, Tensor& y) = 0;
  // y[r] = op over c of x[r, c], x viewed as (R, C); y: R elements (any shape).
  virtual void reduce_rows(Reduce op, const Tensor& x, Tensor& y) = 0;
  // dx[r, c] = dy[r] * d y[r] / d x[r, c], from x and the forward's y: sum 1, mean 1 / C,
  // max 1 at the first largest entry of the row and 0 elsewhere, norm x / y (0 where
  // y is 0). dx is overwritten. Sum and mean read only x's and y's shapes, not their
  // values (a caller that kept neither may pass dx and dy in their places).
  virtual void reduce_rows_backward(Reduce op, const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx) = 0;
  // y = softmax of each row of x (R, C): exp(x - max) / sum exp(x - max); y may be x.
  virtual void softmax(const Tensor& x, Tensor& y) = 0;
  // dx = y * (dy - sum_c dy * y), from the forward's y; dx may be dy.
  virtual void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) = 0;

  // dst = src; either may live on the host or on this backend's device. A copy to the
  // device returns once queued (src may change afterwards: it went through a staging
  // buffer); a copy to the host returns once the data is there.
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  // dst = src in dst's element type: float32, float64 and bfloat16 in any pair, the same
  // element count, both contiguous and on this backend's device. Into bfloat16: rounded
  // to nearest, ties to even, once (also from float64; runtime/bf16.h); out of it: exact;
  // float64 to float32: to nearest. A NaN stays a NaN; into and out of bfloat16 its sign
  // and payload are kept (quieted) by bits, between float32 and float64 they are the
  // hardware's. The same dtype: a copy.
  virtual void cast(const Tensor& src, Tensor& dst) = 0;
  // The value of a one-element tensor, on the host (waits for queued work).
  virtual double item(const Tensor& x) = 0;
  // Waits for all work queued on this backend's stream.
  virtual void synchronize() = 0;
};

// Whether backend_for(device) runs fused_attention for element type t and head width
// head_dim, asked without making that backend (the planner's shape probe asks on a
// machine that may not have the device).
bool fused_attention_available(Device device, DType t, int64_t head_dim);

// The backend of a device, created on first use and alive for the process. CPU
// backends are stateless and thread-safe; a CUDA backend owns its stream and cuBLAS
// handle and is used by one stage thread at a time.
Backend& backend_for(Device device);

// Limits the BLAS library to `threads` threads per call (1 = the calling thread only,
// so one pipeline stage uses one core): OpenBLAS, and oneDNN's OpenMP team on every
// thread that calls it. Also checks GPIPE_GEMM (kernels/cpu_gemm.h), so that a bad value
// stops a run before it starts.
void set_cpu_blas_threads(int threads);

// A promise, for as long as it lives, that no parameter changes: while one is alive on
// a thread, matmul_weight on that thread may keep copies of the weights it reads (in
// oneDNN's packed layout) and reuse them. They are freed when the last one on the thread
// ends. The pipeline executor holds one around each stage's instructions except the
// optimizer step; code that writes a parameter (an optimizer step, a checkpoint load,
// a finite-difference probe) must run with none alive on any thread that computes with
// that parameter. Without one nothing is cached, so a stale copy cannot exist.
class FrozenWeights {
 public:
  FrozenWeights();
  ~FrozenWeights();
  FrozenWeights(const FrozenWeights&) = delete;
  FrozenWeights& operator=(const FrozenWeights&) = delete;
};

}  // namespace gpipe
