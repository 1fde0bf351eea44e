// Layers written as forward only (layers/derived.h): a derived SwiGLU against the
// hand-written built-in (forward, input and weight gradients, B then W, batched W, cost),
// a derived RMSNorm against its definition, every op's derived gradient against finite
// differences in float64, recompute and dropout's keys, the first layer's missing dx,
// and the messages.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "layers/derived.h"
#include "layers/gradcheck.h"
#include "layers/swiglu.h"
#include "runtime/error.h"
#include "runtime/random.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::context_bytes;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

// The docs' SwiGLU (docs/WRITING_LAYERS.md), over (3, dim) per sample.
class MySwiGLU : public DerivedLayer {
 public:
  MySwiGLU(int64_t dim, int64_t hidden, DType dtype, uint64_t seed)
      : DerivedLayer("my_swiglu", {3, dim}, {3, dim}, dtype, seed),
        gate_(add_parameter("gate.weight", {hidden, dim}, 1 / std::sqrt(dim), mix_seed(seed, 0))),
        up_(add_parameter("up.weight", {hidden, dim}, 1 / std::sqrt(dim), mix_seed(seed, 1))),
        down_(add_parameter("down.weight", {dim, hidden}, 1 / std::sqrt(hidden), mix_seed(seed, 2))) {}
  Var define(Graph& g, Var x) const override {
    return g.linear(g.mul(g.silu(g.linear(x, gate_)), g.linear(x, up_)), down_);
  }

 private:
  Parameter &gate_, &up_, &down_;
};

// The docs' RMSNorm.
class MyRmsNorm : public DerivedLayer {
 public:
  explicit MyRmsNorm(int64_t dim, DType dtype = DType::kF64)
      : DerivedLayer("my_rmsnorm", {dim}, {dim}, dtype, 0), g_(add_parameter("weight", {dim}, 1.0, 5)) {}
  Var define(Graph& g, Var x) const override {
    Var inv = g.rsqrt(g.add(g.mean(g.square(x)), 1e-6));
    return g.mul(g.mul(x, inv), g.param(g_));
  }

 private:
  Parameter& g_;
};

// Every op of the Graph, with parameters broadcast on either side of each binary op.
class EveryOp : public DerivedLayer {
 public:
  explicit EveryOp(int64_t c, double dropout = 0.0)
      : DerivedLayer("every_op", {2, c}, {2, c}, DType::kF64, 9),
        w_(add_parameter("w", {c, c}, 0.5, 1)),
        b_(add_parameter("b", {c}, 0.5, 2)),
        p_(add_parameter("p", {c}, 1.0, 3)),
        q_(add_parameter("q", {2, 1}, 1.0, 4)),
        dropout_(dropout) {}
  Var define(Graph& g, Var x) const override {
    Var a = g.linear(x, w_, &b_);                                        // (B, 2, c)
    Var t = g.add(g.mul(a, g.param(p_)), 0.5);                          // a parameter on the right
    Var den = g.add(g.square(g.sub(g.param(q_), x)), 1.0);              // on the left of sub
    Var u = g.div(t, den);                                              // both sides differentiable
    Var r = g.sub(u, g.max(u));                                         // (B, 2, 1) broadcast back
    Var s = g.mul(g.softmax(r), g.norm(x));
    Var v = g.add(s, g.mean(g.sigmoid(x)));
    Var z = g.add(g.tanh(v), g.mul(g.silu(a), g.gelu(x)));
    Var e = g.div(g.exp(g.mul(z, 0.3)), g.param(p_));                   // a parameter below a division
    Var k = g.mul(g.rsqrt(g.add(g.square(a), 1.0)), g.sum(g.relu(x)));
    return g.dropout(g.add(g.add(e, k), x), dropout_);
  }

 private:
  Parameter &w_, &b_, &p_, &q_;
  double dropout_;
};

void copy_parameters(Layer& from, Layer& to) {
  auto src = from.parameters(), dst = to.parameters();
  REQUIRE(src.size() == dst.size());
  for (size_t i = 0; i < src.size(); ++i) {
    REQUIRE(src[i]->value.shape() == dst[i]->value.shape());
    cpu().copy(src[i]->value, dst[i]->value);
    dst[i]->refresh(cpu());
  }
}

void zero_grads(Layer& l) {
  for (Parameter* p : l.parameters()) cpu().fill(p->grad, 0.0);
}

