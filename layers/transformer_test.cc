// The transformer layers: every backward against central finite differences in
// float64, causality, bitwise-reproducible dropout, exact costs, the registry, and a
// small GPT that learns a token pattern.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <set>

#include "layers/attention.h"
#include "layers/dropout.h"
#include "layers/embedding.h"
#include "layers/layernorm.h"
#include "layers/optimizer.h"
#include "layers/registry.h"
#include "layers/sequential.h"
#include "layers/transformer.h"
#include "runtime/error.h"
#include "runtime/random.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::random_tensor;
using gpipe::testing::context_bytes;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

Tensor random_ids(const Shape& shape, int vocab, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty(shape, DType::kI32, Device::cpu());
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng.next() % vocab);
  return t;
}

// The public checker (layers/gradcheck.h) on a given input (float64, or token ids)
// under fixed forward arguments; gradients start non-zero so that backward must add
// into them.
void check_gradients(Layer& layer, const Tensor& x, const ForwardArgs& args = {}) {
  GradCheckOptions o;
  o.args = args;
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(layer, x, o));
}

int64_t param_bytes(Layer& layer) {
  int64_t n = 0;
  for (Parameter* p : layer.parameters()) n += static_cast<int64_t>(p->value.nbytes());
  return n;
}

// Positions [0, t) of (B, T, C) outputs, as doubles.
std::vector<double> prefix(const Tensor& y, int64_t t) {
  const auto v = to_doubles(y);
  const int64_t B = y.size(0), T = y.size(1), C = y.size(2);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b) out.insert(out.end(), v.begin() + b * T * C, v.begin() + (b * T + t) * C);
  return out;
}

constexpr int64_t kT = 4, kC = 8, kHeads = 2;

ForwardArgs fixed_args() {
  ForwardArgs a;
  a.step = 3;
  a.sample_offset = 5;
  return a;
}

}  // namespace

TEST_CASE("embedding backward matches finite differences for token and position tables") {
  for (int64_t positions : {int64_t{0}, kT, int64_t{6}}) {
    INFO("positions=", positions);
    EmbeddingOptions o(/*vocab=*/5, kC, kT);
    o.max_positions = positions;
    o.dtype = DType::kF64;
    o.seed = 1;
    Embedding e(o);
    CHECK(e.input_dtype() == DType::kI32);
    CHECK(e.parameters().size() == (positions > 0 ? 2u : 1u));
    Tensor ids = random_ids({3, kT}, 5, 2);
    ids.data<int32_t>()[1] = ids.data<int32_t>()[2];  // a repeated id: its gradient rows accumulate
    check_gradients(e, ids);
  }
}

TEST_CASE("embedding options are checked") {
  EmbeddingOptions o(10, 4, 8);
  o.max_positions = 6;
  CHECK_THROWS_WITH_AS(Embedding{o}, doctest::Contains("positions=6 is shorter than the sequence (8 tokens)"),
                       UserError);
  Embedding ok(EmbeddingOptions(10, 4, 8));
  Tensor bad = Tensor::from_vector<int32_t>({0, 1, 2, 3, 4, 5, 6, 10}, {1, 8});
  CHECK_THROWS_WITH_AS(ok.forward(cpu(), bad, nullptr), doctest::Contains("token id 10 at (b=0, t=7)"), UserError);
}

TEST_CASE("layernorm backward matches finite differences") {
  LayerNormOptions o({kT, kC});
  o.dtype = DType::kF64;
  LayerNorm ln(o);
  // Non-trivial gamma and beta, so their gradients and dx's gamma term are exercised.
  ln.weight().value = random_tensor({kC}, DType::kF64, 3, 0.5, 1.5);
  ln.bias().value = random_tensor({kC}, DType::kF64, 4);
  check_gradients(ln, random_tensor({3, kT, kC}, DType::kF64, 5, -2, 2));
}

TEST_CASE("layernorm starts as the plain normalisation") {
  LayerNorm ln(LayerNormOptions({kC}));
  CHECK(ln.weight().value.to_vector<float>() == std::vector<float>(kC, 1.f));
  CHECK(ln.bias().value.to_vector<float>() == std::vector<float>(kC, 0.f));
  Tensor y = ln.forward(cpu(), random_tensor({2, kC}, DType::kF32, 1, 3, 5), nullptr);
  for (int r = 0; r < 2; ++r) {
    double m = 0, v = 0;
    for (int c = 0; c < kC; ++c) m += y.data<float>()[r * kC + c] / kC;
    for (int c = 0; c < kC; ++c) v += std::pow(y.data<float>()[r * kC + c] - m, 2) / kC;
    CHECK(m == doctest::Approx(0).epsilon(1e-5));
    CHECK(v == doctest::Approx(1).epsilon(1e-3));  // var / (var + eps), var ~ 1/3
  }
}

