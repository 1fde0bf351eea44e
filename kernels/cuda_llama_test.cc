// The LLaMA ops (rope, rope_backward, pack_qkv, pack_qkv_backward) and the fused ops of
// the LLaMA layers (rmsnorm, swiglu and their backward ops; axpy on 16-bit storage) on
// cuda:0 against the CPU reference, float32 and float64, in place where the op allows it. Built only with
// --config=cuda; without a GPU it prints the skip marker and passes.
#include "tests/gpu_testing.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/widening_backend.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::gpu_testing;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

TEST_CASE("rope and rope_backward match the CPU") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    const Tensor x = random_tensor({3, 37, 4 * 16}, dt, 1, -3, 3);
    Tensor want = cpu().empty(x.shape(), dt), host = cpu().empty(x.shape(), dt);
    cpu().rope(x, 4, 10000.0, want);
    Tensor gx = to_gpu(x);
    gpu().rope(gx, 4, 10000.0, gx);  // in place
    gpu().copy(gx, host);
    EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
    cpu().rope_backward(x, 4, 500.0, want);
    Tensor got = gpu().empty(x.shape(), dt);
    gpu().rope_backward(to_gpu(x), 4, 500.0, got);
    gpu().copy(got, host);
    EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
  }
}

TEST_CASE("pack_qkv and its backward match the CPU") {
  for (DType dt : kFloatTypes) {
    for (int64_t kv : {1, 2, 4}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(kv);
      const int64_t B = 2, T = 9, H = 4, D = 6;
      const Tensor q = random_tensor({B, T, H * D}, dt, 2), k = random_tensor({B, T, kv * D}, dt, 3),
                   v = random_tensor({B, T, kv * D}, dt, 4), g = random_tensor({B, T, 3 * H * D}, dt, 5);
      Tensor want = cpu().empty(g.shape(), dt), got = gpu().empty(g.shape(), dt), host = cpu().empty(g.shape(), dt);
      cpu().pack_qkv(q, k, v, H, want);
      gpu().pack_qkv(to_gpu(q), to_gpu(k), to_gpu(v), H, got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
      Tensor wq = cpu().empty(q.shape(), dt), wk = cpu().empty(k.shape(), dt), wv = cpu().empty(v.shape(), dt);
      Tensor gq = gpu().empty(q.shape(), dt), gk = gpu().empty(k.shape(), dt), gv = gpu().empty(v.shape(), dt);
      cpu().pack_qkv_backward(g, H, wq, wk, wv);
      gpu().pack_qkv_backward(to_gpu(g), H, gq, gk, gv);
      for (auto [gdev, w] : {std::pair<Tensor*, Tensor*>{&gq, &wq}, {&gk, &wk}, {&gv, &wv}}) {
        Tensor h = cpu().empty(w->shape(), dt);
        gpu().copy(*gdev, h);
        EXPECT_CLOSE_TOL(h, *w, elementwise_tol(dt));
      }
    }
  }
}

TEST_CASE("the CUDA LLaMA ops reject what the CPU rejects") {
  Tensor x = to_gpu(random_tensor({2, 3, 12}, DType::kF32, 6)), y = gpu().empty({2, 3, 12}, DType::kF32);
  CHECK_THROWS_WITH_AS(gpu().rope(x, 4, 10000.0, y), doctest::Contains("head width 3 (12 / 4 heads) is odd"),
                       UserError);
  CHECK_THROWS_WITH(gpu().rope(random_tensor({2, 3, 12}, DType::kF32, 7), 2, 10000.0, y),
                    doctest::Contains("is not on cuda:0"));
}

int main(int argc, char** argv) { return run_gpu_tests(argc, argv); }

// ---------------------------------------------------------------------------------
// The fused ops of the LLaMA layers (kernels/cuda_elementwise.cu) against the CPU reference,
// which composes them of generic ops (Backend::rmsnorm and the others).

namespace {

// Row shapes: one element, odd widths, a row wider than a block (4097 > 256 threads), no rows.
// {2, 4104}: 16-bit RMSNorm's threads take two or three chunks of eight; {2, 8}: one chunk, the
// rest of the block's warp idle.
const std::pair<int64_t, int64_t> kFusedRows[] = {{1, 1}, {3, 7}, {37, 1024}, {5, 4097}, {0, 8}, {2, 4104}, {2, 8}};

Tensor widened(const Tensor& t, DType to) {  // on the host
  Tensor out = cpu().empty(t.shape(), to);
  cpu().cast(t, out);
  return out;
}

}  // namespace

TEST_CASE("fused RMSNorm forward, input gradient and weight gradient match the CPU composition") {
  uint64_t seed = 40;
  for (DType dt : kFloatTypes) {
    for (auto [rows, cols] : kFusedRows) {
      CAPTURE(dtype_name(dt));
      CAPTURE(rows);
      CAPTURE(cols);
      const Tensor x = random_tensor({rows, cols}, dt, ++seed), g = random_tensor({cols}, dt, ++seed, 0.5, 1.5);
      const Tensor dy = random_tensor({rows, cols}, dt, ++seed), dg0 = random_tensor({cols}, dt, ++seed);
      Tensor y = cpu().empty(x.shape(), dt), rstd = cpu().empty({rows}, dt);
      cpu().rmsnorm(x, g, 1e-5, y, rstd);
      Tensor yg = gpu().empty(x.shape(), dt), rstdg = gpu().empty({rows}, dt);
      const Tensor xg = to_gpu(x), gg = to_gpu(g), dyg = to_gpu(dy);
      gpu().rmsnorm(xg, gg, 1e-5, yg, rstdg);
      EXPECT_CLOSE_TOL(rstdg, rstd, reduction_tol(dt, cols));
      EXPECT_CLOSE_TOL(yg, y, reduction_tol(dt, cols));

      Tensor dx = cpu().empty(x.shape(), dt), dxg = gpu().empty(x.shape(), dt);
      cpu().rmsnorm_backward(dy, x, g, rstd, dx);
      gpu().rmsnorm_backward(dyg, xg, gg, rstdg, dxg);
      EXPECT_CLOSE_TOL(dxg, dx, reduction_tol(dt, cols));
      // With the residual's gradient added in the kernel (rmsnorm_backward_add).
      const Tensor res = random_tensor({rows, cols}, dt, 7000 + seed);
      Tensor dxa = cpu().empty(x.shape(), dt), dxag = gpu().empty(x.shape(), dt);
      cpu().rmsnorm_backward_add(dy, x, g, rstd, res, dxa);
      gpu().rmsnorm_backward_add(dyg, xg, gg, rstdg, to_gpu(res), dxag);
      EXPECT_CLOSE_TOL(dxag, dxa, reduction_tol(dt, cols));

      Tensor dg = clone(dg0), dgg = to_gpu(dg0);  // accumulated into
      cpu().rmsnorm_weight_grad(dy, x, rstd, dg);
      gpu().rmsnorm_weight_grad(dyg, xg, rstdg, dgg);
      EXPECT_CLOSE_TOL(dgg, dg, reduction_tol(dt, rows));
    }
  }
}

TEST_CASE("fused SwiGLU gate and its backward match the CPU composition, in place too") {
  uint64_t seed = 60;
  for (DType dt : kFloatTypes) {
    for (auto [rows, cols] : kFusedRows) {
      CAPTURE(dtype_name(dt));
      CAPTURE(cols);
      const Tensor a = random_tensor({rows, cols}, dt, ++seed, -6, 6), b = random_tensor({rows, cols}, dt, ++seed);
      const Tensor dy = random_tensor({rows, cols}, dt, ++seed);
      Tensor y = cpu().empty(a.shape(), dt);
      cpu().swiglu(a, b, y);
      Tensor ag = to_gpu(a), bg = to_gpu(b), yg = gpu().empty(a.shape(), dt);
      gpu().swiglu(ag, bg, yg);
      EXPECT_CLOSE_TOL(yg, y, elementwise_tol(dt));
      Tensor da = cpu().empty(a.shape(), dt), db = cpu().empty(a.shape(), dt);
      Tensor dag = gpu().empty(a.shape(), dt), dbg = gpu().empty(a.shape(), dt);
      cpu().swiglu_backward(dy, a, b, da, db);
      gpu().swiglu_backward(to_gpu(dy), ag, bg, dag, dbg);
      EXPECT_CLOSE_TOL(dag, da, elementwise_tol(dt));
      EXPECT_CLOSE_TOL(dbg, db, elementwise_tol(dt));
      gpu().swiglu(ag, bg, ag);  // y may alias a
      EXPECT_CLOSE_TOL(ag, y, elementwise_tol(dt));
    }
  }
}

// 16-bit storage: the GPU computes in float32 and rounds once, so it stays within a unit
// of the 16-bit type's rounding of the exact (float64) result on the same inputs, where
// the widening CPU reference rounds every intermediate.
TEST_CASE("fused ops, axpy, rope and embedding on bfloat16 and float16 round as their references do") {
  uint64_t seed = 80;
  for (DType t : {DType::kBF16, DType::kF16}) {
    CAPTURE(dtype_name(t));
    const double unit = std::ldexp(1.0, t == DType::kBF16 ? -8 : -11);
    const Tol once{2 * unit, 1e-6};  // a unit of rounding, and float32's arithmetic
    for (auto [rows, cols] : kFusedRows) {
      CAPTURE(rows);
      CAPTURE(cols);
      const Tensor x = random_tensor({rows, cols}, t, ++seed), g = random_tensor({cols}, t, ++seed, 0.5, 1.5);
      const Tensor dy = random_tensor({rows, cols}, t, ++seed);
      const Tensor x64 = widened(x, DType::kF64), g64 = widened(g, DType::kF64), dy64 = widened(dy, DType::kF64);
      Tensor y64 = cpu().empty(x.shape(), DType::kF64), rstd64 = cpu().empty({rows}, DType::kF64);
      cpu().rmsnorm(x64, g64, 1e-5, y64, rstd64);
      Tensor yg = gpu().empty(x.shape(), t), rstdg = gpu().empty({rows}, DType::kF32);
      const Tensor xg = to_gpu(x), gg = to_gpu(g), dyg = to_gpu(dy);
      gpu().rmsnorm(xg, gg, 1e-5, yg, rstdg);
      EXPECT_CLOSE_TOL(rstdg, rstd64, (Tol{1e-6, 0}));
      EXPECT_CLOSE_TOL(yg, y64, once);
      // The input gradient subtracts two terms of the size of gdy: its float32 error is
      // relative to them, not to the difference.
      Tensor dx64 = cpu().empty(x.shape(), DType::kF64), dxg = gpu().empty(x.shape(), t);
      cpu().rmsnorm_backward(dy64, x64, g64, rstd64, dx64);
      gpu().rmsnorm_backward(dyg, xg, gg, rstdg, dxg);
      EXPECT_CLOSE_TOL(dxg, dx64, (Tol{2 * unit, 1e-5}));
      // The residual's gradient (here x) added before the one rounding.
      Tensor dxa64 = clone(dx64), dxag = gpu().empty(x.shape(), t);
      cpu().axpy(1.0, x64, dxa64);
      gpu().rmsnorm_backward_add(dyg, xg, gg, rstdg, xg, dxag);
      EXPECT_CLOSE_TOL(dxag, dxa64, (Tol{2 * unit, 1e-5}));
      Tensor dg64 = cpu().zeros({cols}, DType::kF64), dgg = gpu().zeros({cols}, DType::kF32);
      cpu().rmsnorm_weight_grad(dy64, x64, rstd64, dg64);
      gpu().rmsnorm_weight_grad(dyg, xg, rstdg, dgg);
      EXPECT_CLOSE_TOL(dgg, dg64, reduction_tol(DType::kF32, rows));

      const Tensor a = random_tensor({rows, cols}, t, ++seed, -6, 6), b = random_tensor({rows, cols}, t, ++seed);
      const Tensor a64 = widened(a, DType::kF64), b64 = widened(b, DType::kF64);
      Tensor s64 = cpu().empty(a.shape(), DType::kF64), sg = gpu().empty(a.shape(), t);
      cpu().swiglu(a64, b64, s64);
      gpu().swiglu(to_gpu(a), to_gpu(b), sg);
      EXPECT_CLOSE_TOL(sg, s64, once);
      Tensor da64 = cpu().empty(a.shape(), DType::kF64), db64 = cpu().empty(a.shape(), DType::kF64);
      Tensor dag = gpu().empty(a.shape(), t), dbg = gpu().empty(a.shape(), t);
      cpu().swiglu_backward(dy64, a64, b64, da64, db64);
      gpu().swiglu_backward(dyg, to_gpu(a), to_gpu(b), dag, dbg);
      EXPECT_CLOSE_TOL(dag, da64, once);
      EXPECT_CLOSE_TOL(dbg, db64, once);

      // The residual add: y + alpha x.
      Tensor r64 = clone(x64), rg = to_gpu(x);
      cpu().axpy(-0.75, dy64, r64);
      gpu().axpy(-0.75, dyg, rg);
      EXPECT_CLOSE_TOL(rg, r64, once);

      // RMSNorm takes a row's 16-bit elements eight a load where cols is a multiple of 8 and
      // every operand 16-byte aligned, and one at a time otherwise: operands one element into
      // their allocation give the same bits as the aligned ones above.
      if (rows > 0 && cols % 8 == 0) {
        auto shifted = [&](const Tensor& host) {  // host's values, on the GPU one element into an allocation
          Tensor all = to_gpu(random_tensor({host.numel() + 1}, t, 998));
          Tensor v = all.narrow_rows(1, host.numel()).reshape(host.shape());
          gpu().copy(to_gpu(host), v);
          return v;
        };
        Tensor xs = shifted(x), gs = shifted(g), ys = shifted(x), rstds = gpu().empty({rows}, DType::kF32);
        gpu().rmsnorm(xs, gs, 1e-5, ys, rstds);
        CHECK(to_doubles(ys) == to_doubles(yg));
        CHECK(to_doubles(rstds) == to_doubles(rstdg));
        Tensor dys = shifted(dy), dxs = shifted(x);
        gpu().rmsnorm_backward_add(dys, xs, gs, rstdg, xs, dxs);
        CHECK(to_doubles(dxs) == to_doubles(dxag));
        gpu().rmsnorm_backward(dys, xs, gs, rstdg, dxs);
        CHECK(to_doubles(dxs) == to_doubles(dxg));
        Tensor dx_res = gpu().empty(x.shape(), t);  // only the residual off alignment
        gpu().rmsnorm_backward_add(dyg, xg, gg, rstdg, xs, dx_res);
        CHECK(to_doubles(dx_res) == to_doubles(dxag));
      }

      // SwiGLU and the residual add take eight 16-bit elements a load where every operand is
      // 16-byte aligned, and one at a time otherwise: views one row into their allocation
      // (odd widths: 2-byte aligned) give the same bits as the aligned tensors above.
      if (rows > 0 && cols % 8 != 0) {
        auto view = [&](const Tensor& host) {  // host's rows, on the GPU one row into a larger allocation
          Tensor all = to_gpu(random_tensor({rows + 1, cols}, t, 999));
          Tensor v = all.narrow_rows(1, rows);
          gpu().copy(to_gpu(host), v);
          return v;
        };
        Tensor av = view(a), bv = view(b), dyv = view(dy), sv = view(a);
        gpu().swiglu(av, bv, sv);
        CHECK(to_doubles(sv) == to_doubles(sg));
        Tensor dav = view(a), dbv = view(b);
        gpu().swiglu_backward(dyv, av, bv, dav, dbv);
        CHECK(to_doubles(dav) == to_doubles(dag));
        CHECK(to_doubles(dbv) == to_doubles(dbg));
        Tensor rv = view(x);
        gpu().axpy(-0.75, dyv, rv);
        CHECK(to_doubles(rv) == to_doubles(rg));
      }
    }
    // rope on 16-bit storage: the widened CPU reference's rounding (float32, then the type),
    // so equal but where CUDA's cos and sin differ from glibc's in the last bit of a double.
    for (double sign : {1.0, -1.0}) {
      CAPTURE(sign);
      const Tensor x = random_tensor({3, 37, 4 * 16}, t, ++seed, -3, 3);
      Tensor want = cpu().empty(x.shape(), t);
      if (sign > 0) cpu().rope(x, 4, 10000.0, want);
      else cpu().rope_backward(x, 4, 10000.0, want);
      Tensor xg = to_gpu(x);
      if (sign > 0) gpu().rope(xg, 4, 10000.0, xg);  // in place
      else gpu().rope_backward(xg, 4, 10000.0, xg);
      EXPECT_CLOSE_TOL(xg, want, (Tol{2 * unit, 0}));
    }
    // The embedding of a 16-bit table: the row plus the position in float32, rounded once,
    // as the widened reference: equal bit for bit, with and without positions.
    for (bool with_pos : {true, false}) {
      CAPTURE(with_pos);
      const Tensor ids = testing::random_labels(2 * 9, 50, ++seed).reshape({2, 9});
      const Tensor table = random_tensor({50, 24}, t, ++seed);
      const Tensor pos = with_pos ? random_tensor({12, 24}, t, ++seed) : Tensor();
      Tensor want = cpu().empty({2, 9, 24}, t), got = gpu().empty({2, 9, 24}, t);
      cpu().embedding(ids, table, pos, want);
      gpu().embedding(to_gpu(ids), to_gpu(table), with_pos ? to_gpu(pos) : Tensor(), got);
      CHECK(testing::to_doubles(got) == testing::to_doubles(want));
    }
    Backend& bare = static_cast<WideningBackend&>(gpu()).inner();
    for (Backend::NarrowOp op : {Backend::NarrowOp::kAxpy, Backend::NarrowOp::kRmsNorm, Backend::NarrowOp::kSwiglu,
                                 Backend::NarrowOp::kRope, Backend::NarrowOp::kEmbedding}) {
      CHECK(bare.computes_narrow(op, t));
    }
  }
}

TEST_CASE("the fused ops reject operands that do not fit") {
  Tensor x = to_gpu(random_tensor({4, 6}, DType::kF32, 90)), y = gpu().empty({4, 6}, DType::kF32);
  Tensor g5 = gpu().empty({5}, DType::kF32), rstd = gpu().empty({4}, DType::kF32);
  CHECK_THROWS_WITH_AS(gpu().rmsnorm(x, g5, 1e-5, y, rstd), doctest::Contains("rmsnorm: g "), Error);
  Tensor g = gpu().empty({6}, DType::kF32), rstd3 = gpu().empty({3}, DType::kF32);
  CHECK_THROWS_WITH_AS(gpu().rmsnorm(x, g, 1e-5, y, rstd3), doctest::Contains("rmsnorm: rstd "), Error);
  Tensor y64 = gpu().empty({4, 6}, DType::kF64);
  CHECK_THROWS_AS(gpu().swiglu(x, x, y64), Error);
  CHECK_THROWS_WITH(gpu().swiglu(random_tensor({4, 6}, DType::kF32, 91), x, y), doctest::Contains("is not on cuda:0"));
}

// ---------------------------------------------------------------------------------
// Fused attention (cuDNN's SDPA, kernels/cuda_attention_ops.cc) against the exact path
// (pack_qkv, attention and their backward) on the CPU, in float64 on the same 16-bit
// inputs. Flash attention rounds the probabilities to the 16-bit type before its second
// product, so it stays within a few units of that type's rounding, not one.

namespace {

// log sum_{s <= t} exp(q_t . k_s / sqrt(D)) per (b, h, t), in float64, by its definition.
std::vector<double> log_sum_exp(const Tensor& q, const Tensor& k, int64_t H, int64_t KV) {
  const int64_t B = q.size(0), T = q.size(1), D = q.size(2) / H;
  const std::vector<double> qd = testing::to_doubles(q), kd = testing::to_doubles(k);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t j = h / (H / KV);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> scores;
        double top = -INFINITY;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += qd[(b * T + t) * H * D + h * D + d] * kd[(b * T + s) * KV * D + j * D + d];
          }
          scores.push_back(dot / std::sqrt(static_cast<double>(D)));
          top = std::max(top, scores.back());
        }
        double sum = 0;
        for (double x : scores) sum += std::exp(x - top);
        out.push_back(top + std::log(sum));
      }
    }
  }
  return out;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : testing::to_doubles(t)) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace

