// Layer-level CPU-vs-CUDA conformance: the same models (same seeds) run forward and
// backward on the CPU reference and on cuda:0; the loss and every parameter gradient
// must agree to float32 rounding, and one optimizer step must leave the same weights.
// Reports itself skipped where no GPU is visible.
#include "tests/gpu_testing.h"

#include "kernels/backend.h"
#include "layers/derived.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "runtime/device.h"
#include "runtime/random.h"
#include "tests/testing.h"

using namespace gpipe;
using gpipe::testing::random_labels;
using gpipe::testing::random_tensor;

namespace {

Tensor to_device(const Tensor& host, Device d) {
  Tensor t = Tensor::empty(host.shape(), host.dtype(), d);
  copy_tensor(host, t);
  return t;
}

void compare_models(const layers::ModelSpec& spec, const Tensor& x, const Tensor& y, double rtol, double atol) {
  auto cpu_model = layers::build_model(spec);
  auto gpu_model = layers::build_model(spec);
  const Device gpu = Device::cuda(0);
  for (int i = 0; i < gpu_model->size(); ++i) gpu_model->layer(i).to(gpu);
  const double scale = 1.0 / static_cast<double>(y.numel());
  layers::ForwardArgs args;
  args.step = 3;
  const double cpu_loss = cpu_model->forward_backward(backend_for(Device::cpu()), x, y, scale, args);
  const double gpu_loss =
      gpu_model->forward_backward(backend_for(gpu), to_device(x, gpu), to_device(y, gpu), scale, args);
  CHECK(gpu_loss == doctest::Approx(cpu_loss).epsilon(1e-4));
  auto a = gpu_model->named_parameters(), b = cpu_model->named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("gradient of ", a[i].first);
    GPIPE_EXPECT_CLOSE(a[i].second->grad, b[i].second->grad, rtol, atol);
  }
  layers::OptimizerConfig oc;
  oc.type = "adamw";
  oc.lr = 1e-3;
  oc.weight_decay = 0.01;
  // Adam's first step moves a weight by lr * g / (|g| + eps). Where the true gradient is
  // zero (the attention's key bias: softmax ignores a shift shared by all keys; a conv
  // bias before batch norm), both devices compute rounding noise of ~1e-9, and with the
  // default eps of 1e-8 the step is +-lr by the noise's sign: the first run on an H100
  // differed there by 7e-4. An eps far above that noise keeps the step a smooth function
  // of the gradient, so equal gradients must give equal weights.
  oc.eps = 1e-2;
  std::vector<layers::Parameter*> pa, pb;
  for (auto& np : a) pa.push_back(np.second);
  for (auto& np : b) pb.push_back(np.second);
  layers::make_optimizer(pa, oc)->step();
  layers::make_optimizer(pb, oc)->step();
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("weights of ", a[i].first);
    GPIPE_EXPECT_CLOSE(a[i].second->value, b[i].second->value, 1e-4, 1e-5);
  }
  gpu_model->end_step(backend_for(gpu));
  cpu_model->end_step(backend_for(Device::cpu()));
}

// A layer written as forward only (layers/derived.h) that calls every kind of op the
// Graph has: on a CUDA stage its forward, derived backward and dropout run the CUDA
// backend's binary, sum_to, reduce_rows, softmax and unary kernels.
class DerivedEveryOp : public layers::DerivedLayer {
 public:
  DerivedEveryOp(const Shape& shape, DType dtype, uint64_t seed)
      : DerivedLayer("gpu_test_every_op", shape, shape, dtype, seed),
        w_(add_parameter("w", {shape.back(), shape.back()}, 0.3, mix_seed(seed, 1))),
        p_(add_parameter("p", {shape.back()}, 1.0, mix_seed(seed, 2))) {}
  Var define(Graph& g, Var x) const override {
    Var n = g.mul(g.mul(x, g.rsqrt(g.add(g.mean(g.square(x)), 1e-6))), g.param(p_));
    Var a = g.linear(n, w_);
    Var s = g.softmax(g.sub(a, g.max(a)));
    Var d = g.div(g.silu(a), g.add(g.exp(g.mul(s, 0.5)), g.norm(x)));
    return g.add(x, g.dropout(g.add(d, g.mul(g.tanh(s), g.sum(g.sigmoid(n)))), 0.1));
  }

