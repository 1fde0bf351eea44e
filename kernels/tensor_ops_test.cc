// Backend::binary, sum_to, reduce_rows, reduce_rows_backward, softmax and
// softmax_backward on the CPU reference: float64 against references written here from
// the definitions (coordinates taken apart one by one, sums in long double), the
// gradients against central differences, float32 against float64, bfloat16 as float32
// widened and rounded once, operands aliased, and the refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

// The coordinate of flat index i of `shape` along dimension k.
int64_t coordinate(const Shape& shape, int64_t i, size_t k) {
  for (size_t j = shape.size(); j-- > k + 1;) i /= shape[j];
  return i % shape[k];
}

Tensor copy_of(const Tensor& t) {
  Tensor c = cpu().empty(t.shape(), t.dtype());
  cpu().copy(t, c);
  return c;
}

// The flat index into `s` (aligned at the right with `out`, size-1 dimensions read at 0)
// of element i of `out`.
int64_t source_index(const Shape& s, const Shape& out, int64_t i) {
  int64_t index = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    const size_t ok = k + out.size() - s.size();
    index = index * s[k] + (s[k] == 1 ? 0 : coordinate(out, i, ok));
  }
  return index;
}

// In the operands' own type: one operation, rounded once (a long double result rounded
// again to double could differ in the last bit).
template <typename T>
T apply(Binary op, T a, T b) {
  switch (op) {
    case Binary::kAdd: return a + b;
    case Binary::kSub: return a - b;
    case Binary::kMul: return a * b;
    case Binary::kDiv: return a / b;
  }
  return 0;
}

const Binary kBinaries[] = {Binary::kAdd, Binary::kSub, Binary::kMul, Binary::kDiv};
const Reduce kReductions[] = {Reduce::kSum, Reduce::kMean, Reduce::kMax, Reduce::kNorm};

struct Pair {
  Shape a, b, out;
};
const Pair kPairs[] = {
    {{4, 3, 5}, {4, 3, 5}, {4, 3, 5}},  // equal
    {{4, 3, 5}, {5}, {4, 3, 5}},        // a parameter over the last dimension
    {{4, 3, 5}, {4, 3, 1}, {4, 3, 5}},  // a per-row factor (a reduction kept as a column)
    {{3, 1}, {4, 1, 5}, {4, 3, 5}},     // both broadcast
    {{1}, {2, 3}, {2, 3}},              // a scalar
    {{6, 1, 1}, {1, 7}, {6, 1, 7}},
};

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

Tensor widened(Backend& be, const Tensor& t) {
  Tensor w = be.empty(t.shape(), DType::kF32);
  be.cast(t, w);
  return w;
}

}  // namespace

TEST_CASE("binary broadcasts as NumPy does, every operation, in float64 exactly and in float32") {
  for (const Pair& p : kPairs) {
    for (Binary op : kBinaries) {
      CAPTURE(binary_name(op));
      CAPTURE(shape_str(p.a));
      CAPTURE(shape_str(p.b));
      const Tensor a = random_tensor(p.a, DType::kF64, 1, 0.5, 2.0), b = random_tensor(p.b, DType::kF64, 2, 0.5, 2.0);
      Tensor y = cpu().empty(p.out, DType::kF64);
      cpu().binary(op, a, b, y);
      const auto va = to_doubles(a), vb = to_doubles(b), vy = to_doubles(y);
      for (int64_t i = 0; i < y.numel(); ++i) {
        const double want = apply<double>(op, va[source_index(p.a, p.out, i)], vb[source_index(p.b, p.out, i)]);
        CHECK(vy[i] == want);  // one operation, rounded once in double on both sides
      }
      // float32: the same operation on the rounded operands, rounded once.
      Tensor a32 = cpu().empty(p.a, DType::kF32), b32 = cpu().empty(p.b, DType::kF32), y32 = cpu().empty(p.out, DType::kF32);
      cpu().cast(a, a32);
      cpu().cast(b, b32);
      cpu().binary(op, a32, b32, y32);
      const auto fa = to_doubles(a32), fb = to_doubles(b32), fy = to_doubles(y32);
      for (int64_t i = 0; i < y.numel(); ++i) {
        const float want = apply<float>(op, static_cast<float>(fa[source_index(p.a, p.out, i)]),
                                        static_cast<float>(fb[source_index(p.b, p.out, i)]));
        CHECK(static_cast<float>(fy[i]) == want);
      }
    }
  }
}

