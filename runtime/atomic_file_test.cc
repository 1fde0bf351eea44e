// Atomic writes: the file holds the old or the new contents, never a mix, whatever
// happens during the write (an exception, or the writer killed by SIGKILL).
#include "runtime/atomic_file.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "tests/temp_dir.h"

using namespace gpipe;
using gpipe::testing::TempDir;

namespace {
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  return out;
}
}  // namespace

TEST_CASE("atomic_file: writes, replaces and leaves no temporary file behind") {
  TempDir dir;
  const std::string path = dir / "report.json";
  write_file_atomically(path, std::string("first"));
  CHECK(read_file(path) == "first");
  write_file_atomically(path, std::string("second, longer"));
  CHECK(read_file(path) == "second, longer");

  uint64_t counted = 0;
  write_file_atomically(path, [&](FileSink& sink) {
    for (int i = 0; i < 1000; ++i) sink.write("0123456789");
    sink.write(std::string(3, '\0'));
    counted = sink.bytes_written();
    CHECK(sink.path() == path);
  });
  CHECK(counted == 10003);
  CHECK(read_file(path).size() == 10003);
  CHECK(names_in(dir.path()) == std::vector<std::string>{"report.json"});
}

TEST_CASE("atomic_file: a writer that throws leaves the old file and no temporary") {
  TempDir dir;
  const std::string path = dir / "state.json";
  write_file_atomically(path, std::string("old"));
  CHECK_THROWS_WITH(write_file_atomically(path,
                                          [](FileSink& sink) {
                                            sink.write("new but never fin");
                                            throw Error("disk on fire");
                                          }),
                    "disk on fire");
  CHECK(read_file(path) == "old");
  CHECK(names_in(dir.path()) == std::vector<std::string>{"state.json"});
}

TEST_CASE("atomic_file: a missing directory is an error naming the path") {
  TempDir dir;
  CHECK_THROWS_WITH_AS(write_file_atomically(dir / "no/such/dir/f.txt", std::string("x")),
                       doctest::Contains("no/such/dir/.f.txt."), Error);
  CHECK_THROWS_WITH_AS(read_file(dir / "absent"), doctest::Contains("absent': No such file"), Error);
  CHECK(parent_directory("a/b/c") == "a/b");
  CHECK(parent_directory("c") == ".");
  CHECK(parent_directory("/c") == "/");
}

// A full disk is the user's to fix (gpipe run does not restart a UserError), and the
// message names the file, the bytes already written and what to do. /dev/full fails
// every write with ENOSPC.
TEST_CASE("atomic_file: a full disk is a UserError naming the file and the fix") {
  const int fd = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    MESSAGE("skipped: no /dev/full on this machine");
    return;
  }
  FileSink sink(fd, "out/report.html");
  CHECK_THROWS_WITH_AS(sink.write(std::string(4096, 'x')),
                       doctest::Contains("cannot write 'out/report.html'"), UserError);
  CHECK_THROWS_WITH_AS(sink.write(std::string("y")), doctest::Contains("the disk is full"), UserError);
  CHECK_THROWS_WITH_AS(sink.write(std::string("y")), doctest::Contains("free space there or write elsewhere"),
                       UserError);
  ::close(fd);
}

TEST_CASE("atomic_file: a writer killed by SIGKILL in the middle leaves the old contents") {
  TempDir dir;
  const std::string path = dir / "model.bin";
  const std::string old_contents(1 << 20, 'o');
  write_file_atomically(path, old_contents);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The child writes half of a new file, then dies at once, mid-write.
    write_file_atomically(path, [](FileSink& sink) {
      sink.write(std::string(1 << 19, 'n'));
      ::kill(::getpid(), SIGKILL);
      ::pause();
    });
    ::_exit(0);  // not reached
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  CHECK(read_file(path) == old_contents);
  // The torn temporary is hidden (leading dot, .tmp) and never under the final name.
  bool found_tmp = false;
  for (const std::string& n : names_in(dir.path())) {
    if (n == "model.bin") continue;
    CHECK(n.rfind(".model.bin.", 0) == 0);
    CHECK(n.size() > 4);
    CHECK(n.substr(n.size() - 4) == ".tmp");
    found_tmp = true;
  }
  CHECK(found_tmp);
}
