// The float32 matrix products of the MLP and transformer configs, timed on one thread
// with each candidate library, interleaved in one run: which one the CPU backend should
// call for which shape (issue 21). Prints GFLOP/s (2 m n k per call), the median of
// --repeats timings of about --ms milliseconds each, and checks every library's result
// against OpenBLAS's.
//
//   bazel build //bench:gemm_bench && bazel-bin/bench/gemm_bench [--repeats 7] [--ms 40]
//   with libxsmm: bazel build --define=gpipe_libxsmm=1 //bench:gemm_bench
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

#ifdef GPIPE_WITH_LIBXSMM
#include <libxsmm.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;
using dnnl::memory;

// One product as the layers issue it: row-major C (m x n) = op(A) op(B) + beta C, with
// leading dimensions as the layers pass them. `weight`: B is a Linear weight (the same
// tensor on every call until the optimizer step), so a packed copy can be reused.
struct Shape {
  std::string name;
  int m, n, k;
  bool ta, tb;
  int lda, ldb, ldc;
  float beta;
  bool weight;
};

Shape linear_fwd(const std::string& name, int rows, int in, int out) {  // y = x W^T
  return {name + " fwd  X W^T", rows, out, in, false, true, in, in, out, 0.f, true};
}
Shape linear_dx(const std::string& name, int rows, int in, int out) {  // dx = dy W
  return {name + " dX   dY W", rows, in, out, false, false, out, in, in, 0.f, true};
}
Shape linear_dw(const std::string& name, int rows, int in, int out) {  // dW += dy^T x
  return {name + " dW   dY^T X", out, in, rows, true, false, out, in, in, 1.f, false};
}

std::vector<Shape> shapes() {
  std::vector<Shape> s;
  // configs/mlp.yaml-like: 16 x Linear(1024 -> 1024), batch 256 in M = 8 micro-batches.
  s.push_back(linear_fwd("mlp 1024x1024 r32", 32, 1024, 1024));
  s.push_back(linear_dx("mlp 1024x1024 r32", 32, 1024, 1024));
  s.push_back(linear_dw("mlp 1024x1024 r32", 32, 1024, 1024));
  // configs/gpt.yaml-like: hidden 256, MLP ratio 4, 4 heads, T = 128, a micro-batch of
  // 4 sequences = 512 rows. The attention's q k v projection (256 -> 768), its output
  // projection and the head (256 -> 256), the MLP (256 -> 1024 -> 256).
  const int R = 512;
  for (auto [in, out] : std::vector<std::pair<int, int>>{{256, 768}, {256, 256}, {256, 1024}, {1024, 256}}) {
    const std::string n = "gpt " + std::to_string(in) + "->" + std::to_string(out) + " r512";
    s.push_back(linear_fwd(n, R, in, out));
    s.push_back(linear_dx(n, R, in, out));
    s.push_back(linear_dw(n, R, in, out));
  }
  // Attention per (sequence, head): T = 128, D = 64, q k v read from the (T, 3C) qkv
  // rows (ld 768), the output written into (T, C) rows (ld 256); cpu_transformer_ops.cc.
  const int T = 128, D = 64, ld = 768, C = 256;
  s.push_back({"attn q K^T (TxTxD)", T, T, D, false, true, ld, ld, T, 0.f, false});
  s.push_back({"attn P V   (TxDxT)", T, D, T, false, false, T, ld, C, 0.f, false});
  s.push_back({"attn dO V^T(TxTxD)", T, T, D, false, true, C, ld, T, 0.f, false});
  s.push_back({"attn dS K  (TxDxT)", T, D, T, false, false, T, ld, ld, 0.f, false});
  s.push_back({"attn dS^T Q(TxDxT)", T, D, T, true, false, T, ld, ld, 0.f, false});
  // The issue's own measurements: thicker MLP micro-batches and 32 x 768 x 256.
  for (int rows : {64, 128, 256}) {
    s.push_back(linear_fwd("mlp 1024x1024 r" + std::to_string(rows), rows, 1024, 1024));
  }
  s.push_back(linear_fwd("issue 32x768x256", 32, 256, 768));
  return s;
}

// Buffers of one shape, filled with fixed pseudo-random values.
struct Buffers {
  std::vector<float> a, b, c, c0;
  explicit Buffers(const Shape& s) {
    const size_t a_rows = s.ta ? s.k : s.m, b_rows = s.tb ? s.n : s.k;
    a.resize(a_rows * s.lda);
    b.resize(b_rows * s.ldb);
    c.resize(static_cast<size_t>(s.m) * s.ldc);
    std::mt19937 g(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto& x : a) x = u(g);
    for (auto& x : b) x = u(g);
    for (auto& x : c) x = u(g);
    c0 = c;
  }
};

