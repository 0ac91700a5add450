// A thread-safe map from a tensor's identity to a value: how meshddp marks params (placements, expert
// params, params tied across pipeline stages) without owning them. Keyed by the TensorImpl (a param
// keeps it across set_data); each entry holds a weak reference, so a freed tensor's entry never
// answers for a new tensor that reuses its address, and such entries are dropped at the next set().
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <map>
#include <mutex>
#include <optional>
#include <utility>

namespace meshddp {

template <typename Value>
class WeakTensorMap {
 public:
  void set(const at::Tensor& tensor, Value value) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = map_.begin(); it != map_.end();) it = it->second.first.expired() ? map_.erase(it) : std::next(it);
    map_.insert_or_assign(tensor.unsafeGetTensorImpl(),
                          Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr()), std::move(value)});
  }

  // The value set for this tensor, if it is alive and was set.
  std::optional<Value> get(const at::Tensor& tensor) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(tensor.unsafeGetTensorImpl());
    if (it == map_.end() || it->second.first.expired()) return std::nullopt;
    return it->second.second;
  }

 private:
  using Entry = std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, Value>;
  mutable std::mutex mutex_;
  std::map<const c10::TensorImpl*, Entry> map_;
};

}  // namespace meshddp
