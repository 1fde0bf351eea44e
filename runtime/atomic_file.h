// Files a user depends on (checkpoints, report.json and report.html, trace.json, profiles)
// are written atomically, all by this one writer: under a
// temporary name in the same directory, flushed to disk (fsync), renamed over the final
// name, and the directory flushed too, so a crash at any instant leaves either the old
// file or the new one, never a torn one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace gpipe {

// The sink a streaming writer fills. write() retries short writes and EINTR and throws
// naming the file and the system's reason: a UserError for a full disk (ENOSPC, EDQUOT)
// or a file system that refuses writing (EROFS, EACCES, EPERM), an Error otherwise (EIO).
class FileSink {
 public:
  FileSink(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  void write(const void* data, size_t bytes);
  void write(const std::string& s) { write(s.data(), s.size()); }
  uint64_t bytes_written() const { return written_; }
  // The final path (not the temporary one), for messages.
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
  uint64_t written_ = 0;
};

// Writes `contents` to `path` atomically (see above). Throws as FileSink::write does.
void write_file_atomically(const std::string& path, const std::string& contents);
// The same with the bytes produced by `fill`; if `fill` throws, the temporary file is
// removed, `path` is left as it was, and the exception goes on.
void write_file_atomically(const std::string& path, const std::function<void(FileSink&)>& fill);

// fsync of a directory: makes a rename, creation or removal inside it durable.
void fsync_directory(const std::string& dir);
// The directory part of a path ("." for a bare file name).
std::string parent_directory(const std::string& path);
// Whole-file read; throws Error naming the path when it cannot be opened or read.
std::string read_file(const std::string& path);

}  // namespace gpipe
