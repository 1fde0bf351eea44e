// Conformance of the CUDA convolution ops (kernels/cuda_conv_ops.cc) with the CPU
// reference (kernels/cpu_conv_ops.cc): every op runs on cuda:0 and on cpu:0 with the
// same random inputs, for float32 and float64, at odd sizes, strides 1 and 2 and
// padding 0 and 1, forward and backward. Without a visible GPU it prints the skip
// marker and passes.
#include "tests/gpu_testing.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "runtime/cuda_runtime.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/tensor.h"
#include "tests/testing.h"

namespace gpipe {
namespace {

using testing::random_tensor;
using testing::to_doubles;

using namespace gpu_testing;

// Bit-for-bit equality of the values (NaN equal to NaN); reports the first mismatch.
void expect_identical(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = to_doubles(a), y = to_doubles(b);
  REQUIRE(x.size() == y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const bool same = (std::isnan(x[i]) && std::isnan(y[i])) || x[i] == y[i];
    if (!same) {
      INFO("element " << i << ": " << x[i] << " vs " << y[i]);
      CHECK(same);
      return;
    }
  }
}

// ---------------------------------------------------------------------------------
// Convolution

struct ConvCase {
  int64_t N, C, H, W, K, R, S;
  int stride, pad;
};

// Odd sizes, strides 1 and 2, padding 0 and 1, square and non-square kernels and
// images, a pointwise (1x1) case, and a window that only fits thanks to the padding.
const ConvCase kConvCases[] = {
    {2, 3, 7, 6, 4, 3, 3, 1, 1},  {2, 3, 7, 6, 4, 3, 3, 2, 1},  {3, 2, 9, 7, 5, 3, 3, 1, 0},
    {3, 2, 9, 7, 5, 3, 3, 2, 0},  {1, 5, 11, 13, 3, 3, 5, 2, 1}, {2, 4, 5, 5, 7, 1, 1, 1, 0},
    {2, 4, 5, 5, 7, 1, 1, 2, 0},  {1, 3, 8, 9, 2, 2, 3, 2, 1},   {2, 1, 2, 3, 3, 3, 3, 1, 1},
    {4, 6, 13, 11, 8, 5, 5, 2, 1},
};

std::string conv_case_str(const ConvCase& c) {
  return "x (" + std::to_string(c.N) + "," + std::to_string(c.C) + "," + std::to_string(c.H) + "," +
         std::to_string(c.W) + ") w (" + std::to_string(c.K) + "," + std::to_string(c.C) + "," + std::to_string(c.R) +
         "," + std::to_string(c.S) + ") stride " + std::to_string(c.stride) + " pad " + std::to_string(c.pad);
}

int64_t out_extent(int64_t in, int64_t k, int stride, int pad) { return (in + 2 * pad - k) / stride + 1; }

TEST_CASE("conv2d matches the CPU reference") {
  uint64_t seed = 1;
  for (DType dt : kFloatTypes) {
    for (const ConvCase& c : kConvCases) {
      CAPTURE(dtype_name(dt));
      CAPTURE(conv_case_str(c));
      const int64_t P = out_extent(c.H, c.R, c.stride, c.pad), Q = out_extent(c.W, c.S, c.stride, c.pad);
      Tensor x = random_tensor({c.N, c.C, c.H, c.W}, dt, seed++);
      Tensor w = random_tensor({c.K, c.C, c.R, c.S}, dt, seed++);
      Tensor yc = random_tensor({c.N, c.K, P, Q}, dt, seed++);  // garbage: overwritten
      Tensor yg = to_gpu(yc);
      cpu().conv2d(x, w, c.stride, c.pad, yc);
      gpu().conv2d(to_gpu(x), to_gpu(w), c.stride, c.pad, yg);
      EXPECT_CLOSE_TOL(yg, yc, reduction_tol(dt, c.C * c.R * c.S));
    }
  }
}

TEST_CASE("conv2d_backward matches the CPU reference: dx overwritten, dw accumulated, dx optional") {
  uint64_t seed = 100;
  for (DType dt : kFloatTypes) {
    for (const ConvCase& c : kConvCases) {
      CAPTURE(dtype_name(dt));
      CAPTURE(conv_case_str(c));
      const int64_t P = out_extent(c.H, c.R, c.stride, c.pad), Q = out_extent(c.W, c.S, c.stride, c.pad);
      Tensor x = random_tensor({c.N, c.C, c.H, c.W}, dt, seed++);
      Tensor w = random_tensor({c.K, c.C, c.R, c.S}, dt, seed++);
      Tensor dy = random_tensor({c.N, c.K, P, Q}, dt, seed++);
      Tensor dw0 = random_tensor(w.shape(), dt, seed++);  // the accumulated gradient so far
      Tensor dx0 = random_tensor(x.shape(), dt, seed++);  // garbage: overwritten
      Tensor xg = to_gpu(x), wg = to_gpu(w), dyg = to_gpu(dy);

      Tensor dwc = clone(dw0), dxc = clone(dx0);
      Tensor dwg = to_gpu(dw0), dxg = to_gpu(dx0);
      cpu().conv2d_backward(dy, x, w, c.stride, c.pad, dxc, dwc);
      gpu().conv2d_backward(dyg, xg, wg, c.stride, c.pad, dxg, dwg);
      EXPECT_CLOSE_TOL(dwg, dwc, reduction_tol(dt, c.N * P * Q));
      EXPECT_CLOSE_TOL(dxg, dxc, reduction_tol(dt, c.K * c.R * c.S));

      // Without dx only dw changes.
      Tensor none;
      Tensor dwc2 = clone(dw0), dwg2 = to_gpu(dw0);
      cpu().conv2d_backward(dy, x, w, c.stride, c.pad, none, dwc2);
      gpu().conv2d_backward(dyg, xg, wg, c.stride, c.pad, none, dwg2);
      EXPECT_CLOSE_TOL(dwg2, dwc2, reduction_tol(dt, c.N * P * Q));
    }
  }
}

TEST_CASE("conv2d and its backward are deterministic on the GPU") {
  const ConvCase c{4, 6, 13, 11, 8, 3, 3, 1, 1};
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    Tensor x = to_gpu(random_tensor({c.N, c.C, c.H, c.W}, dt, 7));
    Tensor w = to_gpu(random_tensor({c.K, c.C, c.R, c.S}, dt, 8));
    Tensor dy = to_gpu(random_tensor({c.N, c.K, c.H, c.W}, dt, 9));
    Tensor y1 = gpu().zeros(dy.shape(), dt), y2 = gpu().zeros(dy.shape(), dt);
    gpu().conv2d(x, w, c.stride, c.pad, y1);
    gpu().conv2d(x, w, c.stride, c.pad, y2);
    expect_identical(y1, y2);
    Tensor dw1 = gpu().zeros(w.shape(), dt), dw2 = gpu().zeros(w.shape(), dt);
    Tensor dx1 = gpu().zeros(x.shape(), dt), dx2 = gpu().zeros(x.shape(), dt);
    gpu().conv2d_backward(dy, x, w, c.stride, c.pad, dx1, dw1);
    gpu().conv2d_backward(dy, x, w, c.stride, c.pad, dx2, dw2);
    expect_identical(dw1, dw2);
    expect_identical(dx1, dx2);
  }
}

TEST_CASE("conv2d: an empty batch is a no-op, and bad arguments are rejected as on the CPU") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    Tensor x = to_gpu(random_tensor({0, 3, 5, 5}, dt, 1));
    Tensor w = to_gpu(random_tensor({2, 3, 3, 3}, dt, 2));
    Tensor y = gpu().empty({0, 2, 3, 3}, dt);
    gpu().conv2d(x, w, 1, 0, y);
    Tensor dw = gpu().zeros(w.shape(), dt), dx = gpu().empty(x.shape(), dt);
    gpu().conv2d_backward(y, x, w, 1, 0, dx, dw);
    CHECK(to_doubles(dw) == std::vector<double>(dw.numel(), 0.0));