TEST_CASE("causal self-attention backward matches finite differences") {
  AttentionOptions o(kC, kHeads, /*seq_len=*/5);
  o.dtype = DType::kF64;
  o.seed = 7;
  CausalSelfAttention attn(o);
  check_gradients(attn, random_tensor({2, 5, kC}, DType::kF64, 8));
  std::set<std::string> names;
  for (Parameter* p : attn.parameters()) names.insert(p->name);
  CHECK(names == std::set<std::string>{"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"});
}

TEST_CASE("attention rejects heads that do not divide the width") {
  CHECK_THROWS_WITH_AS(CausalSelfAttention(AttentionOptions(10, 4, 3)),
                       doctest::Contains("10 channels do not split into 4 heads"), UserError);
}

TEST_CASE("dropout backward matches finite differences under a fixed key") {
  DropoutOptions o({kT, kC}, 0.4);
  o.dtype = DType::kF64;
  o.seed = 9;
  Dropout d(o);
  Tensor x = random_tensor({3, kT, kC}, DType::kF64, 10);
  check_gradients(d, x, fixed_args());
  // About 1 - p of the elements survive, scaled by 1 / (1 - p).
  const auto y = to_doubles(d.forward(cpu(), x, nullptr, fixed_args())), xs = to_doubles(x);
  int kept = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (y[i] != 0) {
      ++kept;
      CHECK(y[i] == doctest::Approx(xs[i] / 0.6));
    }
  }
  CHECK(kept > 0);
  CHECK(kept < static_cast<int>(y.size()));
}

TEST_CASE("dropout is the identity outside training and with p = 0") {
  Dropout d(DropoutOptions({kC}, 0.5));
  Tensor x = random_tensor({4, kC}, DType::kF32, 1);
  ForwardArgs eval;
  eval.training = false;
  Context ctx;
  Tensor y = d.forward(cpu(), x, &ctx, eval);
  CHECK(y.to_vector<float>() == x.to_vector<float>());
  CHECK(d.backward(cpu(), x, ctx).to_vector<float>() == x.to_vector<float>());
  Dropout none(DropoutOptions({kC}, 0.0));
  CHECK(none.forward(cpu(), x, &ctx).to_vector<float>() == x.to_vector<float>());
  CHECK(none.cost(4).forward_flops == 0);
  CHECK_THROWS_WITH_AS(Dropout(DropoutOptions({kC}, 1.0)), doctest::Contains("p=1 must be in [0, 1)"), UserError);
}

TEST_CASE("dropout masks do not depend on the micro-batch split") {
  Dropout d(DropoutOptions({kT, kC}, 0.5));
  Tensor x = random_tensor({8, kT, kC}, DType::kF32, 2, 0.5, 1.5);
  ForwardArgs all;
  all.step = 11;
  const auto whole = to_doubles(d.forward(cpu(), x, nullptr, all));
  ForwardArgs first = all, second = all;
  second.sample_offset = 3;
  auto split = to_doubles(d.forward(cpu(), x.narrow_rows(0, 3), nullptr, first));
  const auto rest = to_doubles(d.forward(cpu(), x.narrow_rows(3, 5), nullptr, second));
  split.insert(split.end(), rest.begin(), rest.end());
  CHECK(split == whole);
  ForwardArgs next = all;
  next.step = 12;  // a new step draws a new mask
  CHECK(to_doubles(d.forward(cpu(), x, nullptr, next)) != whole);
}

TEST_CASE("transformer block backward matches finite differences") {
  for (double p : {0.0, 0.3}) {
    INFO("dropout=", p);
    TransformerBlockOptions o(kC, kHeads, kT);
    o.dropout = p;
    o.dtype = DType::kF64;
    o.seed = 13;
    TransformerBlock block(o);
    // The mask is a function of (seed, step, sample, element), so with fixed
    // ForwardArgs the block is a deterministic, differentiable function.
    check_gradients(block, random_tensor({2, kT, kC}, DType::kF64, 14), fixed_args());
  }
}

TEST_CASE("transformer block parameters are named and unique") {
  TransformerBlock block(TransformerBlockOptions(kC, kHeads, kT));
  std::vector<std::string> names;
  for (Parameter* p : block.parameters()) names.push_back(p->name);
  CHECK(names == std::vector<std::string>{"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias",
                                          "attn.proj.weight", "attn.proj.bias", "ln2.weight", "ln2.bias",
                                          "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"});
}

