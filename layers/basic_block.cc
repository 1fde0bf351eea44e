#include "layers/basic_block.h"

#include <memory>

#include "layers/image_shape.h"
#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

namespace {
// Children of a BasicBlock's Context, in forward order.
enum Child { kConv1, kBn1, kRelu1, kConv2, kBn2, kProjConv, kProjBn, kReluOut, kNumChildren };

std::string block_name(const BasicBlockOptions& o) {
  std::string s = "basic_block(" + (o.input.empty() ? std::string("?") : std::to_string(o.input[0])) + " -> " +
                  std::to_string(o.out);
  if (o.stride != 1) s += ", stride " + std::to_string(o.stride);
  if (!o.batchnorm) s += ", no batchnorm";
  return s + ")";
}

Shape block_output(const BasicBlockOptions& o) {
  const std::string who = block_name(o);
  check_chw(o.input, who);
  if (o.out < 1 || o.stride < 1) throw UserError(who + ": out and stride must be positive");
  // 3x3 with padding 1, and the 1x1 projection without padding, give the same size.
  return {o.out, out_extent(o.input[1], 3, o.stride, 1), out_extent(o.input[2], 3, o.stride, 1)};
}

std::unique_ptr<Conv2d> make_conv(const Shape& in, int64_t out, int kernel, int stride, const BasicBlockOptions& o,
                                  uint64_t stream) {
  Conv2dOptions c(in, out, kernel);
  c.stride = stride;
  c.pad = kernel / 2;
  c.bias = !o.batchnorm;  // a batch norm's beta makes a bias redundant
  c.dtype = o.dtype;
  c.seed = mix_seed(o.seed, stream);
  return std::make_unique<Conv2d>(c);
}

std::unique_ptr<BatchNorm2d> make_bn(const Shape& in, const BasicBlockOptions& o) {
  if (!o.batchnorm) return nullptr;
  BatchNorm2dOptions b(in);
  b.dtype = o.dtype;
  return std::make_unique<BatchNorm2d>(b);
}

void prefix_names(Layer* l, const std::string& prefix) {
  if (l == nullptr) return;
  for (Parameter* p : l->parameters()) p->name = prefix + p->name;
}
}  // namespace

BasicBlock::BasicBlock(const BasicBlockOptions& opts) : Layer(opts.input, block_output(opts), opts.dtype), opts_(opts) {
  conv1_ = make_conv(opts.input, opts.out, 3, opts.stride, opts, 1);
  bn1_ = make_bn(conv1_->output_shape(), opts);
  relu1_ = std::make_unique<Relu>(conv1_->output_shape(), opts.dtype);
  conv2_ = make_conv(conv1_->output_shape(), opts.out, 3, 1, opts, 2);
  bn2_ = make_bn(conv2_->output_shape(), opts);
  if (opts.stride != 1 || opts.input[0] != opts.out) {
    proj_conv_ = make_conv(opts.input, opts.out, 1, opts.stride, opts, 3);
    proj_bn_ = make_bn(proj_conv_->output_shape(), opts);
  }
  relu_out_ = std::make_unique<Relu>(output_shape_, opts.dtype);
  prefix_names(conv1_.get(), "conv1.");
  prefix_names(bn1_.get(), "bn1.");
  prefix_names(conv2_.get(), "conv2.");
  prefix_names(bn2_.get(), "bn2.");
  prefix_names(proj_conv_.get(), "downsample.0.");
  prefix_names(proj_bn_.get(), "downsample.1.");
}

std::string BasicBlock::describe() const { return block_name(opts_); }

