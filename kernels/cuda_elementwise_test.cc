// The generic elementwise and row ops on cuda:0 against the CPU reference, float32 and
// float64, with rows wider than a block and outputs aliasing inputs. Built only with
// --config=cuda; without a GPU it prints the skip marker and passes.
#include "tests/gpu_testing.h"

using namespace gpipe;
using namespace gpipe::gpu_testing;
using gpipe::testing::random_tensor;

TEST_CASE("mul, scale_rows and scale_columns match the CPU") {
  for (DType dt : kFloatTypes) {
    for (Shape shape : {Shape{3, 2, 5}, Shape{7, 700}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(shape));
      const int64_t C = shape.back(), R = shape_numel(shape) / C;
      Tensor a = random_tensor(shape, dt, 1), b = random_tensor(shape, dt, 2);
      Tensor s_rows = random_tensor({R}, dt, 3), s_cols = random_tensor({C}, dt, 4);
      Tensor want = cpu().empty(shape, dt), got = gpu().empty(shape, dt), host = cpu().empty(shape, dt);
      cpu().mul(a, b, want);
      gpu().mul(to_gpu(a), to_gpu(b), got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
      cpu().scale_rows(a, s_rows, want);
      Tensor ga = to_gpu(a);
      gpu().scale_rows(ga, to_gpu(s_rows), ga);  // in place
      gpu().copy(ga, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
      cpu().scale_columns(a, s_cols, want);
      gpu().scale_columns(to_gpu(a), to_gpu(s_cols), got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
    }
  }
}

// The same formulas (kernels/unary_math.h) on both sides; CUDA's expf and tanhf may differ
// from glibc's in the last bit, and silu's slope cancels near x = -1.28: compared within a
// few of the type's roundings of the value's terms (elementwise_tol's).
TEST_CASE("unary and unary_backward match the CPU for every function") {
  for (DType dt : kFloatTypes) {
    for (Unary f : {Unary::kSilu, Unary::kSigmoid, Unary::kTanh, Unary::kExp, Unary::kSquare, Unary::kRsqrt,
                    Unary::kRelu, Unary::kGelu}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(unary_name(f));
      const bool positive = f == Unary::kRsqrt;
      const Tensor x = random_tensor({9, 70}, dt, 5, positive ? 0.05 : -6.0, 6.0);
      const Tensor dy = random_tensor({9, 70}, dt, 6);
      Tensor want = cpu().empty(x.shape(), dt), host = cpu().empty(x.shape(), dt);
      cpu().unary(f, x, want);
      Tensor gx = to_gpu(x);
      gpu().unary(f, gx, gx);  // in place
      gpu().copy(gx, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
      cpu().unary_backward(f, x, dy, want);
      Tensor got = gpu().empty(x.shape(), dt);
      gpu().unary_backward(f, to_gpu(x), to_gpu(dy), got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, elementwise_tol(dt));
    }
  }
}

TEST_CASE("row_dot and row_inverse_rms match the CPU") {
  for (DType dt : kFloatTypes) {
    for (Shape shape : {Shape{3, 2, 5}, Shape{7, 700}, Shape{1, 1}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(shape_str(shape));
      const int64_t C = shape.back(), R = shape_numel(shape) / C;
      Tensor a = random_tensor(shape, dt, 5, -2, 2), b = random_tensor(shape, dt, 6, -2, 2);
      Tensor want = cpu().empty({R}, dt), got = gpu().empty({R}, dt), host = cpu().empty({R}, dt);
      cpu().row_dot(a, b, -0.25, want);
      gpu().row_dot(to_gpu(a), to_gpu(b), -0.25, got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, reduction_tol(dt, C));
      cpu().row_inverse_rms(a, 1e-5, want);
      gpu().row_inverse_rms(to_gpu(a), 1e-5, got);
      gpu().copy(got, host);
      EXPECT_CLOSE_TOL(host, want, reduction_tol(dt, C));
    }
  }
}

// The broadcasting, reduction and softmax ops (kernels/broadcast.h): binary equals the
// CPU bit for bit (one operation per element), sum_to too (the same order of additions);
// the row reductions and softmax within a reduction's rounding (a tree, not a scan).
TEST_CASE("binary, sum_to, reduce_rows and softmax match the CPU") {
  struct Pair {
    Shape a, b, out;
  };
  const Pair pairs[] = {{{4, 3, 5}, {5}, {4, 3, 5}}, {{4, 3, 5}, {4, 3, 1}, {4, 3, 5}}, {{3, 1}, {4, 1, 5}, {4, 3, 5}},
                        {{7, 700}, {7, 700}, {7, 700}}};
  for (DType dt : kFloatTypes) {
    CAPTURE(dtype_name(dt));
    for (const Pair& p : pairs) {
      CAPTURE(shape_str(p.a));
      CAPTURE(shape_str(p.b));
      const Tensor a = random_tensor(p.a, dt, 1, 0.5, 2), b = random_tensor(p.b, dt, 2, 0.5, 2);
      for (Binary op : {Binary::kAdd, Binary::kSub, Binary::kMul, Binary::kDiv}) {
        Tensor want = cpu().empty(p.out, dt), got = gpu().empty(p.out, dt), host = cpu().empty(p.out, dt);
        cpu().binary(op, a, b, want);
        gpu().binary(op, to_gpu(a), to_gpu(b), got);
        gpu().copy(got, host);
        EXPECT_CLOSE_TOL(host, want, (Tol{0, 0}));
      }
      const Tensor x = random_tensor(p.out, dt, 3);
      for (const Shape& target : {p.a, p.b}) {
        Tensor want = cpu().empty(target, dt), got = gpu().empty(target, dt), host = cpu().empty(target, dt);
        cpu().sum_to(x, want);
        gpu().sum_to(to_gpu(x), got);
        gpu().copy(got, host);
        EXPECT_CLOSE_TOL(host, want, (Tol{0, 0}));
      }
    }
    // Row blocks of 32 to 256 threads, powers of two and not (70, 150, 200 columns).
    for (Shape shape : {Shape{3, 2, 5}, Shape{7, 700}, Shape{1, 1}, Shape{4, 70}, Shape{3, 150}, Shape{2, 200}}) {
      CAPTURE(shape_str(shape));
      const int64_t C = shape.back(), R = shape_numel(shape) / C;
      const Tensor x = random_tensor(shape, dt, 4, -3, 3), dy = random_tensor({R}, dt, 5), dys = random_tensor(shape, dt, 6);
      for (Reduce op : {Reduce::kSum, Reduce::kMean, Reduce::kMax, Reduce::kNorm}) {
        CAPTURE(reduce_name(op));
        Tensor want = cpu().empty({R}, dt), got = gpu().empty({R}, dt), host = cpu().empty({R}, dt);
        cpu().reduce_rows(op, x, want);
        gpu().reduce_rows(op, to_gpu(x), got);
        gpu().copy(got, host);
        EXPECT_CLOSE_TOL(host, want, reduction_tol(dt, C));
        Tensor dwant = cpu().empty(shape, dt), dgot = gpu().empty(shape, dt), dhost = cpu().empty(shape, dt);
        cpu().reduce_rows_backward(op, x, want, dy, dwant);
        gpu().reduce_rows_backward(op, to_gpu(x), to_gpu(want), to_gpu(dy), dgot);
        gpu().copy(dgot, dhost);
        EXPECT_CLOSE_TOL(dhost, dwant, elementwise_tol(dt));
      }
      Tensor want = cpu().empty(shape, dt), host = cpu().empty(shape, dt);
      cpu().softmax(x, want);
      Tensor gx = to_gpu(x);
      gpu().softmax(gx, gx);  // in place
      gpu().copy(gx, host);
      EXPECT_CLOSE_TOL(host, want, reduction_tol(dt, C));
      Tensor dwant = cpu().empty(shape, dt), dgot = gpu().empty(shape, dt);
      cpu().softmax_backward(want, dys, dwant);
      gpu().softmax_backward(to_gpu(want), to_gpu(dys), dgot);
      gpu().copy(dgot, host);
      EXPECT_CLOSE_TOL(host, dwant, reduction_tol(dt, C));
    }
  }
}

TEST_CASE("the CUDA ops reject what the CPU rejects") {
  Tensor x = to_gpu(random_tensor({4, 3}, DType::kF32, 1)), y = gpu().empty({4, 3}, DType::kF32);
  CHECK_THROWS_WITH(gpu().scale_rows(x, to_gpu(random_tensor({3}, DType::kF32, 2)), y),
                    doctest::Contains("scale_rows: s float32(3) on cuda:0 must be float32 with 4 contiguous elements"));
  CHECK_THROWS_WITH(gpu().mul(x, random_tensor({4, 3}, DType::kF32, 3), y), doctest::Contains("is not on cuda:0"));
}

int main(int argc, char** argv) { return run_gpu_tests(argc, argv); }
