// my_gpipe: gpipe's command line with one more layer type. This is the whole program: the
// registration and the call; every subcommand and flag of gpipe comes with it.
#include "examples/custom_layer/rmsnorm.h"
#include "pipeline/cli.h"

int main(int argc, char** argv) {
  example::register_rmsnorm();
  return gpipe::cli::main(argc, argv);
}
