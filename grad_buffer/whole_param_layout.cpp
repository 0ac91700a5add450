#include "grad_buffer/whole_param_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace meshddp {

void check_shard_policy(const std::string& policy) {
  TORCH_CHECK(policy == "byte_range" || policy == "whole_param",
              "GradBufferConfig: shard_policy must be 'byte_range' or 'whole_param', got '", policy, "'");
}

double newton_schulz_cost(const std::vector<int64_t>& shape) {
  if (shape.size() == 2 || shape.size() == 3) {  // a matrix, or a stack of shape[0] of them
    const size_t rows = shape.size() - 2;
    const auto m = static_cast<double>(std::max(shape[rows], shape[rows + 1]));
    const auto n = static_cast<double>(std::min(shape[rows], shape[rows + 1]));
    return (shape.size() == 3 ? static_cast<double>(shape[0]) : 1.0) * m * n * n;
  }
  double numel = 1;
  for (int64_t s : shape) numel *= static_cast<double>(s);
  return numel;
}

std::vector<int64_t> assign_owners_lpt(const std::vector<double>& costs, const std::vector<int64_t>& numels,
                                       std::vector<double>& loads) {
  const auto dp = static_cast<int64_t>(loads.size());
  TORCH_CHECK(dp >= 1, "assign_owners_lpt: the shard group has ", dp, " ranks; it needs at least 1");
  TORCH_CHECK(costs.size() == numels.size(), "assign_owners_lpt: ", costs.size(), " costs for ", numels.size(),
              " params");
  const auto n = static_cast<int64_t>(costs.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (costs[a] != costs[b]) return costs[a] > costs[b];
    return numels[a] > numels[b];
  });
  int64_t total = 0, largest = 0;
  for (int64_t x : numels) total += x, largest = std::max(largest, x);
  const int64_t ideal = (total + dp - 1) / dp;
  const int64_t cap = round_up(
      std::max(static_cast<int64_t>(static_cast<double>(ideal) * kWholeParamMemorySlack), largest), kAlignmentElems);
  std::vector<int64_t> used(dp, 0), owner(n, -1);
  for (int64_t i : order) {
    int64_t best = -1;
    for (int64_t r = 0; r < dp; ++r) {
      if (used[r] + numels[i] > cap) continue;
      if (best < 0 || loads[r] < loads[best] || (loads[r] == loads[best] && used[r] < used[best])) best = r;
    }
    if (best < 0) best = std::min_element(used.begin(), used.end()) - used.begin();  // over the cap: least memory
    owner[i] = best;
    loads[best] += costs[i];
    used[best] += numels[i];
  }
  return owner;
}

std::vector<int64_t> assign_owners_round_robin(const std::vector<double>& costs, std::vector<double>& loads,
                                               int64_t first) {
  const auto dp = static_cast<int64_t>(loads.size());
  TORCH_CHECK(dp >= 1, "assign_owners_round_robin: the shard group has ", dp, " ranks; it needs at least 1");
  std::vector<int64_t> owner(costs.size());
  for (size_t i = 0; i < costs.size(); ++i) {
    owner[i] = (first + static_cast<int64_t>(i)) % dp;
    loads[owner[i]] += costs[i];
  }
  return owner;
}

void place_whole_params(BucketLayout& layout, const std::vector<ParamSpec>& params, const LayoutConfig& config,
                        const ParamCostFn& cost, std::vector<int64_t>* owners) {
  TORCH_CHECK(config.pad_for_reduce_scatter, "place_whole_params: the layout must be built with ",
              "pad_for_reduce_scatter (whole-param shards are reduce-scattered)");
  TORCH_CHECK(params.size() == layout.slots.size(), "place_whole_params: ", params.size(), " params for a layout of ",
              layout.slots.size());
  if (owners) owners->assign(params.size(), 0);
  std::map<int64_t, std::vector<double>> loads;  // per shard-group size: the ranks' loads, carried across buckets
  for (int64_t buffer = 0; buffer < static_cast<int64_t>(layout.buffers.size()); ++buffer) {
    BufferSpec& spec = layout.buffers[buffer];
    const int64_t dp = spec.key.expert ? config.expert_dp_size : config.dp_size;
    int64_t cursor = 0;
    for (int64_t b : spec.buckets) {
      BucketSpan& span = layout.buckets[b];
      std::vector<double> costs;
      std::vector<int64_t> numels;
      for (int64_t p : span.params) {
        costs.push_back(cost ? cost(params[p]) : newton_schulz_cost(params[p].shape));
        numels.push_back(round_up(params[p].numel, kAlignmentElems));
      }
      // Tied buckets are summed across pipeline stages: their layout depends on the bucket alone.
      std::vector<double> fresh(dp, 0.0);
      std::vector<double>& carried = spec.key.tied ? fresh : loads.try_emplace(dp, dp, 0.0).first->second;
      const std::vector<int64_t> owner = assign_owners_lpt(costs, numels, carried);
      std::vector<int64_t> used(dp, 0);
      for (size_t i = 0; i < owner.size(); ++i) used[owner[i]] += numels[i];
      const int64_t shard = std::max<int64_t>(*std::max_element(used.begin(), used.end()), kAlignmentElems);
      span.begin = cursor;
      span.end = cursor + dp * shard;
      span.end_unpadded = span.begin;
      std::vector<int64_t> next(dp);
      for (int64_t r = 0; r < dp; ++r) next[r] = span.begin + r * shard;
      std::vector<std::pair<int64_t, int64_t>> placed;  // (offset, param)
      for (size_t i = 0; i < owner.size(); ++i) {
        const int64_t p = span.params[i];
        layout.slots[p].offset = next[owner[i]];
        next[owner[i]] += numels[i];
        span.end_unpadded = std::max(span.end_unpadded, layout.slots[p].offset + params[p].numel);
        placed.emplace_back(layout.slots[p].offset, p);
        if (owners) (*owners)[p] = owner[i];
      }
      std::sort(placed.begin(), placed.end());
      for (size_t i = 0; i < placed.size(); ++i) span.params[i] = placed[i].second;
      cursor = span.end;
    }
    spec.numel = cursor;
  }
}

}  // namespace meshddp
