#include "grad_buffer/param_gather.h"

#include "grad_buffer/sharded_params.h"
#include "grad_buffer/tensor_subclass_values.h"
#include "mesh/collectives.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <utility>

namespace meshddp {
namespace {

constexpr c10::DispatchKey kWaitMode = c10::DispatchKey::TESTING_ONLY_GenericMode;

// The ParamGathers whose ForwardScope is open on this thread (innermost last).
thread_local std::vector<ParamGather*> active_gathers;

// Note [Raw-module forward after an overlapped step]
// Evaluation code often holds the module, not the DDP wrapper, and calls its forward right after
// the optimizer's step() launched the param all-gathers. So start(async) also turns the wait mode on
// for the thread that launched them (the training thread): until they are done, any op on that
// thread that reads a pending bucket's params waits for it, inside a wrapper's forward or not. The
// gathers are listed per thread with the id they had when launched, and looked up in `live_gathers`
// before use: a ParamGather destroyed (on any thread) is dropped from the list, never dereferenced.
// Another thread reading the params must call wait_all() (finish_param_sync()) first.
std::mutex live_mutex;
std::map<const ParamGather*, uint64_t>& live_gathers() {
  static std::map<const ParamGather*, uint64_t> map;
  return map;
}
uint64_t next_gather_id = 1;  // under live_mutex
thread_local std::vector<std::pair<ParamGather*, uint64_t>> launched_gathers;

// The gathers this thread launched that are still alive (dead ones dropped from the list).
std::vector<ParamGather*> launched_on_this_thread() {
  std::vector<ParamGather*> out;
  if (launched_gathers.empty()) return out;
  std::lock_guard<std::mutex> lock(live_mutex);
  auto& live = live_gathers();
  auto kept = launched_gathers.begin();
  for (auto& entry : launched_gathers) {
    const auto it = live.find(entry.first);
    if (it == live.end() || it->second != entry.second) continue;
    out.push_back(entry.first);
    *kept++ = entry;
  }
  launched_gathers.erase(kept, launched_gathers.end());
  return out;
}

// What `schema` does with argument `i`'s values: writes them in place (Tensor(a!)), not counting the
// ops that change only autograd metadata (requires_grad_, retain_grad, detach_); only returns a view
// of them (Tensor(a): detach, view, t), reading none; or reads them.
ShardedParams::Access access_of(const c10::FunctionSchema& schema, size_t i) {
  const c10::AliasInfo* alias = schema.arguments()[i].alias_info();
  if (alias == nullptr) {
    // x.view_as(p) and its kin read only p's sizes (DTensor.to_local() is local.view_as(local); torch's pipelining
    // finds a param's autograd node with p.view_as(p)), as torch.zeros_like(p) and the other factories do.
    const std::string& name = schema.name();
    const bool like = i == 0 && name.size() > 5 && name.compare(name.size() - 5, 5, "_like") == 0;
    const bool sizes_only =
        like || (i == 1 && (name == "aten::view_as" || name == "aten::expand_as" || name == "aten::reshape_as"));
    return sizes_only ? ShardedParams::Access::kView : ShardedParams::Access::kRead;
  }
  if (!alias->isWrite()) return ShardedParams::Access::kView;
  const std::string& name = schema.name();
  const bool metadata = name == "aten::requires_grad_" || name == "aten::retain_grad" || name == "aten::detach_";
  return metadata ? ShardedParams::Access::kView : ShardedParams::Access::kWrite;
}

std::atomic<TensorValuesOf> subclass_values{nullptr};  // Note [Tensor subclasses under the param modes]

// `t`, or for a tensor subclass the tensor holding its values (its storage is the one a bucket may own), kept
// alive by `holder`. A plain tensor is returned as it is: no reference count touched on the per-op path.
const at::Tensor& values_of(const at::Tensor& t, at::Tensor& holder) {
  if (!t.defined() || !t.key_set().has(c10::DispatchKey::Python)) return t;
  const TensorValuesOf lookup = subclass_values.load(std::memory_order_acquire);
  if (lookup == nullptr) return t;
  holder = lookup(t);
  return holder.defined() ? holder : t;
}

void wait_for_params_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  bool any_pending = false;
  // "optim_grads_params": an argument in a released unit's storage gathers the unit first, and one the
  // op writes in place is refused (Note [Sharded parameters], sharded_params.h); the mode stays on
  // while any ShardedParams lives.
  const char* name = schema.name().c_str();
  const ShardedParams::OpScope one_op;  // its arguments' units are kept together
  const size_t first = stack->size() - num_args;
  at::Tensor holder;  // a subclass argument's values (values_of)
  for (size_t i = first; i < stack->size(); ++i) {
    const c10::IValue& arg = (*stack)[i];
    const ShardedParams::Access written = access_of(schema, i - first);
    if (arg.isTensor()) {
      any_pending = ShardedParams::on_use(values_of(arg.toTensor(), holder), name, written) || any_pending;
    } else if (arg.isTensorList()) {
      for (const at::Tensor& t : arg.toTensorList().vec()) {
        any_pending = ShardedParams::on_use(values_of(t, holder), name, written) || any_pending;
      }
    } else if (arg.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : arg.toOptionalTensorList().vec()) {
        if (t.has_value()) any_pending = ShardedParams::on_use(values_of(*t, holder), name, written) || any_pending;
      }
    }
  }
  any_pending = any_pending || ShardedParams::on_use(at::Tensor());  // any alive: ops without tensor arguments too
  std::vector<ParamGather*> gathers = launched_on_this_thread();
  gathers.insert(gathers.end(), active_gathers.begin(), active_gathers.end());
  for (ParamGather* gather : gathers) {
    for (size_t i = stack->size() - num_args; i < stack->size(); ++i) {
      const c10::IValue& arg = (*stack)[i];
      if (arg.isTensor()) {
        gather->wait_if_pending(values_of(arg.toTensor(), holder));
      } else if (arg.isTensorList()) {
        for (const at::Tensor& t : arg.toTensorList().vec()) gather->wait_if_pending(values_of(t, holder));
      }
    }
    any_pending = any_pending || gather->pending() > 0;
  }
  if (!any_pending) {
    launched_gathers.clear();  // every one is done: nothing to wait for until the next start()
    c10::impl::tls_set_dispatch_key_included(kWaitMode, false);
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWaitMode), stack);
}

}  // namespace

