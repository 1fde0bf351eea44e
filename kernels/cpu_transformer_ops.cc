// The CPU reference of the transformer ops (token and position embedding, layer norm,
// causal multi-head attention, counter-based dropout) and of the Adam step: plain loops,
// plus BLAS for attention's per-head products. The CUDA backend implements the same
// semantics (kernels/backend.h) and is tested against this file.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu_backend.h"
#include "kernels/cpu_blas.h"
#include "kernels/op_checks.h"
#include "kernels/transformer_checks.h"
#include "runtime/error.h"
#include "runtime/philox.h"

namespace gpipe {

namespace {

using cpu_blas::gemm;
using ops::dispatch_float;

// ---- Argument checks. They mirror kernels/op_checks.h: internal mistakes (a layer
// passing the wrong buffer) are Errors; what a user can cause (a token id, a dropout
// probability) is a UserError that names the value and the fix. Those shared with the
// CUDA backend are in kernels/transformer_checks.h; the ones below are the CPU's own.

using ops::AttentionDims;
using ops::check_dropout_p;

// Every id is checked before anything is written, so a bad batch leaves the outputs
// (and, in backward, the accumulated gradients) untouched.
void check_id_range(const Tensor& ids, int64_t vocab) {
  const int64_t B = ids.size(0), T = ids.size(1);
  const int32_t* p = ids.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int32_t id = p[b * T + t];
      if (id < 0 || id >= vocab) {
        throw UserError("token id " + std::to_string(id) + " at (b=" + std::to_string(b) + ", t=" +
                        std::to_string(t) + ") is outside the vocabulary [0, " + std::to_string(vocab) +
                        "); make the embedding's vocab option larger than every id in the data");
      }
    }
  }
}

void check_blas_dim(int64_t n, const char* op) {
  if (n > INT_MAX) throw Error(std::string(op) + ": dimension " + std::to_string(n) + " exceeds BLAS's int range");
}

// BLAS's int range, which the cblas calls of attention need.
void check_attention_blas_dims(const Tensor& qkv, const char* op) {
  check_blas_dim(qkv.size(2), op);
  check_blas_dim(qkv.size(1) * qkv.size(1), op);
}

// out = in * mask / (1 - p) with the mask of backend.h: element e of row i is kept iff
// philox_uniform(key, sample_offset + i, e) >= p. Forward and backward are the same
// map (dropout is linear and diagonal), so both call this. The comparison is made in
// double, C++'s usual promotion of the float uniform against the double p; a kernel
// may equivalently compare the uniform's 24-bit integer with ceil(p * 2^24).
//
// philox_uniform draws one Philox block for every four consecutive elements and
// keeps one word; here each block is drawn once and all four words are used, which
// gives the same values (the test checks element by element) at a quarter of the cost,
// eight blocks are drawn side by side (philox4x32_10_lanes), and the comparison is the
// integer one.
//
// With an element offset, x's element e is the sample's element element_offset + e:
// the blocks are those of the whole sample's elements, the first and last maybe in part.
template <typename Real>
void apply_dropout(const Real* in, Real* out, int64_t rows, int64_t per_row, double p, uint64_t key,
                   int64_t sample_offset, int64_t element_offset) {
  const Real scale = static_cast<Real>(1.0 / (1.0 - p));
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  const int64_t first = element_offset, last = element_offset + per_row;  // [first, last) of the sample
  // u = bits * 2^-24 >= p, exactly: u and p * 2^24 are exact in double, and bits an integer.
  // p is in [0, 1) (check_dropout_p), so the threshold is at most 2^24.
  const uint32_t threshold = static_cast<uint32_t>(std::ceil(p * 16777216.0));
  constexpr int64_t kSpan = 4 * kPhiloxLanes;
  for (int64_t i = 0; i < rows; ++i) {
    const uint64_t sample = static_cast<uint64_t>(sample_offset + i);
    const Real* x = in + i * per_row;  // x[e - first]: the sample's element e
    Real* y = out + i * per_row;
    // kPhiloxLanes blocks at a time (their lanes computed side by side), element g of the
    // sample taking word g & 3 of block g >> 2, as philox_uniform does.
    for (int64_t e0 = first & ~int64_t{3}; e0 < last; e0 += kSpan) {
      uint32_t r[4][kPhiloxLanes];
      philox4x32_10_lanes(static_cast<uint64_t>(e0) >> 2, sample, k0, k1, r);
      uint32_t bits[kSpan];  // each element's uniform's 24 bits, in element order
      for (int j = 0; j < kPhiloxLanes; ++j) {
        for (int w = 0; w < 4; ++w) bits[4 * j + w] = r[w][j] >> 8;
      }
      if (e0 >= first && e0 + kSpan <= last) {  // the whole span: a loop the compiler vectorizes
        const Real* xs = x + (e0 - first);
        Real* ys = y + (e0 - first);
        for (int64_t g = 0; g < kSpan; ++g) ys[g] = bits[g] >= threshold ? xs[g] * scale : Real(0);
        continue;
      }
      const int64_t begin = std::max(first, e0), end = std::min(last, e0 + kSpan);
      for (int64_t g = begin; g < end; ++g) y[g - first] = bits[g - e0] >= threshold ? x[g - first] * scale : Real(0);
    }
  }
}

