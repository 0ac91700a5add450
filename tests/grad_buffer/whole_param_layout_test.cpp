// place_whole_params / assign_owners_lpt: every param whole in one shard, shards equal, the memory cap,
// the balance of Newton-Schulz cost against round-robin, determinism, more ranks than params, tied
// buckets. Pure functions: no process group.
#include "grad_buffer/whole_param_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

using namespace meshddp;

namespace {

// A GPT-like param list in registration order: embedding, then per block qkv, proj, fc1, fc2 and
// norm/bias vectors, then the final norm.
std::vector<ParamSpec> gpt_params(int64_t layers, int64_t d) {
  std::vector<std::vector<int64_t>> shapes{{512, d}};
  for (int64_t l = 0; l < layers; ++l) {
    for (auto s :
         std::vector<std::vector<int64_t>>{{d}, {3 * d, d}, {3 * d}, {d, d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}})
      shapes.push_back(s);
  }
  shapes.push_back({d});
  std::vector<ParamSpec> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t numel = 1;
    for (int64_t s : shapes[i]) numel *= s;
    ParamSpec p{"p" + std::to_string(i), numel, c10::kFloat, c10::kFloat, c10::Device(c10::kCPU)};
    p.shape = shapes[i];
    params.push_back(p);
  }
  return params;
}

BucketLayout whole_layout(const std::vector<ParamSpec>& params, size_t bucket_bytes, int64_t dp,
                          std::vector<int64_t>* owners = nullptr) {
  const LayoutConfig config{bucket_bytes, true, dp};
  BucketLayout layout = assign_buckets(params, config);
  place_whole_params(layout, params, config, {}, owners);
  return layout;
}

// Rank of the shard of bucket `span` that holds [offset, offset + numel), or -1 if it straddles two.
int64_t shard_of(const BucketSpan& span, int64_t dp, int64_t offset, int64_t numel) {
  const int64_t size = span.numel() / dp;
  const int64_t first = (offset - span.begin) / size, last = (offset + numel - 1 - span.begin) / size;
  return first == last ? first : -1;
}

double max_over_mean(const std::vector<double>& loads) {
  const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / static_cast<double>(loads.size());
  return *std::max_element(loads.begin(), loads.end()) / mean;
}

}  // namespace

TEST(WholeParamLayout, EveryParamLiesWholeInExactlyOneShardAndOwnedSumsToTheTotal) {
  for (int64_t dp : {1, 2, 3, 4, 8}) {
    for (size_t bucket_bytes : {size_t{0}, size_t{200000}, size_t{1} << 30}) {
      const auto params = gpt_params(3, 64);
      std::vector<int64_t> owners;
      const BucketLayout layout = whole_layout(params, bucket_bytes, dp, &owners);
      std::vector<int64_t> owned_numel(dp, 0);
      int64_t total = 0;
      for (size_t p = 0; p < params.size(); ++p) {
        const ParamSlot& slot = layout.slots[p];
        const BucketSpan& span = layout.buckets[slot.bucket];
        ASSERT_EQ(span.numel() % (dp * kAlignmentElems), 0) << "dp " << dp;
        ASSERT_GE(slot.offset, span.begin);
        ASSERT_LE(slot.offset + slot.numel, span.end);
        ASSERT_EQ(slot.offset % kAlignmentElems, 0);
        const int64_t r = shard_of(span, dp, slot.offset, slot.numel);
        ASSERT_EQ(r, owners[p]) << "param " << p << " at dp " << dp << " straddles shards or has the wrong owner";
        owned_numel[r] += slot.numel;
        total += params[p].numel;
      }
      EXPECT_EQ(std::accumulate(owned_numel.begin(), owned_numel.end(), int64_t{0}), total);
      // No two params overlap, and each bucket holds exactly its params.
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (const auto& slot : layout.slots) ranges.emplace_back(slot.offset, slot.offset + slot.numel);
      std::sort(ranges.begin(), ranges.end());
      for (size_t i = 1; i < ranges.size(); ++i) ASSERT_LE(ranges[i - 1].second, ranges[i].first);
      int64_t cursor = 0;
      for (int64_t b : layout.buffers[0].buckets) {
        EXPECT_EQ(layout.buckets[b].begin, cursor);  // buckets stay contiguous, in order
        cursor = layout.buckets[b].end;
        for (int64_t p : layout.buckets[b].params) EXPECT_EQ(layout.slots[p].bucket, b);
      }
      EXPECT_EQ(layout.buffers[0].numel, cursor);
    }
  }
}

