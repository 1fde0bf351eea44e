// The gpipe command line as a library. A program of one's own is its registrations and
// one call, and has every subcommand and flag of ours (train, plan, help; --set; one
// process per stage under mpirun):
//
//   #include "layers/registry.h"
//   #include "pipeline/cli.h"
//
//   int main(int argc, char** argv) {
//     gpipe::layers::register_layer("my_rmsnorm", make_rmsnorm);  // type: my_rmsnorm in YAML
//     gpipe::layers::register_model("my_model", make_model);    // model: {cpp: my_model}
//     return gpipe::cli::main(argc, argv);
//   }
//
// Our own `gpipe` binary (pipeline/main.cc) is exactly that with no registrations.
#pragma once

#include <string>

#include "pipeline/config/config.h"
#include "pipeline/config/run_model.h"

namespace gpipe {
namespace cli {

// Runs `PROGRAM COMMAND [ARGS]` and returns the exit status: 0 on success, 2 for a
// user's mistake (bad config, bad arguments, a layer that breaks the contract), 1 for
// an internal error; messages go to stderr as "PROGRAM: error: ...". Under mpirun it
// initialises MPI and runs this rank's stage; a failing rank ends the whole job.
int main(int argc, char** argv);

// `PROGRAM train` for a program that fills its config in C++ and builds its model with
// `make_model` (called once in each process): the same launch under mpirun, the same
// messages and exit status. argc and argv are the program's (MPI_Init reads them).
int train(int argc, char** argv, pipeline::Config config, const pipeline::MakeModel& make_model);

// The commands and flags (what `PROGRAM help` prints first).
std::string usage(const std::string& program);

}  // namespace cli
}  // namespace gpipe
