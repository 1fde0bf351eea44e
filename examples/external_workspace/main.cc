// my_trainer: gpipe's command line plus this project's layer.
#include "affine.h"
#include "pipeline/cli.h"

int main(int argc, char** argv) {
  my_project::register_affine();
  return gpipe::cli::main(argc, argv);
}
