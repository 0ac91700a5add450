// Pipeline parallelism on a DeviceMesh with a "pp" dim: the groups a data-parallel wrapper of one
// pipeline stage needs (the stage's own world, the embedding groups of the first and last stage),
// and the declaration of a weight tied across stages (the token embedding on the first stage and
// the LM head on the last hold two copies of one weight). docs/guide/pipelines.md.
#pragma once

#include "device_mesh.h"
#include "reduction_groups.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace meshddp {

// The name of the pipeline dim DistributedDataParallel looks for on a mesh: it is neither DP nor TP,
// and each stage's gradients are synced within its own stage (docs/guide/pipelines.md).
inline constexpr const char* kPipelineDim = "pp";

// The embedding groups: for each pipeline (the ranks that differ only along `pp_dim`), its first and
// last stage, in that order (first stage = group rank 0); the middle stages' ranks are groups of
// their own (one rank each, unused), so that the groups partition the mesh. With one stage each
// group is one rank. Pure. Throws on a bad mesh or an unknown `pp_dim`.
RankGroups embedding_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                            const std::string& pp_dim = kPipelineDim);

// This rank's embedding group (DeviceMesh::group_of("embedding.<pp_dim>", embedding_groups(...))):
// collective at the first call, as group_of() is. The two copies of a weight tied across stages are
// summed over it.
c10::intrusive_ptr<c10d::ProcessGroup> embedding_group(const DeviceMesh& mesh,
                                                       const std::string& pp_dim = kPipelineDim);

// The mesh's dims other than `pp_dim`, and their sizes (the mesh itself when it has no such dim).
struct StageDims {
  std::vector<std::string> names;
  std::vector<int64_t> sizes;
};
StageDims stage_dims(const DeviceMesh& mesh, const std::string& pp_dim = kPipelineDim);

// The group of every rank of this rank's pipeline stage (all dims but `pp_dim`, flattened): what
// DistributedDataParallel uses as its world on a pipeline mesh (TP-partial sums, gradient norms,
// settings agreement). mesh.world() when the mesh has no `pp_dim`. Collective at the first call.
c10::intrusive_ptr<c10d::ProcessGroup> stage_world(const DeviceMesh& mesh, const std::string& pp_dim = kPipelineDim);

// Declares `param` one copy of a weight tied across pipeline stages (e.g. "wte.weight" on the first
// stage and "lm_head.weight" on the last: declare both, each on its own stage, before wrapping the
// chunk that holds it). DistributedDataParallel then keeps it in a gradient buffer and bucket of its
// own, whose gradient is summed over the embedding group before the DP reduction (ZeRO-1's
// reduce-scatter too), broadcasts the first stage's copy at construction, and checks the two sides'
// tied layouts agree. Keyed by the tensor's identity, as declare_expert_param.
void declare_tied_across_stages(const at::Tensor& param);
bool is_tied_across_stages(const at::Tensor& param);  // false if never declared

}  // namespace meshddp
