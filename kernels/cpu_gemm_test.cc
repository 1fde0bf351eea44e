// The float32 products through oneDNN (kernels/cpu_gemm.h) against OpenBLAS, both held
// to the rounding bound of a float32 dot product against the exact (float64) result;
// and the packed-weight copies: kept inside a FrozenWeights window, dropped when it ends.
//
// The bound: each element of C = alpha op(A) op(B) + beta C is a k-term dot product,
// scaled and added to beta C: k products and k - 1 sums, then alpha's and beta's
// roundings, in any order and with or without FMA, so |computed - exact| <=
// gamma_{k+2} (|alpha| sum_p |a_ip b_pj| + |beta c_ij|), gamma_n = n u / (1 - n u),
// u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). Each library is
// held to it, and so the two differ by at most twice it.
#include <doctest/doctest.h>

#include <cblas.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_blas.h"
#include "kernels/cpu_gemm.h"

using namespace gpipe;

namespace {

struct Case {
  int m, n, k;
  bool ta, tb;
  int pad;  // extra leading-dimension elements on every operand (strided rows)
  double alpha, beta;
};

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

// Runs the case through cpu_blas::gemm under `lib` and checks every element against the
// float64 product within the bound; returns the float32 result.
std::vector<float> check_case(const Case& c, cpu_blas::Library lib) {
  const int a_rows = c.ta ? c.k : c.m, a_cols = c.ta ? c.m : c.k;
  const int b_rows = c.tb ? c.n : c.k, b_cols = c.tb ? c.k : c.n;
  const int lda = a_cols + c.pad, ldb = b_cols + c.pad, ldc = c.n + c.pad;
  const std::vector<float> a = random_floats(static_cast<size_t>(a_rows) * lda, 1);
  const std::vector<float> b = random_floats(static_cast<size_t>(b_rows) * ldb, 2);
  const std::vector<float> c0 = random_floats(static_cast<size_t>(c.m) * ldc, 3);
  std::vector<float> out = c0;
  cpu_blas::set_library(lib);
  cpu_blas::gemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, out.data(), ldc);
  cpu_blas::set_library(cpu_blas::Library::kAuto);
  const double u = std::ldexp(1.0, -24), gamma = (c.k + 2) * u / (1 - (c.k + 2) * u);
  int bad = 0;
  for (int i = 0; i < c.m; ++i) {
    for (int j = 0; j < c.n; ++j) {
      double exact = 0, mag = 0;
      for (int p = 0; p < c.k; ++p) {
        const double x = a[c.ta ? p * lda + i : i * lda + p], y = b[c.tb ? j * ldb + p : p * ldb + j];
        exact += x * y;
        mag += std::fabs(x * y);
      }
      const double cij = c0[i * ldc + j];
      const double want = c.alpha * exact + c.beta * cij;
      const double bound = gamma * (std::fabs(c.alpha) * mag + std::fabs(c.beta * cij));
      if (std::fabs(out[i * ldc + j] - want) > bound && bad++ < 3) {
        FAIL_CHECK("C[" << i << "," << j << "] = " << out[i * ldc + j] << ", exact " << want << ", bound " << bound);
      }
    }
  }
  // The padding between rows is not touched.
  for (int i = 0; i < c.m; ++i) {
    for (int j = c.n; j < ldc; ++j) REQUIRE(out[i * ldc + j] == c0[i * ldc + j]);
  }
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // The layers' shapes (bench/gemm_bench.cc), as Linear and attention issue them.
  out.push_back({32, 1024, 1024, false, true, 0, 1, 0});   // MLP forward X W^T
  out.push_back({32, 1024, 1024, false, false, 0, 1, 0});  // MLP dX = dY W
  out.push_back({1024, 1024, 32, true, false, 0, 1, 1});   // MLP dW += dY^T X
  out.push_back({512, 768, 256, false, true, 0, 1, 0});    // transformer q k v projection
  out.push_back({512, 256, 1024, false, false, 0, 1, 0});  // transformer fc2's dX
  out.push_back({1024, 256, 512, true, false, 0, 1, 1});   // transformer fc1's dW
  out.push_back({128, 128, 64, false, true, 704, 0.125, 0});  // attention q K^T / sqrt(D), ld 768
  out.push_back({128, 64, 128, true, false, 640, 0.125, 0});  // attention dK = dS^T Q
  // Odd shapes, every transpose, the alpha and beta values the ops use and others.
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double alpha : {1.0, 0.5, -2.0}) {
        for (double beta : {0.0, 1.0, 0.25}) {
          out.push_back({7, 13, 5, ta, tb, 0, alpha, beta});
          out.push_back({7, 13, 5, ta, tb, 3, alpha, beta});
        }
      }
      out.push_back({1, 1, 1, ta, tb, 0, 1, 0});
      out.push_back({1, 1, 1, ta, tb, 2, -2, 1});
      out.push_back({33, 17, 129, ta, tb, 5, 1, 1});
    }
  }
  return out;
}

std::string name(const Case& c) {
  return std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) + (c.ta ? " ta" : "") +
         (c.tb ? " tb" : "") + " pad " + std::to_string(c.pad) + " alpha " + std::to_string(c.alpha) + " beta " +
         std::to_string(c.beta);
}

Tensor matrix(int rows, int cols, uint32_t seed) {
  const std::vector<float> v = random_floats(static_cast<size_t>(rows) * cols, seed);
  return Tensor::from_vector<float>(v, {rows, cols});
}

}  // namespace