std::vector<Parameter*> BasicBlock::parameters() {
  std::vector<Parameter*> out;
  for (Layer* l : std::initializer_list<Layer*>{conv1_.get(), bn1_.get(), conv2_.get(), bn2_.get(), proj_conv_.get(),
                                                proj_bn_.get()}) {
    if (l == nullptr) continue;
    for (Parameter* p : l->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<Buffer> BasicBlock::buffers() {
  std::vector<Buffer> out;
  for (const auto& [bn, prefix] : {std::make_pair(bn1_.get(), "bn1."), std::make_pair(bn2_.get(), "bn2."),
                                   std::make_pair(proj_bn_.get(), "downsample.1.")}) {
    if (bn == nullptr) continue;
    for (const Buffer& b : bn->buffers()) out.push_back({prefix + b.name, b.value});
  }
  return out;
}

std::vector<BatchNorm2d*> BasicBlock::batchnorms() {
  std::vector<BatchNorm2d*> out;
  for (BatchNorm2d* b : {bn1_.get(), bn2_.get(), proj_bn_.get()}) {
    if (b != nullptr) out.push_back(b);
  }
  return out;
}

void BasicBlock::end_step_impl(Backend& be, const ReplicaSum& replicas) {
  for (BatchNorm2d* b : batchnorms()) b->end_step(be, replicas);
}

LayerCost BasicBlock::cost(int64_t batch) const {
  const double es = elem_size(dtype_);
  const double in = static_cast<double>(batch * shape_numel(input_shape_));
  const double out = static_cast<double>(batch * shape_numel(output_shape_));
  LayerCost c;
  std::vector<const Layer*> parts = {conv1_.get(), bn1_.get(),       relu1_.get(),   conv2_.get(),
                                     bn2_.get(),   proj_conv_.get(), proj_bn_.get(), relu_out_.get()};
  for (const Layer* l : parts) {
    if (l == nullptr) continue;
    const LayerCost p = l->cost(batch);
    c.forward_flops += p.forward_flops;
    c.backward_flops += p.backward_flops;
    c.forward_bytes += p.forward_bytes;
    c.backward_bytes += p.backward_bytes;
    c.param_bytes += p.param_bytes;
  }
  // The residual add: forward, and the shortcut's gradient added into dx in backward.
  c.forward_flops += out;
  c.forward_bytes += 3 * es * out;
  c.backward_flops += in;
  c.backward_bytes += 3 * es * in;
  // Only conv1's and the projection's input gradients (and their sum) serve dx alone;
  // every other dx inside the block feeds a parameter gradient.
  c.input_grad_flops = conv1_->cost(batch).input_grad_flops + in;
  if (proj_conv_) c.input_grad_flops += proj_conv_->cost(batch).input_grad_flops;
  c.output_bytes = static_cast<int64_t>(es * out);
  // Distinct buffers: conv2 saves relu1's output and the projection saves the block
  // input, both already counted (by relu1 and conv1).
  for (const Layer* l : {static_cast<const Layer*>(conv1_.get()), static_cast<const Layer*>(relu1_.get()),
                         static_cast<const Layer*>(relu_out_.get()), static_cast<const Layer*>(bn1_.get()),
                         static_cast<const Layer*>(bn2_.get()), static_cast<const Layer*>(proj_bn_.get())}) {
    if (l != nullptr) c.saved_bytes += l->cost(batch).saved_bytes;
  }
  return c;
}

Tensor BasicBlock::forward_impl(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  if (ctx != nullptr) ctx->children.assign(kNumChildren, {});
  auto child = [&](Child i) { return ctx != nullptr ? &ctx->children[i] : nullptr; };
  Tensor h = conv1_->forward(be, x, child(kConv1), args);  // (N, K, P, Q)
  if (bn1_) h = bn1_->forward(be, h, child(kBn1), args);
  h = relu1_->forward(be, h, child(kRelu1), args);
  h = conv2_->forward(be, h, child(kConv2), args);
  if (bn2_) h = bn2_->forward(be, h, child(kBn2), args);
  Tensor shortcut = x;
  if (proj_conv_) {
    shortcut = proj_conv_->forward(be, x, child(kProjConv), args);
    if (proj_bn_) shortcut = proj_bn_->forward(be, shortcut, child(kProjBn), args);
  }
  // In place: h is the last conv's or BN's output, which neither keeps for backward.
  be.axpy(1.0, shortcut, h);
  Tensor y = relu_out_->forward(be, h, child(kReluOut), args);
  if (ctx != nullptr) {
    // The children hold what backward reads. The same buffers (shared, not copied)
    // are listed here too, so memory accounting that reads only a layer's own saved
    // tensors (the executor's meter) sees them.
    ctx->saved.clear();
    for (const Context& c : ctx->children) {
      for (const Tensor& t : c.saved) {
        const bool seen = std::any_of(ctx->saved.begin(), ctx->saved.end(),
                                      [&](const Tensor& s) { return s.raw_data() == t.raw_data(); });
        if (!seen) ctx->saved.push_back(t);
      }
    }
  }
  return y;
}

Tensor BasicBlock::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  const auto& ch = ctx.children;
  GPIPE_CHECK(ch.size() == kNumChildren, describe() + ": backward without its forward's context");
  const Tensor g = relu_out_->backward(be, dy, ch[kReluOut], true);  // (N, K, P, Q), into both branches
  Tensor gm = g;
  if (bn2_) gm = bn2_->backward(be, gm, ch[kBn2], true);
  gm = conv2_->backward(be, gm, ch[kConv2], true);
  gm = relu1_->backward(be, gm, ch[kRelu1], true);
  if (bn1_) gm = bn1_->backward(be, gm, ch[kBn1], true);
  Tensor dx = conv1_->backward(be, gm, ch[kConv1], need_dx);  // (N, C, H, W)
  if (proj_conv_) {
    Tensor gs = g;
    if (proj_bn_) gs = proj_bn_->backward(be, gs, ch[kProjBn], true);
    gs = proj_conv_->backward(be, gs, ch[kProjConv], need_dx);
    if (need_dx) be.axpy(1.0, gs, dx);
  } else if (need_dx) {
    be.axpy(1.0, g, dx);  // identity shortcut
  }
  return dx;
}

}  // namespace layers
}  // namespace gpipe
