// Fully connected layer over the last dimension: y = x W^T + b, with W (out, in) as in
// PyTorch; inputs (batch, *leading, in) are treated as (rows, in). Weights are
// initialised He-uniform in [-sqrt(6/in), sqrt(6/in)] (variance 2/in, which keeps the
// signal's scale through deep ReLU stacks; torch.nn.Linear's default, bound 1/sqrt(in),
// shrinks it layer by layer); biases uniform in [-1/sqrt(in), 1/sqrt(in)].
#pragma once

#include "layers/layer.h"
#include "layers/tensor_parallel.h"

namespace gpipe {
namespace layers {

struct LinearOptions {
  LinearOptions(int64_t in, int64_t out) : in(in), out(out) {}
  int64_t in, out;
  Shape leading;  // per-sample dimensions before the features, e.g. {T} for (T, C) inputs
  bool bias = true;
  DType dtype = DType::kF32;
  uint64_t seed = 0;
  // Tensor parallelism (layers/tensor_parallel.h): this member's block of the layer
  // whose whole sizes are in and out. Column: out / T output features, the whole
  // input; row: in / T input features, the whole output (the bias whole on every
  // member). The values are those blocks of the unsplit layer's.
  TensorSplit split;
};

class Linear : public Layer {
 public:
  explicit Linear(const LinearOptions& opts);
  std::string type() const override { return "linear"; }
  std::string describe() const override;
  LayerCost cost(int64_t batch) const override;
  std::vector<Parameter*> parameters() override;
  bool splits_backward() const override { return true; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  // The group a split layer sums over (not owned; it outlives the layer's calls).
  void set_collectives(TensorCollectives* group) override { group_ = group; }
  // A residual block's sums in the product's op. forward_add returns forward(x) +
  // residual (residual of the output's shape and type) through Backend::linear_residual;
  // backward_input_add adds the input gradient into dx (of x's shape and type) through
  // Backend::linear_input_grad_add, for an input that feeds several layers. Where the
  // product is not the last op before the sum (a bias, a member's output or input
  // gradient summed over its group) they are forward or backward_input, then axpy. On
  // the CPU the results are those of that composition, bit for bit.
  Tensor forward_add(Backend& be, const Tensor& x, const Tensor& residual, Context* ctx, const ForwardArgs& args = {});
  void backward_input_add(Backend& be, const Tensor& dy, Context& ctx, Tensor& dx);

 private:
  Tensor forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) override;
  Tensor backward_input_impl(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) override;
  void backward_weight_impl(Backend& be, Context& ctx) override;
  void backward_weight_batch_impl(Backend& be, const std::vector<Context*>& ctxs) override;
  void weight_grad(Backend& be, const Tensor& dy, const Tensor& x);  // W's sums into the gradients
  TensorCollectives& group() const;
  int64_t in_here() const;   // the input features this member takes
  int64_t out_here() const;  // the output features it computes
  LinearOptions opts_;
  TensorCollectives* group_ = nullptr;
  Parameter weight_;  // (out, in), or this member's block of it
  Parameter bias_;    // (out)
};

}  // namespace layers
}  // namespace gpipe
