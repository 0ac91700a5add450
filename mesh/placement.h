// Placement: how a parameter relates to the mesh's tensor-parallel dim. Set by the TP layers when a
// plan parallelizes them, read by the gradient sync (partial grads are summed over TP), the
// gradient norm (replicated params count once, not TP times) and checkpoints (global shape and
// offset of each local shard). A parameter with no placement is Replicate.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace meshddp {

struct Placement {
  enum class Kind {
    kReplicate,    // every TP rank holds the whole param; its gradient is already the same on each
    kShard,        // each TP rank holds chunk tp_rank of dim `dim` (of `tp_size` equal chunks)
    kPartialGrad,  // replicated param whose gradient is a partial sum over TP (sequence-parallel norms,
                   // row-parallel biases under sequence parallelism): the sync sums it over TP
  };
  Kind kind = Kind::kReplicate;
  int64_t dim = -1;     // kShard only
  int64_t tp_size = 1;  // kShard only
  int64_t tp_rank = 0;  // kShard only
  std::string group;    // name of the TP process group it was made over (kShard, kPartialGrad); "" = unknown.
                        // The gradient sync checks it is the TP group it uses: one source of truth

  static Placement replicate() { return {}; }
  static Placement partial_grad(std::string group = "") { return {Kind::kPartialGrad, -1, 1, 0, std::move(group)}; }
  static Placement shard(int64_t dim, int64_t tp_size, int64_t tp_rank, std::string group = "") {
    return {Kind::kShard, dim, tp_size, tp_rank, std::move(group)};
  }
  bool is_shard() const { return kind == Kind::kShard; }
  bool is_partial_grad() const { return kind == Kind::kPartialGrad; }
  // Counted once across TP in norms: sharded params on every rank, others on TP rank 0 only.
  bool counts_on_tp_rank(int64_t tp) const { return is_shard() || tp == 0; }
  std::string str() const;  // "Shard(0)", "Replicate", "PartialGrad"
};

// Registry, keyed by the tensor's identity (a parameter keeps its TensorImpl across set_data).
void set_placement(const at::Tensor& param, Placement placement);
Placement get_placement(const at::Tensor& param);  // Replicate if never set

// Expert parallel (mixture of experts): an expert param is held by the ranks of one expert-data-parallel
// group only (an expert's weights live on one rank of each EP group, EP being carved out of the DP (x CP)
// ranks: mesh/reduction_groups.h). DDP reduces its gradient over that group (DdpConfig::expert_parallel_size)
// instead of over DP (x CP). Kept apart from Placement: an expert's weights may also be TP-sharded.
// Declare before wrapping the model in DistributedDataParallel (or with the plan style ExpertParallel).
void declare_expert_param(const at::Tensor& param);
bool is_expert_param(const at::Tensor& param);  // false if never declared

}  // namespace meshddp
