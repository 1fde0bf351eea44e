// tiny_gpt: gpipe's command line with one more model, built in C++ (tiny_gpt.h) and
// named in YAML as `model: {cpp: tiny_gpt}`. Every subcommand and flag of gpipe comes
// with it: train, plan, --set model.dim=64, mpirun -np 2.
#include "examples/cpp_model/tiny_gpt.h"
#include "pipeline/cli.h"

int main(int argc, char** argv) {
  example::register_tiny_gpt();
  return gpipe::cli::main(argc, argv);
}
