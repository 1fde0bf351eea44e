// The convolution ops of the reference backend against naive loops in double
// precision (odd sizes, strides, padding, non-square kernels and images), and each
// backward against central finite differences in float64.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "kernels/backend.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

std::vector<double> minus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

struct ConvCase {
  int64_t N, C, H, W, K, R, S;
  int stride, pad;
};

// Odd sizes everywhere; the last cases take the pointwise (1x1) path.
const ConvCase kConvCases[] = {
    {2, 3, 7, 6, 4, 3, 3, 1, 1},  // "same" 3x3
    {2, 3, 7, 6, 4, 3, 3, 2, 1},  // stride 2, padding 1
    {1, 2, 5, 8, 3, 3, 2, 2, 0},  // non-square kernel, output rows cut short by the stride
    {3, 2, 5, 4, 2, 5, 5, 1, 2},  // kernel as large as the padded image
    {2, 5, 3, 5, 3, 1, 1, 1, 0},  // pointwise
    {2, 3, 7, 5, 4, 1, 1, 2, 0},  // 1x1 with stride 2 (a ResNet shortcut)
};

int64_t out_size(int64_t in, int64_t k, int stride, int pad) { return (in + 2 * pad - k) / stride + 1; }

std::vector<double> naive_conv(const Tensor& xt, const Tensor& wt, int stride, int pad) {
  const auto x = to_doubles(xt), w = to_doubles(wt);
  const int64_t N = xt.size(0), C = xt.size(1), H = xt.size(2), W = xt.size(3);
  const int64_t K = wt.size(0), R = wt.size(2), S = wt.size(3);
  const int64_t P = out_size(H, R, stride, pad), Q = out_size(W, S, stride, pad);
  std::vector<double> y(N * K * P * Q, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          double s = 0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t r = 0; r < R; ++r)
              for (int64_t t = 0; t < S; ++t) {
                const int64_t h = p * stride - pad + r, v = q * stride - pad + t;
                if (h < 0 || h >= H || v < 0 || v >= W) continue;
                s += x[((n * C + c) * H + h) * W + v] * w[((k * C + c) * R + r) * S + t];
              }
          y[((n * K + k) * P + p) * Q + q] = s;
        }
  return y;
}

// Per-channel mean and biased variance over (N, H, W), and the normalised output.
struct NaiveBn {
  std::vector<double> mean, var, y;
};
NaiveBn naive_batchnorm(const Tensor& xt, const Tensor& gt, const Tensor& bt, double eps) {
  const auto x = to_doubles(xt), g = to_doubles(gt), b = to_doubles(bt);
  const int64_t N = xt.size(0), C = xt.size(1), E = xt.size(2) * xt.size(3);
  NaiveBn out{std::vector<double>(C), std::vector<double>(C), std::vector<double>(x.size())};
  for (int64_t c = 0; c < C; ++c) {
    double s = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) s += x[(n * C + c) * E + e];
    const double mu = s / (N * E);
    double v = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) v += (x[(n * C + c) * E + e] - mu) * (x[(n * C + c) * E + e] - mu);
    v /= N * E;
    out.mean[c] = mu;
    out.var[c] = v;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        const int64_t i = (n * C + c) * E + e;
        out.y[i] = (x[i] - mu) / std::sqrt(v + eps) * g[c] + b[c];
      }
  }
  return out;
}

struct NaivePool {
  std::vector<double> y;
  std::vector<double> argmax;
};
NaivePool naive_maxpool(const Tensor& xt, int k, int stride, int pad) {
  const auto x = to_doubles(xt);
  const int64_t N = xt.size(0), C = xt.size(1), H = xt.size(2), W = xt.size(3);
  const int64_t P = out_size(H, k, stride, pad), Q = out_size(W, k, stride, pad);
  NaivePool out;
  for (int64_t nc = 0; nc < N * C; ++nc)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        double best = -std::numeric_limits<double>::infinity();
        int64_t arg = -1;
        for (int64_t r = 0; r < k; ++r)
          for (int64_t s = 0; s < k; ++s) {
            const int64_t h = p * stride - pad + r, v = q * stride - pad + s;
            if (h < 0 || h >= H || v < 0 || v >= W) continue;  // padding: -infinity
            if (x[nc * H * W + h * W + v] > best) {
              best = x[nc * H * W + h * W + v];
              arg = h * W + v;
            }
          }
        out.y.push_back(best);
        out.argmax.push_back(static_cast<double>(arg));
      }
  return out;
}