std::vector<double> grads_of(Layer& l) {
  std::vector<double> out;
  for (Parameter* p : l.parameters()) {
    const auto g = to_doubles(p->grad);
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

SwiGLU builtin_swiglu(int64_t dim, int64_t hidden, DType dtype) {
  SwiGLUOptions o(dim, hidden);
  o.leading = {3};
  o.dtype = dtype;
  o.seed = 7;
  return SwiGLU(o);
}

}  // namespace

TEST_CASE("a SwiGLU written forward-only equals the hand-written one: forward, dx, weight gradients, B/W, batched W") {
  const int64_t D = 6, H = 10;
  SwiGLU hand = builtin_swiglu(D, H, DType::kF64);
  MySwiGLU derived(D, H, DType::kF64, 7);
  copy_parameters(hand, derived);
  const Tensor x = random_tensor({4, 3, D}, DType::kF64, 1), dy = random_tensor({4, 3, D}, DType::kF64, 2);
  Context ch, cd;
  GPIPE_EXPECT_CLOSE(derived.forward(cpu(), x, &cd), hand.forward(cpu(), x, &ch), 1e-13, 1e-14);
  zero_grads(hand);
  zero_grads(derived);
  const Tensor dx_hand = hand.backward(cpu(), dy, ch);
  const Tensor dx_derived = derived.backward(cpu(), dy, cd);
  GPIPE_EXPECT_CLOSE(dx_derived, dx_hand, 1e-12, 1e-13);
  GPIPE_EXPECT_CLOSE(grads_of(derived), grads_of(hand), 1e-12, 1e-13);
  const std::vector<double> whole = grads_of(derived);

  SUBCASE("B then W") {
    CHECK(derived.splits_backward());
    zero_grads(derived);
    Context c;
    derived.forward(cpu(), x, &c);
    const Tensor dx = derived.backward_input(cpu(), dy, c);
    CHECK(grads_of(derived) == std::vector<double>(whole.size(), 0.0));  // B adds no weight gradient
    GPIPE_EXPECT_CLOSE(dx, dx_hand, 1e-12, 1e-13);
    derived.backward_weight(cpu(), c);
    GPIPE_EXPECT_CLOSE(grads_of(derived), whole, 1e-13, 1e-14);
  }
  SUBCASE("batched W over three micro-batches equals W one by one") {
    std::vector<Context> cs(3);
    std::vector<Context*> ptrs;
    zero_grads(derived);
    for (int m = 0; m < 3; ++m) {
      derived.forward(cpu(), random_tensor({2, 3, D}, DType::kF64, 10 + m), &cs[m]);
      derived.backward_input(cpu(), random_tensor({2, 3, D}, DType::kF64, 20 + m), cs[m]);
      ptrs.push_back(&cs[m]);
    }
    for (Context* c : ptrs) derived.backward_weight(cpu(), *c);
    const std::vector<double> one_by_one = grads_of(derived);
    zero_grads(derived);
    derived.backward_weight(cpu(), ptrs);
    GPIPE_EXPECT_CLOSE(grads_of(derived), one_by_one, 1e-12, 1e-13);
  }
  SUBCASE("the first layer: no dx, the same weight gradients") {
    zero_grads(derived);
    Context c;
    derived.forward(cpu(), x, &c);
    CHECK_FALSE(derived.backward(cpu(), dy, c, /*need_dx=*/false).defined());
    GPIPE_EXPECT_CLOSE(grads_of(derived), whole, 1e-13, 1e-14);
  }
}

TEST_CASE("the derived SwiGLU's cost is the hand-written one's products and its context's bytes") {
  const int64_t D = 8, H = 12, batch = 5;
  MySwiGLU derived(D, H, DType::kF32, 3);
  const LayerCost c = derived.cost(batch);
  check_cost(derived, batch, c);  // parts sum to the totals, W within backward, ...
  const double R = batch * 3.0;
  // Three products, silu (29) and the gate's product (1) per hidden element.
  CHECK(c.forward_flops == doctest::Approx(3 * 2 * R * D * H + 30 * R * H));
  // W: three weight gradients, each a product plus its accumulation.
  CHECK(c.weight_grad_flops == doctest::Approx(3 * (2 * R * D * H + D * H)));
  // dx: down's and the two products' input gradients, and their sum.
  CHECK(c.input_grad_flops == doctest::Approx(2 * 2 * R * D * H + R * D));
  CHECK(c.param_bytes == 4 * 3 * D * H);
  CHECK(c.output_bytes == 4 * R * D);
  const SwiGLU hand = builtin_swiglu(D, H, DType::kF32);
  const LayerCost h = hand.cost(batch);
  CHECK(c.weight_grad_flops == doctest::Approx(h.weight_grad_flops));
  Context ctx;
  derived.forward(cpu(), random_tensor({batch, 3, D}, DType::kF32, 3), &ctx);
  CHECK(c.saved_bytes == context_bytes(ctx));
}

TEST_CASE("a derived layer without parameters: its whole backward, B then an empty W, and the first layer") {
  class Mix : public DerivedLayer {
   public:
    Mix() : DerivedLayer("mix", {2, 5}, {2, 5}, DType::kF64, 3) {}
    Var define(Graph& g, Var x) const override { return g.add(x, g.mul(g.softmax(x), g.max(x))); }
  };
  Mix l;
  CHECK_FALSE(l.splits_backward());
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, 3));
  check_cost(l, 3, l.cost(3));
  const Tensor x = random_tensor({3, 2, 5}, DType::kF64, 8), dy = random_tensor({3, 2, 5}, DType::kF64, 9);
  Context whole, split;
  l.forward(cpu(), x, &whole);
  l.forward(cpu(), x, &split);
  const auto dx = to_doubles(l.backward(cpu(), dy, whole));
  CHECK(to_doubles(l.backward_input(cpu(), dy, split)) == dx);
  l.backward_weight(cpu(), split);
  Context dropped;  // the executor drops a context whose layer does not split before W
  l.backward_weight(cpu(), dropped);
  std::vector<Context*> none = {&dropped, &dropped};
  l.backward_weight(cpu(), none);
  CHECK_FALSE(l.backward(cpu(), dy, whole, /*need_dx=*/false).defined());
  CHECK(l.cost(3).input_grad_flops == l.cost(3).backward_flops);  // all of it is dx's
}