TEST_CASE("binary may write over an operand of the result's shape") {
  const Tensor a0 = random_tensor({4, 3, 5}, DType::kF64, 3), b = random_tensor({3, 1}, DType::kF64, 4, 0.5, 2.0);
  Tensor want = cpu().empty({4, 3, 5}, DType::kF64);
  cpu().binary(Binary::kDiv, a0, b, want);
  Tensor a = copy_of(a0);
  cpu().binary(Binary::kDiv, a, b, a);
  CHECK(same_bits(a, want));
  Tensor c = copy_of(a0);
  cpu().binary(Binary::kSub, b, c, c);  // the other side
  cpu().binary(Binary::kSub, b, a0, want);
  CHECK(same_bits(c, want));
}

TEST_CASE("sum_to sums over the broadcast dimensions: the gradient of a broadcast operand") {
  for (const Pair& p : kPairs) {
    for (const Shape& target : {p.a, p.b}) {
      CAPTURE(shape_str(p.out));
      CAPTURE(shape_str(target));
      const Tensor x = random_tensor(p.out, DType::kF64, 5);
      Tensor y = cpu().empty(target, DType::kF64);
      cpu().sum_to(x, y);
      std::vector<long double> want(static_cast<size_t>(y.numel()), 0.0L);
      const auto vx = to_doubles(x);
      for (int64_t i = 0; i < x.numel(); ++i) want[source_index(target, p.out, i)] += vx[i];
      const auto vy = to_doubles(y);
      for (size_t j = 0; j < want.size(); ++j) CHECK(vy[j] == doctest::Approx(static_cast<double>(want[j])).epsilon(1e-14));
      // The adjoint of broadcasting: <sum_to(x), v> = <x, broadcast(v)>.
      const Tensor v = random_tensor(target, DType::kF64, 6);
      Tensor zeros = cpu().zeros(p.out, DType::kF64), bv = cpu().empty(p.out, DType::kF64);
      cpu().binary(Binary::kAdd, zeros, v, bv);
      CHECK(gpipe::testing::dot(y, v) == doctest::Approx(gpipe::testing::dot(x, bv)).epsilon(1e-13));
    }
  }
}

TEST_CASE("reduce_rows and its backward, each reduction, against the definition and central differences") {
  const Tensor x = random_tensor({6, 9}, DType::kF64, 7, -2.0, 2.0);
  const Tensor dy = random_tensor({6}, DType::kF64, 8);
  const auto vx = to_doubles(x), vdy = to_doubles(dy);
  for (Reduce op : kReductions) {
    CAPTURE(reduce_name(op));
    Tensor y = cpu().empty({6, 1}, DType::kF64), dx = cpu().empty({6, 9}, DType::kF64);
    cpu().reduce_rows(op, x, y);
    const auto vy = to_doubles(y);
    auto row_value = [&](const std::vector<double>& v, int r) {
      long double acc = op == Reduce::kMax ? v[r * 9] : 0.0L;
      for (int c = 0; c < 9; ++c) {
        const long double e = v[r * 9 + c];
        if (op == Reduce::kMax) acc = e > acc ? e : acc;
        else acc += op == Reduce::kNorm ? e * e : e;
      }
      if (op == Reduce::kMean) acc /= 9;
      if (op == Reduce::kNorm) acc = std::sqrt(acc);
      return acc;
    };
    for (int r = 0; r < 6; ++r) CHECK(vy[r] == doctest::Approx(static_cast<double>(row_value(vx, r))).epsilon(1e-14));
    cpu().reduce_rows_backward(op, x, y, dy, dx);
    const auto vdx = to_doubles(dx);
    for (int r = 0; r < 6; ++r) {
      for (int c = 0; c < 9; ++c) {
        std::vector<double> plus = vx, minus = vx;
        const double h = 1e-6;
        plus[r * 9 + c] += h;
        minus[r * 9 + c] -= h;
        const double slope = static_cast<double>((row_value(plus, r) - row_value(minus, r)) / (2 * h));
        CHECK(vdx[r * 9 + c] == doctest::Approx(vdy[r] * slope).epsilon(1e-7).scale(1e-9));
      }
    }
  }
}

