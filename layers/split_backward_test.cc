// Zero-bubble schedules split a layer's backward into B (backward_input) and W
// (backward_weight). For every layer that splits, the two halves give exactly the
// whole backward's input gradient and parameter gradients, whichever order other
// micro-batches' halves run in; a layer that does not split does everything in B.
// The counts the planner splits backward's time by (weight_grad_flops for W, the
// rest of backward for B) equal a hand count of what each half runs.
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "layers/activation.h"
#include "layers/attention.h"
#include "layers/conv2d.h"
#include "layers/linear.h"
#include "layers/gqa_attention.h"
#include "layers/llama_block.h"
#include "layers/rmsnorm.h"
#include "layers/swiglu.h"
#include "layers/transformer.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

std::vector<std::vector<double>> grads_of(Layer& l) {
  std::vector<std::vector<double>> out;
  for (Parameter* p : l.parameters()) out.push_back(to_doubles(p->grad));
  return out;
}

void zero(Layer& l) {
  for (Parameter* p : l.parameters()) backend_for(Device::cpu()).fill(p->grad, 0.0);
}

// Two micro-batches (of 3 and 2 samples): the whole backward of each, against B of
// both then W of both, and against B of both then one batched W of both.
// all_deferred: every parameter gradient waits for W (a composite layer may take
// some in B: layer norms do).
void check_split(Layer& l, const Shape& sample, bool all_deferred) {
  Backend& be = backend_for(Device::cpu());
  CHECK(l.splits_backward());
  auto batch_of = [](int64_t n, const Shape& per_sample) {
    Shape s{n};
    s.insert(s.end(), per_sample.begin(), per_sample.end());
    return s;
  };
  Tensor x[2] = {random_tensor(batch_of(3, sample), DType::kF64, 1),
                 random_tensor(batch_of(2, sample), DType::kF64, 2)};
  Tensor dy[2] = {random_tensor(batch_of(3, l.output_shape()), DType::kF64, 3),
                  random_tensor(batch_of(2, l.output_shape()), DType::kF64, 4)};
  ForwardArgs args;
  Context ctx[2];
  std::vector<double> dx_whole[2], dx_split[2];
  zero(l);
  for (int i = 0; i < 2; ++i) {
    l.forward(be, x[i], &ctx[i], args);
    dx_whole[i] = to_doubles(l.backward(be, dy[i], ctx[i]));
  }
  const auto whole = grads_of(l);
  zero(l);
  for (int i = 0; i < 2; ++i) {
    Context c;
    l.forward(be, x[i], &c, args);
    ctx[i] = c;
    dx_split[i] = to_doubles(l.backward_input(be, dy[i], ctx[i]));
  }
  // B leaves the weight gradients for W.
  int deferred = 0;
  for (const auto& g : grads_of(l)) {
    bool zero_grad = true;
    for (double v : g) zero_grad = zero_grad && v == 0.0;
    deferred += zero_grad;
  }
  CHECK(deferred > 0);
  if (all_deferred) CHECK(deferred == static_cast<int>(l.parameters().size()));
  l.backward_weight(be, ctx[1]);
  l.backward_weight(be, ctx[0]);
  for (int i = 0; i < 2; ++i) CHECK(dx_split[i] == dx_whole[i]);
  const auto split = grads_of(l);
  REQUIRE(split.size() == whole.size());
  for (size_t i = 0; i < split.size(); ++i) GPIPE_EXPECT_CLOSE(split[i], whole[i], 1e-14, 1e-15);

  // A batched W: one product over both micro-batches' rows, the same sums.
  zero(l);
  for (int i = 0; i < 2; ++i) {
    Context c;
    l.forward(be, x[i], &c, args);
    ctx[i] = c;
    CHECK(to_doubles(l.backward_input(be, dy[i], ctx[i])) == dx_whole[i]);
  }
  l.backward_weight(be, std::vector<Context*>{&ctx[0], &ctx[1]});
  const auto batched = grads_of(l);
  REQUIRE(batched.size() == whole.size());
  for (size_t i = 0; i < batched.size(); ++i) GPIPE_EXPECT_CLOSE(batched[i], whole[i], 1e-12, 1e-14);
}

}  // namespace

TEST_CASE("linear: B then W equals the whole backward") {
  LinearOptions o(5, 4);
  o.dtype = DType::kF64;
  Linear l(o);
  check_split(l, {5}, true);
}

TEST_CASE("attention: B then W equals the whole backward") {
  AttentionOptions o(8, 2, 4);
  o.dtype = DType::kF64;
  o.dropout = 0.25;
  CausalSelfAttention l(o);
  check_split(l, {4, 8}, true);
}

