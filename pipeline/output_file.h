// The run's output files (trace.json, report.html, profiles) are written atomically:
// a temporary file in the same directory, flushed to disk (fsync), renamed over the
// final name, the directory flushed too; a crash leaves the old file or the new one.
// One small function, so that it can later call runtime/atomic_file.h's
// write_file_atomically instead.
#pragma once

#include <string>

namespace gpipe {
namespace pipeline {

// Throws UserError naming the path and the system's reason.
void write_text_atomically(const std::string& path, const std::string& text);

}  // namespace pipeline
}  // namespace gpipe
