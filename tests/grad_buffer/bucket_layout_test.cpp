// assign_buckets: boundaries, padding, ordering and offsets, computed by hand. No process group.
#include "grad_buffer/bucket_layout.h"

#include "tests/support/param_specs.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;

namespace {

std::vector<ParamSpec> fp32_params(const std::vector<int64_t>& numels) { return test::fp32_param_specs(numels); }

}  // namespace

TEST(BucketLayout, PlacesParamsInReverseRegistrationOrderDensely) {
  auto layout = assign_buckets(fp32_params({10, 20, 30}), LayoutConfig{size_t{1} << 30, false, 4});
  ASSERT_EQ(layout.buffers.size(), 1u);
  ASSERT_EQ(layout.buckets.size(), 1u);
  EXPECT_EQ(layout.slots[2].offset, 0);  // last registered first
  EXPECT_EQ(layout.slots[1].offset, 30);
  EXPECT_EQ(layout.slots[0].offset, 50);
  EXPECT_EQ(layout.buckets[0].params, (std::vector<int64_t>{2, 1, 0}));
  EXPECT_EQ(layout.buckets[0].end, 60);
  EXPECT_EQ(layout.buffers[0].numel, 60);
}

TEST(BucketLayout, ClosesABucketOnceItReachesTheCapAndNeverSplitsAParam) {
  // 4-byte elements, cap 100 bytes = 25 elements. Reverse order: 30 | 10,10,10 | 5
  auto layout = assign_buckets(fp32_params({5, 10, 10, 10, 30}), LayoutConfig{100, false, 1});
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_EQ(layout.buckets[0].params, (std::vector<int64_t>{4}));        // 120 bytes >= 100: closes alone
  EXPECT_EQ(layout.buckets[1].params, (std::vector<int64_t>{3, 2, 1}));  // 80 < 100, then 120
  EXPECT_EQ(layout.buckets[2].params, (std::vector<int64_t>{0}));        // the remainder
  EXPECT_EQ(layout.buckets[1].begin, 30);
  EXPECT_EQ(layout.buckets[1].end, 60);
  for (int64_t p = 0; p < 5; ++p) {
    const auto& span = layout.buckets[layout.slots[p].bucket];
    EXPECT_GE(layout.slots[p].offset, span.begin);
    EXPECT_LE(layout.slots[p].offset + layout.slots[p].numel, span.end_unpadded);
  }
}

TEST(BucketLayout, ZeroCapGivesOneBucketPerParam) {
  auto layout = assign_buckets(fp32_params({3, 4, 5}), LayoutConfig{0, false, 2});
  ASSERT_EQ(layout.buckets.size(), 3u);
  for (int64_t b = 0; b < 3; ++b) EXPECT_EQ(layout.buckets[b].params, (std::vector<int64_t>{2 - b}));
}

TEST(BucketLayout, PadsEachBucketToMultipleOfDpSizeAndAlignsParams) {
  const int64_t dp = 3;
  // cap 1000 elems * 4 B. Reverse: 100 (aligned to 0), 70 (at 128), 900 -> closes.
  auto layout = assign_buckets(fp32_params({5, 900, 70, 100}), LayoutConfig{4000, true, dp});
  ASSERT_EQ(layout.buckets.size(), 2u);
  EXPECT_EQ(layout.slots[3].offset, 0);
  EXPECT_EQ(layout.slots[2].offset, 128);
  EXPECT_EQ(layout.slots[1].offset, 256);
  EXPECT_EQ(layout.buckets[0].end_unpadded, 1156);
  EXPECT_EQ(layout.buckets[0].end, round_up(1156, dp * kAlignmentElems));  // 1344
  EXPECT_EQ(layout.buckets[1].begin, 1344);
  EXPECT_EQ(layout.slots[0].offset, 1344);
  for (const auto& span : layout.buckets) {
    EXPECT_EQ(span.numel() % dp, 0);
    EXPECT_EQ((span.numel() / dp) % kAlignmentElems, 0) << "every shard is 64-element aligned";
    EXPECT_EQ(span.begin % kAlignmentElems, 0);
  }
  for (const auto& slot : layout.slots) EXPECT_EQ(slot.offset % kAlignmentElems, 0);
}

TEST(BucketLayout, OneBufferPerDtypeAndBucketsOrderedByWhenTheyClose) {
  auto params = fp32_params({8, 8, 8, 8});
  params[1].param_dtype = params[1].grad_dtype = c10::kBFloat16;  // bf16 param with bf16 grads
  params[3].param_dtype = c10::kBFloat16;                         // bf16 param, fp32 main grad
  // Reverse walk: p3 (bf16/fp32) -> buffer 0, p2 (fp32/fp32) -> buffer 1, p1 (bf16/bf16) -> buffer 2, p0 -> buffer 1.
  auto layout = assign_buckets(params, LayoutConfig{0, false, 1});
  ASSERT_EQ(layout.buffers.size(), 3u);
  EXPECT_EQ(layout.buffers[0].key.param_dtype, c10::kBFloat16);
  EXPECT_EQ(layout.buffers[0].key.grad_dtype, c10::kFloat);
  EXPECT_EQ(layout.buffers[2].key.grad_dtype, c10::kBFloat16);
  EXPECT_EQ(layout.slots[3].buffer, 0);
  EXPECT_EQ(layout.slots[2].buffer, 1);
  EXPECT_EQ(layout.slots[0].buffer, 1);
  EXPECT_EQ(layout.slots[0].offset, 8);
  // With cap 0 each bucket closes at its param, so launch order is the reverse walk order.
  for (int64_t p = 0; p < 4; ++p) EXPECT_EQ(layout.slots[p].bucket, 3 - p);

  // With a big cap, the buffers' buckets stay open to the end and close in buffer order.
  auto one_each = assign_buckets(params, LayoutConfig{size_t{1} << 20, false, 1});
  ASSERT_EQ(one_each.buckets.size(), 3u);
  EXPECT_EQ(one_each.buckets[1].params, (std::vector<int64_t>{2, 0}));
}