std::vector<double> naive_avgpool(const Tensor& xt, int k, int stride) {
  const auto x = to_doubles(xt);
  const int64_t N = xt.size(0), C = xt.size(1), H = xt.size(2), W = xt.size(3);
  const int64_t P = out_size(H, k, stride, 0), Q = out_size(W, k, stride, 0);
  std::vector<double> y;
  for (int64_t nc = 0; nc < N * C; ++nc)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        double s = 0;
        for (int64_t r = 0; r < k; ++r)
          for (int64_t t = 0; t < k; ++t) s += x[nc * H * W + (p * stride + r) * W + q * stride + t];
        y.push_back(s / (k * k));
      }
  return y;
}

}  // namespace

TEST_CASE("conv2d equals the naive cross-correlation, float32 and float64") {
  for (const ConvCase& c : kConvCases) {
    for (DType dt : {DType::kF64, DType::kF32}) {
      CAPTURE(c.C);
      CAPTURE(c.H);
      CAPTURE(c.W);
      CAPTURE(c.R);
      CAPTURE(c.S);
      CAPTURE(c.stride);
      CAPTURE(c.pad);
      CAPTURE(dtype_name(dt));
      Tensor x = random_tensor({c.N, c.C, c.H, c.W}, dt, 1);
      Tensor w = random_tensor({c.K, c.C, c.R, c.S}, dt, 2);
      Tensor y = cpu().empty({c.N, c.K, out_size(c.H, c.R, c.stride, c.pad), out_size(c.W, c.S, c.stride, c.pad)}, dt);
      cpu().conv2d(x, w, c.stride, c.pad, y);
      const double tol = dt == DType::kF32 ? 1e-5 : 1e-13;
      GPIPE_EXPECT_CLOSE(y, naive_conv(x, w, c.stride, c.pad), tol, tol);
    }
  }
}

TEST_CASE("conv2d_backward matches finite differences; dw accumulates; dx is optional") {
  for (const ConvCase& c : kConvCases) {
    CAPTURE(c.R);
    CAPTURE(c.S);
    CAPTURE(c.stride);
    CAPTURE(c.pad);
    const int64_t P = out_size(c.H, c.R, c.stride, c.pad), Q = out_size(c.W, c.S, c.stride, c.pad);
    Tensor x = random_tensor({c.N, c.C, c.H, c.W}, DType::kF64, 3);
    Tensor w = random_tensor({c.K, c.C, c.R, c.S}, DType::kF64, 4);
    Tensor r = random_tensor({c.N, c.K, P, Q}, DType::kF64, 5);
    Tensor y = cpu().empty(r.shape(), DType::kF64);
    auto f = [&] {
      cpu().conv2d(x, w, c.stride, c.pad, y);
      return gpipe::testing::dot(y, r);
    };
    Tensor dx = random_tensor(x.shape(), DType::kF64, 6);  // garbage: dx is overwritten
    Tensor dw = random_tensor(w.shape(), DType::kF64, 7);  // a running sum: dw accumulates
    const auto dw0 = to_doubles(dw);
    cpu().conv2d_backward(r, x, w, c.stride, c.pad, dx, dw);
    GPIPE_EXPECT_CLOSE(dx, gpipe::testing::numeric_gradient(x, f), 1e-7, 1e-8);
    const auto dw_num = gpipe::testing::numeric_gradient(w, f);
    GPIPE_EXPECT_CLOSE(minus(to_doubles(dw), dw0), dw_num, 1e-7, 1e-8);

    Tensor none;  // no input gradient: only dw
    Tensor dw2 = cpu().zeros(w.shape(), DType::kF64);
    cpu().conv2d_backward(r, x, w, c.stride, c.pad, none, dw2);
    GPIPE_EXPECT_CLOSE(dw2, dw_num, 1e-7, 1e-8);
  }
}

