// Which FSDP unit each parameter belongs to under the "optim_grads_params" sharding strategy (ZeRO-3):
// a unit's params are gathered and released together (Note [Sharded parameters], sharded_params.h).
// Pure host logic on names: no tensors, no communication, so every rank computes the same units.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

// The root unit's name: the params no unit module holds (those of the root module itself, or, with
// patterns, of modules no pattern matches).
inline constexpr const char* kRootFsdpUnit = "(root)";

struct FsdpUnits {
  std::vector<int64_t> unit_of;    // per param (the order given): its unit's index
  std::vector<std::string> names;  // per unit, in the order of its first param: the module path
};

// `patterns`: DdpConfig::fsdp_unit_modules, comma-separated globs over module paths ('*' matches any
// run of characters, dots included). A param belongs to the unit of the shortest module path of its
// name ("blocks", "blocks.3", "blocks.3.attn" for "blocks.3.attn.q.weight") that a pattern matches;
// with none matching, to the root unit. "" = the default: each top-level child module is a unit, and
// a top-level list's elements each one ("wte", "blocks.0", "blocks.1", ..., "ln_f": a path's second
// component made of digits belongs to its unit). Throws on an empty pattern between commas.
FsdpUnits assign_fsdp_units(const std::vector<std::string>& param_names, const std::string& patterns);

}  // namespace meshddp