TEST_CASE("fused attention (cuDNN SDPA) equals the exact attention: output, log-sum-exp and gradients") {
  cudaDeviceProp prop{};
  REQUIRE(cudaGetDeviceProperties(&prop, kGpu.index) == cudaSuccess);
  if (!fused_attention_available(kGpu, DType::kBF16, 64) || prop.major < 8) {
    MESSAGE("no fused attention here: a build without cuDNN's frontend headers, GPIPE_FUSED_ATTENTION=0, or a GPU "
            "older than sm80 (cuDNN's SDPA needs Ampere or later)");
    return;
  }
  // Where it is built and the GPU has it, a refusal is a failure (its warning is in the log).
  REQUIRE(gpu().has_fused_attention(DType::kBF16, {2, 37, 4, 2, 64}));
  CHECK_FALSE(gpu().has_fused_attention(DType::kF32, {2, 37, 4, 2, 64}));  // float32 keeps the exact path
  CHECK_FALSE(gpu().has_fused_attention(DType::kBF16, {2, 37, 4, 2, 60}));  // head widths: multiples of 8
  CHECK_FALSE(gpu().has_fused_attention(DType::kBF16, {2, 37, 4, 3, 64}));  // kv heads must divide the heads
  CHECK(fused_attention_available(kGpu, DType::kBF16, 64));
  CHECK_FALSE(fused_attention_available(Device::cpu(), DType::kBF16, 64));
  uint64_t seed = 120;
  struct Case {
    int64_t B, T, H, KV, D;
  };
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (const Case& c : {Case{2, 37, 4, 2, 64}, Case{1, 128, 8, 8, 32}, Case{3, 5, 4, 1, 128}}) {
      CAPTURE(dtype_name(t));
      CAPTURE(c.T);
      CAPTURE(c.H);
      CAPTURE(c.KV);
      CAPTURE(c.D);
      const int H = static_cast<int>(c.H);
      REQUIRE(gpu().has_fused_attention(t, {c.B, c.T, c.H, c.KV, c.D}));  // builds both directions' graphs
      const Tensor q = random_tensor({c.B, c.T, c.H * c.D}, t, ++seed, -2, 2);
      const Tensor k = random_tensor({c.B, c.T, c.KV * c.D}, t, ++seed, -2, 2);
      const Tensor v = random_tensor({c.B, c.T, c.KV * c.D}, t, ++seed);
      const Tensor dout = random_tensor({c.B, c.T, c.H * c.D}, t, ++seed);
      // The exact path in float64 on the same values.
      const Tensor q64 = widened(q, DType::kF64), k64 = widened(k, DType::kF64), v64 = widened(v, DType::kF64);
      Tensor qkv = cpu().empty({c.B, c.T, 3 * c.H * c.D}, DType::kF64);
      cpu().pack_qkv(q64, k64, v64, H, qkv);
      Tensor probs = cpu().empty({c.B, c.H, c.T, c.T}, DType::kF64), out64 = cpu().empty(q.shape(), DType::kF64);
      cpu().attention(qkv, H, probs, out64);
      Tensor dqkv = cpu().empty(qkv.shape(), DType::kF64);
      cpu().attention_backward(widened(dout, DType::kF64), qkv, probs, H, dqkv);
      Tensor dq64 = cpu().empty(q.shape(), DType::kF64), dk64 = cpu().empty(k.shape(), DType::kF64),
             dv64 = cpu().empty(v.shape(), DType::kF64);
      cpu().pack_qkv_backward(dqkv, H, dq64, dk64, dv64);

      const Tensor qg = to_gpu(q), kg = to_gpu(k), vg = to_gpu(v);
      Tensor out = gpu().empty(q.shape(), t), stats = gpu().empty({c.B, c.H, c.T}, DType::kF32);
      gpu().fused_attention(qg, kg, vg, H, out, stats);
      const double unit = std::ldexp(1.0, t == DType::kBF16 ? -8 : -11);
      EXPECT_CLOSE_TOL(out, out64, (Tol{4 * unit, 4 * unit * max_abs(out64)}));
      EXPECT_CLOSE_TOL(stats, log_sum_exp(q, k, c.H, c.KV), (Tol{1e-5, 1e-4}));
      Tensor dq = gpu().empty(q.shape(), t), dk = gpu().empty(k.shape(), t), dv = gpu().empty(v.shape(), t);
      gpu().fused_attention_backward(to_gpu(dout), qg, kg, vg, out, stats, H, dq, dk, dv);
      EXPECT_CLOSE_TOL(dq, dq64, (Tol{8 * unit, 8 * unit * max_abs(dq64)}));
      EXPECT_CLOSE_TOL(dk, dk64, (Tol{8 * unit, 8 * unit * max_abs(dk64)}));
      EXPECT_CLOSE_TOL(dv, dv64, (Tol{8 * unit, 8 * unit * max_abs(dv64)}));
      // Deterministic: the same bits again.
      Tensor dq2 = gpu().empty(q.shape(), t), dk2 = gpu().empty(k.shape(), t), dv2 = gpu().empty(v.shape(), t);
      gpu().fused_attention_backward(to_gpu(dout), qg, kg, vg, out, stats, H, dq2, dk2, dv2);
      CHECK(testing::to_doubles(dq2) == testing::to_doubles(dq));
      CHECK(testing::to_doubles(dk2) == testing::to_doubles(dk));
    }
  }
  // A shape that does not fit is an error naming it, not a crash.
  Tensor q = gpu().empty({1, 4, 64}, DType::kBF16), k3 = gpu().empty({1, 4, 48}, DType::kBF16);
  Tensor out = gpu().empty({1, 4, 64}, DType::kBF16), stats = gpu().empty({1, 1, 4}, DType::kF32);
  CHECK_THROWS_WITH_AS(gpu().fused_attention(q, k3, k3, 1, out, stats), doctest::Contains("key/value heads"), Error);
}
