// Layers written as forward only (examples/custom_layer/derived_layers.h) against their
// hand-written twins on one CPU thread: a SwiGLU feed-forward (the built-in swiglu layer)
// and an RMSNorm (the example's examples/custom_layer/rmsnorm.h), forward with a context then the whole backward,
// timed alternately so that the CPU's drift falls on both alike.
//
//   derived_bench [--rows 4096] [--dim 256] [--hidden 688] [--reps 15]
// Prints one JSON line: each pair's median milliseconds and their ratio.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/custom_layer/derived_layers.h"
#include "examples/custom_layer/rmsnorm.h"
#include "kernels/backend.h"
#include "layers/swiglu.h"
#include "runtime/random.h"

using namespace gpipe;
using namespace gpipe::layers;

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Tensor random(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::kF32, Device::cpu());
  Rng rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.uniform(-1, 1));
  return t;
}

// One forward with a context and the whole backward.
double step_ms(Layer& l, const Tensor& x, const Tensor& dy) {
  Backend& be = backend_for(Device::cpu());
  const double t0 = now_ms();
  Context ctx;
  l.forward(be, x, &ctx);
  l.backward(be, dy, ctx);
  return now_ms() - t0;
}

nlohmann::json compare(Layer& derived, Layer& hand, const Tensor& x, const Tensor& dy, int reps) {
  std::vector<double> d, h;
  for (int i = 0; i < 2; ++i) {  // warm-up
    step_ms(derived, x, dy);
    step_ms(hand, x, dy);
  }
  for (int i = 0; i < reps; ++i) {
    d.push_back(step_ms(derived, x, dy));
    h.push_back(step_ms(hand, x, dy));
  }
  const double md = median(d), mh = median(h);
  return {{"derived_ms", md}, {"hand_written_ms", mh}, {"ratio", md / mh}};
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f = {{"rows", "4096"}, {"dim", "256"}, {"hidden", "688"}, {"reps", "15"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0 || !f.count(k.substr(2))) {
      std::fprintf(stderr, "usage: derived_bench [--rows N] [--dim D] [--hidden H] [--reps R]\n");
      return 2;
    }
    f[k.substr(2)] = argv[i + 1];
  }
  const int64_t rows = std::stoll(f["rows"]), dim = std::stoll(f["dim"]), hidden = std::stoll(f["hidden"]);
  const int reps = std::stoi(f["reps"]);
  set_cpu_blas_threads(1);
  const Tensor x = random({rows, dim}, 1), dy = random({rows, dim}, 2);

  example::MySwiGLU dswiglu({dim}, hidden, DType::kF32, 1);
  SwiGLUOptions so(dim, hidden);
  SwiGLU swiglu(so);
  example::DerivedRmsNorm dnorm({dim}, 1e-6, DType::kF32, 1);
  example::RmsNorm norm(example::RmsNormOptions({dim}));

  nlohmann::json out = {{"rows", rows}, {"dim", dim}, {"hidden", hidden}, {"reps", reps}, {"threads", 1}};
  out["swiglu"] = compare(dswiglu, swiglu, x, dy, reps);
  out["rmsnorm"] = compare(dnorm, norm, x, dy, reps);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
