// Start-of-training agreement across data-parallel ranks: every rank must hold the same parameters
// (names, shapes, dtypes, in the same order), and then they take DP rank 0's values. Both are
// collectives over the DP group: every DP rank must call them, in the same order.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace meshddp {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

// Compares every DP rank's list with DP rank 0's; on any difference, every rank throws the same
// error naming the first differing entry, the DP ranks, and expected vs actual. `global_ranks`
// (optional) maps DP rank -> global rank for the message. `what` is e.g. "parameters".
void verify_same_tensors_across_ranks(c10d::ProcessGroup& dp_group, const std::vector<NamedTensor>& tensors,
                                      const std::string& what, const std::vector<int64_t>& global_ranks = {});

// Overwrites every tensor with DP rank 0's values: one broadcast per dtype and device (tensors
// flattened into one buffer), not one per tensor.
void broadcast_from_dp_rank0(c10d::ProcessGroup& dp_group, const std::vector<NamedTensor>& tensors);

}  // namespace meshddp
