// The convolutional layers: every backward against central finite differences in
// float64, exact costs, batch norm's running statistics (deferred over micro-batches,
// untouched by recomputation, used in evaluation), and the registry names.
#include "layers/avgpool2d.h"
#include "layers/basic_block.h"
#include "layers/batchnorm2d.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/maxpool2d.h"

#include <doctest/doctest.h>

#include <cmath>
#include <functional>

#include "layers/registry.h"
#include "layers/sequential.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

// Randomises every parameter (so that BN's gamma is not all ones, and so on).
void randomize(Layer& layer, uint64_t seed) {
  for (Parameter* p : layer.parameters()) {
    Tensor r = random_tensor(p->value.shape(), DType::kF64, seed++, -1.0, 1.0);
    copy_tensor(r, p->value);
  }
}

// Per-channel mean and unbiased variance of an (N, C, H, W) batch.
void naive_stats(const Tensor& x, std::vector<double>& mean, std::vector<double>& unbiased) {
  const auto v = to_doubles(x);
  const int64_t N = x.size(0), C = x.size(1), E = x.size(2) * x.size(3);
  mean.assign(C, 0);
  unbiased.assign(C, 0);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) mean[c] += v[(n * C + c) * E + e];
    mean[c] /= N * E;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) unbiased[c] += std::pow(v[(n * C + c) * E + e] - mean[c], 2);
    unbiased[c] /= N * E - 1;
  }
}

BatchNorm2d make_bn(int64_t C, int64_t H, int64_t W) {
  BatchNorm2dOptions o({C, H, W});
  o.dtype = DType::kF64;
  return BatchNorm2d(o);
}

}  // namespace

TEST_CASE("conv2d backward matches finite differences") {
  struct Case {
    int kernel, stride, pad;
    bool bias;
  };
  for (Case c :
       {Case{3, 1, 1, true}, Case{3, 2, 1, false}, Case{3, 2, 1, true}, Case{1, 2, 0, true}, Case{2, 1, 0, false}}) {
    CAPTURE(c.kernel);
    CAPTURE(c.stride);
    CAPTURE(c.pad);
    CAPTURE(c.bias);
    Conv2dOptions o({3, 7, 6}, 4, c.kernel);
    o.stride = c.stride;
    o.pad = c.pad;
    o.bias = c.bias;
    o.dtype = DType::kF64;
    o.seed = 5;
    Conv2d conv(o);
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(conv, 2));
  }
}

TEST_CASE("batchnorm2d backward in training mode matches finite differences") {
  BatchNorm2d bn = make_bn(3, 4, 5);
  randomize(bn, 7);
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(bn, 3));
}

TEST_CASE("pooling and flatten backward match finite differences") {
  MaxPool2dOptions m({2, 7, 6}, 3);
  m.stride = 2;
  m.pad = 1;
  m.dtype = DType::kF64;
  MaxPool2d maxpool(m);
  CHECK(maxpool.output_shape() == Shape{2, 4, 3});
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(maxpool, 2));
  MaxPool2dOptions m2({2, 5, 7}, 2);  // stride defaults to the kernel
  m2.dtype = DType::kF64;
  MaxPool2d maxpool2(m2);
  CHECK(maxpool2.output_shape() == Shape{2, 2, 3});
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(maxpool2, 2));

  AvgPool2dOptions a({2, 7, 6}, 3);
  a.stride = 2;
  a.dtype = DType::kF64;
  AvgPool2d avgpool(a);
  CHECK(avgpool.output_shape() == Shape{2, 3, 2});
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(avgpool, 2));
  AvgPool2dOptions g = AvgPool2dOptions::global_pool({3, 5, 5});
  g.dtype = DType::kF64;
  AvgPool2d global(g);
  CHECK(global.output_shape() == Shape{3, 1, 1});
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(global, 2));

  Flatten flatten({2, 3, 4}, DType::kF64);
  CHECK(flatten.output_shape() == Shape{24});
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(flatten, 3));
}