// The key itself: with the step's scalars, their step index as the host reads them.
uint64_t resolve_key(const DropoutKey& key, const char* op) {
  if (!key.from_device()) return key.host_key();
  return mixed_key(key.base, key.multiplier, static_cast<uint64_t>(host_step_scalar(key.scalars, kStepIndex, op)));
}

void dropout_impl(const Tensor& in, double p, const DropoutKey& dropout_key, int64_t sample_offset,
                  int64_t element_offset, Tensor& out, const char* op) {
  ops::check_float(in, op);
  ops::check_same(in, out, op);
  if (in.dim() < 1) throw Error(std::string(op) + ": " + in.str() + " needs a batch dimension");
  check_dropout_p(p, op);
  if (sample_offset < 0) throw Error(std::string(op) + ": negative sample offset " + std::to_string(sample_offset));
  if (element_offset < 0) throw Error(std::string(op) + ": negative element offset " + std::to_string(element_offset));
  const int64_t rows = in.size(0);
  if (rows == 0 || in.numel() == 0) return;
  if (p == 0.0) {  // no mask to draw: a plain copy, bit for bit
    if (out.raw_data() != in.raw_data()) std::memcpy(out.raw_data(), in.raw_data(), in.nbytes());
    return;
  }
  const uint64_t key = resolve_key(dropout_key, op);
  dispatch_float(in, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    apply_dropout(in.data<Real>(), out.data<Real>(), rows, in.numel() / rows, p, key, sample_offset, element_offset);
  });
}

}  // namespace

// ---- Optimizer and reductions.

void CpuBackend::adam_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p,
                           int64_t step) {
  ops::check_adam(param, grad, m, v, step);
  // Bias corrections in double: beta2^step underflows slowly, and 1 - beta2^step is
  // tiny on the first steps, where float's rounding of beta2 would show.
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(step));
  dispatch_float(param, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    Real* w = param.data<Real>();
    const Real* g = grad.data<Real>();
    Real* pm = m.data<Real>();
    Real* pv = v.data<Real>();
    const Real lr = static_cast<Real>(p.lr), b1 = static_cast<Real>(p.beta1), b2 = static_cast<Real>(p.beta2);
    const Real eps = static_cast<Real>(p.eps), wd = static_cast<Real>(p.weight_decay);
    const Real decay = static_cast<Real>(1.0 - p.lr * p.weight_decay);
    const Real c1 = static_cast<Real>(bc1), c2 = static_cast<Real>(bc2);
    const int64_t n = param.numel();
    for (int64_t i = 0; i < n; ++i) {
      Real gi = g[i];
      if (p.decoupled) {
        if (p.weight_decay != 0.0) w[i] *= decay;
      } else {
        gi += wd * w[i];
      }
      pm[i] = b1 * pm[i] + (Real(1) - b1) * gi;
      pv[i] = b2 * pv[i] + (Real(1) - b2) * gi * gi;
      w[i] -= lr * (pm[i] / c1) / (std::sqrt(pv[i] / c2) + eps);
    }
  });
}

