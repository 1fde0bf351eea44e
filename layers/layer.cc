#include "layers/layer.h"

#include "runtime/error.h"
#include "runtime/random.h"

namespace gpipe {
namespace layers {

void check_batch(const Tensor& x, const Shape& sample, DType dtype, const std::string& who, const char* what) {
  Shape want{x.dim() > 0 ? x.size(0) : -1};
  want.insert(want.end(), sample.begin(), sample.end());
  if (!x.defined() || x.shape() != want || x.dtype() != dtype) {
    throw UserError(who + ": " + what + " is " + (x.defined() ? x.str() : std::string("undefined")) +
                    ", expected " + dtype_name(dtype) + " (batch, " + shape_str(sample).substr(1) +
                    "; check the previous layer's output size or model.input");
  }
}

Tensor Layer::forward(Backend& be, const Tensor& x, Context* ctx, const ForwardArgs& args) {
  check_batch(x, input_shape_, input_dtype_, describe(), "input");
  GPIPE_CHECK(x.device() == be.device() || (x.device().is_cpu() && be.device().is_cpu()),
              describe() + ": input on " + x.device().str() + ", backend on " + be.device().str());
  return forward_impl(be, x, ctx, args);
}

Tensor Layer::backward(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  check_batch(dy, output_shape_, dtype_, describe(), "output gradient");
  return backward_impl(be, dy, ctx, need_dx && input_dtype_ != DType::kI32);
}

Tensor Layer::backward_input(Backend& be, const Tensor& dy, Context& ctx, bool need_dx) {
  check_batch(dy, output_shape_, dtype_, describe(), "output gradient");
  return backward_input_impl(be, dy, ctx, need_dx && input_dtype_ != DType::kI32);
}

Tensor Layer::backward_impl(Backend& be, const Tensor& dy, const Context& ctx, bool need_dx) {
  GPIPE_CHECK(splits_backward(), describe() + " implements neither backward_impl nor backward_input_impl");
  Context c = ctx;  // shallow: the halves add what W needs to the copy
  Tensor dx = backward_input_impl(be, dy, c, need_dx);
  backward_weight_impl(be, c);
  return dx;
}

void Layer::to(Device device) {
  for (Parameter* p : parameters()) {
    if (p->value.device() != device) {
      Tensor moved = Tensor::empty(p->value.shape(), p->value.dtype(), device);
      copy_tensor(p->value, moved);
      p->value = moved;
    }
    p->grad = backend_for(device).zeros(p->value.shape(), p->value.dtype());
  }
  device_ = device;
}

Parameter Layer::make_parameter(const std::string& name, const Shape& shape, double bound, uint64_t seed) {
  Rng rng(seed);
  Parameter p;
  p.name = name;
  p.value = Tensor::empty(shape, dtype_, Device::cpu());
  const int64_t n = p.value.numel();
  if (dtype_ == DType::kF32) {
    float* d = p.value.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(rng.uniform(-bound, bound));
  } else if (dtype_ == DType::kF64) {
    double* d = p.value.data<double>();
    for (int64_t i = 0; i < n; ++i) d[i] = rng.uniform(-bound, bound);
  } else {
    throw UserError(std::string("parameters in ") + dtype_name(dtype_) +
                    " are not supported yet; use model.dtype: float32");
  }
  p.grad = backend_for(Device::cpu()).zeros(shape, dtype_);
  return p;
}

}  // namespace layers
}  // namespace gpipe