    Tensor x1 = to_gpu(random_tensor({1, 4, 5, 5}, dt, 3));  // 4 channels, the weight takes 3
    Tensor y1 = gpu().empty({1, 2, 3, 3}, dt);
    CHECK_THROWS_AS(gpu().conv2d(x1, w, 1, 0, y1), Error);
    Tensor x2 = to_gpu(random_tensor({1, 3, 5, 5}, dt, 4));
    Tensor wrong = gpu().empty({1, 2, 4, 4}, dt);  // the output is (1, 2, 3, 3)
    CHECK_THROWS_AS(gpu().conv2d(x2, w, 1, 0, wrong), Error);
    CHECK_THROWS_AS(gpu().conv2d(x2, w, 0, 0, y1), Error);
    Tensor small = to_gpu(random_tensor({1, 3, 2, 2}, dt, 5));  // a 3-wide window does not fit
    CHECK_THROWS_AS(gpu().conv2d(small, w, 1, 0, y1), Error);
  }
}

// ---------------------------------------------------------------------------------
// Per-channel bias

const Shape kChannelShapes[] = {{2, 3, 5, 7}, {3, 4}, {1, 5, 1, 1}, {4, 3, 13, 11}, {2, 3, 0, 3}, {17, 2, 33, 31}};

TEST_CASE("add_channel_bias and channel_bias_grad match the CPU reference") {
  uint64_t seed = 200;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kChannelShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      Tensor y = random_tensor(s, dt, seed++);
      Tensor bias = random_tensor({s[1]}, dt, seed++);
      Tensor yc = clone(y), yg = to_gpu(y);
      cpu().add_channel_bias(yc, bias);
      gpu().add_channel_bias(yg, to_gpu(bias));
      EXPECT_CLOSE_TOL(yg, yc, elementwise_tol(dt));

      Tensor dy = random_tensor(s, dt, seed++);
      Tensor db0 = random_tensor({s[1]}, dt, seed++);  // accumulated into
      Tensor dbc = clone(db0), dbg = to_gpu(db0);
      cpu().channel_bias_grad(dy, dbc);
      gpu().channel_bias_grad(to_gpu(dy), dbg);
      EXPECT_CLOSE_TOL(dbg, dbc, reduction_tol(dt, dy.numel() / s[1]));
    }
  }
}

