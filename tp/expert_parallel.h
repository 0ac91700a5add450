// Expert parallelism (mixture of experts): the token exchange between the ranks of an EP group. Each
// EP rank holds a contiguous block of the experts; a token routed to expert e goes to the rank
// holding e and comes back by all-to-all (docs/guide/parallelism.md). This file gives the
// autograd-aware all-to-all and the pure arithmetic of the exchange (who sends how many rows where,
// and in which order the receiver's experts see them); the routing itself (router, top-k, gates)
// belongs to the model (examples/02_dp_x_tp_gpt/moe.h).
//
//   all_to_all    forward: rows to their ranks (variable splits)    backward: the reverse all-to-all
//
// Like tp_functions.h, a no-op on a group of size 1 (or a null group).
#pragma once

#include "tp_functions.h"

#include <cstdint>
#include <vector>

namespace meshddp::tp {

// Sends rows input_splits[r] (consecutive, in rank order) of x to EP rank r and returns the rows every
// rank sent here, output_splits[s] from rank s, in rank order. The backward sends the gradient rows
// back where they came from (the same exchange with the splits swapped), so each row's gradient lands
// on its row. Splits as mesh/all_to_all.h checks them (one per rank, summing to dim 0).
at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& output_splits,
                      const std::vector<int64_t>& input_splits, Group* group);

// How one MoE layer's tokens move on one EP rank: everything both all-to-alls and the local experts
// need, computed from the token counts alone.
struct ExpertRoute {
  std::vector<int64_t> input_splits;           // rows this rank sends to each EP rank
  std::vector<int64_t> output_splits;          // rows this rank receives from each EP rank
  std::vector<int64_t> rows_per_local_expert;  // rows each of this rank's experts processes
  // The received rows (source-major: from rank 0 all its rows for local expert 0, 1, ..., then rank
  // 1's) in expert-major order: local expert 0's rows from rank 0, rank 1, ..., then expert 1's. Row
  // i of the expert-major order is received row expert_major[i].
  std::vector<int64_t> expert_major;
};

// Pure: `sent_per_expert` [num_experts]: how many rows this rank sends to each global expert, its
// rows ordered by expert; `received` [ep_size x experts_per_rank, row-major]: how many rows each EP
// rank sends to each of this rank's experts (what all_to_all_counts returns). Experts are blocked:
// EP rank r holds experts [r * E / ep, (r + 1) * E / ep). Throws unless ep_size divides the number of
// experts, the sizes fit, and no count is negative.
ExpertRoute route_to_experts(const std::vector<int64_t>& sent_per_expert, const std::vector<int64_t>& received,
                             int64_t ep_size);

// Exchanges the counts over `ep` (one small all-to-all; none on a trivial group) and returns the
// route. `sent_per_expert`: int64 [num_experts] (e.g. a bincount of the chosen experts).
ExpertRoute exchange_expert_route(const at::Tensor& sent_per_expert, Group* ep);

}  // namespace meshddp::tp
