#include "pipeline/cli/args.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

#include "runtime/error.h"

namespace gpipe {
namespace cli {

namespace {

// Lines of at most `width` characters, broken between words.
std::string wrap(const std::string& text, size_t width) {
  std::string out, line;
  std::istringstream words(text);
  std::string w;
  while (words >> w) {
    if (!line.empty() && line.size() + 1 + w.size() > width) {
      out += line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + w;
  }
  return out + line;
}

// `cmd`'s parser: its positional argument, --set for a config, and its flags, each bound to
// `values[name]` (a switch's value is its count). The help CLI11 prints from it is the command's.
void declare(CLI::App& app, const Command& cmd, std::string& positional, std::vector<std::string>& overrides,
             std::map<std::string, std::string>& values) {
  constexpr size_t kWidth = 62;  // of the descriptions, right of the 28 columns of names
  app.get_formatter()->column_width(28);
  app.allow_extras();  // refused by refuse_extras, with what was meant
  app.set_help_flag("-h,--help", "print this help and exit");
  if (cmd.positional != nullptr) {
    const bool config = takes_config(cmd);
    app.add_option(cmd.positional, positional,
                   wrap(config ? "the config file (default configs/default.yaml)" : "a command to explain", kWidth))
        ->type_name("");
    if (config) {
      app.add_option("--set", overrides,
                     wrap("override a config field; the value is YAML (--set pipeline.partitions=2, --set "
                          "pipeline.balance=[3,3,2]); give it once per field",
                          kWidth))
          ->option_text("KEY=VALUE")
          ->expected(1)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    }
  }
  for (const Flag& f : cmd.flags) {
    const std::string needs = f.needs != nullptr ? " (with " + std::string(f.needs) + ")" : "";
    const std::string help = wrap(f.help + needs, kWidth);
    // A value's name as the help's only note on a flag: the help says "(with --sweep)" itself.
    CLI::Option* o = f.value != nullptr ? app.add_option(f.name, values[f.name])->option_text(f.value)
                                        : app.add_flag(f.name);
    o->description(help);
    if (f.needs != nullptr) o->needs(app.get_option(f.needs));  // refused without it
    if (f.hidden) o->group("");
  }
  if (cmd.more != nullptr) app.footer(wrap(cmd.more, 90));
}

// Refuses what the parser did not take: the first flag `cmd` does not have (a mistyped
// or shortened one, with what was meant; one of another command), or a second positional.
void refuse_extras(const std::vector<std::string>& extras, const Command& cmd, const std::vector<Command>& all,
                   const Invocation& inv) {
  const std::string see = " (`" + inv.program + " help " + cmd.name + "` lists its flags)";
  for (const std::string& arg : extras) {
    if (arg.size() > 1 && arg[0] == '-') {
      const std::string flag = arg.substr(0, arg.find('='));
      std::vector<std::string> known = {"--help"};
      if (takes_config(cmd)) known.push_back("--set");
      for (const Flag& f : cmd.flags) {
        if (!f.hidden) known.push_back(f.name);
      }
      std::string hint = did_you_mean(flag, known);
      if (hint.empty()) {  // another command's flag
        std::vector<std::string> owners;
        for (const Command& c : all) {
          for (const Flag& f : c.flags) {
            if (!f.hidden && flag == f.name) owners.push_back(c.name);
          }
        }
        for (size_t i = 0; i < owners.size(); ++i) {
          hint += (i == 0 ? " " + flag + " is an option of " : i + 1 == owners.size() ? " and " : ", ") + owners[i];
        }
        if (!owners.empty()) hint += ", not of " + std::string(cmd.name) + ".";
      }
      throw UserError("unknown option '" + flag + "' for " + cmd.name + ";" +
                      (hint.empty() ? std::string(" it has no such flag (a config field is set with --set KEY=VALUE).")
                                    : hint) +
                      see);
    }
  }
  for (const std::string& arg : extras) {
    if (arg == "--") continue;
    throw UserError("unexpected argument '" + arg + "' for " + cmd.name +
                    (takes_config(cmd) ? " (one config file at most)" : "") + see);
  }
}

// A parser's refusal in our words: the flag, what it needs, where the help is.
std::string parse_error(const CLI::ParseError& e, const Command& cmd, const Invocation& inv) {
  const std::string what = e.what();
  const std::string see = " (`" + inv.program + " help " + cmd.name + "` lists its flags)";
  if (dynamic_cast<const CLI::RequiresError*>(&e) != nullptr) {  // "--rows requires --sweep"
    const size_t at = what.find(" requires ");
    if (at != std::string::npos) {
      const std::string flag = what.substr(0, at), needs = what.substr(at + 10);
      return flag + " applies only with " + needs + ": add " + needs + ", or drop " + flag + see;
    }
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr) {  // "--set: 1 required KEY=VALUE missing"
    const std::string flag = what.substr(0, what.find(':'));
    if (flag == "--set") return "--set needs KEY=VALUE, e.g. --set train.steps=10";
    for (const Flag& f : cmd.flags) {
      if (flag != f.name) continue;
      if (what.find("missing") != std::string::npos) return flag + " needs a value: " + flag + " " + f.value + see;
      return flag + " is given more than once; give it once" + see;
    }
  }
  return what + see;
}

}  // namespace

int option_int(const Invocation& inv, const std::string& name, int fallback) {
  auto it = inv.options.find(name);
  if (it == inv.options.end()) return fallback;
  char* end = nullptr;
  const long v = std::strtol(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || v < 1) {
    throw UserError("--" + name + " takes a positive integer, got '" + it->second + "'");
  }
  return static_cast<int>(v);
}

int option_count(const Invocation& inv, const std::string& name, int least, int fallback) {
  auto it = inv.options.find(name);
  if (it == inv.options.end()) return fallback;
  const std::string& v = it->second;
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < least || n > 100000) {
    throw UserError("--" + name + " " + v + ": expected a whole number of at least " + std::to_string(least));
  }
  return static_cast<int>(n);
}

std::string command_help(const Command& cmd, const std::string& program) {
  CLI::App app(wrap(cmd.summary, 90), program + " " + cmd.name);
  std::string positional;
  std::vector<std::string> overrides;
  std::map<std::string, std::string> values;
  declare(app, cmd, positional, overrides, values);
  return app.help();
}

bool parse_args(int argc, char** argv, const Command& cmd, const std::vector<Command>& all, Invocation& inv) {
  CLI::App app(wrap(cmd.summary, 90), inv.program + " " + cmd.name);
  std::string positional;
  std::map<std::string, std::string> values;
  declare(app, cmd, positional, inv.overrides, values);
  std::string refused;
  try {
    app.parse(argc - 1, argv + 1);  // argv[1], the command, stands for the program's name
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  } catch (const CLI::ParseError& e) {
    refused = parse_error(e, cmd, inv);
  }
  refuse_extras(app.remaining(), cmd, all, inv);  // a mistyped flag first: it may be why another is refused
  if (!refused.empty()) throw UserError(refused);
  if (!positional.empty()) {
    if (takes_config(cmd)) {
      inv.config = positional;
      inv.have_config = true;
    } else {
      inv.help_topic = positional;
    }
  }
  for (const Flag& f : cmd.flags) {
    const CLI::Option* o = app.get_option(f.name);
    if (o->count() > 0) inv.options[std::string(f.name).substr(2)] = f.value != nullptr ? values[f.name] : "1";
  }
  inv.resume = inv.options.count("resume") > 0;
  inv.start_over = inv.options.count("start-over") > 0;
  inv.processes = option_count(inv, "np", 1, 1);
  inv.max_restarts = option_count(inv, "max-restarts", 0, 3);
  return true;
}

}  // namespace cli
}  // namespace gpipe
