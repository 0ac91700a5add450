#include "mesh/switches.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace meshddp {
namespace {

constexpr int kUnset = -1;

// Per switch: the environment's value once read, and a test's override (kUnset: none).
std::array<std::atomic<int>, kSwitches.size()> env_values{kUnset, kUnset, kUnset, kUnset};
std::array<std::atomic<int>, kSwitches.size()> overrides{kUnset, kUnset, kUnset, kUnset};

size_t index_of(Switch s) { return static_cast<size_t>(s); }

bool read_environment(const SwitchSpec& spec) {
  const std::string name(spec.name);
  bool on = parse_switch(spec, std::getenv(name.c_str()));
  if (spec.id == Switch::kDebugSync && !on) {
    const char* torch_debug = std::getenv("TORCH_DISTRIBUTED_DEBUG");
    on = torch_debug != nullptr && std::string_view(torch_debug) == "DETAIL";
  }
  return on;
}

}  // namespace

const SwitchSpec& switch_spec(Switch s) {
  const SwitchSpec& spec = kSwitches.at(index_of(s));
  TORCH_INTERNAL_ASSERT(spec.id == s, "kSwitches is not in the order of enum Switch");
  return spec;
}

bool parse_switch(const SwitchSpec& spec, const char* value) {
  if (value == nullptr || *value == '\0') return spec.default_on;
  const std::string_view v(value);
  TORCH_CHECK(v == "0" || v == "1", "meshddp: environment variable ", spec.name, "=", v,
              " is not 0 or 1 (unset: ", spec.default_on ? "1" : "0", "); it controls: ", spec.meaning);
  return v == "1";
}

bool switch_on(Switch s) {
  const size_t i = index_of(s);
  if (const int forced = overrides[i].load(std::memory_order_relaxed); forced != kUnset) return forced == 1;
  int value = env_values[i].load(std::memory_order_relaxed);
  if (value == kUnset) {
    value = read_environment(switch_spec(s)) ? 1 : 0;  // every thread reads the same environment
    env_values[i].store(value, std::memory_order_relaxed);
  }
  return value == 1;
}

void override_switch_for_testing(Switch s, std::optional<bool> value) {
  overrides[index_of(s)].store(value.has_value() ? static_cast<int>(*value) : kUnset, std::memory_order_relaxed);
}

}  // namespace meshddp
