// AvgPool2d: average pooling over square windows of per-sample (C, H, W) images, and
// global average pooling (global_avgpool), one value per channel.
#pragma once

#include <string>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct AvgPool2dOptions {
  AvgPool2dOptions(Shape input, int kernel) : input(std::move(input)), kernel(kernel) {}
  // Global average pooling: one value per channel (kernel = the whole plane, which
  // must be square).
  static AvgPool2dOptions global_pool(Shape input);
  Shape input;     // (C, H, W)
  int kernel;      // square window, no padding
  int stride = 0;  // 0: the kernel size
  bool global = false;
  DType dtype = DType::kF32;
};

class AvgPool2d : public Layer {
 public:
  explicit AvgPool2d(const AvgPool2dOptions& opts);
  std::string type() const override { return global_ ? "global_avgpool" : "avgpool2d"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  int kernel_, stride_;
  bool global_;
};

}  // namespace layers
}  // namespace gpipe