TEST_CASE("transformer block: B then W equals the whole backward") {
  TransformerBlockOptions o(8, 2, 4);
  o.dtype = DType::kF64;
  o.dropout = 0.25;
  TransformerBlock l(o);
  check_split(l, {4, 8}, false);
}

TEST_CASE("swiglu: B then W equals the whole backward") {
  SwiGLUOptions o(8, 12);
  o.leading = {4};
  o.dtype = DType::kF64;
  SwiGLU l(o);
  check_split(l, {4, 8}, true);  // all three weight gradients wait for W
}

TEST_CASE("rmsnorm: B then W equals the whole backward") {
  RmsNormOptions o({4, 8});
  o.dtype = DType::kF64;
  RmsNorm l(o);
  check_split(l, {4, 8}, true);  // dg waits for W
}

TEST_CASE("gqa_attention: B then W equals the whole backward") {
  GqaAttentionOptions o(8, 4, 4);
  o.kv_heads = 2;
  o.dtype = DType::kF64;
  GqaAttention l(o);
  check_split(l, {4, 8}, true);  // the four projections' weight gradients wait for W
}

TEST_CASE("llama_block: B then W equals the whole backward") {
  LlamaBlockOptions o(8, 4, 12, 4);
  o.kv_heads = 2;
  o.dtype = DType::kF64;
  LlamaBlock l(o);
  check_split(l, {4, 8}, true);  // the norms' scales too
  o.dropout = 0.25;
  LlamaBlock dropped(o);
  check_split(dropped, {4, 8}, true);
}

TEST_CASE("conv2d: B then W equals the whole backward") {
  Conv2dOptions o({2, 5, 5}, 3, 3);
  o.pad = 1;
  o.dtype = DType::kF64;
  Conv2d l(o);
  check_split(l, {2, 5, 5}, true);
}

TEST_CASE("a layer that does not split does all its work in B") {
  Relu r(Shape{4}, DType::kF64);
  CHECK(!r.splits_backward());
  Backend& be = backend_for(Device::cpu());
  Tensor x = random_tensor({2, 4}, DType::kF64, 5), dy = random_tensor({2, 4}, DType::kF64, 6);
  Context c1, c2;
  r.forward(be, x, &c1);
  r.forward(be, x, &c2);
  const auto whole = to_doubles(r.backward(be, dy, c1));
  CHECK(to_doubles(r.backward_input(be, dy, c2)) == whole);
  r.backward_weight(be, c2);  // nothing to do
}

// What each half asks of the backend, counted by hand from backward_input_impl and
// backward_weight_impl: a matrix product (R, k) x (k, n) is 2 R k n flops, plus k n
// when it accumulates into a gradient; a bias gradient is R n adds.
TEST_CASE("linear: B and W flops and bytes, counted by hand") {
  const double R = 3 * 2, in = 5, out = 4;  // 3 samples of 2 rows
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    LinearOptions o(5, 4);
    o.leading = {2};
    o.bias = bias;
    const LayerCost c = Linear(o).cost(3);
    const double b_flops = 2 * R * out * in;                                // dx = dy W
    const double w_flops = 2 * R * out * in + out * in + (bias ? R * out : 0);  // dW += dy^T x; db += sum dy
    CHECK(c.weight_grad_flops == w_flops);
    CHECK(c.backward_flops - c.weight_grad_flops == b_flops);
    CHECK(c.input_grad_flops == b_flops);  // B is all dx, skipped for the model's first layer
    // B reads dy and W and writes dx; W reads dy and x and reads and writes dW (float32).
    CHECK(c.weight_grad_bytes == 4 * (R * out + R * in + 2 * out * in));
    CHECK(c.backward_bytes - c.weight_grad_bytes == 4 * (R * out + out * in + R * in));
  }
}

TEST_CASE("transformer block: B and W flops, counted by hand") {
  // 3 samples of T = 4 positions, C = 8 channels, 2 heads of D = 4, MLP 4C wide.
  const double Bs = 3, T = 4, C = 8, H = 2, D = 4, R = Bs * T, n = R * C;
  TransformerBlockOptions o(8, 2, 4);
  o.dropout = 0.25;
  const LayerCost c = TransformerBlock(o).cost(3);
  // W: the weight gradients of qkv (C -> 3C), proj (C -> C), fc1 (C -> 4C), fc2 (4C -> C).
  auto dw = [&](double in, double out) { return 2 * R * in * out + in * out + R * out; };
  const double w = dw(C, 3 * C) + dw(C, C) + dw(C, 4 * C) + dw(4 * C, C);
  CHECK(w == 20064);
  CHECK(c.weight_grad_flops == w);
  // B: the four linear layers' dx, attention's core (four T x T x D products per head
  // and 4 flops per unmasked score), the two layer norms' whole backward (their
  // dgamma and dbeta included: they do not split), GELU (78 per element), the two
  // dropouts (1 per element) and the two residual adds.
  const double dx = 2 * R * (C * 3 * C + C * C + C * 4 * C + 4 * C * C);
  const double core = Bs * H * (8 * T * T * D + 4 * T * (T + 1) / 2);
  const double norms = 2 * (R * (16 * C + 2) + 2 * C);
  const double b = dx + core + norms + 78 * R * 4 * C + 2 * n + 2 * n;
  CHECK(b == 55232);
  CHECK(c.backward_flops - c.weight_grad_flops == b);
  CHECK(c.weight_grad_flops / c.backward_flops == doctest::Approx(0.2665).epsilon(1e-3));  // not ~1
}

