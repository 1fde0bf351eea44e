// A config's words read one way everywhere: the YAML decoder's keys
// (pipeline/config/config.cc) and the layers' options (layers/registry.cc).
#pragma once

#include <optional>
#include <string>

namespace gpipe {

// A boolean as YAML 1.1 (PyYAML) reads one: true/false, yes/no and on/off, each in lower
// case, capitalised or upper case; and 1/0, which OmegaConf and Hydra users write on the
// command line. Anything else: nullopt.
inline std::optional<bool> parse_boolean(const std::string& s) {
  for (const char* t : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON", "1"}) {
    if (s == t) return true;
  }
  for (const char* f : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF", "0"}) {
    if (s == f) return false;
  }
  return std::nullopt;
}

}  // namespace gpipe