TEST_CASE("a later position does not change earlier outputs") {
  const int64_t T = 5;
  AttentionOptions ao(kC, kHeads, T);
  ao.seed = 1;
  CausalSelfAttention attn(ao);
  TransformerBlockOptions bo(kC, kHeads, T);
  bo.seed = 2;
  bo.dropout = 0.2;  // masks are per (sample, element), so they do not leak either
  TransformerBlock block(bo);
  for (Layer* layer : std::initializer_list<Layer*>{&attn, &block}) {
    INFO(layer->describe());
    Tensor x = random_tensor({2, T, kC}, DType::kF32, 3);
    const Tensor y0 = layer->forward(cpu(), x, nullptr, fixed_args());
    for (int64_t c = 0; c < kC; ++c) x.data<float>()[(1 * T + 3) * kC + c] += 1.0f;  // sample 1, position 3
    const Tensor y1 = layer->forward(cpu(), x, nullptr, fixed_args());
    CHECK(prefix(y1, 3) == prefix(y0, 3));
    CHECK(to_doubles(y1) != to_doubles(y0));
  }
}

TEST_CASE("recomputation with dropout is bitwise identical") {
  TransformerBlockOptions o(kC, kHeads, kT);
  o.dropout = 0.3;
  o.seed = 5;
  TransformerBlock block(o);
  Tensor x = random_tensor({3, kT, kC}, DType::kF32, 6);
  const auto no_ctx = block.forward(cpu(), x, nullptr, fixed_args()).to_vector<float>();
  Context ctx;
  const auto with_ctx = block.forward(cpu(), x, &ctx, fixed_args()).to_vector<float>();
  CHECK(no_ctx == with_ctx);
  CHECK(block.forward(cpu(), x, nullptr, fixed_args()).to_vector<float>() == with_ctx);
  ForwardArgs other = fixed_args();
  other.step += 1;
  CHECK(block.forward(cpu(), x, nullptr, other).to_vector<float>() != with_ctx);
  // Outside training the block is its dropout-free twin (same seed, same weights).
  ForwardArgs eval = fixed_args();
  eval.training = false;
  o.dropout = 0.0;
  TransformerBlock plain(o);
  CHECK(block.forward(cpu(), x, nullptr, eval).to_vector<float>() ==
        plain.forward(cpu(), x, nullptr, eval).to_vector<float>());
}

TEST_CASE("costs count parameters and saved tensors exactly") {
  const int64_t B = 3;
  EmbeddingOptions eo(11, kC, kT);
  Embedding emb(eo);
  LayerNorm ln(LayerNormOptions({kT, kC}));
  AttentionOptions ao(kC, kHeads, kT);
  ao.dropout = 0.1;
  CausalSelfAttention attn(ao);
  Dropout drop(DropoutOptions({kT, kC}, 0.2));
  TransformerBlockOptions bo(kC, kHeads, kT);
  TransformerBlock block(bo);
  bo.dropout = 0.1;
  bo.mlp_ratio = 2;
  TransformerBlock block_drop(bo);
  for (Layer* layer : std::initializer_list<Layer*>{&emb, &ln, &attn, &drop, &block, &block_drop}) {
    INFO(layer->describe());
    Tensor x = layer->input_dtype() == DType::kI32 ? random_ids({B, kT}, 11, 1)
                                                   : random_tensor({B, kT, kC}, DType::kF32, 1);
    Context ctx;
    Tensor y = layer->forward(cpu(), x, &ctx);
    const LayerCost c = layer->cost(B);
    CHECK(c.saved_bytes == context_bytes(ctx));
    CHECK(c.param_bytes == param_bytes(*layer));
    CHECK(c.output_bytes == static_cast<int64_t>(y.nbytes()));
    CHECK(c.forward_flops > 0);
    CHECK(c.backward_flops >= c.input_grad_flops);
  }
  // The attention core on top of its two projections: q k^T and probs v over the full
  // (T, T) per head, plus 5 flops per unmasked score and one per row.
  AttentionOptions plain(kC, kHeads, kT);
  CausalSelfAttention a(plain);
  const double D = kC / kHeads, rows = B * kT;
  const double linears = (2 * rows * kC * 3 * kC + rows * 3 * kC) + (2 * rows * kC * kC + rows * kC);
  const double core = B * kHeads * (4.0 * kT * kT * D + 5.0 * kT * (kT + 1) / 2 + kT);
  CHECK(a.cost(B).forward_flops == linears + core);
  CHECK(a.cost(B).input_grad_flops == 2 * rows * kC * 3 * kC);  // the qkv projection's dx
}

