// Shared test helpers: expect_close (reports the largest absolute and relative error
// and the first mismatching elements), random tensors, and the GPU-skip convention.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "layers/gradcheck.h"
#include "runtime/tensor.h"

namespace gpipe {
namespace testing {

struct CloseReport {
  bool ok = true;
  double max_abs = 0, max_rel = 0;
  std::string detail;  // first mismatches, for the failure message
};

// |a - b| <= atol + rtol * |b| elementwise.
CloseReport compare(const std::vector<double>& a, const std::vector<double>& b, double rtol, double atol);

// Host copy of any float tensor (CPU or CUDA) as doubles.
std::vector<double> to_doubles(const Tensor& t);

// A CPU tensor of the given dtype with values uniform in [lo, hi), seeded.
Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, double lo = -1.0, double hi = 1.0);
Tensor random_labels(int64_t n, int classes, uint64_t seed);

// A path for a test's own file: under $TEST_TMPDIR (Bazel's per-test folder), else /tmp.
inline std::string tmp_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

// cpu:0 .. cpu:k-1, one device per stage.
inline std::vector<Device> cpu_devices(int k) {
  std::vector<Device> d;
  for (int i = 0; i < k; ++i) d.push_back(Device::cpu(i));
  return d;
}

// d f / d t by central differences, perturbing every element of the float64 tensor t
// in place (and restoring it): the reference every backward is checked against. The
// public checker's (layers/gradcheck.h), for the op tests' own objectives.
std::vector<double> numeric_gradient(Tensor& t, const std::function<double()>& f, double eps = 1e-6);

// Bytes of every tensor a layer's context (and its children) keeps, counted per tensor:
// what LayerCost::saved_bytes counts.
inline int64_t context_bytes(const layers::Context& ctx) {
  int64_t n = 0;
  for (const Tensor& t : ctx.saved) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  for (const layers::Context& c : ctx.children) n += context_bytes(c);
  return n;
}

// Sum of a[i] * b[i] over all elements, in double, for f(x) = <layer(x), r> objectives.
double dot(const Tensor& a, const Tensor& b);

// Runs f(i) for i in 0 .. n-1, each on a thread of its own (replicas, stages), and
// returns what each threw ("" for none), for the caller to CHECK.
std::vector<std::string> on_threads(int n, const std::function<void(int)>& f);

// Prints the marker that `./gpipe test` counts as "skipped" (a doctest binary that has
// nothing to run here, e.g. GPU tests on a machine without a GPU, exits 0 after it).
void report_skipped(const std::string& why);

}  // namespace testing
}  // namespace gpipe

// CHECK that a gradient check (layers/gradcheck.h) passed; prints its report otherwise.
#define GPIPE_EXPECT_GRADIENTS(report)            \
  do {                                            \
    const auto gpipe_grad_report_ = (report);     \
    CHECK_MESSAGE(gpipe_grad_report_.ok, gpipe_grad_report_.str()); \
  } while (0)

// CHECK that two tensors (or vectors of doubles) agree; prints the errors on failure.
#define GPIPE_EXPECT_CLOSE(a, b, rtol, atol)                                                         \
  do {                                                                                              \
    auto gpipe_rep_ = ::gpipe::testing::compare(::gpipe::testing::as_doubles(a),                    \
                                                ::gpipe::testing::as_doubles(b), (rtol), (atol));   \
    INFO("max abs err " << gpipe_rep_.max_abs << ", max rel err " << gpipe_rep_.max_rel << "; "     \
                        << gpipe_rep_.detail);                                                      \
    CHECK(gpipe_rep_.ok);                                                                           \
  } while (0)

namespace gpipe {
namespace testing {
inline std::vector<double> as_doubles(const Tensor& t) { return to_doubles(t); }
inline std::vector<double> as_doubles(const std::vector<double>& v) { return v; }
}  // namespace testing
}  // namespace gpipe