TEST_CASE("basic_block backward matches finite differences, both shortcuts") {
  SUBCASE("identity shortcut") {
    BasicBlockOptions o({4, 6, 5}, 4);
    o.dtype = DType::kF64;
    o.seed = 3;
    BasicBlock block(o);
    CHECK_FALSE(block.has_projection());
    CHECK(block.output_shape() == Shape{4, 6, 5});
    randomize(block, 40);
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(block, 2));
  }
  SUBCASE("projection shortcut: stride 2 and more channels") {
    BasicBlockOptions o({3, 6, 5}, 4);
    o.stride = 2;
    o.dtype = DType::kF64;
    o.seed = 4;
    BasicBlock block(o);
    CHECK(block.has_projection());
    CHECK(block.output_shape() == Shape{4, 3, 3});
    CHECK(block.batchnorms().size() == 3);
    randomize(block, 50);
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(block, 2));
  }
  SUBCASE("projection without batch norm") {
    BasicBlockOptions o({3, 6, 5}, 4);
    o.stride = 2;
    o.batchnorm = false;
    o.dtype = DType::kF64;
    BasicBlock block(o);
    CHECK(block.batchnorms().empty());
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(block, 2));
  }
}

TEST_CASE("basic_block names its parameters as torchvision does") {
  BasicBlockOptions o({3, 6, 6}, 4);
  o.stride = 2;
  BasicBlock block(o);
  std::vector<std::string> names;
  for (Parameter* p : block.parameters()) names.push_back(p->name);
  CHECK(names == std::vector<std::string>{"conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight",
                                          "bn2.bias", "downsample.0.weight", "downsample.1.weight",
                                          "downsample.1.bias"});
  CHECK(block.parameters()[0]->value.shape() == Shape{4, 3, 3, 3});
  CHECK(block.parameters()[6]->value.shape() == Shape{4, 3, 1, 1});
}

TEST_CASE("conv2d cost counts the exact convolution flops and bytes") {
  // (3, 7, 6) -> (4, 4, 3) with a 3x3 kernel, stride 2, pad 1; batch 5; float32.
  Conv2dOptions o({3, 7, 6}, 4, 3);
  o.stride = 2;
  o.pad = 1;
  Conv2d conv(o);
  REQUIRE(conv.output_shape() == Shape{4, 4, 3});
  const double N = 5, K = 4, P = 4, Q = 3, C = 3, R = 3, S = 3, H = 7, W = 6;
  const double flops = 2 * N * K * P * Q * C * R * S;
  const LayerCost c = conv.cost(5);
  CHECK(c.forward_flops == flops + N * K * P * Q);
  CHECK(c.input_grad_flops == flops);
  CHECK(c.backward_flops == 2 * flops + K * C * R * S + N * K * P * Q);
  CHECK(c.param_bytes == 4 * (4 * 3 * 3 * 3 + 4));
  CHECK(c.output_bytes == 4 * 5 * 4 * 4 * 3);
  CHECK(c.saved_bytes == 4 * 5 * 3 * 7 * 6);
  CHECK(c.forward_bytes == 4 * (N * C * H * W + K * C * R * S + K + N * K * P * Q));

  o.bias = false;
  o.dtype = DType::kF64;
  const LayerCost d = Conv2d(o).cost(5);
  CHECK(d.forward_flops == flops);
  CHECK(d.backward_flops == 2 * flops + K * C * R * S);
  CHECK(d.param_bytes == 8 * 4 * 3 * 3 * 3);
}

TEST_CASE("maxpool2d cost counts one comparison per real window value but the first") {
  MaxPool2dOptions o({2, 7, 6}, 3);
  o.stride = 2;
  o.pad = 1;
  MaxPool2d pool(o);
  // Brute force over the windows, padding excluded.
  int64_t values = 0;
  for (int p = 0; p < 4; ++p)
    for (int q = 0; q < 3; ++q)
      for (int r = 0; r < 3; ++r)
        for (int s = 0; s < 3; ++s) {
          const int h = 2 * p - 1 + r, w = 2 * q - 1 + s;
          if (h >= 0 && h < 7 && w >= 0 && w < 6) ++values;
        }
  const LayerCost c = pool.cost(3);
  CHECK(c.forward_flops == 3 * 2 * (values - 4 * 3));
  CHECK(c.saved_bytes == 4 * 3 * 2 * 4 * 3);
}