TEST(WholeParamLayout, IsDeterministic) {
  const auto params = gpt_params(4, 96);
  std::vector<int64_t> a, b;
  const BucketLayout first = whole_layout(params, 300000, 4, &a), second = whole_layout(params, 300000, 4, &b);
  EXPECT_EQ(a, b);
  for (size_t p = 0; p < params.size(); ++p) EXPECT_EQ(first.slots[p].offset, second.slots[p].offset);
}

TEST(WholeParamLayout, BalancesNewtonSchulzCostWithinTheLptBoundAndBeatsRoundRobin) {
  // One big bucket of the GPT preset's matrices: LPT's makespan <= (4/3 - 1/(3 dp)) x optimal, and
  // optimal >= max(mean load, largest cost).
  const auto params = gpt_params(8, 128);
  std::vector<double> costs;
  std::vector<int64_t> numels;
  for (const auto& p : params) {
    if (p.shape.size() != 2) continue;
    costs.push_back(newton_schulz_cost(p.shape));
    numels.push_back(p.numel);
  }
  for (int64_t dp : {2, 4}) {
    std::vector<double> lpt(dp, 0.0), rr(dp, 0.0);
    assign_owners_lpt(costs, numels, lpt);
    assign_owners_round_robin(costs, rr);
    const double mean = std::accumulate(costs.begin(), costs.end(), 0.0) / static_cast<double>(dp);
    const double lower = std::max(mean, *std::max_element(costs.begin(), costs.end()));
    const double bound = (4.0 / 3.0 - 1.0 / (3.0 * static_cast<double>(dp))) * lower;
    EXPECT_LE(*std::max_element(lpt.begin(), lpt.end()), bound * (1 + 1e-12)) << "dp " << dp;
    EXPECT_LT(max_over_mean(lpt), max_over_mean(rr)) << "dp " << dp;
    EXPECT_LT(max_over_mean(lpt), 1.05)
        << "dp " << dp;  // measured: LPT 1.000 at dp 2 and 4; round-robin 1.12 (dp 2), 1.44 (dp 4)
  }
}

TEST(WholeParamLayout, CarriesLoadsAcrossBuckets) {
  // Two buckets of one big matrix each and two ranks: the second goes to the rank without the first.
  std::vector<ParamSpec> params;
  for (int i = 0; i < 2; ++i) {
    ParamSpec p{"w" + std::to_string(i), 64 * 64, c10::kFloat, c10::kFloat, c10::Device(c10::kCPU)};
    p.shape = {64, 64};
    params.push_back(p);
  }
  std::vector<int64_t> owners;
  whole_layout(params, 0, 2, &owners);
  EXPECT_NE(owners[0], owners[1]);
}