TEST_CASE("conv2d_backward in float32 agrees with float64") {
  const ConvCase c = kConvCases[1];
  const int64_t P = out_size(c.H, c.R, c.stride, c.pad), Q = out_size(c.W, c.S, c.stride, c.pad);
  Tensor dx[2], dw[2];
  int i = 0;
  for (DType dt : {DType::kF64, DType::kF32}) {
    Tensor x = random_tensor({c.N, c.C, c.H, c.W}, dt, 3);
    Tensor w = random_tensor({c.K, c.C, c.R, c.S}, dt, 4);
    Tensor dy = random_tensor({c.N, c.K, P, Q}, dt, 5);
    dx[i] = cpu().empty(x.shape(), dt);
    dw[i] = cpu().zeros(w.shape(), dt);
    cpu().conv2d_backward(dy, x, w, c.stride, c.pad, dx[i], dw[i]);
    ++i;
  }
  GPIPE_EXPECT_CLOSE(dx[1], to_doubles(dx[0]), 1e-4, 1e-5);
  GPIPE_EXPECT_CLOSE(dw[1], to_doubles(dw[0]), 1e-4, 1e-5);
}

TEST_CASE("channel bias: added to every position, its gradient summed and accumulated") {
  for (DType dt : {DType::kF64, DType::kF32}) {
    Tensor y = random_tensor({3, 4, 5, 3}, dt, 1);
    Tensor bias = random_tensor({4}, dt, 2);
    const auto y0 = to_doubles(y), b = to_doubles(bias);
    cpu().add_channel_bias(y, bias);
    std::vector<double> expect(y0.size());
    for (size_t i = 0; i < y0.size(); ++i) expect[i] = y0[i] + b[(i / 15) % 4];
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-15;
    GPIPE_EXPECT_CLOSE(y, expect, tol, tol);

    Tensor db = Tensor::from_vector<double>({1, 2, 3, 4}, {4});
    if (dt == DType::kF32) db = Tensor::from_vector<float>({1, 2, 3, 4}, {4});
    cpu().channel_bias_grad(y, db);
    std::vector<double> sums = {1, 2, 3, 4};
    for (size_t i = 0; i < expect.size(); ++i) sums[(i / 15) % 4] += expect[i];
    GPIPE_EXPECT_CLOSE(db, sums, 1e-5, 1e-5);
  }
  Tensor y = random_tensor({2, 3, 2, 2}, DType::kF64, 1);
  Tensor bias = random_tensor({4}, DType::kF64, 2);
  CHECK_THROWS_WITH(cpu().add_channel_bias(y, bias), doctest::Contains("one value per channel of float64(2, 3, 2, 2)"));
}

TEST_CASE("batchnorm_train writes the batch statistics and normalises with them") {
  for (DType dt : {DType::kF64, DType::kF32}) {
    // A large mean: the two-pass variance must not cancel.
    Tensor x = random_tensor({3, 4, 5, 3}, dt, 1, 9.0, 11.0);
    Tensor g = random_tensor({4}, dt, 2, 0.5, 1.5), b = random_tensor({4}, dt, 3);
    Tensor y = cpu().empty(x.shape(), dt), mean = cpu().empty({4}, dt), var = cpu().empty({4}, dt);
    cpu().batchnorm_train(x, g, b, 1e-5, y, mean, var);
    const NaiveBn ref = naive_batchnorm(x, g, b, 1e-5);
    const double tol = dt == DType::kF32 ? 1e-4 : 1e-11;
    GPIPE_EXPECT_CLOSE(mean, ref.mean, tol, tol);
    GPIPE_EXPECT_CLOSE(var, ref.var, tol, tol);
    GPIPE_EXPECT_CLOSE(y, ref.y, tol, tol);
  }
}

TEST_CASE("batchnorm_eval uses the given statistics") {
  Tensor x = random_tensor({2, 3, 3, 5}, DType::kF64, 1);
  Tensor g = random_tensor({3}, DType::kF64, 2), b = random_tensor({3}, DType::kF64, 3);
  Tensor mean = random_tensor({3}, DType::kF64, 4), var = random_tensor({3}, DType::kF64, 5, 0.5, 2.0);
  Tensor y = cpu().empty(x.shape(), DType::kF64);
  cpu().batchnorm_eval(x, g, b, mean, var, 1e-3, y);
  const auto xv = to_doubles(x), m = to_doubles(mean), v = to_doubles(var), gv = to_doubles(g), bv = to_doubles(b);
  std::vector<double> expect(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const size_t c = (i / 15) % 3;
    expect[i] = (xv[i] - m[c]) / std::sqrt(v[c] + 1e-3) * gv[c] + bv[c];
  }
  GPIPE_EXPECT_CLOSE(y, expect, 1e-13, 1e-13);
}

