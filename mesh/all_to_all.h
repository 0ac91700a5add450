// The all-to-all collective with variable split sizes (c10d alltoall_base), checked and recorded like
// every meshddp collective (mesh/collectives.h): the token exchange of expert parallelism
// (tp/expert_parallel.h). Kept in a file of its own so that collectives.h, which almost every file
// includes, stays as it is. No autograd here: tp::all_to_all wraps it.
#pragma once

#include "collectives.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

// Rows (slices along dim 0) [sum(input_splits[0..r)), + input_splits[r]) of `input` go to group rank
// r; `output` receives, in group-rank order, output_splits[s] rows from each rank s. Every rank's
// input_splits[r] must equal rank r's output_splits[this rank] (the caller exchanges counts first:
// all_to_all_counts). Both tensors dense, contiguous, same dtype and device, the same row shape
// (sizes after dim 0); both split lists have one entry per group rank, none negative, summing to the
// tensors' dim 0. `what` names the exchange in errors and in the hang report. Gloo (CPU) and NCCL
// (CUDA) both implement it.
Work all_to_all_rows(c10d::ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                     const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits,
                     const std::string& what);

// Equal splits: `counts` (int64, n * group size elements) sends its r-th block of n to rank r; returns
// the n-element blocks every rank sent to this one, in group-rank order. Launched and waited: the
// count exchange that must precede an all_to_all_rows with variable splits.
at::Tensor all_to_all_counts(c10d::ProcessGroup& group, const at::Tensor& counts, const std::string& what);

}  // namespace meshddp
