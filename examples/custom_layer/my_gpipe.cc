// my_gpipe: gpipe's command line with three more layer types. This is the whole program: the
// registration and the call; every subcommand and flag of gpipe comes with it.
#include "examples/custom_layer/derived_layers.h"
#include "examples/custom_layer/rmsnorm.h"
#include "pipeline/cli.h"

int main(int argc, char** argv) {
  example::register_rmsnorm();
  example::register_derived_layers();  // my_swiglu, derived_rmsnorm: written as forward only
  return gpipe::cli::main(argc, argv);
}