TEST_CASE("batchnorm_backward matches finite differences through the batch statistics") {
  for (Shape shape : {Shape{3, 4, 5, 3}, Shape{1, 2, 1, 7}, Shape{5, 3, 1, 1}}) {
    CAPTURE(shape_str(shape));
    const int64_t C = shape[1];
    Tensor x = random_tensor(shape, DType::kF64, 1);
    Tensor g = random_tensor({C}, DType::kF64, 2, 0.5, 1.5), b = random_tensor({C}, DType::kF64, 3);
    Tensor r = random_tensor(shape, DType::kF64, 4);
    Tensor y = cpu().empty(shape, DType::kF64), mean = cpu().empty({C}, DType::kF64),
           var = cpu().empty({C}, DType::kF64);
    const double eps = 1e-5;
    auto f = [&] {
      cpu().batchnorm_train(x, g, b, eps, y, mean, var);
      return gpipe::testing::dot(y, r);
    };
    f();
    Tensor dx = random_tensor(shape, DType::kF64, 5);                                         // overwritten
    Tensor dg = random_tensor({C}, DType::kF64, 6), db = random_tensor({C}, DType::kF64, 7);  // accumulated
    const auto dg0 = to_doubles(dg), db0 = to_doubles(db);
    cpu().batchnorm_backward(r, x, g, mean, var, eps, dx, dg, db);
    GPIPE_EXPECT_CLOSE(dx, gpipe::testing::numeric_gradient(x, f), 1e-6, 1e-7);
    GPIPE_EXPECT_CLOSE(minus(to_doubles(dg), dg0), gpipe::testing::numeric_gradient(g, f), 1e-6, 1e-7);
    GPIPE_EXPECT_CLOSE(minus(to_doubles(db), db0), gpipe::testing::numeric_gradient(b, f), 1e-6, 1e-7);
  }
}

TEST_CASE("maxpool2d: values, first-maximum argmax, padding as -infinity") {
  struct Case {
    int64_t H, W;
    int k, stride, pad;
  };
  for (Case c : {Case{7, 6, 3, 2, 1}, Case{5, 5, 2, 2, 0}, Case{6, 7, 3, 1, 1}, Case{4, 5, 2, 1, 1}}) {
    for (DType dt : {DType::kF64, DType::kF32}) {
      CAPTURE(c.H);
      CAPTURE(c.W);
      CAPTURE(c.k);
      CAPTURE(c.stride);
      CAPTURE(c.pad);
      // Negative values only: a padded zero would win if padding were not -infinity.
      Tensor x = random_tensor({2, 3, c.H, c.W}, dt, 1, -2.0, -1.0);
      const int64_t P = out_size(c.H, c.k, c.stride, c.pad), Q = out_size(c.W, c.k, c.stride, c.pad);
      Tensor y = cpu().empty({2, 3, P, Q}, dt), arg = cpu().empty({2, 3, P, Q}, DType::kI32);
      cpu().maxpool2d(x, c.k, c.stride, c.pad, y, arg);
      const NaivePool ref = naive_maxpool(x, c.k, c.stride, c.pad);
      GPIPE_EXPECT_CLOSE(y, ref.y, 0, 0);
      GPIPE_EXPECT_CLOSE(arg, ref.argmax, 0, 0);
    }
  }
  // Ties go to the first maximum in row-major order within the window.
  Tensor x = Tensor::from_vector<double>({1, 3, 3, 0, 3, 2, 0, 0, 0}, {1, 1, 3, 3});
  Tensor y = cpu().empty({1, 1, 1, 1}, DType::kF64), arg = cpu().empty({1, 1, 1, 1}, DType::kI32);
  cpu().maxpool2d(x, 3, 3, 0, y, arg);
  CHECK(y.data<double>()[0] == 3.0);
  CHECK(arg.data<int32_t>()[0] == 1);
}

TEST_CASE("maxpool2d_backward routes each gradient to its maximum (finite differences)") {
  Tensor x = random_tensor({2, 2, 7, 6}, DType::kF64, 8);
  Tensor r = random_tensor({2, 2, 4, 3}, DType::kF64, 9);
  Tensor y = cpu().empty(r.shape(), DType::kF64), arg = cpu().empty(r.shape(), DType::kI32);
  auto f = [&] {
    cpu().maxpool2d(x, 3, 2, 1, y, arg);
    return gpipe::testing::dot(y, r);
  };
  f();
  Tensor dx = random_tensor(x.shape(), DType::kF64, 10);  // overwritten
  cpu().maxpool2d_backward(r, arg, dx);
  GPIPE_EXPECT_CLOSE(dx, gpipe::testing::numeric_gradient(x, f), 1e-7, 1e-8);

  arg.data<int32_t>()[3] = 42;  // outside a 7 x 6 plane
  CHECK_THROWS_WITH(cpu().maxpool2d_backward(r, arg, dx), doctest::Contains("argmax 42"));
}

