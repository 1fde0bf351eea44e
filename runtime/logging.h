// Logging through spdlog. Every line shows the rank and stage of the thread that wrote
// it ("[r0 s1]"), so the interleaved output of a pipeline can be read stage by stage.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace gpipe {

// Sets the default logger's pattern and level ("trace".."off"). Safe to call again.
void init_logging(const std::string& level = "info");

// The rank and stage the calling thread works for; -1 means "none" (the driver).
void set_thread_context(int rank, int stage);
int thread_rank();
int thread_stage();
// "r0 s1", "r0 s-" ...
std::string thread_context_str();

}  // namespace gpipe
