// BucketReduction (how one bucket is reduced over the SyncGroups of sync_groups.h: group, divisor,
// ZeRO-1 shard, cross-instance step), chosen once per bucket by the pure bucket_reduction_of(); and
// the checks an expert param must pass. No communication.
#pragma once

#include "../mesh/placement.h"
#include "bucket_layout.h"
#include "named_param.h"
#include "sync_groups.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>

namespace meshddp {

// How one bucket is reduced, fixed at construction (one checked path: launch, wait, ZeRO-1 shards and
// the param all-gather all read it). Dense buckets: over DP (x CP), divided by the DP size; expert
// buckets: over the expert-data-parallel group, divided by the DP size too (Note [Expert gradient
// scale] in bucket_reduction.cpp: an expert's local gradient already sums tokens of EP ranks' batches);
// TP-partial buckets: over the whole mesh (a TP sum and a DP mean in one collective), divided by the
// DP size.
struct BucketReduction {
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // the collective runs over it
  int64_t divisor = 1;                           // the bucket is pre-divided by it (the whole DP (x CP) size)
  bool tp_partial = false;                       // all-reduced over the world: a TP sum and a DP mean
  bool expert = false;                           // expert params, over the expert-data-parallel group
  // ZeRO-1: this rank's shard is shard `shard_rank` of `shard_size` equal ones (the DP or expert-DP
  // rank and size, within the optimizer instance with K > 1; the bucket is padded to a multiple of shard_size), and its
  // param all-gather runs over `shard_group`.
  c10::intrusive_ptr<c10d::ProcessGroup> shard_group;
  int64_t shard_rank = 0;
  int64_t shard_size = 1;
  // Hierarchical ZeRO-1 (SyncGroups::cross_instance; null otherwise, for TP-partial buckets, and for
  // expert buckets without SyncGroups::expert_instance): after the reduce-scatter within the instance and the comm
  // hook's write-back, this rank's shard is all-reduced over it.
  c10::intrusive_ptr<c10d::ProcessGroup> cross_group;
  // Params tied across pipeline stages (BufferKey::tied): the pre-divided bucket is first summed over
  // this group (SyncGroups::embedding), then reduced over DP as a dense bucket. Null otherwise.
  c10::intrusive_ptr<c10d::ProcessGroup> tied_group;
};

// How a bucket of a buffer with `key` is reduced over `groups`. Pure: reads the groups' ranks and sizes.
BucketReduction bucket_reduction_of(const BufferKey& key, const SyncGroups& groups);

// Throws naming `p` when it is declared an expert (mesh/placement.h: declare_expert_param) but
// `groups` has no expert-data-parallel group, or when its gradient is partial over TP.
void check_expert_param(const NamedParam& p, const Placement& placement, const SyncGroups& groups);

// Throws naming `p` (declared tied across stages, mesh/pipeline_groups.h) when `groups` has no
// embedding group, or when it is also an expert param or its gradient is partial over TP.
void check_tied_param(const NamedParam& p, const Placement& placement, const SyncGroups& groups);

}  // namespace meshddp