double CpuBackend::sum_squares(const Tensor& x) {
  ops::check_float(x, "sum_squares");
  double total = 0.0;  // double even for float32: a gradient norm sums millions of terms
  dispatch_float(x, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* p = x.data<Real>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) total += static_cast<double>(p[i]) * static_cast<double>(p[i]);
  });
  return total;
}

// ---- Embedding.

void CpuBackend::embedding(const Tensor& ids, const Tensor& table, const Tensor& pos, Tensor& out) {
  const ops::EmbeddingDims d = ops::check_embedding(ids, table, pos, out, "embedding", "out");
  const int64_t B = d.B, T = d.T, V = d.V, C = d.C;
  check_id_range(ids, V);
  dispatch_float(table, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const int32_t* pid = ids.data<int32_t>();  // (B, T)
    const Real* wte = table.data<Real>();      // (V, C)
    const Real* wpe = pos.defined() ? pos.data<Real>() : nullptr;  // (P, C)
    Real* po = out.data<Real>();               // (B, T, C)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const Real* tok = wte + static_cast<int64_t>(pid[b * T + t]) * C;
        Real* o = po + (b * T + t) * C;
        if (wpe != nullptr) {
          const Real* ps = wpe + t * C;
          for (int64_t c = 0; c < C; ++c) o[c] = tok[c] + ps[c];
        } else {
          std::copy(tok, tok + C, o);
        }
      }
    }
  });
}

void CpuBackend::embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable, Tensor& dpos) {
  const ops::EmbeddingDims d = ops::check_embedding(ids, dtable, dpos, dout, "embedding_backward", "dout");
  const int64_t B = d.B, T = d.T, V = d.V, C = d.C;
  check_id_range(ids, V);
  dispatch_float(dtable, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const int32_t* pid = ids.data<int32_t>();  // (B, T)
    const Real* pd = dout.data<Real>();        // (B, T, C)
    Real* dwte = dtable.data<Real>();          // (V, C)
    Real* dwpe = dpos.defined() ? dpos.data<Real>() : nullptr;  // (P, C); rows >= T untouched
    // Sequential in (b, t) order: a repeated id accumulates deterministically.
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const Real* g = pd + (b * T + t) * C;
        Real* dt = dwte + static_cast<int64_t>(pid[b * T + t]) * C;
        for (int64_t c = 0; c < C; ++c) dt[c] += g[c];
        if (dwpe != nullptr) {
          Real* dp = dwpe + t * C;
          for (int64_t c = 0; c < C; ++c) dp[c] += g[c];
        }
      }
    }
  });
}

void CpuBackend::embedding_slice(const Tensor& ids, const Tensor& table, int64_t first, int64_t vocab, Tensor& out) {
  const ops::EmbeddingDims d = ops::check_embedding_slice(ids, table, first, vocab, out, "embedding_slice", "out");
  const int64_t P = d.B * d.T, V = d.V, C = d.C;
  check_id_range(ids, vocab);
  dispatch_float(table, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const int32_t* pid = ids.data<int32_t>();  // (B, T)
    const Real* rows = table.data<Real>();     // (V, C): ids first .. first + V - 1
    Real* po = out.data<Real>();               // (B, T, C)
    for (int64_t p = 0; p < P; ++p) {
      const int64_t row = static_cast<int64_t>(pid[p]) - first;
      Real* o = po + p * C;
      if (row >= 0 && row < V) {
        std::copy(rows + row * C, rows + (row + 1) * C, o);
      } else {
        std::fill(o, o + C, Real(0));
      }
    }
  });
}

