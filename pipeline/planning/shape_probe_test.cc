// Planning on shapes (issue 36): what each layer's forward keeps for its backward, read by
// running the model on tensors without data (kernels/meta_backend.h), equals the probe
// that computes on the CPU with data (probe_activations_on_devices, the oracle), byte for
// byte and flag for flag, for every built-in layer type (the test fails when one is not
// covered) and the derived example layers (their tapes recorded on shapes), in float64,
// float32 and bf16, and for a model built on shapes too; and
// building and probing on shapes allocates no host memory in proportion to the model.
#include <doctest/doctest.h>

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "examples/custom_layer/derived_layers.h"
#include "kernels/meta_backend.h"
#include "layers/layer.h"
#include "layers/registry.h"
#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"
#include "pipeline/planning/plan.h"
#include "runtime/allocator.h"
#include "runtime/tensor.h"

using namespace gpipe;
using namespace gpipe::pipeline;

namespace {

// Every built-in layer type in one of two models: a token model and an image model.
const char* kTokens = R"(model:
  input: [6]
  layers:
    - {type: embedding, vocab: 16, dim: 8}
    - {type: transformer_block, heads: 2, dropout: 0.1}
    - {type: attention, heads: 2, dropout: 0.1}
    - {type: dropout, p: 0.2}
    - {type: layernorm}
    - {type: gqa_attention, heads: 2, kv_heads: 1}
    - {type: llama_block, heads: 2, kv_heads: 1, hidden: 12}
    - {type: rmsnorm}
    - {type: swiglu, hidden: 12}
    - {type: gelu}
    - {type: linear, out: 16, tied: true, bias: false}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 4}
)";
const char* kImages = R"(model:
  input: [3, 8, 8]
  layers:
    - {type: conv2d, out: 4, kernel: 3}
    - {type: batchnorm2d}
    - {type: relu}
    - {type: basic_block, out: 8, stride: 2}
    - {type: basic_block, out: 8, batchnorm: false}
    - {type: maxpool2d, kernel: 2}
    - {type: avgpool2d, kernel: 2}
    - {type: global_avgpool}
    - {type: flatten}
    - {type: linear, out: 5}
  loss: softmax_cross_entropy
data: {classes: 5}
train: {steps: 1, batch_size: 4}
)";

void check_same(const ContextKeeps& a, const ContextKeeps& b) {
  CHECK(a.own_base == b.own_base);
  CHECK(a.own_per_sample == b.own_per_sample);
  CHECK(a.keeps_input == b.keeps_input);
  CHECK(a.keeps_output == b.keeps_output);
  CHECK(a.keeps_grad_output == b.keeps_grad_output);
  CHECK(a.keeps_grad_input == b.keeps_grad_input);
}

void check_same(const ActivationLayout& shapes, const ActivationLayout& oracle) {
  REQUIRE(shapes.layers.size() == oracle.layers.size());
  for (size_t i = 0; i < shapes.layers.size(); ++i) {
    CAPTURE(i);
    check_same(shapes.layers[i].forward, oracle.layers[i].forward);
    check_same(shapes.layers[i].weight, oracle.layers[i].weight);
  }
  check_same(shapes.loss, oracle.loss);
}

}  // namespace

// The derived examples (examples/custom_layer), forward only: their tapes decide what is kept.
const char* kDerived = R"(model:
  input: [5, 8]
  layers:
    - {type: derived_rmsnorm}
    - {type: my_swiglu, hidden: 12}
    - {type: derived_rmsnorm}
    - {type: linear, out: 3}
  loss: softmax_cross_entropy
data: {classes: 3}
train: {steps: 1, batch_size: 4}
)";

