#include "mesh/placement.h"

#include <c10/core/TensorImpl.h>

#include <map>
#include <mutex>

namespace meshddp {
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;  // detects a freed tensor whose address was reused
  Placement placement;
};

std::mutex registry_mutex;
std::map<const c10::TensorImpl*, Entry>& registry() {
  static std::map<const c10::TensorImpl*, Entry> map;
  return map;
}

// The expert params (declare_expert_param), same keying as the placements.
std::map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>& expert_registry() {
  static std::map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> map;
  return map;
}

// Drops the entries of freed tensors (whose address a new tensor may reuse).
template <typename Map, typename WeakOf>
void erase_expired(Map& map, WeakOf weak_of) {
  for (auto it = map.begin(); it != map.end();) it = weak_of(it->second).expired() ? map.erase(it) : std::next(it);
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

void set_placement(const at::Tensor& param, Placement placement) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& map = registry();
  erase_expired(map, [](const Entry& e) -> const auto& { return e.tensor; });
  map.insert_or_assign(param.unsafeGetTensorImpl(),
                       Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), placement});
}

Placement get_placement(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& map = registry();
  auto it = map.find(param.unsafeGetTensorImpl());
  if (it == map.end() || it->second.tensor.expired()) return Placement::replicate();
  return it->second.placement;
}

void declare_expert_param(const at::Tensor& param) {
  TORCH_CHECK(param.defined(), "declare_expert_param: the tensor is undefined");
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& map = expert_registry();
  erase_expired(map, [](const auto& weak) -> const auto& { return weak; });
  map.insert_or_assign(param.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()));
}

bool is_expert_param(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& map = expert_registry();
  auto it = map.find(param.unsafeGetTensorImpl());
  return it != map.end() && !it->second.expired();
}

}  // namespace meshddp