void CpuBackend::embedding_slice_backward(const Tensor& ids, const Tensor& dout, int64_t first, int64_t vocab,
                                          Tensor& dtable) {
  const ops::EmbeddingDims d =
      ops::check_embedding_slice(ids, dtable, first, vocab, dout, "embedding_slice_backward", "dout");
  const int64_t P = d.B * d.T, V = d.V, C = d.C;
  check_id_range(ids, vocab);
  dispatch_float(dtable, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const int32_t* pid = ids.data<int32_t>();
    const Real* pd = dout.data<Real>();
    Real* rows = dtable.data<Real>();
    // In position order, as embedding_backward: a repeated id accumulates deterministically.
    for (int64_t p = 0; p < P; ++p) {
      const int64_t row = static_cast<int64_t>(pid[p]) - first;
      if (row < 0 || row >= V) continue;
      const Real* g = pd + p * C;
      Real* dt = rows + row * C;
      for (int64_t c = 0; c < C; ++c) dt[c] += g[c];
    }
  });
}

// ---- Layer normalisation.

void CpuBackend::layernorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y,
                           Tensor& mean, Tensor& rstd) {
  const ops::RowDims d = ops::check_layernorm(x, gamma, beta, eps, y, mean, rstd);
  const int64_t R = d.R, C = d.C;
  dispatch_float(x, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* px = x.data<Real>();  // (R, C)
    const Real* g = gamma.data<Real>();
    const Real* bt = beta.data<Real>();
    Real* py = y.data<Real>();  // (R, C)
    Real* pm = mean.data<Real>();
    Real* pr = rstd.data<Real>();
    for (int64_t r = 0; r < R; ++r) {
      const Real* xr = px + r * C;
      // Two passes in double for the statistics; the normalisation then uses the
      // stored (rounded) mean and rstd, exactly as backward will.
      double sum = 0;
      for (int64_t c = 0; c < C; ++c) sum += xr[c];
      const double mu = sum / static_cast<double>(C);
      double var = 0;
      for (int64_t c = 0; c < C; ++c) var += (xr[c] - mu) * (xr[c] - mu);
      var /= static_cast<double>(C);
      const Real m = static_cast<Real>(mu), s = static_cast<Real>(1.0 / std::sqrt(var + eps));
      pm[r] = m;
      pr[r] = s;
      Real* yr = py + r * C;
      for (int64_t c = 0; c < C; ++c) yr[c] = (xr[c] - m) * s * g[c] + bt[c];
    }
  });
}

void CpuBackend::layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                    const Tensor& rstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
  const ops::RowDims d = ops::check_layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
  const int64_t R = d.R, C = d.C;
  dispatch_float(x, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* pdy = dy.data<Real>();  // (R, C)
    const Real* px = x.data<Real>();    // (R, C)
    const Real* g = gamma.data<Real>();
    const Real* pm = mean.data<Real>();
    const Real* pr = rstd.data<Real>();
    Real* pdx = dx.data<Real>();  // (R, C)
    std::vector<double> dg(C, 0.0), db(C, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const Real* xr = px + r * C;
      const Real* dyr = pdy + r * C;
      const Real m = pm[r], s = pr[r];
      // a = mean_c(dy * gamma), b = mean_c(dy * gamma * xhat)
      double a = 0, b = 0;
      for (int64_t c = 0; c < C; ++c) {
        const Real xhat = (xr[c] - m) * s;
        const Real dyg = dyr[c] * g[c];
        a += dyg;
        b += dyg * xhat;
      }
      const Real ma = static_cast<Real>(a / static_cast<double>(C));
      const Real mb = static_cast<Real>(b / static_cast<double>(C));
      Real* dxr = pdx + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const Real xhat = (xr[c] - m) * s;
        const Real d = dyr[c];
        dg[c] += d * xhat;
        db[c] += d;
        dxr[c] = s * (d * g[c] - ma - xhat * mb);
      }
    }
    Real* pdg = dgamma.data<Real>();
    Real* pdb = dbeta.data<Real>();
    for (int64_t c = 0; c < C; ++c) {
      pdg[c] += static_cast<Real>(dg[c]);
      pdb[c] += static_cast<Real>(db[c]);
    }
  });
}

// ---- Causal self-attention. Per (batch, head), q, k and v are strided views into
// qkv with leading dimension 3C, so no head is ever copied out:
//
//   qkv row t:  [ q_h0 q_h1 ... | k_h0 k_h1 ... | v_h0 v_h1 ... ]   (3C)
//                 ^ q + h D       ^ q + C + h D   ^ q + 2C + h D
//
// The product q k^T is computed over the full (T, T) and the upper triangle is then
// overwritten with zeros: one BLAS call beats T row-sized ones at these sizes.

