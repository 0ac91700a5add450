#include "mesh/pipeline_groups.h"

#include "mesh/weak_tensor_map.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace meshddp {
namespace {

WeakTensorMap<bool>& tied_params() {
  static WeakTensorMap<bool> map;
  return map;
}

}  // namespace

RankGroups embedding_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                            const std::string& pp_dim) {
  RankGroups out;
  // Each pipeline: the flattened group over pp_dim, in stage order (flattened_groups checks the mesh
  // and the dim's name).
  for (const auto& pipeline : flattened_groups(sizes, names, {pp_dim})) {
    if (pipeline.size() <= 2) {
      out.push_back(pipeline);
      continue;
    }
    out.push_back({pipeline.front(), pipeline.back()});
    for (size_t s = 1; s + 1 < pipeline.size(); ++s) out.push_back({pipeline[s]});
  }
  std::sort(out.begin(), out.end());  // a partition ordered by first rank (DeviceMesh::group_of)
  return out;
}

c10::intrusive_ptr<c10d::ProcessGroup> embedding_group(const DeviceMesh& mesh, const std::string& pp_dim) {
  return mesh.group_of("embedding." + pp_dim, embedding_groups(mesh.sizes(), mesh.names(), pp_dim));
}

StageDims stage_dims(const DeviceMesh& mesh, const std::string& pp_dim) {
  StageDims out;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    if (mesh.names()[d] == pp_dim) continue;
    out.names.push_back(mesh.names()[d]);
    out.sizes.push_back(mesh.sizes()[d]);
  }
  return out;
}

c10::intrusive_ptr<c10d::ProcessGroup> stage_world(const DeviceMesh& mesh, const std::string& pp_dim) {
  const auto& names = mesh.names();
  if (std::find(names.begin(), names.end(), pp_dim) == names.end()) return mesh.world();
  const StageDims stage = stage_dims(mesh, pp_dim);
  TORCH_CHECK(!stage.names.empty(), "stage_world: the mesh (", mesh.describe(), ") has only the pipeline dim '", pp_dim,
              "'; give it a data-parallel dim too (of size 1 if need be)");
  return mesh.flattened(stage.names);
}

void declare_tied_across_stages(const at::Tensor& param) {
  TORCH_CHECK(param.defined(), "declare_tied_across_stages: the tensor is undefined");
  tied_params().set(param, true);
}

bool is_tied_across_stages(const at::Tensor& param) { return tied_params().get(param).has_value(); }

}  // namespace meshddp
