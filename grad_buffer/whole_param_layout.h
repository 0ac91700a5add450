// Whole-param ownership (the "whole_param" shard policy): each bucket's params are re-placed so that
// every DP rank's shard of the bucket holds whole params, chosen by cost-balanced bin packing. Pure
// host logic over a BucketLayout, like assign_buckets: every rank computes the identical layout.
//
// Note [Whole-param ownership]
// - Why: optimizers that need a whole matrix (Muon's Newton-Schulz orthogonalization) cannot run on
//   ZeRO-1's byte-range shards, which cut params anywhere. With whole params, rank r's shard of a
//   bucket is still the contiguous range [begin + r * S, begin + (r + 1) * S), so the reduce-scatter,
//   the param all-gather and shard_buckets() stay as they are; only the params' offsets change.
// - Owners: longest-processing-time (LPT) bin packing. The bucket's params are sorted by cost
//   (descending; ties: larger numel, then lower index) and each goes to the rank with the smallest
//   load (ties: smaller shard so far, then lower rank) among the ranks whose shard stays within the
//   memory cap. Loads (summed costs) carry across the buckets of one shard group, so a rank that got
//   a big matrix in bucket 0 gets less in bucket 1. Buckets of params tied across pipeline stages
//   start from zero loads: their layout must depend on the bucket alone (both stages build it).
// - Cost (pluggable, ParamCostFn): the default, newton_schulz_cost(), is max(m,n) * min(m,n)^2 for a
//   2-D param (the flops of one Newton-Schulz iteration up to a constant), E times that for a 3-D
//   param [E, m, n] (a stack of matrices: Muon's muon_stacked_matrices runs one iteration per slice),
//   and numel otherwise. The layout is built before the optimizer, so it does not know which params
//   take Muon: 2-D params kept on AdamW and 3-D ones without muon_stacked_matrices cost the same
//   (only which rank owns them changes; AdamW's elementwise arithmetic is the same on any rank).
// - Memory cap: with A = the bucket's aligned param elements and L = its largest aligned param, the
//   ideal shard is I = ceil(A / dp). A rank takes a param only if its shard stays <= max(1.25 * I, L)
//   (rounded up to kAlignmentElems); when no rank can, the param goes to the rank with the smallest
//   shard (<= I + L after it), so every shard is <= max(1.25 I, I + L). The shard size S of the bucket is the largest
//   rank's (all shards equal, as reduce-scatter needs); the bucket's padding is dp * S - A.
// - More ranks than params: the extra ranks' shards hold only padding (S is then the largest
//   param's size: whole-param ownership trades memory for whole matrices; bigger buckets help).
// - Within a shard, params keep their bucket order, each starting kAlignmentElems-aligned.
#pragma once

#include "bucket_layout.h"

#include <functional>
#include <string>
#include <vector>

namespace meshddp {

inline constexpr double kWholeParamMemorySlack = 1.25;  // the cap on a shard over the ideal (Note above)

// Throws unless `policy` is "byte_range" or "whole_param" (GradBufferConfig::shard_policy).
void check_shard_policy(const std::string& policy);

// max(m, n) * min(m, n)^2 for a 2-D shape [m, n], E times that for a 3-D shape [E, m, n]; the element
// count otherwise (an empty shape counts 1).
double newton_schulz_cost(const std::vector<int64_t>& shape);

// The cost of one param for the bin packing (default: newton_schulz_cost of its shape).
using ParamCostFn = std::function<double(const ParamSpec&)>;

// LPT over one bucket: the owner rank of each item, given each item's cost and (aligned) element
// count. `loads` (size dp) holds the ranks' loads before and gets them after. Throws on dp < 1 or a
// size mismatch. Exposed for tests and the bench.
std::vector<int64_t> assign_owners_lpt(const std::vector<double>& costs, const std::vector<int64_t>& numels,
                                       std::vector<double>& loads);

// The naive alternative, for comparison: item i to rank (first + i) % dp, loads updated likewise.
std::vector<int64_t> assign_owners_round_robin(const std::vector<double>& costs, std::vector<double>& loads,
                                               int64_t first = 0);

// Re-places the params of every bucket of `layout` (built by assign_buckets with
// pad_for_reduce_scatter and the same config) so that each shard holds whole params: offsets,
// bucket ranges and buffer sizes change; which bucket a param is in, and the bucket order, do not.
// `owners` (if given) gets each param's owner rank within its bucket's shard group.
void place_whole_params(BucketLayout& layout, const std::vector<ParamSpec>& params, const LayoutConfig& config,
                        const ParamCostFn& cost = {}, std::vector<int64_t>* owners = nullptr);

}  // namespace meshddp