TEST_CASE("the probe on shapes equals the probe that computes, for every built-in layer, derived layers and dtypes") {
  example::register_derived_layers();
  std::set<std::string> covered;
  for (const char* text : {kTokens, kImages, kDerived}) {
    for (const char* dtype : {"float64", "float32", "bf16"}) {
      const std::string which = std::string(text == kTokens ? "tokens " : text == kImages ? "images " : "derived ") + dtype;
      CAPTURE(which);
      const Config c = parse_config(text, "t.yaml", {std::string("model.dtype=") + dtype});
      RunModel run = build_run_model(c);
      for (int i = 0; i < run.model->size(); ++i) covered.insert(run.model->layer(i).type());
      const ActivationLayout oracle = probe_activations_on_devices(*run.model);
      // Some layer keeps something of its own, and some its input: the comparison sees them.
      bool own = false, input = false;
      for (const LayerActivation& a : oracle.layers) {
        own = own || a.forward.own_per_sample > 0;
        input = input || a.forward.keeps_input;
      }
      CHECK(own);
      CHECK(input);
      check_same(probe_activations(*run.model), oracle);

      // The same model built on shapes: parameters without data, nothing initialised.
      const int64_t before = allocator_for(Device::cpu()).stats().in_use;
      const ShapesOnly shapes;
      RunModel planned = build_run_model(c);
      for (int i = 0; i < planned.model->size(); ++i) {
        for (layers::Parameter* p : planned.model->layer(i).parameters()) CHECK(p->value.is_meta());
      }
      check_same(probe_activations(*planned.model), oracle);
      CHECK(allocator_for(Device::cpu()).stats().in_use - before < 4096);
    }
  }
  for (const std::string& type : layers::layer_types()) {
    CAPTURE(type);
    CHECK(covered.count(type) == 1);
  }
}

namespace {

// A layer of one's own that writes a weight in its constructor (a scale starting at 2).
class WritesInConstructor : public layers::Layer {
 public:
  explicit WritesInConstructor(const Shape& shape) : Layer(shape, shape, DType::kF32) {
    scale_ = make_parameter("scale", {1}, 0.0, 0);
    scale_.value.data<float>()[0] = 2.0f;
  }
  std::string type() const override { return "writes_in_constructor"; }
  std::string describe() const override { return "writes_in_constructor"; }
  layers::LayerCost cost(int64_t batch) const override {
    layers::LayerCost c;
    c.forward_flops = c.backward_flops = c.input_grad_flops = static_cast<double>(batch * shape_numel(input_shape_));
    c.param_bytes = 4;
    c.output_bytes = batch * shape_numel(input_shape_) * 4;
    return c;
  }
  std::vector<layers::Parameter*> parameters() override { return {&scale_}; }

 protected:
  Tensor forward_impl(Backend& be, const Tensor& x, layers::Context*, const layers::ForwardArgs&) override {
    Tensor y = be.empty(x.shape(), x.dtype());
    be.copy(x, y);
    return y;
  }
  Tensor backward_impl(Backend&, const Tensor& dy, const layers::Context&, bool) override { return dy; }

 private:
  layers::Parameter scale_;
};

}  // namespace

TEST_CASE("a model whose layer writes its weights in its constructor is built with them, and planned") {
  layers::register_layer("writes_in_constructor", [](layers::LayerArgs&, const Shape& in, DType, uint64_t) {
    return std::unique_ptr<layers::Layer>(new WritesInConstructor(in));
  });
  const Config c = parse_config(R"(model:
  input: [4]
  layers:
    - {type: writes_in_constructor}
    - {type: linear, out: 3}
  loss: softmax_cross_entropy
data: {classes: 3}
train: {steps: 1, batch_size: 4}
)", "t.yaml");
  const RunModel run = build_run_model_on_shapes(c);
  CHECK_FALSE(run.on_shapes);
  CHECK(run.model->layer(0).parameters()[0]->value.to_vector<float>() == std::vector<float>{2.0f});
  CHECK(build_run_model_on_shapes(parse_config(kTokens, "t.yaml")).on_shapes);
}

TEST_CASE("a tensor made on shapes has no data to read, and copies between two of them do nothing") {
  Tensor a, b;
  {
    const ShapesOnly shapes;
    a = Tensor::empty({1000, 1000}, DType::kF32, Device::cpu());
    b = Tensor::empty({1000, 1000}, DType::kF32, Device::cuda(3));  // no GPU is needed to stand for one
    // from_vector writes its data at once: it stays a real tensor.
    CHECK_FALSE(Tensor::from_vector<float>({1, 2}, {2}).is_meta());
  }
  CHECK(a.is_meta());
  CHECK(b.is_meta());
  CHECK(a.raw_data() != b.raw_data());
  CHECK(a.narrow_rows(10, 5).raw_data() != a.raw_data());
  CHECK_THROWS_WITH_AS(a.data<float>(), doctest::Contains("planning on shapes"), Error);
  CHECK_FALSE(Tensor::empty({2}, DType::kF32, Device::cpu()).is_meta());
  Tensor c;
  {
    const ShapesOnly shapes;
    c = Tensor::empty({1000, 1000}, DType::kF32, Device::cpu());
  }
  copy_tensor(a, c);
  Tensor real = Tensor::empty({1000, 1000}, DType::kF32, Device::cpu());
  CHECK_THROWS_AS(copy_tensor(a, real), Error);
}