// ---------------------------------------------------------------------------------
// Batch normalisation (cuDNN's spatial mode, kernels/cuda_conv_ops.cc)

// Odd sizes; planes shorter and longer than a block; large channels (the last two);
// one value per plane.
const Shape kBatchnormShapes[] = {{2, 3, 5, 7}, {1, 4, 3, 3}, {5, 3, 1, 1}, {4, 3, 13, 11}, {16, 3, 13, 11},
                                  {3, 2, 47, 45}};

// The statistics (and y, dgamma, dbeta, dx through them) are sums of m = N H W values
// that cuDNN adds in its own order and in the element type: reduction_tol(dt, m). The
// biased variance comes back from cuDNN's inverse standard deviation; that conversion
// adds only a few ulps of var + eps (see kernels/cuda_conv_ops.cc).
//
// Inference has no reduction, but cuDNN may arrange gamma (x - mean) / sqrt(var + eps)
// + beta differently from the CPU (folded into x scale + shift, with a reciprocal square
// root of a few ulps): allow a few ulps of the intermediates, |x scale| and
// |mean scale| <= ~5 with these inputs, beyond the elementwise tolerance.
Tol batchnorm_eval_tol(DType t) { return t == DType::kF32 ? Tol{1e-5, 5e-6} : Tol{1e-12, 1e-13}; }

