// Flag parsing shared by the examples and the benchmark (bench/bench_flags.cpp): one strict parser per
// value type, so `--steps 1e3`,
// `--steps 0` and `--lr 1e-2x` are refused with a message naming the flag instead of being read as
// 1, accepted, or truncated. Pure string handling: no torch, no communication.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

// Thrown by the parsers; what() is the whole message ("--steps: '1e3' is not an integer").
struct FlagError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A base-10 integer (optional sign, digits, nothing after) in [min, max].
inline int64_t parse_int_flag(const std::string& flag, const std::string& text, int64_t min,
                              int64_t max = std::numeric_limits<int64_t>::max()) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(begin, &end, 10);
  if (text.empty() || end != begin + text.size() || text.find_first_of(" \t") != std::string::npos) {
    throw FlagError(flag + ": '" + text + "' is not an integer");
  }
  if (errno == ERANGE || value < min || value > max) {
    throw FlagError(flag + " must be in [" + std::to_string(min) + ", " +
                    (max == std::numeric_limits<int64_t>::max() ? std::string("...") : std::to_string(max)) +
                    "], got " + text);
  }
  return value;
}

// A finite decimal or scientific number (1e-3, 0.5) with nothing after it, > min (or >= min when
// `inclusive`).
inline double parse_float_flag(const std::string& flag, const std::string& text, double min, bool inclusive) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(begin, &end);
  if (text.empty() || end != begin + text.size() || text.find_first_of(" \t") != std::string::npos) {
    throw FlagError(flag + ": '" + text + "' is not a number");
  }
  if (errno == ERANGE || !std::isfinite(value)) throw FlagError(flag + ": '" + text + "' is out of range");
  if (inclusive ? value < min : value <= min) {
    throw FlagError(flag + " must be " + (inclusive ? ">= " : "> ") + std::to_string(min) + ", got " + text);
  }
  return value;
}

// One of `known` (e.g. --lr-decay-style constant|linear|cosine).
inline std::string parse_choice_flag(const std::string& flag, const std::string& text,
                                     const std::vector<std::string>& known) {
  std::string list;
  for (const std::string& k : known) {
    if (text == k) return text;
    list += (list.empty() ? "" : ", ") + k;
  }
  throw FlagError(flag + ": '" + text + "' is not one of " + list);
}

// "STEP:RANK" (e.g. --inject-nan 3:1), both >= 0.
struct StepRank {
  int64_t step = -1;  // -1: unset
  int64_t rank = -1;
};
inline StepRank parse_step_rank_flag(const std::string& flag, const std::string& text) {
  const auto colon = text.find(':');
  if (colon == std::string::npos) throw FlagError(flag + ": '" + text + "' is not STEP:RANK (e.g. 3:1)");
  return {parse_int_flag(flag + " (STEP)", text.substr(0, colon), 0),
          parse_int_flag(flag + " (RANK)", text.substr(colon + 1), 0)};
}

// Prints "error: <message>" and the usage line, exits 2 (bad flags: nothing ran).
[[noreturn]] inline void exit_with_usage(const char* prog, const std::string& message, const std::string& usage) {
  std::cerr << "error: " << message << "\nusage: " << prog << " " << usage << "\n";
  std::exit(2);
}

// Prints the usage line to stdout and exits 0 (--help / -h).
[[noreturn]] inline void exit_with_help(const char* prog, const std::string& usage) {
  std::cout << "usage: " << prog << " " << usage << "\n";
  std::exit(0);
}

}  // namespace examples