 private:
  Parameter &w_, &p_;
};

}  // namespace

TEST_CASE("a model of forward-only layers agrees on CPU and CUDA, dropout included") {
  static const bool registered = [] {
    layers::register_layer("gpu_test_every_op", [](layers::LayerArgs&, const Shape& input, DType dtype, uint64_t seed) {
      return std::unique_ptr<layers::Layer>(std::make_unique<DerivedEveryOp>(input, dtype, seed));
    });
    return true;
  }();
  (void)registered;
  layers::ModelSpec spec;
  spec.input = {8, 24};
  spec.seed = 6;
  spec.layers = {{"gpu_test_every_op", {}, {}, ""}, {"gpu_test_every_op", {}, {}, ""}, {"flatten", {}, {}, ""},
                 {"linear", {{"out", "10"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  compare_models(spec, random_tensor({6, 8, 24}, DType::kF32, 3), random_labels(6, 10, 4), 1e-3, 1e-5);
}


// The second llama_block has no dropout: its residual sums are in its projections' products
// (Linear::forward_add), the first's after its dropouts.
TEST_CASE("a small LLaMA-style model agrees on CPU and CUDA: rmsnorm, gqa_attention, llama_block, dropout") {
  layers::ModelSpec spec;
  spec.input = {16};
  spec.input_dtype = DType::kI32;
  spec.seed = 5;
  spec.layers = {{"embedding", {{"vocab", "64"}, {"dim", "32"}, {"positions", "0"}}, {}, ""},
                 {"llama_block", {{"heads", "4"}, {"kv_heads", "2"}, {"hidden", "48"}, {"dropout", "0.1"}}, {}, ""},
                 {"llama_block", {{"heads", "4"}, {"kv_heads", "2"}, {"hidden", "48"}}, {}, ""},
                 {"gqa_attention", {{"heads", "4"}, {"kv_heads", "1"}}, {}, ""},
                 {"rmsnorm", {}, {}, ""},
                 {"linear", {{"out", "64"}, {"bias", "false"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  Tensor x = random_labels(4 * 16, 64, 5).reshape({4, 16});
  Tensor y = random_labels(4 * 16, 64, 6).reshape({4, 16});
  compare_models(spec, x, y, 2e-3, 1e-5);
}

TEST_CASE("a small GPT agrees on CPU and CUDA, dropout included") {
  layers::ModelSpec spec;
  spec.input = {16};
  spec.input_dtype = DType::kI32;
  spec.seed = 4;
  spec.layers = {{"embedding", {{"vocab", "64"}, {"dim", "32"}}, {}, ""},
                 {"transformer_block", {{"heads", "4"}, {"dropout", "0.1"}}, {}, ""},
                 {"transformer_block", {{"heads", "4"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", "64"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  Tensor x = random_labels(4 * 16, 64, 1).reshape({4, 16});
  Tensor y = random_labels(4 * 16, 64, 2).reshape({4, 16});
  compare_models(spec, x, y, 2e-3, 2e-5);
}

TEST_CASE("a small ResNet agrees on CPU and CUDA") {
  layers::ModelSpec spec;
  spec.input = {3, 8, 8};
  spec.seed = 5;
  spec.layers = {{"conv2d", {{"out", "8"}, {"kernel", "3"}}, {}, ""},
                 {"batchnorm2d", {}, {}, ""},
                 {"relu", {}, {}, ""},
                 {"maxpool2d", {{"kernel", "2"}}, {}, ""},
                 {"basic_block", {{"out", "16"}, {"stride", "2"}}, {}, ""},
                 {"global_avgpool", {}, {}, ""},
                 {"flatten", {}, {}, ""},
                 {"linear", {{"out", "10"}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  Tensor x = random_tensor({6, 3, 8, 8}, DType::kF32, 3);
  Tensor y = random_labels(6, 10, 4);
  compare_models(spec, x, y, 2e-3, 2e-5);
}

int main(int argc, char** argv) { return gpipe::gpu_testing::run_gpu_tests(argc, argv); }
