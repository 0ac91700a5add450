#include "grad_buffer/bucket_reduction.h"

#include <c10/util/Exception.h>

namespace meshddp {

// Note [Expert gradient scale]
// An expert's gradient is summed over its expert-data-parallel group but divided by the whole DP (x CP)
// size, not by the expert-DP size (Megatron-core: expert_gradient_scaling_factor = 1 / dp_cp_size). Each
// rank's loss is the mean over its own b = B / DP tokens; an expert receives, by all-to-all over its EP
// group, the tokens of EP ranks' batches routed to it, each weighted 1/b. Summed over the expert-DP group
// (one rank per EP group) that is (1/b) * sum over all B tokens routed to it, and the one-process
// gradient (1/B) * the same sum is that divided by DP. Dividing by the expert-DP size instead would
// scale expert gradients by EP.

BucketReduction bucket_reduction_of(const BufferKey& key, const SyncGroups& groups) {
  BucketReduction r;
  r.tp_partial = key.tp_partial;
  r.expert = key.expert;
  r.shard_group = key.expert ? groups.expert_shard_group() : groups.dp;
  TORCH_INTERNAL_ASSERT(r.shard_group, "no group for a bucket of ", key.expert ? "expert" : "dense", " params");
  r.shard_rank = r.shard_group->getRank();
  r.shard_size = r.shard_group->getSize();
  r.group = key.tp_partial ? groups.world : r.shard_group;
  // Every bucket is divided by the whole DP (x CP) size D (with K optimizer instances too), expert
  // buckets too: Note [Expert gradient scale]. TP-partial: the world all-reduce sums over TP, the
  // divisor makes it a DP mean.
  r.divisor = groups.data_parallel_size();
  // Hierarchical ZeRO-1: dense and expert buckets' shards are all-reduced across the instances (expert
  // ones sharded within the instance: SyncGroups::expert_instance, Note [Hierarchical ZeRO-1]; the K
  // ranks at one position of each instance hold the same experts, so the cross group is the dense one).
  // TP-partial buckets are whole and final after their all-reduce over the world.
  if (!key.tp_partial && (!key.expert || groups.expert_instance)) r.cross_group = groups.cross_instance;
  if (key.tied) r.tied_group = groups.embedding;  // Note [Tied across stages] (tied_params.cpp)
  return r;
}

void check_expert_param(const NamedParam& p, const Placement& placement, const SyncGroups& groups) {
  TORCH_CHECK(groups.expert_dp, "GradBuffer: parameter ", describe_param_name(p),
              " is an expert param (declare_expert_param / the plan style ExpertParallel) but this buffer has no ",
              "expert-data-parallel group to reduce it over; build DistributedDataParallel over a DeviceMesh with ",
              "DdpConfig::expert_parallel_size set (with a DP process group alone, only expert_parallel_size = 1 ",
              "works), or do not declare it");
  TORCH_CHECK(!placement.is_partial_grad(), "GradBuffer: parameter ", describe_param_name(p),
              " is an expert param whose gradient is partial over TP (", placement.str(),
              "); meshddp does not reduce TP-partial expert gradients (they would need an all-reduce over the ",
              "expert-DP x TP ranks). Keep sequence-parallel norms out of the experts (or their params undeclared ",
              "as experts)");
}

}  // namespace meshddp
