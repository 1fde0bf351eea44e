// gpipe: the command-line program (pipeline/cli.h), with the built-in layers only. A
// program with layers or models of one's own is the same call after its registrations.
#include "pipeline/cli.h"

int main(int argc, char** argv) { return gpipe::cli::main(argc, argv); }
