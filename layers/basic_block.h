// ResNet's BasicBlock as one composite layer, so that a partition never cuts a
// residual connection.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/activation.h"
#include "layers/batchnorm2d.h"
#include "layers/conv2d.h"
#include "layers/layer.h"

namespace gpipe {
namespace layers {

struct BasicBlockOptions {
  BasicBlockOptions(Shape input, int64_t out) : input(std::move(input)), out(out) {}
  Shape input;  // (C, H, W)
  int64_t out;  // K
  int stride = 1;
  // false: no batch norm anywhere in the block, and the convolutions get biases
  // instead (a model whose outputs do not depend on the micro-batch split).
  bool batchnorm = true;
  DType dtype = DType::kF32;
  uint64_t seed = 0;
};

// ResNet's basic block (He et al. 2016; torchvision's BasicBlock):
//
//   x -> conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN -> (+) -> ReLU -> y
//   |                                                     ^
//   +------ identity, or conv1x1(stride) -> BN -----------+
//
// The shortcut is a projection when the shape changes (stride > 1 or C != K).
// Parameters are named as torchvision's: conv1, bn1, conv2, bn2, downsample.0 (the
// projection) and downsample.1 (its BN). The Context keeps one child per sub-layer.
class BasicBlock : public Layer {
 public:
  explicit BasicBlock(const BasicBlockOptions& opts);
  std::string type() const override { return "basic_block"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;
  std::vector<Buffer> buffers() override;  // bn1.running_mean, ...
  bool has_projection() const { return proj_conv_ != nullptr; }
  // Batch norms in forward order (bn1, bn2, then the projection's); empty without.
  std::vector<BatchNorm2d*> batchnorms();
  // Not with batch norms (BatchNorm2d::capturable).
  bool capturable() const override { return bn1_ == nullptr; }

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) override;
  void end_step_impl(Backend& be, const ReplicaSum& replicas) override;
  BasicBlockOptions opts_;
  std::unique_ptr<Conv2d> conv1_, conv2_, proj_conv_;
  std::unique_ptr<BatchNorm2d> bn1_, bn2_, proj_bn_;  // null without batch norm
  std::unique_ptr<Relu> relu1_, relu_out_;
};

}  // namespace layers
}  // namespace gpipe
