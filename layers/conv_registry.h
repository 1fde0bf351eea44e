// The config names of the convolutional layers, kept apart from registry.cc so that the
// registry's core does not depend on every layer family.
#pragma once

#include <functional>
#include <string>

#include "layers/registry.h"

namespace gpipe {
namespace layers {

// Gives conv2d, batchnorm2d, maxpool2d, avgpool2d, global_avgpool, flatten and
// basic_block to `register_layer`: the registry (layers/registry.cc) adds them to its
// built-in types when it is first used.
void add_conv_layer_types(const std::function<void(const std::string&, LayerFactory)>& register_layer);

}  // namespace layers
}  // namespace gpipe
