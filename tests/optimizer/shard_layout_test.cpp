// shard_buckets: ZeRO-1 ownership arithmetic, without any process group.
#include "optimizer/shard_layout.h"

#include "grad_buffer/bucket_layout.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

using namespace meshddp;

namespace {

std::vector<ParamSpec> params_of(const std::vector<int64_t>& numels) {
  std::vector<ParamSpec> params;
  for (size_t i = 0; i < numels.size(); ++i) params.push_back({"p" + std::to_string(i), numels[i]});
  return params;
}

}  // namespace

TEST(ShardLayout, OwnedRangesOverAllDpRanksCoverEveryParamElementExactlyOnce) {
  const auto params = params_of({1, 7, 64, 65, 300, 3, 1000, 129});
  for (int64_t dp : {1, 2, 3, 4, 8}) {
    for (size_t cap : {size_t{0}, size_t{512}, size_t{4096}, size_t{1} << 20}) {
      const auto layout = assign_buckets(params, LayoutConfig{cap, true, dp});
      std::vector<std::vector<int>> hits(params.size());
      for (size_t p = 0; p < params.size(); ++p) hits[p].assign(params[p].numel, 0);
      int64_t owned_per_bucket_total = 0;
      for (int64_t r = 0; r < dp; ++r) {
        for (const BucketShard& shard : shard_buckets(layout, r, dp)) {
          owned_per_bucket_total += shard.numel;
          for (const ShardSegment& s : shard.segments) {
            ASSERT_GE(s.shard_offset, 0);
            ASSERT_LE(s.shard_offset + s.numel, shard.numel);
            for (int64_t e = s.param_offset; e < s.param_offset + s.numel; ++e) ++hits[s.param][e];
          }
        }
      }
      for (size_t p = 0; p < params.size(); ++p) {
        for (int64_t e = 0; e < params[p].numel; ++e) {
          ASSERT_EQ(hits[p][e], 1) << "param " << p << " element " << e << " dp " << dp << " cap " << cap;
        }
      }
      int64_t total = 0;
      for (const auto& b : layout.buffers) total += b.numel;
      EXPECT_EQ(owned_per_bucket_total, total) << "the shards tile every buffer";
    }
  }
}

TEST(ShardLayout, SplitsAParamThatStraddlesTwoRanks) {
  // One bucket: p1 (100) at 0, p0 (50) at 128; end padded to 2 * 64 -> 256, 128 per rank.
  const auto layout = assign_buckets(params_of({50, 100}), LayoutConfig{size_t{1} << 20, true, 2});
  const auto r0 = shard_buckets(layout, 0, 2), r1 = shard_buckets(layout, 1, 2);
  ASSERT_EQ(r0[0].segments.size(), 1u);
  EXPECT_EQ(r0[0].segments[0].param, 1);
  EXPECT_EQ(r0[0].segments[0].numel, 100);
  ASSERT_EQ(r1[0].segments.size(), 1u);
  EXPECT_EQ(r1[0].segments[0].param, 0);
  EXPECT_EQ(r1[0].segments[0].shard_offset, 0);

  // Unaligned dense layout: one param straddles the two shards.
  LayoutConfig dense{size_t{1} << 20, false, 2};
  const auto straddle = assign_buckets(params_of({30, 50}), dense);  // p1 [0,50), p0 [50,80): 40 per rank
  const auto s1 = shard_buckets(straddle, 1, 2);
  ASSERT_EQ(s1[0].segments.size(), 2u);
  EXPECT_EQ(s1[0].segments[0].param, 1);
  EXPECT_EQ(s1[0].segments[0].param_offset, 40);
  EXPECT_EQ(s1[0].segments[0].numel, 10);
  EXPECT_EQ(s1[0].segments[1].param, 0);
  EXPECT_EQ(s1[0].segments[1].numel, 30);
}

TEST(ShardLayout, RejectsABucketNotPaddedForTheDpSize) {
  const auto layout = assign_buckets(params_of({3}), LayoutConfig{0, false, 2});
  try {
    shard_buckets(layout, 0, 2);
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("not a multiple of the DP size 2"), std::string::npos);
  }
}

TEST(ShardLayout, ShardsEachBucketOverItsOwnGroupDenseOverDpExpertOverExpertDp) {
  // p0 dense (200), p1 expert (100); DP 4, expert-DP 2: the dense bucket is cut in 4, the expert one in 2.
  auto params = params_of({200, 100});
  params[1].expert = true;
  const auto layout = assign_buckets(params, LayoutConfig{size_t{1} << 20, true, 4, 2});
  ASSERT_EQ(layout.buckets.size(), 2u);
  std::vector<ShardOwner> owners(2);
  for (int64_t b = 0; b < 2; ++b) {
    const bool expert = layout.buffers[layout.buckets[b].buffer].key.expert;
    owners[b] = expert ? ShardOwner{1, 2} : ShardOwner{3, 4};  // DP rank 3 is expert-DP rank 1
  }
  const auto shards = shard_buckets(layout, owners);
  for (int64_t b = 0; b < 2; ++b) {
    const BucketSpan& span = layout.buckets[b];
    EXPECT_EQ(shards[b].numel, span.numel() / owners[b].size);
    EXPECT_EQ(shards[b].begin, span.begin + owners[b].rank * shards[b].numel);
  }
  const int64_t expert_bucket = layout.slots[1].bucket;
  EXPECT_EQ(layout.buckets[expert_bucket].numel(), 128);  // 100 padded to 2 * 64
  ASSERT_EQ(shards[expert_bucket].segments.size(), 1u);   // elements [64, 100) of p1
  EXPECT_EQ(shards[expert_bucket].segments[0].param_offset, 64);
  EXPECT_EQ(shards[expert_bucket].segments[0].numel, 36);
  EXPECT_THROW(shard_buckets(layout, std::vector<ShardOwner>(1)), c10::Error);  // one owner per bucket
}
