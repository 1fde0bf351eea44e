// Test helper for the multi-process tests: compares two runs' report.json at full
// precision (the console prints losses to 4 digits). Every step's loss, and the final
// evaluation, must agree to a relative tolerance; prints both columns either way.
//
//   compare_reports A.json B.json RTOL     exit 0: equal, 1: they differ, 2: unreadable
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {
bool read(const char* path, nlohmann::json& out) {
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "compare_reports: cannot read %s\n", path);
    return false;
  }
  try {
    out = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "compare_reports: %s is not JSON: %s\n", path, e.what());
    return false;
  }
  return true;
}

bool close(double a, double b, double rtol) { return std::abs(a - b) <= rtol * std::abs(b); }
}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: compare_reports A.json B.json RTOL\n");
    return 2;
  }
  nlohmann::json a, b;
  if (!read(argv[1], a) || !read(argv[2], b)) return 2;
  const double rtol = std::atof(argv[3]);
  bool same = a["steps"].size() == b["steps"].size() && !a["steps"].empty();
  if (!same) std::printf("step counts differ: %zu vs %zu\n", a["steps"].size(), b["steps"].size());
  for (size_t i = 0; i < std::min(a["steps"].size(), b["steps"].size()); ++i) {
    const double x = a["steps"][i]["loss"].get<double>(), y = b["steps"][i]["loss"].get<double>();
    const bool ok = close(x, y, rtol);
    std::printf("step %zu  %.17g  %.17g  %s\n", i, x, y, ok ? "" : "DIFFERENT");
    same = same && ok;
  }
  if (a.contains("eval") != b.contains("eval")) {
    std::printf("only one run has an evaluation\n");
    same = false;
  } else if (a.contains("eval")) {
    for (const char* k : {"loss", "accuracy"}) {
      const double x = a["eval"][k].get<double>(), y = b["eval"][k].get<double>();
      const bool ok = close(x, y, rtol);
      std::printf("eval %s  %.17g  %.17g  %s\n", k, x, y, ok ? "" : "DIFFERENT");
      same = same && ok;
    }
  }
  return same ? 0 : 1;
}
