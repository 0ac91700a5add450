// Which elements of each bucket a data-parallel rank owns under ZeRO-1, and how they map onto
// parameters. Pure host logic over a BucketLayout: no tensors, no communication.
// With hierarchical ZeRO-1 (K optimizer instances) `dp` here is the instance: dp_rank / dp_size are
// the rank's index in its instance and the instance's size D/K (SyncGroups::dp is the instance).
//
// Rank r owns the contiguous range [begin + r * n / dp, begin + (r + 1) * n / dp) of every bucket
// (n = the bucket's padded length, a multiple of dp). Ranges ignore param boundaries: a param may
// be split across ranks, and a rank's range may end in padding. A segment is the intersection of
// one param with one rank's range.
#pragma once

#include <cstdint>
#include <vector>

namespace meshddp {

struct BucketLayout;  // grad_buffer/bucket_layout.h

struct ShardSegment {
  int64_t param = -1;        // param index (registration order among trainable params)
  int64_t param_offset = 0;  // first element, in the flattened param
  int64_t shard_offset = 0;  // first element, in this rank's shard of the bucket
  int64_t numel = 0;
};

struct BucketShard {
  int64_t bucket = -1;
  int64_t buffer = -1;
  int64_t begin = 0;                   // in the flat buffer
  int64_t numel = 0;                   // n / dp
  std::vector<ShardSegment> segments;  // in buffer order
};

// One BucketShard per bucket (indexed like layout.buckets). Throws if a bucket's length is not a
// multiple of dp_size (the layout must be built with pad_for_reduce_scatter and the same dp_size).
std::vector<BucketShard> shard_buckets(const BucketLayout& layout, int64_t dp_rank, int64_t dp_size);

// Which shard of a bucket a rank owns: its rank and the size of the bucket's reduction group (the
// DP group for dense buckets, the expert-data-parallel group for expert ones: GradBuffer's
// BucketReduction::shard_rank / shard_size).
struct ShardOwner {
  int64_t rank = 0;
  int64_t size = 1;
};

// The same with each bucket's own owner (`owners` indexed like layout.buckets): buckets reduced over
// different groups are cut into different numbers of shards. Same checks, per bucket.
std::vector<BucketShard> shard_buckets(const BucketLayout& layout, const std::vector<ShardOwner>& owners);

}  // namespace meshddp