memory::desc plain(int rows, int cols, bool trans, int ld) {
  // The logical (rows x cols) operand stored row-major, or transposed (cols x rows).
  return memory::desc({rows, cols}, memory::data_type::f32, trans ? memory::dims{1, ld} : memory::dims{ld, 1});
}

// oneDNN's matmul for one shape: a primitive with plain strided operands, and one whose
// B is in the layout the primitive prefers (format any), filled by a reorder once.
struct DnnlMatmul {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul plain_prim, packed_prim;
  memory::desc a_md, b_md, c_md, packed_md;
  memory packed_b;
  bool packed_is_plain = false;

  DnnlMatmul(const Shape& s, float* b) {
    a_md = plain(s.m, s.k, s.ta, s.lda);
    b_md = plain(s.k, s.n, s.tb, s.ldb);
    c_md = plain(s.m, s.n, false, s.ldc);
    dnnl::primitive_attr attr;
    if (s.beta != 0.f) {
      dnnl::post_ops po;
      po.append_sum(s.beta);
      attr.set_post_ops(po);
    }
    plain_prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, eng));
    const memory::desc any({s.k, s.n}, memory::data_type::f32, memory::format_tag::any);
    auto pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, any, c_md), attr, eng);
    packed_md = pd.weights_desc();
    packed_is_plain = packed_md == b_md;
    packed_prim = dnnl::matmul(pd);
    packed_b = memory(packed_md, eng);
    (void)b;
  }
  // Reorders B into the packed layout; returns seconds.
  double pack(float* b) {
    memory src(b_md, eng, b);
    const auto t0 = Clock::now();
    dnnl::reorder(src, packed_b).execute(strm, src, packed_b);
    strm.wait();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  void run(bool packed, const float* a, float* b, float* c) {
    memory am(a_md, eng, const_cast<float*>(a)), cm(c_md, eng, c);
    if (packed) {
      packed_prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, packed_b}, {DNNL_ARG_DST, cm}});
    } else {
      memory bm(b_md, eng, b);
      plain_prim.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    }
    strm.wait();
  }
};

#ifdef GPIPE_WITH_LIBXSMM
// libxsmm's JIT kernel for the shape, column-major: row-major C = op(A) op(B) is
// column-major C^T = op(B)^T op(A)^T, so the operands swap. Null where libxsmm 1.17
// generates none (it has no kernel for a transposed A here).
libxsmm_smmfunction xsmm_kernel(const Shape& s) {
  if (s.tb) return nullptr;  // would be column-major trans-A: unsupported by its JIT
  const libxsmm_blasint m = s.n, n = s.m, k = s.k, lda = s.ldb, ldb = s.lda, ldc = s.ldc;
  const float alpha = 1.f, beta = s.beta;
  const int flags = s.ta ? LIBXSMM_GEMM_FLAG_TRANS_B : LIBXSMM_GEMM_FLAG_NONE;
  return libxsmm_smmdispatch(m, n, k, &lda, &ldb, &ldc, &alpha, &beta, &flags, nullptr);
}
#endif

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double max_rel_diff(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(got[i]) - want[i]));
    den = std::max(den, std::fabs(static_cast<double>(want[i])));
  }
  return num / std::max(den, 1e-30);
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 7;
  double ms = 40;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--ms")) ms = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: gemm_bench [--repeats N] [--ms MS per timing]\n");
      return 2;
    }
  }
  // One thread everywhere: OpenBLAS's pool, and the OpenMP team oneDNN opens.
  openblas_set_num_threads(1);
  omp_set_num_threads(1);
#ifdef GPIPE_WITH_LIBXSMM
  libxsmm_init();
#endif

  const std::vector<Shape> ss = shapes();
  enum Lib { kOpenblas, kDnnlPlain, kDnnlPacked, kDnnlSgemm, kXsmm, kLibs };
  const char* lib_names[kLibs] = {"openblas", "dnnl mm", "dnnl packed", "dnnl_sgemm", "libxsmm"};
  std::vector<Buffers> bufs;
  std::vector<std::unique_ptr<DnnlMatmul>> mms;
  std::vector<std::vector<double>> pack_s(ss.size());
  std::vector<std::function<void()>> calls[kLibs];
  for (const Shape& s : ss) bufs.emplace_back(s);
  for (size_t i = 0; i < ss.size(); ++i) {
    const Shape& s = ss[i];
    Buffers& b = bufs[i];
    mms.push_back(std::make_unique<DnnlMatmul>(s, b.b.data()));
    DnnlMatmul* mm = mms.back().get();
    mm->pack(b.b.data());
    calls[kOpenblas].push_back([&s, &b] {
      cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k,
                  1.f, b.a.data(), s.lda, b.b.data(), s.ldb, s.beta, b.c.data(), s.ldc);
    });
    calls[kDnnlPlain].push_back([mm, &b] { mm->run(false, b.a.data(), b.b.data(), b.c.data()); });
    calls[kDnnlPacked].push_back([mm, &b] { mm->run(true, b.a.data(), b.b.data(), b.c.data()); });
    calls[kDnnlSgemm].push_back([&s, &b] {
      dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.m, s.n, s.k, 1.f, b.a.data(), s.lda, b.b.data(), s.ldb,
                 s.beta, b.c.data(), s.ldc);
    });