TEST_CASE("oneDNN and OpenBLAS both stay within float32's rounding bound, and so within twice it of each other") {
  for (const Case& c : cases()) {
    CAPTURE(name(c));
    const std::vector<float> dnnl = check_case(c, cpu_blas::Library::kOnednn);
    const std::vector<float> blas = check_case(c, cpu_blas::Library::kOpenblas);
    CHECK(dnnl.size() == blas.size());
  }
}

TEST_CASE("GPIPE_GEMM's names, and a wrong one lists them") {
  CHECK(cpu_blas::parse_library("auto") == cpu_blas::Library::kAuto);
  CHECK(cpu_blas::parse_library("openblas") == cpu_blas::Library::kOpenblas);
  CHECK(cpu_blas::parse_library("onednn") == cpu_blas::Library::kOnednn);
  CHECK_THROWS_WITH(cpu_blas::parse_library("mkl"), doctest::Contains("use auto, openblas or onednn"));
}

// x (R, in) @ W^T and dy (R, out) @ W, as Linear calls them.
TEST_CASE("a packed weight serves only inside its window; a changed weight is read again in the next window") {
  Backend& be = backend_for(Device::cpu());
  cpu_blas::set_library(cpu_blas::Library::kOnednn);
  cpu_blas::set_always_pack(true);
  const int R = 8, in = 24, out = 40;
  Tensor x = matrix(R, in, 11), dy = matrix(R, out, 12), w = matrix(out, in, 13);
  auto forward = [&](Tensor& y) { be.matmul_weight(x, false, w, true, y); };
  auto input_grad = [&](Tensor& dx) { be.matmul_weight(dy, false, w, false, dx); };
  auto reference = [&](const Tensor& weight, Tensor& y, Tensor& dx) {
    cpu_blas::set_library(cpu_blas::Library::kOpenblas);
    be.matmul(x, false, weight, true, y);
    be.matmul(dy, false, weight, false, dx);
    cpu_blas::set_library(cpu_blas::Library::kOnednn);
  };
  Tensor y = be.empty({R, out}, DType::kF32), dx = be.empty({R, in}, DType::kF32);
  Tensor y_ref = be.empty({R, out}, DType::kF32), dx_ref = be.empty({R, in}, DType::kF32);
  auto close = [](const Tensor& got, const Tensor& want) {
    const auto g = got.to_vector<float>(), h = want.to_vector<float>();
    for (size_t i = 0; i < g.size(); ++i) {
      if (std::fabs(g[i] - h[i]) > 1e-5f * (1 + std::fabs(h[i]))) return false;
    }
    return true;
  };
  const Tensor w_before = matrix(out, in, 13);
  reference(w_before, y_ref, dx_ref);
  {
    FrozenWeights frozen;
    forward(y);
    input_grad(dx);
    CHECK(cpu_blas::packed_weights_held() == 2);  // W^T and W, one copy each
    CHECK(close(y, y_ref));
    CHECK(close(dx, dx_ref));
    forward(y);  // served from the copy: nothing new
    CHECK(cpu_blas::packed_weights_held() == 2);
    // Breaking the window's promise shows that the copy is what is read: the stale result.
    w.data<float>()[0] += 1.0f;
    forward(y);
    CHECK(close(y, y_ref));
    w.data<float>()[0] -= 1.0f;
  }
  CHECK(cpu_blas::packed_weights_held() == 0);

  // An optimizer step between windows: the next window reads the new values.
  Tensor grad = matrix(out, in, 14), momentum = be.zeros({out, in}, DType::kF32);
  SgdParams sgd;
  sgd.lr = 0.5;
  be.sgd_step(w, grad, momentum, sgd, true);
  reference(w, y_ref, dx_ref);
  CHECK_FALSE(close(y_ref, y));
  {
    FrozenWeights frozen;
    forward(y);
    input_grad(dx);
    CHECK(close(y, y_ref));
    CHECK(close(dx, dx_ref));
  }
  // A checkpoint load or a set (a copy into the parameter) between windows: the same.
  be.copy(matrix(out, in, 15), w);
  reference(w, y_ref, dx_ref);
  {
    FrozenWeights frozen;
    forward(y);
    input_grad(dx);
    CHECK(close(y, y_ref));
    CHECK(close(dx, dx_ref));
  }
  // Outside any window nothing is kept.
  forward(y);
  CHECK(cpu_blas::packed_weights_held() == 0);
  CHECK(close(y, y_ref));
  cpu_blas::set_always_pack(false);
  cpu_blas::set_library(cpu_blas::Library::kAuto);
}

// GPIPE_GEMM=auto takes a weight's product to oneDNN only at one thread a product: at
// more (or the libraries' default, all cores), oneDNN's OpenMP team and OpenBLAS's
// threads spin against each other (an MLP's step 53x as long at 2 threads on 2 cores;
// bench/RESULTS.md), and OpenBLAS takes every product. Packing forced, so that a product
// oneDNN takes keeps a copy on any CPU: the count of copies says which library ran.
TEST_CASE("auto: a weight's product goes to oneDNN only at one thread a product") {
  Backend& be = backend_for(Device::cpu());
  cpu_blas::set_library(cpu_blas::Library::kAuto);
  cpu_blas::set_always_pack(true);
  const Tensor x = matrix(8, 24, 21), w = matrix(40, 24, 22);
  Tensor y = be.empty({8, 40}, DType::kF32);
  for (int threads : {1, 2, 0, 1}) {
    CAPTURE(threads);
    set_cpu_blas_threads(threads);
    FrozenWeights frozen;
    be.matmul_weight(x, false, w, true, y);
    CHECK(cpu_blas::packed_weights_held() == (threads == 1 ? 1 : 0));
  }
  cpu_blas::set_always_pack(false);
}
