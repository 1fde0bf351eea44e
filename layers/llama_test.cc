// LLaMA's attention and block: gqa_attention's forward against the definition computed
// element by element here (projections, rotary embeddings, grouped heads, causal
// softmax), with kv_heads == heads and no rotation equal to the GPT attention layer, and
// grouped key/value heads equal to multi-head attention whose key/value weights repeat;
// llama_block against its definition from separately built sub-layers; both against
// finite differences; their costs (a hand count and what the context keeps); their
// config forms and the errors a config can cause.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "layers/attention.h"
#include "layers/gqa_attention.h"
#include "layers/gradcheck.h"
#include "layers/llama_block.h"
#include "layers/registry.h"
#include "layers/rmsnorm.h"
#include "layers/sequential.h"
#include "layers/swiglu.h"
#include "runtime/error.h"
#include "tests/testing.h"

using namespace gpipe;
using namespace gpipe::layers;
using gpipe::testing::context_bytes;
using gpipe::testing::random_tensor;
using gpipe::testing::to_doubles;

namespace {

Backend& cpu() { return backend_for(Device::cpu()); }

GqaAttention make_gqa(int64_t dim, int64_t heads, int64_t kv_heads, int64_t T, DType dtype, bool rope = true,
                      uint64_t seed = 3) {
  GqaAttentionOptions o(dim, heads, T);
  o.kv_heads = kv_heads;
  o.rope = rope;
  o.rope_base = 100.0;  // turns fast enough that a wrong position or pairing shows at small T
  o.dtype = dtype;
  o.seed = seed;
  return GqaAttention(o);
}

void set(Parameter& p, const std::vector<double>& v) {
  Tensor t = Tensor::empty(p.value.shape(), DType::kF64, Device::cpu());
  std::copy(v.begin(), v.end(), t.data<double>());
  cpu().copy(t, p.value);
}

// y (R, out) = x (R, in) W^T, W (out, in).
std::vector<double> project(const std::vector<double>& x, const std::vector<double>& w, int64_t R, int64_t in,
                            int64_t out) {
  std::vector<double> y(static_cast<size_t>(R * out), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) y[r * out + o] += x[r * in + i] * w[o * in + i];
    }
  }
  return y;
}

// In place on (B, T, heads, D): pair (i, i + D/2) at position t turned by t base^(-2i/D).
void rotate(std::vector<double>& x, int64_t B, int64_t T, int64_t heads, int64_t D, double base) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        double* p = &x[((b * T + t) * heads + h) * D];
        for (int64_t i = 0; i < D / 2; ++i) {
          const double a = t * std::pow(base, -2.0 * i / D), x1 = p[i], x2 = p[i + D / 2];
          p[i] = x1 * std::cos(a) - x2 * std::sin(a);
          p[i + D / 2] = x2 * std::cos(a) + x1 * std::sin(a);
        }
      }
    }
  }
}

// The whole layer, element by element: query head h reads key/value head h / (H / KV).
std::vector<double> gqa_reference(GqaAttention& l, const std::vector<double>& x, int64_t B, int64_t T, int64_t C,
                                  int64_t H, int64_t KV, bool rope, double base) {
  auto ps = l.parameters();
  const int64_t D = C / H, R = B * T;
  std::vector<double> q = project(x, to_doubles(ps[0]->value), R, C, C);
  std::vector<double> k = project(x, to_doubles(ps[1]->value), R, C, KV * D);
  const std::vector<double> v = project(x, to_doubles(ps[2]->value), R, C, KV * D);
  if (rope) {
    rotate(q, B, T, H, D, base);
    rotate(k, B, T, KV, D, base);
  }
  std::vector<double> att(static_cast<size_t>(R * C), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t j = h / (H / KV);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> s(static_cast<size_t>(t + 1));
        double mx = -1e300, sum = 0;
        for (int64_t u = 0; u <= t; ++u) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[(b * T + t) * C + h * D + d] * k[(b * T + u) * KV * D + j * D + d];
          s[u] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[u]);
        }
        for (int64_t u = 0; u <= t; ++u) sum += (s[u] = std::exp(s[u] - mx));
        for (int64_t u = 0; u <= t; ++u) {
          for (int64_t d = 0; d < D; ++d) att[(b * T + t) * C + h * D + d] += s[u] / sum * v[(b * T + u) * KV * D + j * D + d];
        }
      }
    }
  }
  return project(att, to_doubles(ps[3]->value), R, C, C);
}

}  // namespace