// The kernels the planner charges one roofline each (LayerCost::backward_parts), as
// {W?, flops, bytes}, from backward_input_impl and backward_weight_impl of every
// sub-layer; float32. Compared as sets: the order of the list does not matter.
TEST_CASE("transformer block: backward's kernels, counted by hand") {
  const double Bs = 3, T = 4, C = 8, H = 2, D = 4, R = Bs * T, n = R * C, bh = Bs * H, kept = T * (T + 1) / 2;
  TransformerBlockOptions o(8, 2, 4);
  o.dropout = 0.25;
  const LayerCost c = TransformerBlock(o).cost(3);
  using P = std::tuple<bool, double, double>;
  std::vector<P> want;
  for (auto [in, out] : {std::pair<double, double>{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}}) {
    want.push_back({false, 2 * R * in * out, 4 * (R * out + in * out + R * in)});                    // dx = dy W
    want.push_back({true, 2 * R * in * out + in * out + R * out, 4 * (R * out + R * in + 2 * in * out)});  // dW, db
  }
  for (int i = 0; i < 2; ++i) {
    want.push_back({false, R * (16 * C + 2) + 2 * C, 4 * (3 * R * C + 2 * R + 5 * C)});  // layer norm
    want.push_back({false, n, 4 * 2 * n});                                                // dropout
    want.push_back({false, n, 4 * 3 * n});                                                // residual axpy
  }
  want.push_back({false, 78 * 4 * n, 4 * 3 * 4 * n});  // GELU: reads x and dy, writes dx
  // Attention's core per (batch, head): four (T, T, D) products, each reading two
  // operands and writing one (two of (T, D) and one of (T, T), or the reverse), and
  // the softmax Jacobian reading probs and dprobs where unmasked, writing all of ds.
  want.push_back({false, bh * 4 * 2 * T * T * D, 4 * bh * 4 * (2 * T * D + T * T)});
  want.push_back({false, bh * 4 * kept, 4 * bh * (2 * kept + T * T)});
  std::vector<P> got;
  for (const CostPart& p : c.backward_parts) got.push_back({p.weight, p.flops, p.bytes});
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  CHECK(got == want);
  double flops = 0, w_bytes = 0;
  for (const CostPart& p : c.backward_parts) {
    flops += p.flops;
    if (p.weight) w_bytes += p.bytes;
  }
  CHECK(flops == c.backward_flops);  // the totals are the parts' sums
  CHECK(w_bytes == c.weight_grad_bytes);
}

TEST_CASE("a layer that lists no kernels is one part per phase, and the first layer's B parts shrink with B") {
  LinearOptions o(5, 4);
  const LayerCost c = Linear(o).cost(3);
  CHECK(c.backward_parts.empty());
  const std::vector<CostPart> parts = backward_parts(c);
  REQUIRE(parts.size() == 2);
  CHECK((!parts[0].weight && parts[0].flops == c.backward_flops - c.weight_grad_flops &&
         parts[0].bytes == c.backward_bytes - c.weight_grad_bytes));
  CHECK((parts[1].weight && parts[1].flops == c.weight_grad_flops && parts[1].bytes == c.weight_grad_bytes));
  CHECK(backward_parts(Relu({4}, DType::kF32).cost(3)).size() == 1);  // no W part: it has nothing there
  // A composite's first layer: B loses its dx, every B part in proportion; W keeps all.
  TransformerBlockOptions t(8, 2, 4);
  const LayerCost block = TransformerBlock(t).cost(3);
  const LayerCost first = without_input_grad(block);
  double b_flops = 0, b_bytes = 0, w_flops = 0;
  for (const CostPart& p : first.backward_parts) (p.weight ? w_flops : b_flops) += p.flops;
  for (const CostPart& p : first.backward_parts) b_bytes += p.weight ? 0 : p.bytes;
  CHECK(b_flops == doctest::Approx(first.backward_flops - first.weight_grad_flops));
  CHECK(b_bytes == doctest::Approx(first.backward_bytes - first.weight_grad_bytes));
  CHECK(w_flops == block.weight_grad_flops);
}
