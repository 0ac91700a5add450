#include "mesh/config_fields.h"

#include "mesh/collectives.h"

#include <algorithm>
#include <map>

namespace meshddp {

std::string FieldRange::describe() const {
  auto num = [](double v) { return field_text(v); };
  const bool has_min = min != -std::numeric_limits<double>::infinity();
  const bool has_max = max != std::numeric_limits<double>::infinity();
  if (has_min && has_max) {
    return std::string("in ") + (min_open ? "(" : "[") + num(min) + ", " + num(max) + (max_open ? ")" : "]");
  }
  if (has_min) return (min_open ? "> " : ">= ") + num(min);
  if (has_max) return (max_open ? "< " : "<= ") + num(max);
  return "a number";
}

bool FieldRange::contains(double v) const {
  const bool above = min_open ? v > min : v >= min;
  const bool below = max_open ? v < max : v <= max;
  return above && below;  // false for NaN
}

void verify_same_settings_across_ranks(c10d::ProcessGroup& group, const std::vector<Setting>& settings,
                                       const std::string& who, const std::string& what) {
  if (group.getSize() == 1) return;
  std::string mine;
  for (const auto& [name, value] : settings) mine += name + "=" + value + "\n";
  std::vector<std::string> all;
  try {
    all = all_gather_strings(group, mine, what + " check");
  } catch (const c10::Error& e) {
    // A peer that is gone before the check: most often one that failed on its own first (a config
    // invalid on that rank alone, refused where it was made, as Python's configs are).
    TORCH_CHECK(false, who, ": ", what, " check over ", describe_group(group), " failed: ", e.what_without_backtrace(),
                ". A rank that stopped before reaching this check (e.g. one whose config was refused where it was "
                "made) leaves its peers here: the job's first error, from that rank, names the cause");
  }
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) return;
  auto parse = [](const std::string& text) {
    std::map<std::string, std::string> out;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      const auto eq = line.find('=');
      out[line.substr(0, eq)] = eq == std::string::npos ? "" : line.substr(eq + 1);
    }
    return out;
  };
  std::vector<std::map<std::string, std::string>> per_rank;
  for (const auto& text : all) per_rank.push_back(parse(text));
  for (const auto& setting : settings) {
    const std::string& name = setting.first;
    std::ostringstream values;
    bool differs = false;
    for (size_t r = 0; r < per_rank.size(); ++r) {
      const auto it = per_rank[r].find(name);
      const std::string value = it == per_rank[r].end() ? "(missing)" : it->second;
      differs = differs || value != per_rank[0][name];
      values << (r ? ", " : "") << "rank " << r << ": " << value;
    }
    TORCH_CHECK(!differs, who, ": ", what, " differ across the ranks of ", describe_group(group), ": '", name, "' is ",
                values.str(), ". Every rank must use the same settings (and the same model); a mismatch ",
                "would hang or corrupt the collectives");
  }
  TORCH_CHECK(false, who, ": ", what, " differ across the ranks of ", describe_group(group),
              " (in a setting this rank does not have; this rank's: ", mine, ")");
}

}  // namespace meshddp