namespace {

// One (batch, head) of causal attention, shared by attention() and the fused path so
// that both compute the same bits: q, k, v (T, D) at leading dimension ld (the fused
// operand's 3C), p (T, T) receives the probabilities (masked entries 0); out (T, D) at
// ldo = p v, skipped when null (a recompute); lse (T), when not null, receives each
// row's log-sum-exp of the scaled scores, max + log(sum), from the softmax's own terms.
template <typename Real>
void attention_head(const Real* q, const Real* k, const Real* v, int ld, int64_t T, int64_t D, double scale, Real* p,
                    Real* out, int ldo, float* lse) {
  const int iT = static_cast<int>(T), iD = static_cast<int>(D);
  gemm(false, true, iT, iT, iD, scale, q, ld, k, ld, 0.0, p, iT);  // scores = q k^T / sqrt(D)
  for (int64_t t = 0; t < T; ++t) {
    Real* row = p + t * T;
    Real mx = row[0];
    for (int64_t s = 1; s <= t; ++s) mx = std::max(mx, row[s]);
    Real sum = 0;
    for (int64_t s = 0; s <= t; ++s) {
      row[s] = std::exp(row[s] - mx);
      sum += row[s];
    }
    const Real inv = Real(1) / sum;
    for (int64_t s = 0; s <= t; ++s) row[s] *= inv;
    std::fill(row + t + 1, row + T, Real(0));  // the causal mask
    if (lse != nullptr) lse[t] = static_cast<float>(static_cast<double>(mx) + std::log(static_cast<double>(sum)));
  }
  // out (T, D), ld ldo = probs (T, T) @ v (T, D)
  if (out != nullptr) gemm(false, false, iT, iD, iT, 1.0, p, iT, v, ld, 0.0, out, ldo);
}

// Its backward from the probabilities p (T, T): dq, dk, dv (T, D) at ld, overwritten;
// go (T, D) at ldo is the output's gradient; ds (T, T) is scratch.
template <typename Real>
void attention_head_backward(const Real* q, const Real* k, const Real* v, int ld, const Real* p, const Real* go,
                             int ldo, int64_t T, int64_t D, double scale, Real* dq, Real* dk, Real* dv, Real* ds) {
  const int iT = static_cast<int>(T), iD = static_cast<int>(D);
  gemm(false, true, iT, iT, iD, 1.0, go, ldo, v, ld, 0.0, ds, iT);  // dprobs = dout v^T
  // Softmax Jacobian per row: dscore_s = p_s (dprob_s - sum_s' p_s' dprob_s');
  // masked entries have p = 0 and get exactly 0.
  for (int64_t t = 0; t < T; ++t) {
    const Real* pr = p + t * T;
    Real* dr = ds + t * T;
    Real dot = 0;
    for (int64_t s = 0; s <= t; ++s) dot += pr[s] * dr[s];
    for (int64_t s = 0; s <= t; ++s) dr[s] = pr[s] * (dr[s] - dot);
    std::fill(dr + t + 1, dr + T, Real(0));
  }
  // scores = scale q k^T, so dq = scale ds k and dk = scale ds^T q.
  gemm(false, false, iT, iD, iT, scale, ds, iT, k, ld, 0.0, dq, ld);
  gemm(true, false, iT, iD, iT, scale, ds, iT, q, ld, 0.0, dk, ld);
  gemm(true, false, iT, iD, iT, 1.0, p, iT, go, ldo, 0.0, dv, ld);  // dv = probs^T dout
}

}  // namespace