TEST_CASE("batchnorm_train matches the CPU reference (statistics and output)") {
  uint64_t seed = 300;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kBatchnormShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      const int64_t C = s[1], m = s[0] * s[2] * s[3];
      // An offset mean: the two-pass variance must not cancel.
      Tensor x = random_tensor(s, dt, seed++, 2.0, 4.0);
      Tensor gamma = random_tensor({C}, dt, seed++, 0.5, 1.5);
      Tensor beta = random_tensor({C}, dt, seed++);
      const double eps = 1e-5;
      Tensor yc = Tensor::empty(s, dt, Device::cpu()), mc = Tensor::empty({C}, dt, Device::cpu()),
             vc = Tensor::empty({C}, dt, Device::cpu());
      Tensor yg = gpu().empty(s, dt), mg = gpu().empty({C}, dt), vg = gpu().empty({C}, dt);
      cpu().batchnorm_train(x, gamma, beta, eps, yc, mc, vc);
      gpu().batchnorm_train(to_gpu(x), to_gpu(gamma), to_gpu(beta), eps, yg, mg, vg);
      EXPECT_CLOSE_TOL(mg, mc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(vg, vc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(yg, yc, reduction_tol(dt, m));

      // y may alias x.
      Tensor inplace = to_gpu(x);
      Tensor m2 = gpu().empty({C}, dt), v2 = gpu().empty({C}, dt);
      gpu().batchnorm_train(inplace, to_gpu(gamma), to_gpu(beta), eps, inplace, m2, v2);
      EXPECT_CLOSE_TOL(inplace, yc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(v2, vc, reduction_tol(dt, m));
    }
  }
}

// A channel of equal values has variance 0: cuDNN's invstd is then 1 / sqrt(eps), and
// 1 / invstd^2 - eps is 0 up to rounding, which must not come back negative.
TEST_CASE("batchnorm_train: a constant channel gets variance 0 (not below), and y = beta there") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    const Shape s{3, 2, 5, 4};
    const int64_t m = s[0] * s[2] * s[3];
    Tensor x = random_tensor(s, dt, 42);
    // Channel 0 holds 2.0 everywhere: every sum of it is exact, so the mean is exactly 2
    // and every deviation exactly 0, whatever order cuDNN adds in.
    for (int64_t n = 0; n < s[0]; ++n) {
      for (int64_t e = 0; e < s[2] * s[3]; ++e) {
        const int64_t i = n * s[1] * s[2] * s[3] + e;
        if (dt == DType::kF32) {
          x.data<float>()[i] = 2.0f;
        } else {
          x.data<double>()[i] = 2.0;
        }
      }
    }
    Tensor gamma = random_tensor({2}, dt, 43, 0.5, 1.5), beta = random_tensor({2}, dt, 44);
    const double eps = 1e-5;
    Tensor yc = Tensor::empty(s, dt, Device::cpu()), mc = Tensor::empty({2}, dt, Device::cpu()),
           vc = Tensor::empty({2}, dt, Device::cpu());
    Tensor yg = gpu().empty(s, dt), mg = gpu().empty({2}, dt), vg = gpu().empty({2}, dt);
    cpu().batchnorm_train(x, gamma, beta, eps, yc, mc, vc);
    gpu().batchnorm_train(to_gpu(x), to_gpu(gamma), to_gpu(beta), eps, yg, mg, vg);
    EXPECT_CLOSE_TOL(mg, mc, reduction_tol(dt, m));
    const std::vector<double> v = to_doubles(vg);
    CHECK(v[0] >= 0.0);
    // A few ulps d of invstd turn into about 2 d eps (kernels/cuda_conv_ops.cc).
    CHECK(v[0] <= (dt == DType::kF32 ? 1e-10 : 1e-19));
    EXPECT_CLOSE_TOL(vg, vc, reduction_tol(dt, m));
    // On the CPU channel 0 gets y = 0 * scale + beta = beta exactly; cuDNN may fold the
    // normalisation into x scale + shift, whose terms are |2 gamma / sqrt(eps)| <= ~950
    // here: allow a few of their ulps.
    const double ulp = dt == DType::kF32 ? 6e-8 : 1.2e-16;
    EXPECT_CLOSE_TOL(yg, yc, (Tol{1e-5, 8 * ulp * 2.0 * 1.5 / std::sqrt(eps)}));
  }
}