TEST(BucketLayout, SmallBufferBucketLaunchesBeforeALaterBigBucket) {
  // Reverse walk: p3 fp32 (big, stays open), p2 bf16 (cap reached -> closes first), p1, p0 fp32.
  auto params = fp32_params({4, 4, 64, 4});
  params[2].param_dtype = params[2].grad_dtype = c10::kBFloat16;
  auto layout = assign_buckets(params, LayoutConfig{100, false, 1});
  EXPECT_EQ(layout.slots[2].bucket, 0);
  EXPECT_EQ(layout.slots[3].bucket, 1);
}

TEST(BucketLayout, RejectsBadConfigAndParams) {
  EXPECT_THROW(assign_buckets(fp32_params({1}), LayoutConfig{0, true, 0}), c10::Error);
  auto bad = fp32_params({1});
  bad[0].numel = -1;
  try {
    assign_buckets(bad, LayoutConfig{});
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("parameter 'p0' has numel -1"));
  }
}

TEST(BucketLayout, ExpertParamsGetBuffersOfTheirOwnPaddedToTheExpertDpSize) {
  // p0 dense, p1 expert, p2 dense, p3 expert; DP 4, expert-DP 2.
  auto params = fp32_params({100, 30, 50, 70});
  params[1].expert = params[3].expert = true;
  const auto layout = assign_buckets(params, LayoutConfig{size_t{1} << 30, true, 4, 2});
  ASSERT_EQ(layout.buffers.size(), 2u);
  // Reverse order: p3 (expert) opens buffer 0, p2 (dense) buffer 1.
  EXPECT_TRUE(layout.buffers[0].key.expert);
  EXPECT_FALSE(layout.buffers[1].key.expert);
  EXPECT_EQ(layout.slots[3].buffer, 0);
  EXPECT_EQ(layout.slots[1].buffer, 0);
  EXPECT_EQ(layout.slots[2].buffer, 1);
  EXPECT_EQ(layout.slots[0].buffer, 1);
  ASSERT_EQ(layout.buckets.size(), 2u);  // one per buffer: a bucket never mixes groups
  for (const BucketSpan& span : layout.buckets) {
    const int64_t group_size = layout.buffers[span.buffer].key.expert ? 2 : 4;
    EXPECT_EQ(span.numel() % (group_size * kAlignmentElems), 0);
  }
  // Expert bucket: p3 at 0 (70), p1 at 128 (30): 158 -> padded to 2 * 64 = 128 multiples: 256.
  EXPECT_EQ(layout.buckets[layout.slots[3].bucket].end, 256);
  // Dense bucket: p2 at 0 (50), p0 at 64 (100): 164 -> 4 * 64 = 256 multiples: 256.
  EXPECT_EQ(layout.buckets[layout.slots[2].bucket].end, 256);
  EXPECT_THROW(assign_buckets(params, LayoutConfig{0, true, 4, 0}), c10::Error);
}

TEST(BucketLayout, ABucketNeverSpansTwoFsdpUnits) {
  // Units (registration order): {0, 1} | {2, 3, 4} | {5}. A cap no bucket reaches: only unit
  // boundaries close buckets, walking backwards: {5} | {4, 3, 2} | {1, 0}.
  auto specs = fp32_params({8, 8, 8, 8, 8, 8});
  const std::vector<int64_t> unit = {0, 0, 1, 1, 1, 2};
  for (size_t i = 0; i < specs.size(); ++i) specs[i].unit = unit[i];
  auto layout = assign_buckets(specs, LayoutConfig{size_t{1} << 30, true, 2});
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_EQ(layout.buckets[0].params, (std::vector<int64_t>{5}));
  EXPECT_EQ(layout.buckets[1].params, (std::vector<int64_t>{4, 3, 2}));
  EXPECT_EQ(layout.buckets[2].params, (std::vector<int64_t>{1, 0}));
  for (const BucketSpan& span : layout.buckets) EXPECT_EQ(span.numel() % (2 * kAlignmentElems), 0);
  // The cap still closes buckets inside a unit (16 bytes = 4 elements: one param a bucket).
  layout = assign_buckets(specs, LayoutConfig{16, false, 1});
  EXPECT_EQ(layout.buckets.size(), 6u);
}
