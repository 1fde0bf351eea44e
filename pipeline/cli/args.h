// The command line's words: what each command declares (its flags, its positional
// argument, its help) and what a parsed command line holds. CLI11 parses each command's
// arguments from its declaration; a flag it does not take is refused here, by name, with
// the flag that was probably meant. Private to pipeline/cli (cli.cc holds the commands).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace gpipe {
namespace pipeline {
class MpiLaunch;
}
namespace cli {

constexpr const char* kDefaultConfig = "configs/default.yaml";

// What a command runs with.
struct Invocation {
  std::string program;  // argv[0]'s file name, for messages
  std::string invoked_as;  // how the user started this program (./gpipe through the wrapper), for hints
  std::string command;     // the subcommand
  bool have_config = false;  // a config path was given
  std::string config = kDefaultConfig;
  std::vector<std::string> overrides;  // --set key=value
  std::map<std::string, std::string> options;  // the command's own --flags given ("sweep" -> "1", "devices" -> "8")
  std::string help_topic;                      // help COMMAND
  pipeline::MpiLaunch* mpi = nullptr;  // set under mpirun
  bool resume = false;                 // --resume: go on from the newest complete checkpoint
  bool start_over = false;             // --start-over: move an earlier run in output.dir aside
  int processes = 1;                   // run --np P
  int max_restarts = 3;                // run --max-restarts N
};

// A flag of a command, declared once: the parser (CLI11) takes it, `help COMMAND` explains
// it, and a mistyped flag is matched against it.
struct Flag {
  const char* name;             // "--devices"
  const char* value;            // its value's name ("N"), or nullptr for a switch
  const char* help;             // what it does, for the command's help
  const char* needs = nullptr;  // the flag it only applies with ("--sweep"), or nullptr
  bool hidden = false;          // gpipe run's own, not in the help
};

// The positional arguments a command takes: a config, or (help) a command's name.
constexpr const char* kConfig = "CONFIG.yaml";
constexpr const char* kCommandName = "COMMAND";

// A subcommand. Adding one is a function and an entry in commands().
struct Command {
  const char* name;
  const char* positional;  // kConfig (and then --set), kCommandName, or nullptr
  const char* summary;     // what it does
  const char* mpirun;      // how mpirun launches it, or nullptr
  std::vector<Flag> flags;
  const char* more;  // the help's last paragraph, or nullptr
  int (*run)(Invocation& inv);
};

// Whether `cmd` takes a config file (and then --set).
inline bool takes_config(const Command& cmd) {
  return cmd.positional != nullptr && std::string(cmd.positional) == kConfig;
}

// The value of --NAME (a positive integer), or `fallback` when not given.
int option_int(const Invocation& inv, const std::string& name, int fallback);
// --np P, --max-restarts N: a count of at least `least`, or `fallback` when not given.
int option_count(const Invocation& inv, const std::string& name, int least, int fallback);

// `cmd`'s help, as `help COMMAND` and `COMMAND --help` print it.
std::string command_help(const Command& cmd, const std::string& program);

// Parses the command's arguments (argv[2] on) into `inv`: its config path, --set overrides
// and flags; a flag `cmd` does not take is refused (gpipe::UserError) with what was meant,
// among `all` commands' flags too. Returns false when it printed the command's help instead
// (--help, -h).
bool parse_args(int argc, char** argv, const Command& cmd, const std::vector<Command>& all, Invocation& inv);

}  // namespace cli
}  // namespace gpipe