TEST_CASE("batchnorm_eval matches the CPU reference") {
  uint64_t seed = 400;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kBatchnormShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      const int64_t C = s[1];
      Tensor x = random_tensor(s, dt, seed++);
      Tensor gamma = random_tensor({C}, dt, seed++, 0.5, 1.5);
      Tensor beta = random_tensor({C}, dt, seed++);
      Tensor mean = random_tensor({C}, dt, seed++);
      Tensor var = random_tensor({C}, dt, seed++, 0.1, 2.0);
      Tensor yc = Tensor::empty(s, dt, Device::cpu()), yg = gpu().empty(s, dt);
      cpu().batchnorm_eval(x, gamma, beta, mean, var, 1e-3, yc);
      gpu().batchnorm_eval(to_gpu(x), to_gpu(gamma), to_gpu(beta), to_gpu(mean), to_gpu(var), 1e-3, yg);
      EXPECT_CLOSE_TOL(yg, yc, batchnorm_eval_tol(dt));

      // y may alias x.
      Tensor inplace = to_gpu(x);
      gpu().batchnorm_eval(inplace, to_gpu(gamma), to_gpu(beta), to_gpu(mean), to_gpu(var), 1e-3, inplace);
      EXPECT_CLOSE_TOL(inplace, yc, batchnorm_eval_tol(dt));
    }
  }
}

