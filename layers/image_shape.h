// Shapes of per-sample (C, H, W) images and of the square windows that slide over them,
// shared by the convolution, pooling and residual-block layers (layers/conv2d.h,
// maxpool2d.h, avgpool2d.h, flatten.h, basic_block.h). Private to //layers.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/tensor.h"

namespace gpipe {
namespace layers {

// A user's shape mistake names the layer, the shape and the fix.
void check_chw(const Shape& in, const std::string& who);

// Positions of a kernel-wide window sliding with `stride` over `in` padded by `pad`.
inline int64_t out_extent(int64_t in, int64_t kernel, int64_t stride, int64_t pad) {
  return (in + 2 * pad - kernel) / stride + 1;
}

// Sum over the output positions of the input values each window covers (padding
// excluded), along one dimension.
int64_t covered(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t pad);

inline double elem_size(DType dtype) { return static_cast<double>(dtype_size(dtype)); }

// "3x3", "3x3, stride 2", "3x3, stride 2, pad 1": a window as describe() prints it.
std::string window_str(int kernel, int stride, int pad);

}  // namespace layers
}  // namespace gpipe