TEST_CASE("basic_block cost is its parts plus the residual add") {
  BasicBlockOptions o({4, 6, 6}, 8);
  o.stride = 2;
  BasicBlock block(o);
  Conv2dOptions c1({4, 6, 6}, 8, 3), c2({8, 3, 3}, 8, 3), proj({4, 6, 6}, 8, 1);
  c1.stride = 2, c1.pad = 1, c1.bias = false;
  c2.pad = 1, c2.bias = false;
  proj.stride = 2, proj.bias = false;
  const double convs =
      Conv2d(c1).cost(2).forward_flops + Conv2d(c2).cost(2).forward_flops + Conv2d(proj).cost(2).forward_flops;
  const double bns = 3 * BatchNorm2d(BatchNorm2dOptions({8, 3, 3})).cost(2).forward_flops;
  const double out = 2 * 8 * 3 * 3;
  const LayerCost c = block.cost(2);
  CHECK(c.forward_flops == convs + bns + 2 * out /* relus */ + out /* add */);
  CHECK(c.input_grad_flops ==
        Conv2d(c1).cost(2).input_grad_flops + Conv2d(proj).cost(2).input_grad_flops + 2 * 4 * 6 * 6);
  CHECK(c.param_bytes == 4 * (8 * 4 * 9 + 8 * 8 * 9 + 8 * 4 + 3 * 2 * 8));

  // saved_bytes equals the distinct buffers the forward actually keeps.
  Context ctx;
  Tensor x = random_tensor({2, 4, 6, 6}, DType::kF32, 1);
  block.forward(cpu(), x, &ctx);
  int64_t held = 0;
  for (const Tensor& t : ctx.saved) held += static_cast<int64_t>(t.nbytes());
  CHECK(c.saved_bytes == held);
}

TEST_CASE("batchnorm2d updates running statistics with the unbiased variance, and eval uses them") {
  BatchNorm2d bn = make_bn(3, 4, 5);
  randomize(bn, 3);
  Tensor x = random_tensor({6, 3, 4, 5}, DType::kF64, 1, -2.0, 3.0);
  bn.forward(cpu(), x, nullptr);
  CHECK(bn.pending_micro_batches() == 1);
  bn.end_step(cpu());
  CHECK(bn.pending_micro_batches() == 0);
  std::vector<double> mean, unbiased;
  naive_stats(x, mean, unbiased);
  std::vector<double> rm(3), rv(3);
  for (int c = 0; c < 3; ++c) {
    rm[c] = 0.1 * mean[c];                  // from 0
    rv[c] = 0.9 * 1.0 + 0.1 * unbiased[c];  // from 1
  }
  GPIPE_EXPECT_CLOSE(bn.running_mean(), rm, 1e-13, 1e-14);
  GPIPE_EXPECT_CLOSE(bn.running_var(), rv, 1e-13, 1e-14);

  // Evaluation normalises with the running statistics, and keeps nothing.
  ForwardArgs eval;
  eval.training = false;
  Tensor x2 = random_tensor({2, 3, 4, 5}, DType::kF64, 2);
  Context ctx;
  Tensor y = bn.forward(cpu(), x2, &ctx, eval);
  CHECK(bn.pending_micro_batches() == 0);
  const auto xv = to_doubles(x2), g = to_doubles(bn.gamma().value), b = to_doubles(bn.beta().value);
  std::vector<double> expect(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    const size_t c = (i / 20) % 3;
    expect[i] = (xv[i] - rm[c]) / std::sqrt(rv[c] + 1e-5) * g[c] + b[c];
  }
  GPIPE_EXPECT_CLOSE(y, expect, 1e-12, 1e-13);
  CHECK_THROWS_WITH_AS(bn.backward(cpu(), y, ctx), doctest::Contains("after an evaluation forward"), UserError);
}

TEST_CASE("deferred batch norm: M micro-batches end with the whole batch's running statistics") {
  const int64_t N = 7;  // split unevenly: 3, 2, 2
  BatchNorm2d whole = make_bn(3, 4, 5), split = make_bn(3, 4, 5);
  for (uint64_t step = 0; step < 2; ++step) {
    CAPTURE(step);
    Tensor x = random_tensor({N, 3, 4, 5}, DType::kF64, 10 + step, -1.0 + step, 2.0 + 3 * step);
    ForwardArgs args;
    args.step = step;
    Context ctx;
    whole.forward(cpu(), x, &ctx, args);
    const int64_t sizes[] = {3, 2, 2};
    int64_t offset = 0;
    for (int64_t m : sizes) {
      // A checkpointed micro-batch: first a forward that keeps nothing for backward,
      // then its recompute. Only the first may count.
      args.sample_offset = offset;
      args.recompute = false;
      split.forward(cpu(), x.narrow_rows(offset, m), nullptr, args);
      args.recompute = true;
      Context rctx;
      Tensor other = random_tensor({m, 3, 4, 5}, DType::kF64, 99, 5.0, 9.0);  // would skew the stats if counted
      split.forward(cpu(), other, &rctx, args);
      offset += m;
    }
    CHECK(split.pending_micro_batches() == 3);
    whole.end_step(cpu());
    split.end_step(cpu());
    GPIPE_EXPECT_CLOSE(split.running_mean(), whole.running_mean(), 1e-13, 1e-15);
    GPIPE_EXPECT_CLOSE(split.running_var(), whole.running_var(), 1e-13, 1e-15);
  }
}