TEST_CASE("avgpool2d and its backward (finite differences)") {
  struct Case {
    int64_t H, W;
    int k, stride;
  };
  for (Case c : {Case{7, 6, 3, 2}, Case{4, 4, 4, 4}, Case{5, 7, 2, 1}, Case{6, 5, 2, 3}}) {
    CAPTURE(c.H);
    CAPTURE(c.W);
    CAPTURE(c.k);
    CAPTURE(c.stride);
    const int64_t P = out_size(c.H, c.k, c.stride, 0), Q = out_size(c.W, c.k, c.stride, 0);
    for (DType dt : {DType::kF64, DType::kF32}) {
      Tensor x = random_tensor({2, 3, c.H, c.W}, dt, 1);
      Tensor y = cpu().empty({2, 3, P, Q}, dt);
      cpu().avgpool2d(x, c.k, c.stride, y);
      const double tol = dt == DType::kF32 ? 1e-6 : 1e-15;
      GPIPE_EXPECT_CLOSE(y, naive_avgpool(x, c.k, c.stride), tol, tol);
    }
    Tensor x = random_tensor({2, 3, c.H, c.W}, DType::kF64, 2);
    Tensor r = random_tensor({2, 3, P, Q}, DType::kF64, 3);
    Tensor y = cpu().empty(r.shape(), DType::kF64);
    auto f = [&] {
      cpu().avgpool2d(x, c.k, c.stride, y);
      return gpipe::testing::dot(y, r);
    };
    Tensor dx = random_tensor(x.shape(), DType::kF64, 4);  // overwritten, uncovered positions too
    cpu().avgpool2d_backward(r, c.k, c.stride, dx);
    GPIPE_EXPECT_CLOSE(dx, gpipe::testing::numeric_gradient(x, f), 1e-8, 1e-9);
  }
}

TEST_CASE("convolution ops reject operands that do not fit, naming them") {
  Tensor x = random_tensor({2, 3, 5, 5}, DType::kF32, 1);
  Tensor w = random_tensor({4, 2, 3, 3}, DType::kF32, 2);
  Tensor y = cpu().empty({2, 4, 5, 5}, DType::kF32);
  CHECK_THROWS_WITH(
      cpu().conv2d(x, w, 1, 1, y),
      doctest::Contains("input float32(2, 3, 5, 5) on cpu:0 and weight float32(4, 2, 3, 3) on cpu:0 do not "
                        "fit: the weight takes 2 input channels, the input has 3"));
  Tensor w3 = random_tensor({4, 3, 3, 3}, DType::kF32, 2);
  Tensor bad_y = cpu().empty({2, 4, 3, 3}, DType::kF32);
  CHECK_THROWS_WITH(
      cpu().conv2d(x, w3, 1, 1, bad_y),
      doctest::Contains("expected contiguous float32(2, 4, 5, 5) for input (2, 3, 5, 5) and weight (4, 3, 3, 3)"));
  Tensor w7 = random_tensor({4, 3, 7, 7}, DType::kF32, 2);
  CHECK_THROWS_WITH(cpu().conv2d(x, w7, 1, 0, y), doctest::Contains("does not fit in input float32(2, 3, 5, 5)"));
  Tensor flat = random_tensor({2, 75}, DType::kF32, 1);
  CHECK_THROWS_WITH(cpu().conv2d(flat, w3, 1, 1, y), doctest::Contains("must be a 4-D NCHW tensor"));
  Tensor py = cpu().empty({2, 3, 3, 3}, DType::kF32), arg = cpu().empty({2, 3, 3, 3}, DType::kI32);
  CHECK_THROWS_WITH(cpu().maxpool2d(x, 2, 2, 2, py, arg), doctest::Contains("at most half the kernel"));
  Tensor g = random_tensor({4}, DType::kF32, 1);
  Tensor m = cpu().empty({3}, DType::kF32), v = cpu().empty({3}, DType::kF32),
         bn_y = cpu().empty(x.shape(), DType::kF32);
  CHECK_THROWS_WITH(cpu().batchnorm_train(x, g, g, 1e-5, bn_y, m, v), doctest::Contains("gamma is float32(4)"));
}
