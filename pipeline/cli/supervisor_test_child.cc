// The job supervisor_test runs in place of gpipe: called as gpipe's `train` is,
//   supervisor_test_child train STATE_DIR [--set failures=N] [--set mode=M] [--resume]
// it counts its launches in STATE_DIR/count, appends its arguments to STATE_DIR/args,
// and fails (mode exit3: exit status 3; exit2: status 2; kill9: SIGKILL on itself;
// hang: writes STATE_DIR/pid and waits for a signal) while the count is at most N,
// then exits 0.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 3) return 64;
  const std::string dir = argv[2];
  int failures = 0;
  std::string mode = "exit3";
  std::string line;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    line += (i > 1 ? " " : "") + a;
    if (a.rfind("failures=", 0) == 0) failures = std::atoi(a.c_str() + 9);
    if (a.rfind("mode=", 0) == 0) mode = a.substr(5);
  }
  int count = 0;
  std::ifstream(dir + "/count") >> count;
  ++count;
  std::ofstream(dir + "/count") << count;
  std::ofstream(dir + "/args", std::ios::app) << line << "\n";
  if (count > failures) return 0;
  if (mode == "exit2") return 2;
  if (mode == "kill9") ::raise(SIGKILL);
  if (mode == "hang") {
    std::ofstream(dir + "/pid") << ::getpid();
    for (;;) ::pause();
  }
  return 3;
}