TEST_CASE("deferred batch norm: statistics of a step without end_step are dropped, not mixed in") {
  BatchNorm2d a = make_bn(2, 3, 3), b = make_bn(2, 3, 3);
  ForwardArgs args;
  args.step = 0;
  a.forward(cpu(), random_tensor({4, 2, 3, 3}, DType::kF64, 1, 3.0, 4.0), nullptr, args);  // never folded in
  Tensor x = random_tensor({4, 2, 3, 3}, DType::kF64, 2);
  args.step = 1;
  a.forward(cpu(), x.narrow_rows(0, 2), nullptr, args);
  a.forward(cpu(), x.narrow_rows(2, 2), nullptr, args);
  CHECK(a.pending_micro_batches() == 2);
  b.forward(cpu(), x, nullptr, args);
  a.end_step(cpu());
  b.end_step(cpu());
  GPIPE_EXPECT_CLOSE(a.running_mean(), b.running_mean(), 1e-13, 1e-15);
  GPIPE_EXPECT_CLOSE(a.running_var(), b.running_var(), 1e-13, 1e-15);
}

TEST_CASE("batch norm's running statistics follow the backend's device") {
  BatchNorm2d bn = make_bn(2, 3, 3);
  bn.to(Device::cpu(1));
  Tensor x = random_tensor({2, 2, 3, 3}, DType::kF64, 1);
  Backend& be = backend_for(Device::cpu(1));
  bn.forward(be, x, nullptr);
  bn.end_step(be);
  CHECK(bn.running_mean().device() == Device::cpu(1));
  CHECK(bn.running_var().device() == Device::cpu(1));
}

TEST_CASE("the registry builds convolutional models and reports mistakes with their location") {
  ModelSpec spec;
  spec.input = {3, 8, 8};
  spec.dtype = DType::kF64;
  spec.layers = {{"conv2d", {{"out", "4"}, {"kernel", "3"}}, {}, ""},
                 {"batchnorm2d", {}, {}, ""},
                 {"relu", {}, {}, ""},
                 {"maxpool2d", {{"kernel", "2"}}, {}, ""},
                 {"basic_block", {{"out", "8"}, {"stride", "2"}}, {}, ""},
                 {"avgpool2d", {{"kernel", "2"}}, {}, ""},
                 {"flatten", {}, {}, ""},
                 {"linear", {{"out", "5"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  CHECK(model->layer(0).output_shape() == Shape{4, 8, 8});  // pad defaults to kernel / 2
  CHECK(model->layer(3).output_shape() == Shape{4, 4, 4});  // stride defaults to the kernel
  CHECK(model->layer(4).output_shape() == Shape{8, 2, 2});
  CHECK(model->layer(5).output_shape() == Shape{8, 1, 1});
  CHECK(model->output_shape() == Shape{5});
  const int64_t params = (4 * 3 * 9 + 4) + 2 * 4 + (8 * 4 * 9 + 8 * 8 * 9 + 8 * 4 + 3 * 2 * 8) + 8 * 5 + 5;
  CHECK(model->parameter_count() == params);
  CHECK(model->named_parameters()[4].first == "layers.4.conv1.weight");  // the checkpoint's name

  spec.layers[5] = {"global_avgpool", {}, {}, ""};
  CHECK(build_model(spec)->layer(5).output_shape() == Shape{8, 1, 1});

  spec.layers[0] = {"conv2d", {{"out", "4"}, {"kernel", "3"}, {"padding", "1"}}, {}, "cfg.yaml:3:5"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("unknown option 'padding'"), UserError);
  spec.layers[0] = {"conv2d", {{"out", "4"}, {"kernel", "11"}, {"pad", "0"}}, {}, "cfg.yaml:3:5"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("does not fit in the (3, 8, 8) input"), UserError);
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("(at cfg.yaml:3:5)"), UserError);
  spec.layers[0] = {"conv2d", {{"out", "4"}, {"kernel", "3"}}, {}, ""};
  spec.layers[3] = {"maxpool2d", {{"kernel", "2"}, {"pad", "2"}}, {}, "cfg.yaml:6:5"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("pad between 0 and kernel / 2"), UserError);
  spec.layers[3] = {"flatten", {}, {}, ""};
  spec.layers[4] = {"basic_block", {{"out", "8"}}, {}, "cfg.yaml:7:5"};
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("expects a (C, H, W) image per sample, got (256)"),
                       UserError);
}
