#include "layers/image_shape.h"

#include <algorithm>

#include "runtime/error.h"

namespace gpipe {
namespace layers {

void check_chw(const Shape& in, const std::string& who) {
  if (in.size() != 3 || in[0] < 1 || in[1] < 1 || in[2] < 1) {
    throw UserError(who + ": expects a (C, H, W) image per sample, got " + shape_str(in) +
                    "; set model.input to (channels, height, width) and keep image layers before flatten");
  }
}

int64_t covered(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad) {
  int64_t total = 0;
  for (int64_t p = 0; p < out; ++p) {
    const int64_t lo = std::max<int64_t>(0, p * stride - pad), hi = std::min<int64_t>(in, p * stride - pad + kernel);
    total += hi - lo;
  }
  return total;
}

std::string window_str(int kernel, int stride, int pad) {
  std::string s = std::to_string(kernel) + "x" + std::to_string(kernel);
  if (stride != 1) s += ", stride " + std::to_string(stride);
  if (pad != 0) s += ", pad " + std::to_string(pad);
  return s;
}

}  // namespace layers
}  // namespace gpipe