void CpuBackend::attention(const Tensor& qkv, int heads, Tensor& probs, Tensor& out) {
  const AttentionDims d = ops::check_attention_forward(qkv, heads, probs, out);
  check_attention_blas_dims(qkv, "attention");
  const int64_t B = d.B, T = d.T, C = d.C, H = d.H, D = d.D;
  if (B == 0 || T == 0) return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int ld = static_cast<int>(3 * C), ldo = static_cast<int>(C);
  dispatch_float(qkv, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* pqkv = qkv.data<Real>();  // (B, T, 3C)
    Real* pp = probs.data<Real>();        // (B, H, T, T)
    Real* po = out.data<Real>();          // (B, T, C)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const Real* q = pqkv + b * T * 3 * C + h * D;  // (T, D), ld 3C
        attention_head(q, q + C, q + 2 * C, ld, T, D, scale, pp + (b * H + h) * T * T, po + b * T * C + h * D, ldo,
                       static_cast<float*>(nullptr));
      }
    }
  });
}

void CpuBackend::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs, int heads,
                                    Tensor& dqkv) {
  const AttentionDims d = ops::check_attention_backward(dout, qkv, probs, heads, dqkv);
  check_attention_blas_dims(qkv, "attention_backward");
  const int64_t B = d.B, T = d.T, C = d.C, H = d.H, D = d.D;
  if (B == 0 || T == 0) return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int ld = static_cast<int>(3 * C), ldo = static_cast<int>(C);
  dispatch_float(qkv, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* pqkv = qkv.data<Real>();  // (B, T, 3C)
    const Real* pp = probs.data<Real>();  // (B, H, T, T)
    const Real* pdo = dout.data<Real>();  // (B, T, C)
    Real* pdq = dqkv.data<Real>();        // (B, T, 3C)
    std::vector<Real> ds(T * T);          // (T, T): dprobs, then dscores in place
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = b * T * 3 * C + h * D;
        const Real* q = pqkv + off;  // (T, D), ld 3C
        Real* dq = pdq + off;
        attention_head_backward(q, q + C, q + 2 * C, ld, pp + (b * H + h) * T * T, pdo + b * T * C + h * D, ldo, T,
                                D, scale, dq, dq + C, dq + 2 * C, ds.data());
      }
    }
  });
}

// ---- Fused attention on the CPU (float32, float64): what a flash kernel keeps (the
// output and one log-sum-exp per row and head), computed by the exact path's own
// per-head code on the fused operand, so that the output and the gradients are those
// of pack_qkv then attention bit for bit. The backward recomputes each head's
// probabilities (the same bits as the forward's) in a (T, T) scratch; nothing of
// (B, H, T, T) is kept between the two. Key and value heads are repeated only in a
// temporary (B, T, 3C) operand, which is freed when the op returns.

namespace {

void check_fused_like(const Tensor& t, const Shape& shape, DType dtype, const char* what, const char* op) {
  if (t.shape() != shape || t.dtype() != dtype || !t.is_contiguous()) {
    throw Error(std::string(op) + ": " + what + " " + t.str() + " must be contiguous " + shape_str(shape) + " of " +
                dtype_name(dtype));
  }
}

// What both directions start from: the fused operand (B, T, 3C) with the key/value heads
// repeated, as the exact path packs it (pack_qkv checks q, k and v), and its sizes;
// `out` and `stats` checked against them.
struct FusedOperand {
  Tensor qkv;
  int64_t B = 0, T = 0, C = 0, H = 0, D = 0;
};

FusedOperand pack_fused(Backend& be, const Tensor& q, const Tensor& k, const Tensor& v, int heads, const Tensor& out,
                        const Tensor& stats, const char* op) {
  FusedOperand f;
  if (q.dim() == 3) f.B = q.size(0), f.T = q.size(1), f.C = q.size(2);
  f.qkv = be.empty({f.B, f.T, 3 * f.C}, q.dtype());
  be.pack_qkv(q, k, v, heads, f.qkv);
  f.H = heads;
  f.D = f.C / f.H;
  check_fused_like(out, q.shape(), q.dtype(), "out", op);
  check_fused_like(stats, {f.B, f.H, f.T}, DType::kF32, "stats", op);
  check_attention_blas_dims(f.qkv, op);
  return f;
}

}  // namespace

bool CpuBackend::has_fused_attention(DType t, const AttentionSizes& dims) {
  return cpu_fused_attention_available(t) && dims.heads > 0 && dims.kv_heads > 0 && dims.heads % dims.kv_heads == 0;
}

