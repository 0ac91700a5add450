// A whole checkpoint read into one process: every tensor TP-unsharded at its global shape, through
// the same CheckpointReader (and so the same checks: manifest, sizes, headers, save ids, CRC32C,
// piece checksums) as a load at any mesh. What `meshddp-consolidate` (meshddp/consolidate.py) reads
// with; not a collective over the caller's ranks (it makes its own one-rank group).
#pragma once

#include "store.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace meshddp {

struct WholeCheckpoint {
  std::string path;                                         // <dir>/step-<N>, the directory read
  CheckpointMeta meta;                                      // step, values, optimizer of the save
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // checkpoint key -> whole CPU tensor, sorted by key
};

// Reads `dir` (its live run's newest checkpoint, or step-<step>): the "model/" tensors, and with
// `with_optimizer` every other tensor too. Throws naming the file and what is wrong; on a failure
// nothing is returned.
WholeCheckpoint read_whole_checkpoint(const std::string& dir, std::optional<int64_t> step, bool with_optimizer);

}  // namespace meshddp
