// meshddp's environment switches, declared once: each MESHDDP_* variable's name, default and meaning
// (docs/reference/cpp_api.md's "Environment switches" table is checked against this list by
// tests/mesh/switches_test.cpp), read through one helper that caches the value and that tests can
// override. No other file reads a MESHDDP_* variable. All are for debugging or tests; none is needed
// in production.
#pragma once

#include <array>
#include <optional>
#include <string_view>

namespace meshddp {

enum class Switch { kDebugSync, kForceCollectives, kNcclBlockingWait, kNcclSplit };

struct SwitchSpec {
  Switch id;
  std::string_view name;     // the environment variable: "1" turns it on, "0" off
  bool default_on;           // when the variable is unset or empty
  std::string_view meaning;  // one line (docs/reference/cpp_api.md has the long form)
};

inline constexpr std::array<SwitchSpec, 4> kSwitches{{
    {Switch::kDebugSync, "MESHDDP_DEBUG_SYNC", false,
     "before each bucket collective, check across its group that every rank launches the same one (also on with "
     "TORCH_DISTRIBUTED_DEBUG=DETAIL)"},
    {Switch::kForceCollectives, "MESHDDP_FORCE_COLLECTIVES", false,
     "run every collective even on a group of one rank (a one-GPU run then exercises NCCL)"},
    {Switch::kNcclBlockingWait, "MESHDDP_NCCL_BLOCKING_WAIT", false,
     "on NCCL groups, poll collectives on the host: the stuck report, and a timeout that names the bucket"},
    {Switch::kNcclSplit, "MESHDDP_NCCL_SPLIT", true,
     "CUDA meshes of 2+ dims: make each dim's NCCL communicator by splitting the world group's"},
}};

const SwitchSpec& switch_spec(Switch s);

// The value of `spec`'s variable as a switch: "1" on, "0" off, unset or empty the default; any other
// value throws naming the variable and what it takes. Pure: tests call it with values.
bool parse_switch(const SwitchSpec& spec, const char* value);

// Whether `s` is on: a test's override if one is set, else the environment, read once per process
// (the first call) and cached. kDebugSync is also on with TORCH_DISTRIBUTED_DEBUG=DETAIL.
bool switch_on(Switch s);

// Tests: forces `s` on or off for the whole process (nullopt: back to the environment).
void override_switch_for_testing(Switch s, std::optional<bool> value);

}  // namespace meshddp