TEST_CASE("max's gradient goes to the first largest entry; a zero row's norm has a zero gradient") {
  Tensor x = Tensor::from_vector<double>({1, 3, 3, 0, 0, 0}, {2, 3});
  Tensor y = cpu().empty({2}, DType::kF64), dy = Tensor::from_vector<double>({2, 5}, {2}), dx = cpu().empty({2, 3}, DType::kF64);
  cpu().reduce_rows(Reduce::kMax, x, y);
  cpu().reduce_rows_backward(Reduce::kMax, x, y, dy, dx);
  CHECK(to_doubles(dx) == std::vector<double>{0, 2, 0, 5, 0, 0});
  cpu().reduce_rows(Reduce::kNorm, x, y);
  cpu().reduce_rows_backward(Reduce::kNorm, x, y, dy, dx);
  CHECK(to_doubles(dx)[3] == 0.0);
  CHECK(std::isfinite(to_doubles(dx)[4]));
  Tensor nan_row = Tensor::from_vector<double>({1, NAN, 2}, {1, 3});
  Tensor m = cpu().empty({1}, DType::kF64);
  cpu().reduce_rows(Reduce::kMax, nan_row, m);
  CHECK(std::isnan(to_doubles(m)[0]));
}

TEST_CASE("softmax and its backward against the definition and central differences") {
  const Tensor x = random_tensor({5, 7}, DType::kF64, 9, -30.0, 30.0);  // wide: the max shift matters
  const Tensor dy = random_tensor({5, 7}, DType::kF64, 10);
  const auto vx = to_doubles(x), vdy = to_doubles(dy);
  auto softmax_row = [](const std::vector<double>& v, int r) {
    std::vector<long double> out(7);
    long double sum = 0;
    for (int c = 0; c < 7; ++c) sum += std::exp(static_cast<long double>(v[r * 7 + c]) - 30.0L);
    for (int c = 0; c < 7; ++c) out[c] = std::exp(static_cast<long double>(v[r * 7 + c]) - 30.0L) / sum;
    return out;
  };
  Tensor y = cpu().empty({5, 7}, DType::kF64);
  cpu().softmax(x, y);
  const auto vy = to_doubles(y);
  for (int r = 0; r < 5; ++r) {
    const auto want = softmax_row(vx, r);
    for (int c = 0; c < 7; ++c) CHECK(vy[r * 7 + c] == doctest::Approx(static_cast<double>(want[c])).epsilon(1e-13).scale(1e-300));
  }
  Tensor dx = cpu().empty({5, 7}, DType::kF64);
  cpu().softmax_backward(y, dy, dx);
  const auto vdx = to_doubles(dx);
  for (int r = 0; r < 5; ++r) {
    for (int c = 0; c < 7; ++c) {  // d/dx_c of sum_j dy_j softmax_j
      std::vector<double> plus = vx, minus = vx;
      const double h = 1e-5;
      plus[r * 7 + c] += h;
      minus[r * 7 + c] -= h;
      const auto sp = softmax_row(plus, r), sm = softmax_row(minus, r);
      long double d = 0;
      for (int j = 0; j < 7; ++j) d += vdy[r * 7 + j] * (sp[j] - sm[j]) / (2 * h);
      CHECK(vdx[r * 7 + c] == doctest::Approx(static_cast<double>(d)).epsilon(1e-6).scale(1e-6));
    }
  }
  Tensor in_place = copy_of(x);
  cpu().softmax(in_place, in_place);
  CHECK(same_bits(in_place, y));
}

