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
  for (auto it = map.begin(); it != map.end();) it = it->second.tensor.expired() ? map.erase(it) : std::next(it);
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

}  // namespace meshddp
