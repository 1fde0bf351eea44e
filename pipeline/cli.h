// The command line as a library, gpipe::cli::main and gpipe::cli::train: a public entry
// point of pipeline/ (target //pipeline:cli). It lives in pipeline/cli/cli.h.
#pragma once

#include "pipeline/cli/cli.h"
