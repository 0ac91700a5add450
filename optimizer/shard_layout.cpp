#include "optimizer/shard_layout.h"

#include "grad_buffer/bucket_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace meshddp {

std::vector<BucketShard> shard_buckets(const BucketLayout& layout, int64_t dp_rank, int64_t dp_size) {
  return shard_buckets(layout, std::vector<ShardOwner>(layout.buckets.size(), ShardOwner{dp_rank, dp_size}));
}

std::vector<BucketShard> shard_buckets(const BucketLayout& layout, const std::vector<ShardOwner>& owners) {
  TORCH_CHECK(owners.size() == layout.buckets.size(), "shard_buckets: ", owners.size(), " shard owners for ",
              layout.buckets.size(), " buckets");
  std::vector<BucketShard> shards;
  shards.reserve(layout.buckets.size());
  for (int64_t b = 0; b < static_cast<int64_t>(layout.buckets.size()); ++b) {
    const BucketSpan& span = layout.buckets[b];
    const int64_t dp_rank = owners[b].rank, dp_size = owners[b].size;  // the bucket's group (DP or expert-DP)
    TORCH_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "shard_buckets: DP rank ", dp_rank,
                " is not in [0, ", dp_size, ")");
    TORCH_CHECK(span.numel() % dp_size == 0, "shard_buckets: bucket ", b, " has ", span.numel(),
                " elements, not a multiple of the DP size ", dp_size,
                "; build the layout with pad_for_reduce_scatter (use_distributed_optimizer) and this DP size");
    BucketShard shard;
    shard.bucket = b;
    shard.buffer = span.buffer;
    shard.numel = span.numel() / dp_size;
    shard.begin = span.begin + dp_rank * shard.numel;
    const int64_t end = shard.begin + shard.numel;
    for (int64_t p : span.params) {
      const ParamSlot& slot = layout.slots[p];
      const int64_t lo = std::max(slot.offset, shard.begin);
      const int64_t hi = std::min(slot.offset + slot.numel, end);
      if (lo >= hi) continue;
      shard.segments.push_back(ShardSegment{p, lo - slot.offset, lo - shard.begin, hi - lo});
    }
    std::sort(shard.segments.begin(), shard.segments.end(),
              [](const ShardSegment& a, const ShardSegment& b) { return a.shard_offset < b.shard_offset; });
    shards.push_back(std::move(shard));
  }
  return shards;
}

}  // namespace meshddp