TEST_CASE("an RMSNorm written forward-only: its definition and finite differences") {
  MyRmsNorm l(7);
  const Tensor x = random_tensor({5, 7}, DType::kF64, 4);
  const auto y = to_doubles(l.forward(cpu(), x, nullptr)), xv = to_doubles(x), g = to_doubles(l.parameters()[0]->value);
  for (int r = 0; r < 5; ++r) {
    double ms = 0;
    for (int c = 0; c < 7; ++c) ms += xv[r * 7 + c] * xv[r * 7 + c] / 7;
    for (int c = 0; c < 7; ++c) CHECK(y[r * 7 + c] == doctest::Approx(xv[r * 7 + c] / std::sqrt(ms + 1e-6) * g[c]).epsilon(1e-13));
  }
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, 4));
  Context ctx;
  l.forward(cpu(), x, &ctx);
  const LayerCost c = l.cost(5);
  check_cost(l, 5, c);
  CHECK(c.saved_bytes == context_bytes(ctx));
  // It keeps x (square's gradient), x / rms (the scale's), 1 / rms (x's) and rsqrt's
  // input; the mean's gradient needs neither its input nor its output.
  CHECK(c.saved_bytes == 8 * (2 * 5 * 7 + 2 * 5));
  // After B the context holds what W reads, x / rms, and the output gradient W needs.
  const Tensor dy = random_tensor({5, 7}, DType::kF64, 6);
  zero_grads(l);
  l.backward_input(cpu(), dy, ctx);
  CHECK(context_bytes(ctx) == 8 * (5 * 7 + 5 * 7));
  l.backward_weight(cpu(), ctx);
  const auto g_whole = grads_of(l);
  // The first layer: no dx, and none of the chain that leads only to x runs, which its
  // cost counts as dx's.
  zero_grads(l);
  Context first;
  l.forward(cpu(), x, &first);
  CHECK_FALSE(l.backward(cpu(), dy, first, /*need_dx=*/false).defined());
  CHECK(grads_of(l) == g_whole);
  // W: dy * (x / rms), its sum over the rows and the accumulation; without dx, that is all.
  CHECK(c.weight_grad_flops == doctest::Approx(5 * 7 + 5 * 7 + 2 * 7));
  CHECK(without_input_grad(c).backward_flops == doctest::Approx(c.weight_grad_flops));
}

TEST_CASE("every op's derived gradient against finite differences in float64, with dropout's mask") {
  for (double p : {0.0, 0.3}) {
    CAPTURE(p);
    EveryOp l(5, p);
    GradCheckOptions o;
    o.args.step = 3;
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, 3, o));
    check_cost(l, 3, l.cost(3));
  }
}