TEST_CASE("the registry builds transformer layers and names their mistakes") {
  auto spec_for = [](std::vector<LayerSpec> layers) {
    ModelSpec s;
    s.input = {kT};
    s.input_dtype = DType::kI32;
    s.layers = std::move(layers);
    s.loss = {"softmax_cross_entropy", {}, {}, ""};
    return s;
  };
  const LayerSpec emb{"embedding", {{"vocab", "7"}, {"dim", "8"}}, {}, ""};
  const LayerSpec block{"transformer_block", {{"heads", "2"}, {"dropout", "0.1"}, {"mlp_ratio", "2"}}, {}, ""};
  auto m = build_model(spec_for({emb,
                                 block,
                                 {"attention", {{"heads", "4"}}, {}, ""},
                                 {"dropout", {{"p", "0.25"}}, {}, ""},
                                 {"layernorm", {}, {}, ""},
                                 {"linear", {{"out", "7"}}, {}, ""}}));
  CHECK(m->output_shape() == Shape{kT, 7});
  CHECK(m->layer(0).parameters().size() == 2);  // positions default to the sequence length
  CHECK(m->layer(0).parameters()[1]->value.shape() == Shape{kT, 8});
  CHECK(static_cast<Dropout&>(m->layer(3)).p() == 0.25);
  std::set<std::string> names;
  for (auto& np : m->named_parameters()) CHECK(names.insert(np.first).second);

  CHECK_THROWS_WITH_AS(build_model(spec_for({emb, {"dropout", {{"p", "lots"}}, {}, "m.yaml:3:5"}})),
                       doctest::Contains("option 'p' must be a number, got 'lots'"), UserError);
  CHECK_THROWS_WITH_AS(build_model(spec_for({emb, {"dropout", {}, {}, ""}})), doctest::Contains("needs the option 'p'"),
                       UserError);
  CHECK_THROWS_WITH_AS(build_model(spec_for({emb, {"attention", {{"heads", "3"}}, {}, ""}})),
                       doctest::Contains("8 channels do not split into 3 heads"), UserError);
  CHECK_THROWS_WITH_AS(build_model(spec_for({emb, {"transformer_block", {{"heads", "2"}, {"drop", "0.1"}}, {}, ""}})),
                       doctest::Contains("unknown option 'drop'"), UserError);
  CHECK_THROWS_WITH_AS(build_model(spec_for({{"attention", {{"heads", "2"}}, {}, "m.yaml:2:5"}})),
                       doctest::Contains("takes a sequence (T, C) per sample, got (4); put an embedding layer"),
                       UserError);
  ModelSpec wrong = spec_for({emb});
  wrong.input = {kT, 2};
  CHECK_THROWS_WITH_AS(build_model(wrong), doctest::Contains("takes int32 token ids (T) per sample"), UserError);
}

TEST_CASE("a small GPT learns a repeated token pattern with SGD") {
  const int64_t T = 8, V = 6, B = 4;
  ModelSpec spec;
  spec.input = {T};
  spec.input_dtype = DType::kI32;
  spec.seed = 1;
  spec.layers = {{"embedding", {{"vocab", std::to_string(V)}, {"dim", "16"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}}, {}, ""},
                 {"transformer_block", {{"heads", "2"}}, {}, ""},
                 {"layernorm", {}, {}, ""},
                 {"linear", {{"out", std::to_string(V)}}, {}, ""}};
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  // Windows of the cycle 0, 1, ..., V-1 starting at different phases; the target is
  // the next token.
  std::vector<int32_t> xs, ys;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      xs.push_back(static_cast<int32_t>((b + t) % V));
      ys.push_back(static_cast<int32_t>((b + t + 1) % V));
    }
  }
  Tensor x = Tensor::from_vector<int32_t>(xs, {B, T}), y = Tensor::from_vector<int32_t>(ys, {B, T});
  std::vector<Parameter*> params;
  for (auto& np : model->named_parameters()) params.push_back(np.second);
  SgdParams sp;
  sp.lr = 0.5;
  Sgd opt(params, sp);
  const double scale = 1.0 / (B * T);  // mean over tokens
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    model->zero_grad();
    ForwardArgs args;
    args.step = step;
    last = model->forward_backward(cpu(), x, y, scale, args);
    if (step == 0) first = last;
    opt.step();
  }
  INFO("loss ", first, " -> ", last);
  // From worse than a uniform guess (log V = 1.79) to nearly certain of every token.
  CHECK(first > std::log(static_cast<double>(V)));
  CHECK(last < 0.1);
}
