#include "tests/testing.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <thread>

#include "runtime/bf16.h"
#include "runtime/fp16.h"
#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace testing {

CloseReport compare(const std::vector<double>& a, const std::vector<double>& b, double rtol, double atol) {
  CloseReport r;
  std::ostringstream os;
  if (a.size() != b.size()) {
    r.ok = false;
    r.detail = "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
    return r;
  }
  int shown = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    const double rel = d / std::max(std::fabs(b[i]), 1e-300);
    if (!(d <= atol + rtol * std::fabs(b[i]))) {  // NaN fails too
      r.ok = false;
      if (shown++ < 5) os << "[" << i << "] " << a[i] << " vs " << b[i] << "; ";
    }
    if (d > r.max_abs || std::isnan(d)) r.max_abs = d;
    if (rel > r.max_rel && std::fabs(b[i]) > atol) r.max_rel = rel;
  }
  r.detail = r.ok ? "all close" : "first mismatches: " + os.str();
  return r;
}

std::vector<double> to_doubles(const Tensor& t) {
  Tensor host = t;
  if (!t.device().is_cpu()) {
    host = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
    copy_tensor(t, host);
  }
  std::vector<double> out(host.numel());
  if (host.dtype() == DType::kF32) {
    const float* p = host.data<float>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else if (host.dtype() == DType::kF64) {
    const double* p = host.data<double>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else if (host.dtype() == DType::kBF16) {
    const BFloat16* p = host.data<BFloat16>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_double(p[i]);
  } else if (host.dtype() == DType::kF16) {
    const Half* p = host.data<Half>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = half_to_double(p[i]);
  } else if (host.dtype() == DType::kI32) {
    const int32_t* p = host.data<int32_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else {
    throw Error("to_doubles: unsupported " + host.str());
  }
  return out;
}

Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, double lo, double hi) {
  Rng rng(seed);
  Tensor t = Tensor::empty(shape, dtype, Device::cpu());
  const int64_t n = t.numel();
  if (dtype == DType::kF32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(rng.uniform(lo, hi));
  } else if (dtype == DType::kBF16) {  // float32's values, rounded
    BFloat16* p = t.data<BFloat16>();
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(static_cast<float>(rng.uniform(lo, hi)));
  } else if (dtype == DType::kF16) {  // float32's values, rounded
    Half* p = t.data<Half>();
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_half(static_cast<float>(rng.uniform(lo, hi)));
  } else {
    double* p = t.data<double>();
    for (int64_t i = 0; i < n; ++i) p[i] = rng.uniform(lo, hi);
  }
  return t;
}

Tensor random_labels(int64_t n, int classes, uint64_t seed) {
  Rng rng(seed);
  Tensor t = Tensor::empty({n}, DType::kI32, Device::cpu());
  for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng.next() % classes);
  return t;
}

std::vector<double> numeric_gradient(Tensor& t, const std::function<double()>& f, double eps) {
  return layers::numeric_gradient(t, f, eps);
}

double dot(const Tensor& a, const Tensor& b) {
  const auto x = to_doubles(a), y = to_doubles(b);
  GPIPE_CHECK(x.size() == y.size(), "dot of " + a.str() + " and " + b.str());
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

void report_skipped(const std::string& why) {
  std::printf("GPIPE_TEST_SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
}

std::vector<std::string> on_threads(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        f(i);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace testing
}  // namespace gpipe