TEST_CASE("gqa_attention's forward is its definition computed element by element") {
  const int64_t B = 2, T = 5, C = 12, H = 6;
  for (int64_t KV : {1, 2, 3, 6}) {
    for (bool rope : {true, false}) {
      CAPTURE(KV);
      CAPTURE(rope);
      GqaAttention l = make_gqa(C, H, KV, T, DType::kF64, rope);
      auto ps = l.parameters();
      REQUIRE(ps.size() == 4);
      CHECK(ps[0]->name == "q.weight");
      CHECK(ps[1]->value.shape() == Shape{KV * 2, C});
      CHECK(ps[3]->name == "o.weight");
      const Tensor x = random_tensor({B, T, C}, DType::kF64, 1);
      const std::vector<double> y = to_doubles(l.forward(cpu(), x, nullptr));
      const std::vector<double> want = gqa_reference(l, to_doubles(x), B, T, C, H, KV, rope, 100.0);
      for (size_t e = 0; e < y.size(); ++e) CHECK(y[e] == doctest::Approx(want[e]).epsilon(1e-12));
    }
  }
}

TEST_CASE("gqa_attention with kv_heads == heads and no rotation is GPT's attention without biases") {
  const int64_t B = 2, T = 4, C = 8, H = 2;
  GqaAttention g = make_gqa(C, H, H, T, DType::kF64, /*rope=*/false);
  AttentionOptions ao(C, H, T);
  ao.dtype = DType::kF64;
  CausalSelfAttention a(ao);
  auto gp = g.parameters(), ap = a.parameters();  // q, k, v, o; qkv.weight, qkv.bias, proj.weight, proj.bias
  std::vector<double> qkv;
  for (int i = 0; i < 3; ++i) {
    const std::vector<double> w = to_doubles(gp[i]->value);
    qkv.insert(qkv.end(), w.begin(), w.end());
  }
  set(*ap[0], qkv);
  set(*ap[1], std::vector<double>(3 * C, 0.0));
  set(*ap[2], to_doubles(gp[3]->value));
  set(*ap[3], std::vector<double>(C, 0.0));
  const Tensor x = random_tensor({B, T, C}, DType::kF64, 2);
  const std::vector<double> yg = to_doubles(g.forward(cpu(), x, nullptr)), ya = to_doubles(a.forward(cpu(), x, nullptr));
  for (size_t e = 0; e < yg.size(); ++e) CHECK(yg[e] == doctest::Approx(ya[e]).epsilon(1e-13));
}

TEST_CASE("grouped key/value heads are multi-head attention whose key/value weights repeat per group") {
  const int64_t B = 2, T = 5, C = 12, H = 6, KV = 2, D = C / H;
  GqaAttention g = make_gqa(C, H, KV, T, DType::kF64);
  GqaAttention m = make_gqa(C, H, H, T, DType::kF64, true, 9);
  auto gp = g.parameters(), mp = m.parameters();
  set(*mp[0], to_doubles(gp[0]->value));
  set(*mp[3], to_doubles(gp[3]->value));
  for (int i : {1, 2}) {  // head h of the full layer takes the rows of key/value head h / (H / KV)
    const std::vector<double> w = to_doubles(gp[i]->value);
    std::vector<double> full;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t j = h / (H / KV);
      full.insert(full.end(), w.begin() + j * D * C, w.begin() + (j + 1) * D * C);
    }
    set(*mp[i], full);
  }
  const Tensor x = random_tensor({B, T, C}, DType::kF64, 3);
  const std::vector<double> yg = to_doubles(g.forward(cpu(), x, nullptr)), ym = to_doubles(m.forward(cpu(), x, nullptr));
  for (size_t e = 0; e < yg.size(); ++e) CHECK(yg[e] == doctest::Approx(ym[e]).epsilon(1e-13));
}

