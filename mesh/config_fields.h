// Config field lists: each config struct (DdpConfig, DistributedOptimizerConfig) has ONE list of its
// fields (name, member, allowed range), and everything that must cover every field is driven by it:
// range validation, the cross-rank agreement check, the Python keyword setters, getters and
// __repr__. A static_assert next to each list compares its length with the struct's own field
// count, so a field added to a struct and not to its list does not compile.
// Also the cross-rank settings comparison itself (verify_same_settings_across_ranks). No knowledge
// of any particular config here: the lists live next to their users (plugin/ddp_config_fields.h,
// optimizer/optimizer_config_fields.h).
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace meshddp {

// The values a numeric field accepts; the default accepts everything (NaN aside).
struct FieldRange {
  double min = -std::numeric_limits<double>::infinity();
  bool min_open = false;  // true: min itself is excluded
  double max = std::numeric_limits<double>::infinity();
  bool max_open = false;
  // "> 0", ">= 0", "in [0, 1)", "<= 1099511627776"; empty when everything is allowed.
  std::string describe() const;
  bool contains(double v) const;
};
constexpr FieldRange kAnyValue{};
constexpr FieldRange kPositive{0.0, true};
constexpr FieldRange kNonNegative{0.0, false};

// One field of `Config`: its name (as in C++ and Python) and member pointer. A member of a base
// class (DdpConfig's GradBufferConfig fields) has Config = the base; it applies to the derived too.
template <typename Config, typename T>
struct ConfigField {
  using Value = T;
  const char* name;
  T Config::* member;
  FieldRange range = kAnyValue;
};

template <typename Config, typename T>
constexpr ConfigField<Config, T> field(const char* name, T Config::* member, FieldRange range = kAnyValue) {
  return {name, member, range};
}

// Calls f(field) for every field of a list (a std::tuple of ConfigField).
template <typename Fields, typename F>
void for_each_field(const Fields& fields, F&& f) {
  std::apply([&](const auto&... each) { (f(each), ...); }, fields);
}

// The number of fields of aggregate T, counting a base class as one (C++20 aggregate rules: an
// initializer convertible to the base initializes the base). Used to check a list is complete.
namespace config_fields_detail {
struct AnyValue {
  template <typename T>
  constexpr operator T() const;  // declared only: used in unevaluated requires-expressions
};
template <typename T, typename... Inits>
constexpr size_t count_fields() {
  if constexpr (requires { T{Inits{}..., AnyValue{}}; }) {
    return count_fields<T, Inits..., AnyValue>();
  } else {
    return sizeof...(Inits);
  }
}
}  // namespace config_fields_detail

template <typename T>
constexpr size_t aggregate_field_count() {
  static_assert(std::is_aggregate_v<T>, "a config with a field list must stay an aggregate");
  return config_fields_detail::count_fields<T>();
}

// Text of a value for settings and messages (bools as true/false, numbers exactly round-trippable).
inline std::string field_text(bool v) { return v ? "true" : "false"; }
inline std::string field_text(const std::string& v) { return v; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string field_text(T v) {
  char text[64];
  const auto end = std::to_chars(text, text + sizeof(text), v).ptr;  // shortest text that reads back as v
  return std::string(text, end);
}

// Throws "<type>: <field> must be <range>, got <value>" for the first numeric field out of range.
template <typename Config, typename Fields>
void validate_field_ranges(const Config& config, const Fields& fields, const char* type) {
  for_each_field(fields, [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::Value;
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      const double v = static_cast<double>(config.*(f.member));
      TORCH_CHECK(f.range.contains(v), type, ": ", f.name, " must be ", f.range.describe(), ", got ",
                  field_text(config.*(f.member)));
    }
  });
}

// A setting every rank of a group must agree on, as (name, value as text).
using Setting = std::pair<std::string, std::string>;

// Every field of `config` as a setting, by its name; the value's text from field_text(value)
// (found by argument-dependent lookup, so an enum's field_text sits beside the enum).
template <typename Config, typename Fields>
std::vector<Setting> field_settings(const Config& config, const Fields& fields) {
  std::vector<Setting> out;
  for_each_field(fields, [&](const auto& f) { out.push_back({f.name, field_text(config.*(f.member))}); });
  return out;
}

// Note [Agree first, then validate]
// A config is compared across ranks before it is validated. A value that is invalid on one rank only
// (comm_hook = "bogus" on rank 1) would otherwise fail that rank alone, and its peers would meet the
// hole it left at their next collective ("Connection reset by peer", a timeout). Compared first, it
// is a difference, which every rank reports the same way: the field, each rank and its value. A
// value invalid on every rank then fails every rank's validate() alike.

// Compares every rank's settings with group rank 0's; on a difference every rank throws the same
// error naming the first differing setting and each rank's value (`who`: e.g. "DistributedDataParallel").
// A collective over `group`.
void verify_same_settings_across_ranks(c10d::ProcessGroup& group, const std::vector<Setting>& settings,
                                       const std::string& who, const std::string& what);

}  // namespace meshddp
