#include "mesh/placement.h"

#include "mesh/weak_tensor_map.h"

namespace meshddp {
namespace {

WeakTensorMap<Placement>& placements() {
  static WeakTensorMap<Placement> map;
  return map;
}

// The expert params (declare_expert_param).
WeakTensorMap<bool>& expert_params() {
  static WeakTensorMap<bool> map;
  return map;
}

}  // namespace

std::string Placement::str() const {
  switch (kind) {
    case Kind::kShard:
      return "Shard(" + std::to_string(dim) + ")";
    case Kind::kPartialGrad:
      return "PartialGrad";
    default:
      return "Replicate";
  }
}

void set_placement(const at::Tensor& param, Placement placement) { placements().set(param, placement); }

Placement get_placement(const at::Tensor& param) { return placements().get(param).value_or(Placement::replicate()); }

void declare_expert_param(const at::Tensor& param) {
  TORCH_CHECK(param.defined(), "declare_expert_param: the tensor is undefined");
  expert_params().set(param, true);
}

bool is_expert_param(const at::Tensor& param) { return expert_params().get(param).has_value(); }

}  // namespace meshddp
