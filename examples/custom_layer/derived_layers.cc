#include "examples/custom_layer/derived_layers.h"

#include <memory>

#include "layers/registry.h"

namespace example {

void register_derived_layers() {
  using gpipe::layers::LayerArgs;
  gpipe::layers::register_layer("my_swiglu", [](LayerArgs& args, const gpipe::Shape& input, gpipe::DType dtype,
                                                uint64_t seed) {
    return std::unique_ptr<gpipe::layers::Layer>(
        std::make_unique<MySwiGLU>(input, args.get_int("hidden"), dtype, seed));
  });
  gpipe::layers::register_layer("derived_rmsnorm", [](LayerArgs& args, const gpipe::Shape& input, gpipe::DType dtype,
                                                      uint64_t seed) {
    return std::unique_ptr<gpipe::layers::Layer>(
        std::make_unique<DerivedRmsNorm>(input, args.get_double("eps", 1e-6), dtype, seed));
  });
}

}  // namespace example
