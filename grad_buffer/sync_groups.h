// SyncGroups: the process groups a GradBuffer reduces over (DP, the whole mesh, TP, optimizer
// instances, expert-DP, the pipeline's), as a DistributedDataParallel holds them. Plain data: no
// communication.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>

namespace meshddp {

// The groups a GradBuffer syncs over. `world` (the whole DP x TP mesh) sums gradients that are
// partial over TP (Placement::kPartialGrad: their buckets are all-reduced over it, pre-divided by
// the DP size: a TP sum and a DP mean in one collective, once per step) and reduces gradient norms;
// it may be null when no param is TP-partial and TP is 1.
struct SyncGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> dp;
  c10::intrusive_ptr<c10d::ProcessGroup> world;
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  // The TP group (null when TP is 1): TP-replica checks, and the group TP placements must name.
  c10::intrusive_ptr<c10d::ProcessGroup> tp = {};
  // Hierarchical ZeRO-1 (num_distributed_optimizer_instances = K > 1): `dp` is then this rank's
  // optimizer instance (D/K ranks: buckets are reduce-scattered and params all-gathered over it) and
  // this is the group of the K ranks at the same position in each instance (the shards are
  // all-reduced over it). Null otherwise.
  c10::intrusive_ptr<c10d::ProcessGroup> cross_instance = {};
  // The expert-data-parallel group (mesh/reduction_groups.h): the ranks holding the same experts, over
  // which expert params (mesh/placement.h: declare_expert_param) are reduced. Null: no expert params
  // allowed (the DP group itself when expert_parallel_size is 1).
  c10::intrusive_ptr<c10d::ProcessGroup> expert_dp = {};
  // Hierarchical ZeRO-1 with expert params: the expert-DP ranks within this rank's optimizer instance
  // (expert-DP / K of them), over which expert buckets are reduce-scattered and their params
  // all-gathered; their shards are then all-reduced over `cross_instance`, as dense ones (Megatron-core's
  // intra-instance expert-DP group). Null otherwise: expert buckets are sharded over `expert_dp`.
  c10::intrusive_ptr<c10d::ProcessGroup> expert_instance = {};
  // Pipeline parallel: the embedding group (mesh/pipeline_groups.h: the first and last stage of this
  // rank's pipeline), over which params tied across stages (declare_tied_across_stages) are summed
  // before their DP reduction. Null: no tied params allowed.
  c10::intrusive_ptr<c10d::ProcessGroup> embedding = {};
  // Pipeline parallel: this rank's pipeline (the pp group: one rank per stage). A pipeline is one
  // training run: gradient norms and non-finite checks summed over the stats group (the stage) are then
  // summed over it (grad_buffer/run_stats.h). Null: no pipeline (a mesh without a pp dim).
  c10::intrusive_ptr<c10d::ProcessGroup> pipeline = {};

  int64_t dp_rank() const { return dp->getRank(); }
  int64_t dp_size() const { return dp->getSize(); }
  int64_t instances() const { return cross_instance ? cross_instance->getSize() : 1; }
  int64_t instance_index() const { return cross_instance ? cross_instance->getRank() : 0; }
  // The group expert buckets are sharded over: this instance's expert-DP ranks, or the whole expert-DP.
  const c10::intrusive_ptr<c10d::ProcessGroup>& expert_shard_group() const {
    return expert_instance ? expert_instance : expert_dp;
  }
  // D, the ranks a gradient is averaged over: the instance's size times the number of instances.
  int64_t data_parallel_size() const { return dp_size() * instances(); }
  // This rank's index among those D (instances are consecutive blocks of the DP group).
  int64_t data_parallel_rank() const { return instance_index() * dp_size() + dp_rank(); }
  // The group gradient norms and non-finite checks reduce over within a stage: the world group if
  // there is one (then over `pipeline`, grad_buffer/run_stats.h).
  c10d::ProcessGroup& stats_group() const { return world ? *world : *dp; }
  // A pipeline of more than one stage.
  bool has_pipeline() const { return pipeline && pipeline->getSize() > 1; }
  // Whether this rank counts a weight tied across stages toward the norm: the first stage's copy
  // only (the last stage holds the same summed gradient).
  bool counts_tied() const { return !embedding || embedding->getRank() == 0; }
};

}  // namespace meshddp
