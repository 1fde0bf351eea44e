// Zero-bubble schedules split a layer's backward into B (backward_input) and W
// (backward_weight). For every layer that splits, the two halves give exactly the
// whole backward's input gradient and parameter gradients, whichever order other
// micro-batches' halves run in; a layer that does not split does everything in B.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "layers/activation.h"
#include "layers/attention.h"
#include "layers/conv2d.h"
#include "layers/linear.h"
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

// Two micro-batches: the whole backward of each, against B of both then W of both.
// all_deferred: every parameter gradient waits for W (a composite layer may take
// some in B: layer norms do).
void check_split(Layer& l, const Shape& sample, bool all_deferred) {
  Backend& be = backend_for(Device::cpu());
  CHECK(l.splits_backward());
  Shape shape{3};
  shape.insert(shape.end(), sample.begin(), sample.end());
  Shape out_shape{3};
  out_shape.insert(out_shape.end(), l.output_shape().begin(), l.output_shape().end());
  Tensor x[2] = {random_tensor(shape, DType::kF64, 1), random_tensor(shape, DType::kF64, 2)};
  Tensor dy[2] = {random_tensor(out_shape, DType::kF64, 3), random_tensor(out_shape, DType::kF64, 4)};
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