namespace {
// A grouped-query attention of 2 heads of 8 (cuDNN's fused path takes D = 8) on 32
// positions, between an embedding and a head; model.dtype by --set.
const char* kGqa = R"(model:
  input: [32]
  layers:
    - {type: embedding, vocab: 16, dim: 16}
    - {type: gqa_attention, heads: 2, kv_heads: 1}
    - {type: linear, out: 16, bias: false}
  loss: softmax_cross_entropy
train: {steps: 1, batch_size: 4}
)";
}  // namespace

// `gpipe plan --device-spec` plans GPUs from a machine that may have none, its model on
// the CPU: under MetaAnswersAs(cuda) the probe keeps what a GPU's layers keep. A bf16
// grouped-query attention keeps cuDNN's fused operands there (q, k, v, out and a float32
// log-sum-exp) in place of the packed qkv and the (B, H, T, T) probabilities, as a GPU
// build with cuDNN's frontend does, whether or not this build has it; the CPU's probe
// (bf16: widened, the exact path) is unchanged after.
TEST_CASE("planning for GPUs on the CPU probes what the GPU's attention keeps") {
  const int64_t T = 32, C = 16, H = 2, KV = 1, D = C / H;
  RunModel run = build_run_model(parse_config(kGqa, "t.yaml", {"model.dtype=bf16"}));
  const ActivationLayout cpu = probe_activations(*run.model);
  ActivationLayout gpu;
  {
    const MetaAnswersAs as_gpu(Device::cuda(0));
    gpu = probe_activations(*run.model);
  }
  check_same(probe_activations(*run.model), cpu);  // restored after
  const double exact = static_cast<double>(T * 3 * C * 2 + H * T * T * 2);  // qkv and probs, bf16, per sample
  const double fused_at_most = static_cast<double>(2 * T * C * 2 + 2 * T * KV * D * 2 + H * T * 4);
  const double saved = cpu.layers[1].forward.own_per_sample - gpu.layers[1].forward.own_per_sample;
  REQUIRE(gpu_fused_attention_expected(DType::kBF16, D));  // in any build: a GPU build's answer
  CHECK(saved >= exact - fused_at_most);
  CHECK(saved <= exact);
  for (int i : {0, 2}) check_same(gpu.layers[i].forward, cpu.layers[i].forward);
}

// The planner probes before the executor moves the layers to their devices, so it asks
// for the plan's devices: on a GPU a float32 attention keeps its probabilities (the CPU
// now keeps the fused operands in float32), a bf16 one cuDNN's operands (the CPU widens
// bf16 to the exact path).
TEST_CASE("the planner's probe answers for the plan's devices, not the CPU the layers are built on") {
  const std::vector<Device> cpu{Device::cpu(0)}, gpu{Device::cuda(0)};
  for (const char* dtype : {"float32", "bf16"}) {
    CAPTURE(dtype);
    RunModel run = build_run_model(parse_config(kGqa, "t.yaml", {std::string("model.dtype=") + dtype}));
    const ActivationLayout on_cpu = probe_activations(*run.model, cpu);
    const ActivationLayout on_gpu = probe_activations(*run.model, gpu);
    setenv("GPIPE_FUSED_ATTENTION", "0", 1);  // the exact path everywhere: the probabilities kept
    const ActivationLayout exact = probe_activations(*run.model, cpu);
    unsetenv("GPIPE_FUSED_ATTENTION");
    const double cpu_kept = on_cpu.layers[1].forward.own_per_sample;
    const double gpu_kept = on_gpu.layers[1].forward.own_per_sample;
    const double exact_kept = exact.layers[1].forward.own_per_sample;
    if (std::string(dtype) == "float32") {
      CHECK(gpu_kept == exact_kept);  // a GPU's float32 keeps the probabilities
      CHECK(cpu_kept < exact_kept);   // the CPU's fused float32 does not
    } else {
      CHECK(cpu_kept == exact_kept);  // the CPU widens bf16 to the exact path
      CHECK(gpu_kept < exact_kept);   // a GPU's cuDNN keeps its operands
    }
  }
}