#ifdef GPIPE_WITH_LIBXSMM
    libxsmm_smmfunction kern = xsmm_kernel(s);
    calls[kXsmm].push_back(kern == nullptr ? std::function<void()>() : [kern, &b] {
      kern(b.b.data(), b.a.data(), b.c.data());
    });
#else
    calls[kXsmm].push_back(nullptr);
#endif
  }

  // Correctness first: every library against OpenBLAS, from the same C.
  std::vector<std::vector<double>> err(ss.size(), std::vector<double>(kLibs, 0));
  for (size_t i = 0; i < ss.size(); ++i) {
    Buffers& b = bufs[i];
    b.c = b.c0;
    calls[kOpenblas][i]();
    const std::vector<float> want = b.c;
    for (int l = 1; l < kLibs; ++l) {
      if (!calls[l][i]) continue;
      b.c = b.c0;
      calls[l][i]();
      err[i][l] = max_rel_diff(b.c, want);
    }
  }

  // Calls per timing, so that each lasts about `ms` (from one OpenBLAS warm-up timing).
  std::vector<int> iters(ss.size());
  for (size_t i = 0; i < ss.size(); ++i) {
    for (int l = 0; l < kLibs; ++l) {
      if (calls[l][i]) calls[l][i]();  // warm-up: JIT, first-touch, OpenMP team
    }
    const auto t0 = Clock::now();
    for (int r = 0; r < 3; ++r) calls[kOpenblas][i]();
    const double one = std::chrono::duration<double>(Clock::now() - t0).count() / 3;
    iters[i] = std::max(1, static_cast<int>(ms * 1e-3 / one));
  }
  // Interleaved: each repeat times every (shape, library) once, so a drift of the
  // machine's speed hits all libraries alike.
  std::vector<std::vector<std::vector<double>>> secs(ss.size(), std::vector<std::vector<double>>(kLibs));
  for (int r = 0; r < repeats; ++r) {
    for (size_t i = 0; i < ss.size(); ++i) {
      for (int l = 0; l < kLibs; ++l) {
        if (!calls[l][i]) continue;
        const auto t0 = Clock::now();
        for (int j = 0; j < iters[i]; ++j) calls[l][i]();
        secs[i][l].push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters[i]);
      }
      pack_s[i].push_back(mms[i]->pack(bufs[i].b.data()));
    }
  }

  std::printf("GFLOP/s, one thread, median of %d timings of ~%.0f ms each, interleaved; ratio = best oneDNN "
              "for the operand kind / OpenBLAS (packed only where B is a weight); pack = one reorder of B, in "
              "calls of the packed product\n\n",
              repeats, ms);
  std::printf("| shape | m x n x k | %s | %s | %s | %s | %s | best dnnl / openblas | pack | max rel diff |\n",
              lib_names[0], lib_names[1], lib_names[2], lib_names[3], lib_names[4]);
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < ss.size(); ++i) {
    const Shape& s = ss[i];
    const double flop = 2.0 * s.m * s.n * s.k;
    double g[kLibs];
    std::string cells;
    for (int l = 0; l < kLibs; ++l) {
      g[l] = secs[i][l].empty() ? 0 : flop / median(secs[i][l]) * 1e-9;
      char buf[32];
      if (g[l] == 0) std::snprintf(buf, sizeof buf, "n/a");
      else std::snprintf(buf, sizeof buf, "%.1f", g[l]);
      cells += std::string(" ") + buf + " |";
    }
    const double best = std::max({g[kDnnlPlain], g[kDnnlSgemm], s.weight ? g[kDnnlPacked] : 0.0});
    double worst_err = 0;
    for (int l = 1; l < kLibs; ++l) worst_err = std::max(worst_err, err[i][l]);
    std::printf("| %s%s | %dx%dx%d%s%s |%s %.2f | %.1f | %.1e |\n", s.name.c_str(), s.weight ? " (W)" : "", s.m, s.n,
                s.k, s.ta ? " ta" : "", s.tb ? " tb" : "", cells.c_str(), best / g[kOpenblas],
                median(pack_s[i]) / median(secs[i][kDnnlPacked]), worst_err);
  }
  std::printf("\nfloat64: oneDNN has no f64 matmul (nor a dnnl_dgemm), so float64 products stay on OpenBLAS.\n");
  return 0;
}