TEST_CASE("gqa_attention's and llama_block's gradients equal finite differences") {
  for (int64_t KV : {1, 2, 4}) {
    CAPTURE(KV);
    GqaAttention l = make_gqa(8, 4, KV, 4, DType::kF64);
    GPIPE_EXPECT_GRADIENTS(check_layer_gradients(l, random_tensor({2, 4, 8}, DType::kF64, 4)));
  }
  LlamaBlockOptions o(8, 4, 12, 4);
  o.kv_heads = 2;
  o.rope_base = 100.0;
  o.dtype = DType::kF64;
  o.seed = 5;
  LlamaBlock block(o);
  // Scales that are not ones, so that a norm's dg or its use in dx cannot hide.
  for (Parameter* p : block.parameters()) {
    if (p->name == "norm1.weight" || p->name == "norm2.weight") {
      cpu().copy(random_tensor({8}, DType::kF64, 6, 0.5, 1.5), p->value);
    }
  }
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(block, random_tensor({2, 4, 8}, DType::kF64, 7)));
  // With dropout on both branches (the checker's forwards share one step: one mask).
  o.dropout = 0.3;
  LlamaBlock dropped(o);
  CHECK(dropped.describe() == "llama_block(8, 4 heads, 2 kv heads, hidden 12, dropout 0.3)");
  GPIPE_EXPECT_GRADIENTS(check_layer_gradients(dropped, random_tensor({2, 4, 8}, DType::kF64, 8)));
  check_cost(dropped, 2, dropped.cost(2));
}

TEST_CASE("llama_block is x + attn(norm1(x)), then h + ffn(norm2(h)), from separately built sub-layers") {
  const int64_t B = 2, T = 5, C = 8, H = 4, KV = 2, F = 12;
  LlamaBlockOptions o(C, H, F, T);
  o.kv_heads = KV;
  o.rope_base = 100.0;
  o.eps = 1e-5;
  o.dtype = DType::kF64;
  o.seed = 8;
  LlamaBlock block(o);
  RmsNormOptions no({T, C});
  no.eps = 1e-5;
  no.dtype = DType::kF64;
  RmsNorm n1(no), n2(no);
  GqaAttention attn = make_gqa(C, H, KV, T, DType::kF64, true, 1);
  SwiGLUOptions fo(C, F);
  fo.leading = {T};
  fo.dtype = DType::kF64;
  SwiGLU ffn(fo);
  std::vector<Parameter*> mine;
  for (Layer* l : std::initializer_list<Layer*>{&n1, &attn, &n2, &ffn}) {
    for (Parameter* p : l->parameters()) mine.push_back(p);
  }
  auto ps = block.parameters();
  REQUIRE(ps.size() == mine.size());
  const std::vector<std::string> names = {"norm1.weight",    "attn.q.weight",  "attn.k.weight", "attn.v.weight",
                                          "attn.o.weight",   "norm2.weight",   "ffn.gate.weight", "ffn.up.weight",
                                          "ffn.down.weight"};
  for (size_t i = 0; i < ps.size(); ++i) {
    CHECK(ps[i]->name == names[i]);
    cpu().copy(random_tensor(ps[i]->value.shape(), DType::kF64, 20 + i, -0.8, 0.8), ps[i]->value);
    cpu().copy(ps[i]->value, mine[i]->value);
  }
  const Tensor x = random_tensor({B, T, C}, DType::kF64, 9);
  const std::vector<double> y = to_doubles(block.forward(cpu(), x, nullptr));
  const std::vector<double> xv = to_doubles(x);
  const std::vector<double> a = to_doubles(attn.forward(cpu(), n1.forward(cpu(), x, nullptr), nullptr));
  Tensor h = Tensor::empty(x.shape(), DType::kF64, Device::cpu());
  for (int64_t e = 0; e < x.numel(); ++e) h.data<double>()[e] = xv[e] + a[e];
  const std::vector<double> f = to_doubles(ffn.forward(cpu(), n2.forward(cpu(), h, nullptr), nullptr));
  for (int64_t e = 0; e < x.numel(); ++e) CHECK(y[e] == doctest::Approx(h.data<double>()[e] + f[e]).epsilon(1e-13));
}