TEST_CASE("float32 reductions and softmax equal float64's to float32's rounding") {
  const Tensor x64 = random_tensor({4, 300}, DType::kF64, 11, -3.0, 3.0);
  Tensor x = cpu().empty(x64.shape(), DType::kF32);
  cpu().cast(x64, x);
  Tensor x_back = cpu().empty(x64.shape(), DType::kF64);
  cpu().cast(x, x_back);  // the float32 values, exactly
  for (Reduce op : kReductions) {
    CAPTURE(reduce_name(op));
    Tensor y = cpu().empty({4}, DType::kF32), y64 = cpu().empty({4}, DType::kF64);
    cpu().reduce_rows(op, x, y);
    cpu().reduce_rows(op, x_back, y64);
    GPIPE_EXPECT_CLOSE(y, y64, 1e-6, 1e-6);  // summed in double on both sides: one float32 rounding apart
  }
  Tensor s = cpu().empty(x.shape(), DType::kF32), s64 = cpu().empty(x.shape(), DType::kF64);
  cpu().softmax(x, s);
  cpu().softmax(x_back, s64);
  GPIPE_EXPECT_CLOSE(s, s64, 4e-6, 1e-9);
}

TEST_CASE("in bfloat16 every op is float32's on the widened values, rounded once") {
  CpuBackend bare(Device::cpu());  // float32 and float64 only
  const Tensor a = random_tensor({3, 4, 6}, DType::kBF16, 12, 0.5, 2.0), b = random_tensor({4, 1}, DType::kBF16, 13, 0.5, 2.0);
  auto rounded = [&](const Tensor& wide) {
    Tensor n = bare.empty(wide.shape(), DType::kBF16);
    bare.cast(wide, n);
    return n;
  };
  for (Binary op : kBinaries) {
    Tensor y = cpu().empty({3, 4, 6}, DType::kBF16), y32 = bare.empty({3, 4, 6}, DType::kF32);
    cpu().binary(op, a, b, y);
    bare.binary(op, widened(bare, a), widened(bare, b), y32);
    CHECK(same_bits(y, rounded(y32)));
  }
  Tensor s = cpu().empty({4, 1}, DType::kBF16), s32 = bare.empty({4, 1}, DType::kF32);
  cpu().sum_to(a, s);
  bare.sum_to(widened(bare, a), s32);
  CHECK(same_bits(s, rounded(s32)));
  for (Reduce op : kReductions) {
    Tensor r = cpu().empty({12}, DType::kBF16), r32 = bare.empty({12}, DType::kF32);
    cpu().reduce_rows(op, a, r);
    bare.reduce_rows(op, widened(bare, a), r32);
    CHECK(same_bits(r, rounded(r32)));
    const Tensor dy = random_tensor({12}, DType::kBF16, 14);
    Tensor dx = cpu().empty(a.shape(), DType::kBF16), dx32 = bare.empty(a.shape(), DType::kF32);
    cpu().reduce_rows_backward(op, a, r, dy, dx);
    bare.reduce_rows_backward(op, widened(bare, a), widened(bare, r), widened(bare, dy), dx32);
    CHECK(same_bits(dx, rounded(dx32)));
  }
  Tensor p = cpu().empty(a.shape(), DType::kBF16), p32 = bare.empty(a.shape(), DType::kF32);
  cpu().softmax(a, p);
  bare.softmax(widened(bare, a), p32);
  CHECK(same_bits(p, rounded(p32)));
}

