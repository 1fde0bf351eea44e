#include "runtime/error.h"

#include <algorithm>

#include "runtime/logging.h"

namespace gpipe {

namespace {

// Levenshtein distance with adjacent transpositions ("--rwos" is one from "--rows").
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

std::string did_you_mean(const std::string& word, const std::vector<std::string>& known) {
  std::vector<std::string> close;
  const size_t letters = word.size() - std::min(word.find_first_not_of('-'), word.size());
  if (letters > 0) {
    for (const std::string& k : known) {
      if (k.size() > word.size() && k.compare(0, word.size(), word) == 0) close.push_back(k);
    }
  }
  if (close.empty()) {
    size_t best = std::max<size_t>(1, letters / 3) + 1;
    for (const std::string& k : known) {
      const size_t d = edit_distance(word, k);
      if (d < best) close.clear(), best = d;
      if (d == best) close.push_back(k);
    }
  }
  if (close.empty()) return "";
  std::string out = " did you mean ";
  for (size_t i = 0; i < close.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == close.size() ? " or " : ", ") + close[i];
  }
  return out + "?";
}

std::string error_location(const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line) + " [" + thread_context_str() + "]";
}

}  // namespace gpipe
