// Times each kernel of one transformer block's split backward on the CPU, one by one,
// at a config's sizes: where B's and W's time goes, to hold the planner's per-part
// roofline (pipeline/planning/planner.cc, estimate_costs) against. The kernels are the
// ones TransformerBlock::backward_input_impl and backward_weight_impl call, in order.
//
//   bw_parts_bench [--hidden 256] [--heads 4] [--seq 128] [--batch 4] [--steps 200]
// Prints one line per kernel (median ms) and the sums of B's and W's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "runtime/random.h"

using namespace gpipe;

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Tensor rand_cpu(const Shape& shape, uint64_t seed, double lo = -1, double hi = 1) {
  Tensor t = Tensor::empty(shape, DType::kF32, Device::cpu());
  Rng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.uniform(lo, hi));
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f = {
      {"hidden", "256"}, {"heads", "4"}, {"seq", "128"}, {"batch", "4"}, {"steps", "200"}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || i + 1 >= argc || !f.count(a.substr(2))) {
      std::fprintf(stderr, "usage: bw_parts_bench [--hidden C] [--heads H] [--seq T] [--batch B] [--steps N]\n");
      return 2;
    }
    f[a.substr(2)] = argv[++i];
  }
  const int64_t C = std::stoll(f["hidden"]), H = std::stoll(f["heads"]), T = std::stoll(f["seq"]);
  const int64_t B = std::stoll(f["batch"]), R = B * T;
  const int steps = std::stoi(f["steps"]);
  set_cpu_blas_threads(1);
  Backend& be = backend_for(Device::cpu());
  uint64_t seed = 1;
  auto r = [&](const Shape& s) { return rand_cpu(s, seed++); };

  // Activations and weights of one block, (R, .) rows.
  Tensor x = r({R, C}), h4 = r({R, 4 * C}), dy = r({R, C}), dy4 = r({R, 4 * C}), dy3 = r({R, 3 * C});
  Tensor w_fc1 = r({4 * C, C}), w_fc2 = r({C, 4 * C}), w_qkv = r({3 * C, C}), w_proj = r({C, C});
  Tensor gw_fc1 = r({4 * C, C}), gw_fc2 = r({C, 4 * C}), gw_qkv = r({3 * C, C}), gw_proj = r({C, C});
  Tensor b1 = r({4 * C}), bC = r({C}), b3 = r({3 * C});
  Tensor gamma = r({C}), dgamma = r({C}), dbeta = r({C}), mean = r({R}), rstd = rand_cpu({R}, 99, 0.5, 1.5);
  Tensor outC = r({R, C}), out4 = r({R, 4 * C});
  Tensor qkv = r({B, T, 3 * C}), dqkv = r({B, T, 3 * C}), att = r({B, T, C});
  Tensor probs = Tensor::empty({B, H, T, T}, DType::kF32, Device::cpu());
  be.attention(qkv, static_cast<int>(H), probs, att);  // a real (causal, normalised) probs
  Tensor datt = r({B, T, C});
  Tensor dyC3 = dy.reshape({B, T, C});

  struct Part {
    const char* phase;
    std::string name;
    std::function<void()> run;
  };
  const std::vector<Part> parts = {
      {"B", "dropout_backward (mlp)", [&] { be.dropout_backward(dy, 0.1, 7, 0, 0, outC); }},
      {"B", "fc2 dx (R,C)@(C,4C)", [&] { be.matmul(dy, false, w_fc2, false, out4); }},
      {"B", "gelu_backward (R,4C)", [&] { be.gelu_backward(h4, dy4, out4); }},
      {"B", "fc1 dx (R,4C)@(4C,C)", [&] { be.matmul(dy4, false, w_fc1, false, outC); }},
      {"B", "layernorm_backward (ln2)", [&] { be.layernorm_backward(dy, x, gamma, mean, rstd, outC, dgamma, dbeta); }},
      {"B", "axpy (residual)", [&] { be.axpy(1.0, dy, outC); }},
      {"B", "dropout_backward (attn)", [&] { be.dropout_backward(dy, 0.1, 7, 0, 0, outC); }},
      {"B", "proj dx (R,C)@(C,C)", [&] { be.matmul(dy, false, w_proj, false, outC); }},
      {"B", "attention_backward", [&] { be.attention_backward(datt, qkv, probs, static_cast<int>(H), dqkv); }},
      {"B", "qkv dx (R,3C)@(3C,C)", [&] { be.matmul(dy3, false, w_qkv, false, outC); }},
      {"B", "layernorm_backward (ln1)", [&] { be.layernorm_backward(dy, x, gamma, mean, rstd, outC, dgamma, dbeta); }},
      {"B", "axpy (residual)", [&] { be.axpy(1.0, dy, outC); }},
      {"W", "fc2 dW (C,R)@(R,4C)", [&] { be.matmul(dy, true, h4, false, gw_fc2, 1.0, 1.0); }},
      {"W", "fc2 db", [&] { be.bias_grad(dy, bC, 1.0); }},
      {"W", "fc1 dW (4C,R)@(R,C)", [&] { be.matmul(dy4, true, x, false, gw_fc1, 1.0, 1.0); }},
      {"W", "fc1 db", [&] { be.bias_grad(dy4, b1, 1.0); }},
      {"W", "proj dW (C,R)@(R,C)", [&] { be.matmul(dy, true, x, false, gw_proj, 1.0, 1.0); }},
      {"W", "proj db", [&] { be.bias_grad(dy, bC, 1.0); }},
      {"W", "qkv dW (3C,R)@(R,C)", [&] { be.matmul(dy3, true, x, false, gw_qkv, 1.0, 1.0); }},
      {"W", "qkv db", [&] { be.bias_grad(dy3, b3, 1.0); }},
  };
  std::map<std::string, double> sum;
  for (const Part& p : parts) {
    for (int s = 0; s < 5; ++s) p.run();  // warm up
    std::vector<double> ms;
    for (int s = 0; s < steps; ++s) {
      const double t0 = now_ms();
      p.run();
      ms.push_back(now_ms() - t0);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    sum[p.phase] += med;
    std::printf("%s  %-28s %8.4f ms\n", p.phase, p.name.c_str(), med);
  }
  std::printf("B %.3f ms, W %.3f ms, W share %.1f%%\n", sum["B"], sum["W"], 100 * sum["W"] / (sum["B"] + sum["W"]));
  return 0;
}