TEST_CASE("batchnorm_backward matches the CPU reference: dx overwritten, dgamma and dbeta accumulated") {
  uint64_t seed = 500;
  for (DType dt : kFloatTypes) {
    for (const Shape& s : kBatchnormShapes) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(s));
      const int64_t C = s[1], m = s[0] * s[2] * s[3];
      Tensor x = random_tensor(s, dt, seed++, -1.0, 3.0);
      Tensor gamma = random_tensor({C}, dt, seed++, 0.5, 1.5);
      Tensor beta = random_tensor({C}, dt, seed++);
      const double eps = 1e-5;
      // The statistics the forward pass kept (from the CPU, so both sides get the same).
      Tensor y = Tensor::empty(s, dt, Device::cpu()), mean = Tensor::empty({C}, dt, Device::cpu()),
             var = Tensor::empty({C}, dt, Device::cpu());
      cpu().batchnorm_train(x, gamma, beta, eps, y, mean, var);

      Tensor dy = random_tensor(s, dt, seed++);
      Tensor dx0 = random_tensor(s, dt, seed++);  // garbage: overwritten
      Tensor dg0 = random_tensor({C}, dt, seed++), db0 = random_tensor({C}, dt, seed++);
      Tensor dxc = clone(dx0), dgc = clone(dg0), dbc = clone(db0);
      Tensor dxg = to_gpu(dx0), dgg = to_gpu(dg0), dbg = to_gpu(db0);
      cpu().batchnorm_backward(dy, x, gamma, mean, var, eps, dxc, dgc, dbc);
      gpu().batchnorm_backward(to_gpu(dy), to_gpu(x), to_gpu(gamma), to_gpu(mean), to_gpu(var), eps, dxg, dgg, dbg);
      EXPECT_CLOSE_TOL(dbg, dbc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(dgg, dgc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(dxg, dxc, reduction_tol(dt, m));

      // dx may alias dy.
      Tensor inplace = to_gpu(dy);
      Tensor dg2 = to_gpu(dg0), db2 = to_gpu(db0);
      gpu().batchnorm_backward(inplace, to_gpu(x), to_gpu(gamma), to_gpu(mean), to_gpu(var), eps, inplace, dg2, db2);
      EXPECT_CLOSE_TOL(inplace, dxc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(dg2, dgc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(db2, dbc, reduction_tol(dt, m));

      // As a layer uses it: the statistics the GPU's batchnorm_train kept (the variance
      // converted from cuDNN's invstd, and back again for the backward).
      Tensor yg = gpu().empty(s, dt), mg = gpu().empty({C}, dt), vg = gpu().empty({C}, dt);
      gpu().batchnorm_train(to_gpu(x), to_gpu(gamma), to_gpu(beta), eps, yg, mg, vg);
      Tensor dx3 = to_gpu(dx0), dg3 = to_gpu(dg0), db3 = to_gpu(db0);
      gpu().batchnorm_backward(to_gpu(dy), to_gpu(x), to_gpu(gamma), mg, vg, eps, dx3, dg3, db3);
      EXPECT_CLOSE_TOL(db3, dbc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(dg3, dgc, reduction_tol(dt, m));
      EXPECT_CLOSE_TOL(dx3, dxc, reduction_tol(dt, m));
    }
  }
}

TEST_CASE("batch norm: an input with nothing to normalise over is rejected as on the CPU") {
  for (DType dt : kFloatTypes) {
    Tensor x = gpu().empty({0, 3, 4, 4}, dt), y = gpu().empty({0, 3, 4, 4}, dt);
    Tensor g = gpu().empty({3}, dt), b = gpu().empty({3}, dt), m = gpu().empty({3}, dt), v = gpu().empty({3}, dt);
    CHECK_THROWS_AS(gpu().batchnorm_train(x, g, b, 1e-5, y, m, v), Error);
    Tensor x2 = gpu().empty({2, 3, 4, 4}, dt), y2 = gpu().empty({2, 3, 4, 4}, dt), g2 = gpu().empty({2}, dt);
    CHECK_THROWS_AS(gpu().batchnorm_train(x2, g2, b, 1e-5, y2, m, v), Error);  // gamma has 2 channels
  }
}

// ---------------------------------------------------------------------------------
// Pooling

struct PoolCase {
  int64_t N, C, H, W;
  int kernel, stride, pad;
};

// Odd sizes, strides 1 and 2, padding 0 and 1, overlapping windows, windows that skip
// input positions.
const PoolCase kMaxPoolCases[] = {
    {2, 3, 7, 6, 2, 2, 0},  {2, 3, 7, 6, 3, 2, 1},  {1, 2, 9, 11, 3, 1, 1}, {3, 2, 5, 5, 3, 1, 0},
    {2, 4, 13, 9, 3, 2, 0}, {1, 1, 1, 1, 1, 1, 0},  {2, 3, 8, 7, 5, 2, 2},  {2, 2, 12, 10, 2, 1, 1},
};

std::string pool_case_str(const PoolCase& c) {
  return "x (" + std::to_string(c.N) + "," + std::to_string(c.C) + "," + std::to_string(c.H) + "," +
         std::to_string(c.W) + ") kernel " + std::to_string(c.kernel) + " stride " + std::to_string(c.stride) +
         " pad " + std::to_string(c.pad);
}

// Values from a small set, so that windows hold ties (the first maximum must win).
Tensor tied_tensor(const Shape& s, DType dt, uint64_t seed) {
  Tensor t = random_tensor(s, dt, seed, 0.0, 4.0);
  Tensor out = Tensor::empty(s, dt, Device::cpu());
  const std::vector<double> v = to_doubles(t);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double r = std::floor(v[static_cast<size_t>(i)]);
    if (dt == DType::kF32) {
      out.data<float>()[i] = static_cast<float>(r);
    } else {
      out.data<double>()[i] = r;
    }
  }
  return out;
}

TEST_CASE("maxpool2d and maxpool2d_backward match the CPU reference bit for bit (ties, NaN, overlaps)") {
  uint64_t seed = 600;
  for (DType dt : kFloatTypes) {
    for (const PoolCase& c : kMaxPoolCases) {
      for (int variant = 0; variant < 3; ++variant) {  // random, tied, with a NaN
        CAPTURE(dtype_name(dt));
        CAPTURE(pool_case_str(c));
        CAPTURE(variant);
        const Shape s{c.N, c.C, c.H, c.W};
        Tensor x = variant == 0 ? random_tensor(s, dt, seed++) : tied_tensor(s, dt, seed++);
        if (variant == 2) {
          const int64_t at = x.numel() / 2;
          if (dt == DType::kF32) {
            x.data<float>()[at] = std::numeric_limits<float>::quiet_NaN();
          } else {
            x.data<double>()[at] = std::numeric_limits<double>::quiet_NaN();
          }
        }
        const int64_t P = out_extent(c.H, c.kernel, c.stride, c.pad), Q = out_extent(c.W, c.kernel, c.stride, c.pad);
        const Shape out{c.N, c.C, P, Q};
        Tensor yc = Tensor::empty(out, dt, Device::cpu()), ac = Tensor::empty(out, DType::kI32, Device::cpu());
        Tensor yg = gpu().empty(out, dt), ag = gpu().empty(out, DType::kI32);
        cpu().maxpool2d(x, c.kernel, c.stride, c.pad, yc, ac);
        gpu().maxpool2d(to_gpu(x), c.kernel, c.stride, c.pad, yg, ag);
        expect_identical(yg, yc);
        expect_identical(ag, ac);

        // Backward with the CPU's argmax (the same on both sides), into garbage.
        Tensor dy = random_tensor(out, dt, seed++);
        Tensor dx0 = random_tensor(s, dt, seed++);
        Tensor dxc = clone(dx0), dxg = to_gpu(dx0);
        cpu().maxpool2d_backward(dy, ac, dxc);
        gpu().maxpool2d_backward(to_gpu(dy), to_gpu(ac), dxg);
        expect_identical(dxg, dxc);
      }
    }
  }
}

// A bad argmax is found on the device as dx is written and reported at the backend's
// next wait (kernels/cuda_backend.h), not by the op.
TEST_CASE("maxpool2d_backward: a bad argmax is the CPU's Error at the next synchronize; the rest scatters") {
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    const Shape s{2, 3, 6, 6}, out{2, 3, 3, 3};
    Tensor x = random_tensor(s, dt, 1);
    Tensor y = gpu().empty(out, dt), a = gpu().empty(out, DType::kI32);
    gpu().maxpool2d(to_gpu(x), 2, 2, 0, y, a);
    Tensor host_a = Tensor::empty(out, DType::kI32, Device::cpu());
    gpu().copy(a, host_a);
    Tensor bad_a = clone(host_a);
    bad_a.data<int32_t>()[20] = 36;  // planes hold 6 * 6 = 36 values
    bad_a.data<int32_t>()[40] = -1;  // a second one, later: 20 is reported
    Tensor dy_host = random_tensor(out, dt, 3);
    Tensor dx = to_gpu(random_tensor(s, dt, 2));
    Tensor dy = to_gpu(dy_host);
    Tensor bad_a_g = to_gpu(bad_a);

    std::string cpu_msg, gpu_msg;
    Tensor dx_cpu = Tensor::empty(s, dt, Device::cpu());
    try {
      cpu().maxpool2d_backward(dy_host, bad_a, dx_cpu);
    } catch (const Error& e) {
      cpu_msg = e.what();
    }
    CHECK_NOTHROW(gpu().maxpool2d_backward(dy, bad_a_g, dx));
    try {
      gpu().synchronize();
    } catch (const UserError& e) {
      FAIL("a bad argmax is an Error, as on the CPU, not a UserError: " << e.what());
    } catch (const Error& e) {
      gpu_msg = e.what();
    }
    CAPTURE(gpu_msg);
    CHECK(gpu_msg.find("maxpool2d_backward: argmax 36 at 20 is outside the 36-value planes") != std::string::npos);
    // Word for word the CPU's message, but for the device dx lives on.
    const std::string on_cpu = " on " + Device::cpu().str(), on_gpu = " on " + kGpu.str();
    REQUIRE(cpu_msg.find(on_cpu) != std::string::npos);
    CHECK(gpu_msg == cpu_msg.replace(cpu_msg.find(on_cpu), on_cpu.size(), on_gpu));
    CHECK_NOTHROW(gpu().synchronize());  // reported once

    // Until then dx held the other outputs' gradients: the CPU's result with the bad
    // entries' dy at 0 (pointed at index 0, where adding +0 changes nothing).
    Tensor fixed_a = clone(bad_a), fixed_dy = clone(dy_host);
    for (int64_t i : {20, 40}) {
      fixed_a.data<int32_t>()[i] = 0;
      if (dt == DType::kF32) {
        fixed_dy.data<float>()[i] = 0.0f;
      } else {
        fixed_dy.data<double>()[i] = 0.0;
      }
    }
    cpu().maxpool2d_backward(fixed_dy, fixed_a, dx_cpu);
    expect_identical(dx, dx_cpu);

    // The backend still works afterwards.
    gpu().maxpool2d_backward(dy, a, dx);
    gpu().synchronize();
    cpu().maxpool2d_backward(dy_host, host_a, dx_cpu);
    expect_identical(dx, dx_cpu);
  }
}

const PoolCase kAvgPoolCases[] = {
    {2, 3, 7, 6, 2, 2, 0}, {2, 3, 7, 6, 3, 2, 0}, {1, 2, 9, 11, 3, 1, 0}, {3, 2, 5, 5, 5, 1, 0},
    {2, 4, 13, 9, 3, 3, 0}, {1, 1, 1, 1, 1, 1, 0}, {2, 3, 8, 7, 2, 1, 0}, {2, 2, 11, 10, 4, 3, 0},
};

TEST_CASE("avgpool2d and avgpool2d_backward match the CPU reference (dx overwritten, skipped positions 0)") {
  uint64_t seed = 700;
  for (DType dt : kFloatTypes) {
    for (const PoolCase& c : kAvgPoolCases) {
      CAPTURE(dtype_name(dt));
      CAPTURE(pool_case_str(c));
      const Shape s{c.N, c.C, c.H, c.W};
      const int64_t P = out_extent(c.H, c.kernel, c.stride, 0), Q = out_extent(c.W, c.kernel, c.stride, 0);
      const Shape out{c.N, c.C, P, Q};
      Tensor x = random_tensor(s, dt, seed++);
      Tensor yc = Tensor::empty(out, dt, Device::cpu()), yg = gpu().empty(out, dt);
      cpu().avgpool2d(x, c.kernel, c.stride, yc);
      gpu().avgpool2d(to_gpu(x), c.kernel, c.stride, yg);
      EXPECT_CLOSE_TOL(yg, yc, reduction_tol(dt, c.kernel * c.kernel));

      Tensor dy = random_tensor(out, dt, seed++);
      Tensor dx0 = random_tensor(s, dt, seed++);  // garbage: overwritten
      Tensor dxc = clone(dx0), dxg = to_gpu(dx0);
      cpu().avgpool2d_backward(dy, c.kernel, c.stride, dxc);
      gpu().avgpool2d_backward(to_gpu(dy), c.kernel, c.stride, dxg);
      EXPECT_CLOSE_TOL(dxg, dxc, reduction_tol(dt, c.kernel * c.kernel));
    }
  }
}

}  // namespace
}  // namespace gpipe

int main(int argc, char** argv) { return gpipe::gpu_testing::run_gpu_tests(argc, argv); }
