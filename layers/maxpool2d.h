// MaxPool2d: max pooling over square windows of per-sample (C, H, W) images.
#pragma once

#include <string>

#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct MaxPool2dOptions {
  MaxPool2dOptions(Shape input, int kernel) : input(std::move(input)), kernel(kernel) {}
  Shape input;     // (C, H, W)
  int kernel;      // square window
  int stride = 0;  // 0: the kernel size
  int pad = 0;     // at most kernel / 2; padding never wins (-infinity)
  DType dtype = DType::kF32;
};

class MaxPool2d : public Layer {
 public:
  explicit MaxPool2d(const MaxPool2dOptions& opts);
  std::string type() const override { return "maxpool2d"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  int kernel_, stride_, pad_;
};

}  // namespace layers
}  // namespace gpipe
