// The values a checkpoint holds beside its tensors, in plain C++ types (no JSON library in a public
// header): the user's key-values and the optimizer record. manifest.h reads and writes them as JSON.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>

namespace meshddp {

// User key-values saved with a checkpoint (data position, LR schedule state, anything): numbers are
// kept exactly (int64) or as double; strings may hold anything, e.g. a JSON document of one's own.
using CheckpointValue = std::variant<int64_t, double, std::string>;
using CheckpointValues = std::map<std::string, CheckpointValue>;

// The optimizer a checkpoint was saved with: the manifest's "optimizer" {"kind", "step"[,
// "muon_adamw_params"][, "muon_stacked_matrices": true]} (absent, i.e. JSON null, for a checkpoint
// saved without an optimizer).
struct CheckpointOptimizer {
  std::string kind;  // "adamw", "sgd" or "muon"
  int64_t step = 0;  // the optimizer's step count at the save, >= 0
  // Muon: the patterns of the 2-D params that stepped with AdamW (they decide what each matrix's
  // state means); absent for other kinds and in the first Muon format.
  std::optional<std::string> muon_adamw_params;
  // Muon: whether 3-D params stepped as stacks of Muon matrices (else with AdamW). Written only when
  // true, so checkpoints saved without it read as false.
  bool muon_stacked_matrices = false;
};

}  // namespace meshddp
