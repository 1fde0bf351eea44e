#include "runtime/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "runtime/error.h"

namespace gpipe {

namespace {

std::string sys_error(const std::string& what, const std::string& path) {
  return what + " '" + path + "': " + std::strerror(errno);
}

// A full, read-only or forbidden file system is the user's to fix, and retrying cannot
// help (gpipe run does not restart a UserError): it says so. Anything else (EIO, ...)
// stays an Error.
[[noreturn]] void throw_io(const std::string& message) {
  switch (errno) {
    case ENOSPC:
    case EDQUOT:
      throw UserError(message + ": the disk is full (or over its quota); free space there or write elsewhere");
    case EROFS:
    case EACCES:
    case EPERM:
      throw UserError(message + ": the file system or directory is not writable; make it writable or write "
                                "elsewhere");
    default:
      throw Error(message);
  }
}

// A name no other writer in this or another process uses: the pid and a counter. It
// starts with a dot and ends in ".tmp" so directory listings and globs skip it.
std::string temporary_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  return dir + "." + base + "." + std::to_string(::getpid()) + "." + std::to_string(counter++) + ".tmp";
}

}  // namespace

void FileSink::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io(sys_error("cannot write", path_) + " (after " + std::to_string(written_) + " bytes)");
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

std::string parent_directory(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(sys_error("cannot open directory", dir));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems (e.g. some network mounts) refuse fsync on directories; the
  // rename itself has happened, so only a real I/O error is fatal.
  if (rc != 0 && err != EINVAL && err != ENOTSUP) {
    errno = err;
    throw Error(sys_error("cannot flush directory", dir));
  }
}

void write_file_atomically(const std::string& path, const std::function<void(FileSink&)>& fill) {
  const std::string tmp = temporary_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw_io(sys_error("cannot create", tmp) + "; check that the directory exists and is writable");
  bool open = true;
  try {
    FileSink sink(fd, path);
    fill(sink);
    if (::fsync(fd) != 0) throw_io(sys_error("cannot flush", path));
    open = false;  // close releases the descriptor even when it fails
    // close can report a deferred write error (NFS).
    if (::close(fd) != 0) throw_io(sys_error("cannot close", path));
  } catch (...) {
    if (open) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    const std::string msg = sys_error("cannot rename the temporary file onto", path);
    ::unlink(tmp.c_str());
    errno = err;
    throw_io(msg);
  }
  fsync_directory(parent_directory(path));
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  write_file_atomically(path, [&](FileSink& sink) { sink.write(contents); });
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(sys_error("cannot open", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(sys_error("cannot read", path));
  return ss.str();
}

}  // namespace gpipe
