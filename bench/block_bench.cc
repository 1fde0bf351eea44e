// One transformer block (pre-LayerNorm, causal attention, GELU MLP) forward and
// backward on a device, timed, with its FLOPs from the layer's exact cost estimate and
// the device's own matrix-product rate on the block's largest product for comparison:
// where the time goes, as a fraction of what the machine's BLAS (or cuBLAS) reaches.
//
//   block_bench [--device cpu|cuda:0] [--hidden 256] [--heads 4] [--seq 128] [--batch 32]
//               [--blocks 1] [--steps 20] [--warmup 3]
// Prints one JSON line.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/backend.h"
#include "layers/registry.h"
#include "runtime/error.h"
#include "runtime/random.h"

using namespace gpipe;

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Tensor random_on(Backend& be, const Shape& shape, uint64_t seed) {
  Tensor host = Tensor::empty(shape, DType::kF32, Device::cpu());
  Rng rng(seed);
  for (int64_t i = 0; i < host.numel(); ++i) host.data<float>()[i] = static_cast<float>(rng.uniform(-1, 1));
  if (be.device().is_cpu()) return host;
  Tensor t = be.empty(shape, DType::kF32);
  be.copy(host, t);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f = {{"device", "cpu"}, {"hidden", "256"}, {"heads", "4"}, {"seq", "128"},
                                          {"batch", "32"},   {"blocks", "1"},   {"steps", "20"}, {"warmup", "3"}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || i + 1 >= argc || !f.count(a.substr(2))) {
      std::fprintf(stderr, "usage: block_bench [--device D] [--hidden C] [--heads H] [--seq T] [--batch B] "
                           "[--blocks L] [--steps N] [--warmup W]\n");
      return 2;
    }
    f[a.substr(2)] = argv[++i];
  }
  try {
    const Device dev = parse_device(f["device"]);
    const int64_t C = std::stoll(f["hidden"]), T = std::stoll(f["seq"]), B = std::stoll(f["batch"]);
    const int L = std::stoi(f["blocks"]), steps = std::stoi(f["steps"]), warmup = std::stoi(f["warmup"]);
    if (dev.is_cpu()) set_cpu_blas_threads(1);
    Backend& be = backend_for(dev);

    layers::ModelSpec spec;
    spec.input = {T, C};
    for (int l = 0; l < L; ++l) spec.layers.push_back({"transformer_block", {{"heads", f["heads"]}}, {}, ""});
    spec.loss = {"softmax_cross_entropy", {}, {}, ""};
    auto model = layers::build_model(spec);
    for (int l = 0; l < L; ++l) model->layer(l).to(dev);

    Tensor x = random_on(be, {B, T, C}, 1);
    Tensor dy = random_on(be, {B, T, C}, 2);
    std::vector<double> fwd_ms, bwd_ms;
    for (int s = 0; s < warmup + steps; ++s) {
      std::vector<layers::Context> ctx(L);
      be.synchronize();
      const double t0 = now_ms();
      Tensor h = x;
      for (int l = 0; l < L; ++l) h = model->layer(l).forward(be, h, &ctx[l]);
      be.synchronize();
      const double t1 = now_ms();
      Tensor g = dy;
      for (int l = L - 1; l >= 0; --l) g = model->layer(l).backward(be, g, ctx[l]);
      be.synchronize();
      const double t2 = now_ms();
      if (s >= warmup) {
        fwd_ms.push_back(t1 - t0);
        bwd_ms.push_back(t2 - t1);
      }
    }
    double flops = 0;
    for (int l = 0; l < L; ++l) {
      const auto c = model->layer(l).cost(B);
      flops += c.forward_flops + c.backward_flops;
    }
    // The device's rate on the block's largest product: (B T, C) x (C, 4C).
    Tensor a = random_on(be, {B * T, C}, 3), w = random_on(be, {4 * C, C}, 4);
    Tensor out = be.empty({B * T, 4 * C}, DType::kF32);
    std::vector<double> gemm_ms;
    for (int s = 0; s < warmup + steps; ++s) {
      be.synchronize();
      const double t0 = now_ms();
      be.matmul(a, false, w, true, out);
      be.synchronize();
      if (s >= warmup) gemm_ms.push_back(now_ms() - t0);
    }
    const double step_ms = median(fwd_ms) + median(bwd_ms);
    const double gemm_gflops = 2.0 * B * T * C * 4 * C / (median(gemm_ms) * 1e6);
    const double achieved = flops / (step_ms * 1e6);
    nlohmann::json j = {{"bench", "block"},           {"device", dev.str()},      {"hidden", C},
                        {"heads", std::stoi(f["heads"])}, {"seq", T},             {"batch", B},
                        {"blocks", L},                {"forward_ms", median(fwd_ms)}, {"backward_ms", median(bwd_ms)},
                        {"step_ms", step_ms},         {"gflop", flops / 1e9},     {"achieved_gflops", achieved},
                        {"gemm_gflops", gemm_gflops}, {"fraction_of_gemm_rate", achieved / gemm_gflops}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "block_bench: %s\n", e.what());
    return 1;
  }
}