TEST_CASE("gqa_attention's and llama_block's costs: a hand count, the checks, and what the context keeps") {
  const int64_t batch = 3, T = 6, C = 16, H = 4, KV = 2, D = 4, F = 24;
  const double R = batch * T, KC = KV * D;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CAPTURE(dtype_name(dtype));
    GqaAttention g = make_gqa(C, H, KV, T, dtype);
    const LayerCost c = g.cost(batch);
    check_cost(g, batch, c);
    const LayerCost core = attention_core_cost(batch, T, C, H, dtype);
    // Four products (q, o: C x C; k, v: C x KV D), the core, rope's 41 per rotated element.
    CHECK(c.forward_flops == doctest::Approx(2 * R * C * (2 * C + 2 * KC) + core.forward_flops + 41 * R * (C + KC)));
    CHECK(c.weight_grad_flops == doctest::Approx(2 * R * C * (2 * C + 2 * KC) + 2 * C * C + 2 * C * KC));
    CHECK(c.param_bytes == static_cast<int64_t>(dtype_size(dtype)) * (2 * C * C + 2 * C * KV * D));
    Context ctx;
    g.forward(cpu(), random_tensor({batch, T, C}, dtype, 10), &ctx);
    CHECK(c.saved_bytes == context_bytes(ctx));

    LlamaBlockOptions o(C, H, F, T);
    o.kv_heads = KV;
    o.dtype = dtype;
    LlamaBlock block(o);
    const LayerCost bc = block.cost(batch);
    check_cost(block, batch, bc);
    Context bctx;
    block.forward(cpu(), random_tensor({batch, T, C}, dtype, 11), &bctx);
    CHECK(bc.saved_bytes == context_bytes(bctx));
    // Everything in W is a weight gradient: the four projections, the three of SwiGLU,
    // the two norms' scales.
    SwiGLUOptions fo(C, F);
    fo.leading = {T};
    fo.dtype = dtype;
    RmsNormOptions no({T, C});
    no.dtype = dtype;
    CHECK(bc.weight_grad_flops ==
          doctest::Approx(c.weight_grad_flops + SwiGLU(fo).cost(batch).weight_grad_flops +
                          2 * RmsNorm(no).cost(batch).weight_grad_flops));
  }
}