TEST_CASE("shapes that do not broadcast and results of the wrong shape are refused, naming both") {
  const Tensor a = random_tensor({4, 3}, DType::kF32, 15), b = random_tensor({4}, DType::kF32, 16);
  Tensor y = cpu().empty({4, 3}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().binary(Binary::kAdd, a, b, y),
                       doctest::Contains("binary add: shapes (4, 3) and (4) do not broadcast"), Error);
  Tensor wrong = cpu().empty({3, 4}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().binary(Binary::kMul, a, a, wrong),
                       doctest::Contains("must have the broadcast shape (4, 3)"), Error);
  Tensor s = cpu().empty({2}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().sum_to(a, s), doctest::Contains("sum_to"), Error);
  Tensor r = cpu().empty({3}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().reduce_rows(Reduce::kMean, a, r), doctest::Contains("reduce_rows mean"), Error);
  const Tensor d = random_tensor({4, 3}, DType::kF64, 17);
  CHECK_THROWS_WITH_AS(cpu().binary(Binary::kSub, a, d, y), doctest::Contains("differ in dtype"), Error);
}

TEST_CASE("transpose_blocks moves block [r, c] to [c, r] exactly, any element type; bad sizes are refused") {
  // (rows, cols, block elements): a tensor group's shares of positions (B, T, run), a
  // row maximum's gathered members (T, n, 1), and one-row and one-column cases.
  const int64_t cases[][3] = {{3, 2, 5}, {2, 4, 1}, {1, 3, 4}, {4, 1, 2}, {2, 3, 0}};
  for (DType dt : {DType::kF64, DType::kF32, DType::kBF16, DType::kI32}) {
    for (const auto& c : cases) {
      const int64_t rows = c[0], cols = c[1], block = c[2];
      INFO(dtype_name(dt) << " " << rows << " x " << cols << " blocks of " << block);
      Tensor src = cpu().empty({rows * cols * block}, dt);
      std::vector<uint8_t> bytes(src.nbytes());
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>((i * 37 + 11) % 251);
      if (!bytes.empty()) std::memcpy(src.raw_data(), bytes.data(), bytes.size());
      Tensor dst = cpu().empty({cols, rows, block}, dt);
      cpu().transpose_blocks(src, rows, cols, dst);
      const size_t es = dtype_size(dt), bb = static_cast<size_t>(block) * es;
      const auto* out = static_cast<const uint8_t*>(dst.raw_data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < cols; ++k) {
          CHECK(std::memcmp(out + (k * rows + r) * bb, bytes.data() + (r * cols + k) * bb, bb) == 0);
        }
      }
      // Back again: the identity.
      Tensor again = cpu().empty(src.shape(), dt);
      cpu().transpose_blocks(dst, cols, rows, again);
      CHECK(std::memcmp(again.raw_data(), src.raw_data(), src.nbytes()) == 0);
    }
  }
  Tensor a = cpu().empty({12}, DType::kF32), b = cpu().empty({12}, DType::kF32);
  CHECK_THROWS_WITH_AS(cpu().transpose_blocks(a, 5, 2, b), doctest::Contains("no 5 x 2 equal blocks"), Error);
  Tensor d = cpu().empty({12}, DType::kF64);
  CHECK_THROWS_WITH_AS(cpu().transpose_blocks(a, 3, 2, d), doctest::Contains("one dtype and size"), Error);
  CHECK_THROWS_WITH_AS(cpu().transpose_blocks(a, 3, 2, a), doctest::Contains("overlap"), Error);
  Tensor wide = cpu().empty({18}, DType::kF32);
  Tensor front = wide.narrow_rows(0, 12), back = wide.narrow_rows(6, 12);
  CHECK_THROWS_WITH_AS(cpu().transpose_blocks(front, 3, 2, back), doctest::Contains("overlap"), Error);
}