TEST(WholeParamLayout, KeepsEveryShardWithinTheStatedMemoryCap) {
  // Many random sizes, costs that disagree with sizes (a pluggable cost: the reverse of numel).
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t dp = 2 + trial % 5;
    std::vector<double> costs;
    std::vector<int64_t> numels;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      numels.push_back(round_up(1 + static_cast<int64_t>(rng() % 5000), kAlignmentElems));
      costs.push_back(1.0 / static_cast<double>(numels.back()));
    }
    std::vector<double> loads(dp, 0.0);
    const auto owner = assign_owners_lpt(costs, numels, loads);
    std::vector<int64_t> used(dp, 0);
    for (int i = 0; i < n; ++i) used[owner[i]] += numels[i];
    const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
    const int64_t largest = *std::max_element(numels.begin(), numels.end());
    const int64_t ideal = (total + dp - 1) / dp;
    // The stated cap: max(1.25 x ideal (aligned), ideal + largest) (Note [Whole-param ownership]).
    const int64_t cap =
        std::max(round_up(static_cast<int64_t>(1.25 * static_cast<double>(ideal)), kAlignmentElems), ideal + largest);
    for (int64_t r = 0; r < dp; ++r) EXPECT_LE(used[r], cap) << "trial " << trial;
  }
  // Equal sizes, costs all on one param: the cap (1.25 x ideal) still spreads the memory evenly.
  std::vector<double> costs(8, 1.0);
  costs[0] = 1000.0;
  std::vector<int64_t> numels(8, 640);
  std::vector<double> loads(4, 0.0);
  const auto owner = assign_owners_lpt(costs, numels, loads);
  std::vector<int64_t> used(4, 0);
  for (size_t i = 0; i < owner.size(); ++i) used[owner[i]] += numels[i];
  for (int64_t u : used) EXPECT_LE(u, round_up(static_cast<int64_t>(1.25 * 1280), kAlignmentElems));
}

TEST(WholeParamLayout, MoreRanksThanParamsLeavesEmptyShards) {
  const auto params = gpt_params(0, 64);  // embedding (512 x 64) and one norm vector
  std::vector<int64_t> owners;
  const BucketLayout layout = whole_layout(params, size_t{1} << 30, 8, &owners);
  ASSERT_EQ(layout.buckets.size(), 1u);
  EXPECT_EQ(layout.buckets[0].numel(), 8 * 512 * 64);  // the shard is the largest param
  EXPECT_NE(owners[0], owners[1]);
}

TEST(WholeParamLayout, TiedBucketsDoNotDependOnTheLoadsOfOtherBuckets) {
  // The tied embedding's bucket must be laid out the same on both pipeline stages, whatever else
  // each stage holds.
  auto stage = [](int64_t others) {
    std::vector<ParamSpec> params;
    for (int i = 0; i < 2; ++i) {  // registered first: placed after the other buffer's buckets
      ParamSpec t{"tied" + std::to_string(i), 256 * 64, c10::kFloat, c10::kFloat, c10::Device(c10::kCPU)};
      t.shape = {256, 64};
      t.tied = true;
      params.push_back(t);
    }
    for (int64_t i = 0; i < others; ++i) {
      ParamSpec p{"w" + std::to_string(i), 128 * 128, c10::kFloat, c10::kFloat, c10::Device(c10::kCPU)};
      p.shape = {128, 128};
      params.push_back(p);
    }
    std::vector<int64_t> owners;
    const BucketLayout layout = whole_layout(params, 0, 2, &owners);
    EXPECT_EQ(layout.buffers.back().key.tied, true);
    return std::vector<int64_t>(owners.begin(), owners.begin() + 2);
  };
  EXPECT_EQ(stage(1), stage(2));  // carried loads would give (1, 0) and (0, 1)
}

TEST(WholeParamLayout, DefaultCostIsNewtonSchulzFlopsForMatricesAndStacksAndNumelOtherwise) {
  EXPECT_EQ(newton_schulz_cost({300, 100}), 300.0 * 100 * 100);
  EXPECT_EQ(newton_schulz_cost({100, 300}), 300.0 * 100 * 100);
  EXPECT_EQ(newton_schulz_cost({7}), 7.0);
  EXPECT_EQ(newton_schulz_cost({2, 3, 4}), 2.0 * 4 * 3 * 3);  // a stack of two 3 x 4 matrices
  EXPECT_EQ(newton_schulz_cost({8, 100, 300}), 8.0 * 300 * 100 * 100);
  EXPECT_EQ(newton_schulz_cost({2, 3, 4, 5}), 120.0);
}
