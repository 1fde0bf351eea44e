#include "pipeline/executor/held_bytes.h"

#include <algorithm>

namespace gpipe {
namespace pipeline {

void add_buffer(const Tensor& t, BufferList& out) {
  if (t.defined()) out.emplace_back(t.raw_data(), static_cast<int64_t>(t.nbytes()));
}

void add_buffers(const layers::Context& c, BufferList& out) {
  for (const auto& t : c.saved) add_buffer(t, out);
  for (const auto& child : c.children) add_buffers(child, out);
}

int64_t distinct_bytes(BufferList held) {
  std::sort(held.begin(), held.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  });
  held.erase(std::unique(held.begin(), held.end(), [](const auto& a, const auto& b) { return a.first == b.first; }),
             held.end());
  int64_t total = 0;
  for (const auto& h : held) total += h.second;
  return total;
}

}  // namespace pipeline
}  // namespace gpipe
