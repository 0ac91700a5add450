#include "grad_buffer/param_gather.h"

#include "mesh/collectives.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>

namespace meshddp {
namespace {

constexpr c10::DispatchKey kWaitMode = c10::DispatchKey::TESTING_ONLY_GenericMode;

// The ParamGathers whose ForwardScope is open on this thread (innermost last).
thread_local std::vector<ParamGather*> active_gathers;

void wait_for_params_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const size_t num_args = op.schema().arguments().size();
  bool any_pending = false;
  for (ParamGather* gather : active_gathers) {
    for (size_t i = stack->size() - num_args; i < stack->size(); ++i) {
      const c10::IValue& arg = (*stack)[i];
      if (arg.isTensor()) {
        gather->wait_if_pending(arg.toTensor());
      } else if (arg.isTensorList()) {
        for (const at::Tensor& t : arg.toTensorList().vec()) gather->wait_if_pending(t);
      }
    }
    any_pending = any_pending || gather->pending() > 0;
  }
  if (!any_pending) c10::impl::tls_set_dispatch_key_included(kWaitMode, false);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWaitMode), stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&wait_for_params_fallback>());
}

ParamGather::ParamGather(std::vector<Bucket> buckets) : buckets_(std::move(buckets)), works_(buckets_.size()) {
  for (const Bucket& b : buckets_) TORCH_INTERNAL_ASSERT(b.group, "ParamGather: no group for ", b.what);
}

ParamGather::~ParamGather() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& w : works_) {
    if (!w) continue;
    try {
      w->wait();
    } catch (const std::exception&) {
      // Destruction must not throw; a failed gather is reported by whoever waits for it.
    }
  }
}

void ParamGather::start(bool async) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(pending_ == 0, "ParamGather: ", pending_, " parameter all-gather(s) of the previous step are still ",
                "pending; wait_all() before starting new ones");
    for (size_t b = buckets_.size(); b-- > 0;) {  // forward order: last bucket first
      if (skip_collective(*buckets_[b].group)) continue;
      works_[b] = all_gather_into(*buckets_[b].group, buckets_[b].full, buckets_[b].shard, buckets_[b].what);
      ++pending_;
    }
  }
  if (!async) wait_all();
}

void ParamGather::wait_bucket(size_t b) {
  if (!works_[b]) return;
  auto work = std::move(works_[b]);
  works_[b].reset();
  --pending_;
  wait_collective(work, *buckets_[b].group, buckets_[b].what);
}

void ParamGather::wait_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t b = buckets_.size(); b-- > 0;) wait_bucket(b);
}

int64_t ParamGather::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_;
}

bool ParamGather::wait_if_pending(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pending_ == 0) return false;
  if (!t.defined() || !t.has_storage()) return true;
  const void* storage = t.storage().unsafeGetStorageImpl();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!works_[b]) continue;
    const at::Tensor& full = buckets_[b].full;
    if (full.storage().unsafeGetStorageImpl() != storage) continue;
    const int64_t begin = full.storage_offset();
    const int64_t end = begin + full.numel();
    if (t.storage_offset() < end && t.storage_offset() + std::max<int64_t>(t.numel(), 1) > begin) {
      wait_bucket(b);
      ++waited_in_forward_;
    }
  }
  return pending_ > 0;
}

ParamGather::ForwardScope::ForwardScope(ParamGather* gather) {
  if (gather == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(gather->mutex_);
    gather->pending_at_forward_start_ = gather->pending_;
    gather->waited_in_forward_ = 0;
    if (gather->pending_ == 0) return;
  }
  gather_ = gather;
  active_gathers.push_back(gather);
  previous_mode_ = c10::impl::tls_is_dispatch_key_included(kWaitMode);
  c10::impl::tls_set_dispatch_key_included(kWaitMode, true);
}

ParamGather::ForwardScope::~ForwardScope() {
  if (gather_ == nullptr) return;
  active_gathers.erase(std::find(active_gathers.begin(), active_gathers.end(), gather_));
  c10::impl::tls_set_dispatch_key_included(kWaitMode, previous_mode_);
}

}  // namespace meshddp