void set_tensor_subclass_values(TensorValuesOf lookup) { subclass_values.store(lookup, std::memory_order_release); }

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&wait_for_params_fallback>());
}

ParamGather::ParamGather(std::vector<Bucket> buckets) : buckets_(std::move(buckets)), works_(buckets_.size()) {
  for (const Bucket& b : buckets_) TORCH_INTERNAL_ASSERT(b.group, "ParamGather: no group for ", b.what);
  std::lock_guard<std::mutex> lock(live_mutex);
  live_gathers()[this] = next_gather_id++;
}

ParamGather::~ParamGather() {
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    live_gathers().erase(this);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<InFlightCollective> in_flight;
  for (size_t b = 0; b < works_.size(); ++b) {
    if (works_[b]) in_flight.push_back({works_[b], buckets_[b].group.get(), "all-gather of " + buckets_[b].what});
  }
  // No waiting forever on the gathers of a failed step (Note [Abandoned collectives], mesh/collectives.h).
  wait_or_abandon(in_flight, "a ZeRO-1 param all-gather");
}

void ParamGather::start(bool async) {
  {
    // The launches' own ops never wait in the fallback (this thread may still have the mode on from
    // the previous step's start(), and the fallback would take mutex_, held here).
    const c10::impl::ExcludeDispatchKeyGuard no_wait(kWaitMode);
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(pending_ == 0, "ParamGather: ", pending_, " parameter all-gather(s) of the previous step are still ",
                "pending; wait_all() before starting new ones");
    for (size_t b = buckets_.size(); b-- > 0;) {  // forward order: last bucket first
      if (skip_collective(*buckets_[b].group)) continue;
      works_[b] = all_gather_into(*buckets_[b].group, buckets_[b].full, buckets_[b].shard, buckets_[b].what);
      ++pending_;
    }
  }
  if (!async) {
    wait_all();
    return;
  }
  // Note [Raw-module forward after an overlapped step]: after the launches (the all-gathers' own ops
  // must not wait for each other).
  if (pending() == 0) return;
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    launched_gathers.emplace_back(this, live_gathers().at(this));
  }
  c10::impl::tls_set_dispatch_key_included(kWaitMode, true);
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
