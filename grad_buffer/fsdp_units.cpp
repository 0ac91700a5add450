#include "grad_buffer/fsdp_units.h"

#include "grad_buffer/glob_match.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace meshddp {
namespace {

std::vector<std::string> split_patterns(const std::string& patterns) {
  std::vector<std::string> out;
  if (patterns.empty()) return out;
  size_t begin = 0;
  while (true) {
    const size_t comma = patterns.find(',', begin);
    std::string item = patterns.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    TORCH_CHECK(!item.empty(), "DdpConfig: fsdp_unit_modules = '", patterns,
                "' has an empty pattern; give comma-separated module paths or globs, e.g. 'blocks.*,wte'");
    out.push_back(std::move(item));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

// The default unit of a param name: its top-level module, and a list element's index with it.
std::string default_unit(const std::string& name) {
  const size_t first = name.find('.');
  if (first == std::string::npos) return kRootFsdpUnit;  // a param of the root module itself
  const size_t second = name.find('.', first + 1);
  if (second != std::string::npos && all_digits(name.substr(first + 1, second - first - 1))) {
    return name.substr(0, second);
  }
  return name.substr(0, first);
}

std::string matched_unit(const std::string& name, const std::vector<std::string>& patterns) {
  // Module paths only: every dotted prefix short of the param's own name.
  for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
    const std::string path = name.substr(0, dot);
    for (const std::string& pattern : patterns) {
      if (glob_match(pattern, path)) return path;
    }
  }
  return kRootFsdpUnit;
}

// Whether `pattern` matches some module path (a dotted prefix short of a param's own name) of `names`.
bool matches_a_module(const std::string& pattern, const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
      if (glob_match(pattern, name.substr(0, dot))) return true;
    }
  }
  return false;
}

}  // namespace

FsdpUnits assign_fsdp_units(const std::vector<std::string>& param_names, const std::string& patterns) {
  const std::vector<std::string> globs = split_patterns(patterns);
  for (const std::string& glob : globs) {
    if (param_names.empty() || matches_a_module(glob, param_names)) continue;  // no model yet: the config's check
    const std::string example = param_names.empty() ? std::string("(no params)") : default_unit(param_names.front());
    TORCH_WARN("DdpConfig: fsdp_unit_modules pattern '", glob, "' matches no module path of the model (the dotted ",
               "prefixes of its parameter names, e.g. '", example, "'), so no unit is made from it: the params it was ",
               "meant for stay in the root unit, gathered whole together. Fix the pattern (globs: 'blocks.*')");
  }
  FsdpUnits units;
  for (const std::string& name : param_names) {
    const std::string unit = globs.empty() ? default_unit(name) : matched_unit(name, globs);
    const auto it = std::find(units.names.begin(), units.names.end(), unit);
    units.unit_of.push_back(it - units.names.begin());
    if (it == units.names.end()) units.names.push_back(unit);
  }
  return units;
}

}  // namespace meshddp