void CpuBackend::fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, int heads, Tensor& out,
                                 Tensor& stats) {
  if (!cpu_fused_attention_available(q.dtype())) Backend::fused_attention(q, k, v, heads, out, stats);  // says none
  const FusedOperand f = pack_fused(*this, q, k, v, heads, out, stats, "fused_attention");
  const Tensor& qkv = f.qkv;
  const int64_t B = f.B, T = f.T, C = f.C, H = f.H, D = f.D;
  if (B == 0 || T == 0) return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int ld = static_cast<int>(3 * C), ldo = static_cast<int>(C);
  dispatch_float(qkv, [&](auto* tag) {
    using Real = std::remove_pointer_t<decltype(tag)>;
    const Real* pqkv = qkv.data<Real>();  // (B, T, 3C)
    Real* po = out.data<Real>();          // (B, T, C)
    float* pl = stats.data<float>();      // (B, H, T)
    std::vector<Real> p(T * T);           // (T, T): one head's probabilities
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const Real* qh = pqkv + b * T * 3 * C + h * D;  // (T, D), ld 3C
        attention_head(qh, qh + C, qh + 2 * C, ld, T, D, scale, p.data(), po + b * T * C + h * D, ldo,
                       pl + (b * H + h) * T);
      }
    }
  });
}

void CpuBackend::fused_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const Tensor& stats, int heads, Tensor& dq, Tensor& dk,
                                          Tensor& dv) {
  if (!cpu_fused_attention_available(q.dtype())) {
    Backend::fused_attention_backward(dout, q, k, v, out, stats, heads, dq, dk, dv);  // says none
  }
  const char* op = "fused_attention_backward";
  const FusedOperand f = pack_fused(*this, q, k, v, heads, out, stats, op);  // as the forward packed it
  const Tensor& qkv = f.qkv;
  const int64_t B = f.B, T = f.T, C = f.C, H = f.H, D = f.D;
  check_fused_like(dout, q.shape(), q.dtype(), "dout", op);
  Tensor dqkv = empty(qkv.shape(), q.dtype());  // (B, T, 3C)
  if (B > 0 && T > 0) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const int ld = static_cast<int>(3 * C), ldo = static_cast<int>(C);
    dispatch_float(qkv, [&](auto* tag) {
      using Real = std::remove_pointer_t<decltype(tag)>;
      const Real* pqkv = qkv.data<Real>();  // (B, T, 3C)
      const Real* pdo = dout.data<Real>();  // (B, T, C)
      Real* pdq = dqkv.data<Real>();        // (B, T, 3C)
      std::vector<Real> p(T * T), ds(T * T);  // (T, T): the recomputed probabilities; dscores
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t off = b * T * 3 * C + h * D;
          const Real* qh = pqkv + off;  // (T, D), ld 3C
          attention_head(qh, qh + C, qh + 2 * C, ld, T, D, scale, p.data(), static_cast<Real*>(nullptr), ldo,
                         static_cast<float*>(nullptr));
          Real* dqh = pdq + off;
          attention_head_backward(qh, qh + C, qh + 2 * C, ld, p.data(), pdo + b * T * C + h * D, ldo, T, D, scale,
                                  dqh, dqh + C, dqh + 2 * C, ds.data());
        }
      }
    });
  }
  pack_qkv_backward(dqkv, heads, dq, dk, dv);  // each key/value head's group summed; checks dq, dk, dv
}

// ---- Dropout.

void CpuBackend::dropout(const Tensor& x, double p, const DropoutKey& key, int64_t sample_offset,
                         int64_t element_offset, Tensor& y) {
  dropout_impl(x, p, key, sample_offset, element_offset, y, "dropout");
}

void CpuBackend::dropout_backward(const Tensor& dy, double p, const DropoutKey& key, int64_t sample_offset,
                                  int64_t element_offset, Tensor& dx) {
  dropout_impl(dy, p, key, sample_offset, element_offset, dx, "dropout_backward");
}

}  // namespace gpipe