TEST_CASE("a recomputed forward and a split batch reproduce dropout's mask and the gradients") {
  EveryOp l(4, 0.5);
  const Tensor x = random_tensor({6, 2, 4}, DType::kF64, 5), dy = random_tensor({6, 2, 4}, DType::kF64, 6);
  ForwardArgs args;
  args.step = 11;
  Context once;
  const auto y = to_doubles(l.forward(cpu(), x, &once, args));
  zero_grads(l);
  const auto dx = to_doubles(l.backward(cpu(), dy, once));
  const auto g = grads_of(l);
  // Rematerialisation: a forward without a context, then the same forward recorded.
  CHECK(to_doubles(l.forward(cpu(), x, nullptr, args)) == y);
  ForwardArgs again = args;
  again.recompute = true;
  Context recorded;
  CHECK(to_doubles(l.forward(cpu(), x, &recorded, again)) == y);
  zero_grads(l);
  CHECK(to_doubles(l.backward(cpu(), dy, recorded)) == dx);
  CHECK(grads_of(l) == g);
  // Two micro-batches with their sample offsets: the same rows as the whole batch.
  ForwardArgs second = args;
  second.sample_offset = 2;
  const auto head = to_doubles(l.forward(cpu(), x.narrow_rows(0, 2), nullptr, args));
  const auto tail = to_doubles(l.forward(cpu(), x.narrow_rows(2, 4), nullptr, second));
  std::vector<double> split = head;
  split.insert(split.end(), tail.begin(), tail.end());
  GPIPE_EXPECT_CLOSE(split, y, 1e-14, 1e-15);
  // Another step draws another mask.
  ForwardArgs next = args;
  next.step = 12;
  CHECK(to_doubles(l.forward(cpu(), x, nullptr, next)) != y);
  // Evaluation: no dropout.
  ForwardArgs eval;
  eval.training = false;
  EveryOp plain(4, 0.0);
  copy_parameters(l, plain);
  CHECK(to_doubles(l.forward(cpu(), x, nullptr, eval)) == to_doubles(plain.forward(cpu(), x, nullptr, eval)));
}

TEST_CASE("in bfloat16 the derived SwiGLU computes what the hand-written one does") {
  SwiGLU hand = builtin_swiglu(6, 10, DType::kBF16);
  MySwiGLU derived(6, 10, DType::kBF16, 7);
  copy_parameters(hand, derived);
  const Tensor x = random_tensor({4, 3, 6}, DType::kBF16, 1), dy = random_tensor({4, 3, 6}, DType::kBF16, 2);
  Context ch, cd;
  const Tensor yh = hand.forward(cpu(), x, &ch), yd = derived.forward(cpu(), x, &cd);
  GPIPE_EXPECT_CLOSE(yd, yh, 0, 0);  // the same kernels in the same order, rounded at the same places
  zero_grads(hand);
  zero_grads(derived);
  GPIPE_EXPECT_CLOSE(derived.backward(cpu(), dy, cd), hand.backward(cpu(), dy, ch), 2e-2, 1e-2);
  GPIPE_EXPECT_CLOSE(grads_of(derived), grads_of(hand), 2e-2, 1e-2);
  for (Parameter* p : derived.parameters()) CHECK(p->grad.dtype() == DType::kF32);  // the masters' type
}

TEST_CASE("a derived layer's mistakes name the layer and the op") {
  class Bad : public DerivedLayer {
   public:
    explicit Bad(int which) : DerivedLayer("bad", {4}, {4}, DType::kF64, 0), which_(which), p_(add_parameter("p", {3}, 1, 1)) {}
    Var define(Graph& g, Var x) const override {
      if (which_ == 0) return g.mul(x, g.param(p_));  // (B, 4) * (3)
      if (which_ == 1) return g.sum(x);               // (B, 1), not (B, 4)
      Parameter stray = p_;
      return g.mul(x, g.param(stray));                // not the layer's own
    }

   private:
    int which_;
    Parameter& p_;
  };
  const Tensor x = random_tensor({2, 4}, DType::kF64, 1);
  Bad broadcast(0), shape(1), stray(2);
  CHECK_THROWS_WITH_AS(broadcast.forward(cpu(), x, nullptr),
                       doctest::Contains("bad(4) -> (4): mul: shapes (2, 4) and (3) do not broadcast"), UserError);
  CHECK_THROWS_WITH_AS(shape.forward(cpu(), x, nullptr),
                       doctest::Contains("forward returned a value of shape (2, 1), not (2, 4)"), UserError);
  CHECK_THROWS_WITH_AS(stray.forward(cpu(), x, nullptr), doctest::Contains("is not this layer's own"), UserError);
  CHECK_THROWS_AS(broadcast.cost(2), UserError);  // the cost runs the same forward on shapes
}
