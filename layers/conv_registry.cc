// Config names for the convolutional layers (conv2d.h, batchnorm2d.h, maxpool2d.h,
// avgpool2d.h, flatten.h, basic_block.h). Kept apart from registry.cc so that the
// registry's core does not depend on every layer family; registry.cc adds them to its
// built-in types once.
#include "layers/conv_registry.h"

#include <climits>
#include <functional>

#include "layers/avgpool2d.h"
#include "layers/basic_block.h"
#include "layers/batchnorm2d.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/maxpool2d.h"
#include "layers/registry.h"
#include "runtime/error.h"

namespace gpipe {
namespace layers {

namespace {

std::string at(const LayerSpec& s) { return s.at(); }

// An option that a layer stores as int (kernel, stride, pad).
int small_int(LayerArgs& a, const std::string& key, int64_t value) {
  if (value < INT_MIN || value > INT_MAX) {
    throw UserError("layer '" + a.spec().type + "'" + a.spec().at(key) + ": option '" + key +
                    "' is out of range: " + std::to_string(value));
  }
  return static_cast<int>(value);
}

}  // namespace

void add_conv_layer_types(const std::function<void(const std::string&, LayerFactory)>& register_layer) {
  register_layer("conv2d", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) {
    const int kernel = small_int(a, "kernel", a.get_int("kernel"));
    Conv2dOptions o(in, a.get_int("out"), kernel);
    o.stride = small_int(a, "stride", a.get_int("stride", 1));
    o.pad = small_int(a, "pad", a.get_int("pad", kernel / 2));  // "same" size at stride 1 for odd kernels
    o.bias = a.get_bool("bias", true);
    o.dtype = dtype;
    o.seed = seed;
    return std::make_unique<Conv2d>(o);
  });
  register_layer("batchnorm2d", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) {
    BatchNorm2dOptions o(in);
    o.dtype = dtype;
    return std::make_unique<BatchNorm2d>(o);
  });
  register_layer("maxpool2d", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t) {
    const int kernel = small_int(a, "kernel", a.get_int("kernel"));
    MaxPool2dOptions o(in, kernel);
    o.stride = small_int(a, "stride", a.get_int("stride", kernel));
    o.pad = small_int(a, "pad", a.get_int("pad", 0));
    o.dtype = dtype;
    return std::make_unique<MaxPool2d>(o);
  });
  register_layer("avgpool2d", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t) {
    const int kernel = small_int(a, "kernel", a.get_int("kernel"));
    AvgPool2dOptions o(in, kernel);
    o.stride = small_int(a, "stride", a.get_int("stride", kernel));
    o.dtype = dtype;
    return std::make_unique<AvgPool2d>(o);
  });
  register_layer("global_avgpool", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) {
    AvgPool2dOptions o = AvgPool2dOptions::global_pool(in);
    o.dtype = dtype;
    return std::make_unique<AvgPool2d>(o);
  });
  register_layer("flatten", [](LayerArgs&, const Shape& in, DType dtype, uint64_t) {
    return std::make_unique<Flatten>(in, dtype);
  });
  register_layer("basic_block", [](LayerArgs& a, const Shape& in, DType dtype, uint64_t seed) {
    BasicBlockOptions o(in, a.get_int("out"));
    o.stride = small_int(a, "stride", a.get_int("stride", 1));
    o.batchnorm = a.get_bool("batchnorm", true);
    o.dtype = dtype;
    o.seed = seed;
    return std::make_unique<BasicBlock>(o);
  });
}

}  // namespace layers
}  // namespace gpipe