TEST_CASE("gqa_attention and llama_block from a config, and the mistakes a config can make") {
  ModelSpec spec;
  spec.input = {6};
  spec.input_dtype = DType::kI32;
  spec.dtype = DType::kF64;
  spec.layers = {{"embedding", {{"vocab", "11"}, {"dim", "16"}, {"positions", "0"}}, {}, ""},
                 {"llama_block", {{"heads", "4"}, {"kv_heads", "2"}, {"hidden", "24"}}, {}, "cfg.yaml:4:7"},
                 {"gqa_attention", {{"heads", "4"}, {"kv_heads", "1"}, {"rope_base", "500"}}, {}, ""},
                 {"rmsnorm", {}, {}, ""},
                 {"linear", {{"out", "11"}, {"bias", "false"}}, {}, ""}};
  spec.layers[1].name = "block";
  spec.loss = {"softmax_cross_entropy", {}, {}, ""};
  auto model = build_model(spec);
  CHECK(model->layer(1).describe() == "llama_block(16, 4 heads, 2 kv heads, hidden 24)");
  CHECK(model->layer(2).describe() == "gqa_attention(16, 4 heads, 1 kv heads, rope base 500)");
  CHECK(model->named_parameters()[1].first == "block.norm1.weight");
  CHECK(model->named_parameters()[3].first == "block.attn.k.weight");
  CHECK(model->named_parameters().size() == 1 + 9 + 4 + 1 + 1);  // no position table
  CHECK_NOTHROW(model->costs(2));

  auto refused = [&](const std::string& key, const std::string& value, const std::string& what) {
    ModelSpec s = spec;
    s.layers[1].args[key] = value;
    CHECK_THROWS_WITH_AS(build_model(s), doctest::Contains(what.c_str()), UserError);
  };
  refused("kv_heads", "3",
          "llama_block (at cfg.yaml:4:7): gqa_attention: kv_heads=3 does not divide heads=4; each key/value head "
          "serves an equal group");
  refused("heads", "5", "16 channels do not split into 5 heads; choose heads that divide the embedding dim");
  refused("hidden", "0", "swiglu: dim and hidden must be positive");
  refused("eps", "0", "rmsnorm: eps must be positive");
  refused("rope_base", "1", "rope_base must be greater than 1");
  spec.layers[0].args["dim"] = "12";  // 12 / 4 heads = 3: an odd head width
  spec.layers[1].args["kv_heads"] = "4";
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("head width 3 (dim 12 / 4 heads) is odd"), UserError);
  spec.layers[1].args.erase("hidden");
  CHECK_THROWS_WITH_AS(build_model(spec), doctest::Contains("needs the option 'hidden'"), UserError);
}

// On the CPU a float32 or float64 gqa_attention takes the fused attention (what a flash
// kernel keeps), GPIPE_FUSED_ATTENTION=0 the exact one (the probabilities kept): the
// same output and gradients bit for bit, a context smaller by the probabilities and
// qkv less q, k, v, the output and the log-sum-exp, and the same counted FLOPs (the
// backward's recompute is not useful work).
TEST_CASE("gqa_attention fused or exact on the CPU: the same bits, less kept, the same FLOPs") {
  const int64_t batch = 2, T = 5, C = 16, H = 4, KV = 2, D = 4;
  auto run = [&](bool fused, Context& ctx, std::vector<double>& y, std::vector<double>& dx, LayerCost& cost) {
    if (!fused) setenv("GPIPE_FUSED_ATTENTION", "0", 1);
    GqaAttention g = make_gqa(C, H, KV, T, DType::kF64);
    cost = g.cost(batch);
    const Tensor x = random_tensor({batch, T, C}, DType::kF64, 20);
    y = to_doubles(g.forward(cpu(), x, &ctx));
    const int64_t kept_now = context_bytes(ctx);
    dx = to_doubles(g.backward(cpu(), random_tensor({batch, T, C}, DType::kF64, 21), ctx, true));
    unsetenv("GPIPE_FUSED_ATTENTION");
    return kept_now;
  };
  Context fc, ec;
  std::vector<double> fy, fdx, ey, edx;
  LayerCost fcost, ecost;
  const int64_t fused_kept = run(true, fc, fy, fdx, fcost);
  const int64_t exact_kept = run(false, ec, ey, edx, ecost);
  CHECK(fy == ey);
  CHECK(fdx == edx);
  CHECK(fused_kept == fcost.saved_bytes);
  CHECK(exact_kept == ecost.saved_bytes);
  // qkv (B, T, 3C) and probs (B, H, T, T) against q, k, v, the output (B, T, C) and the
  // log-sum-exp (B, H, T) in float32.
  CHECK(exact_kept - fused_kept ==
        8 * (batch * T * 3 * C + batch * H * T * T) - (8 * (2 * batch * T * C + 2 * batch * T * KV * D) + 4 * batch * H * T));
  CHECK(fcost.backward_flops == ecost.backward_flops);
  CHECK(fcost.forward_flops == ecost.forward_flops);
}
