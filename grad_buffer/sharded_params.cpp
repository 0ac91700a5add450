#include "grad_buffer/sharded_params.h"

#include "mesh/collectives.h"

#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <utility>

namespace meshddp {
namespace {

// The mode ParamGather's fallback runs under (Note [Waiting for parameters in forward without module
// hooks], param_gather.h); its fallback calls ShardedParams::on_use().
constexpr c10::DispatchKey kUseMode = c10::DispatchKey::TESTING_ONLY_GenericMode;

// Note [Finding a bucket's storage without a lock]
// Every op on a thread with the mode on asks, for each tensor argument, whether its StorageImpl is a
// live ShardedParams' bucket (on_use()). The answer changes only when a ShardedParams is built or
// destroyed, so the live buckets are published as an immutable index sorted by StorageImpl, with a
// generation number bumped at each publication. A thread keeps its own reference to the index it last
// read and compares generations (one atomic load) before each lookup; registry_mutex is taken only to
// pick up a newer index. The index itself is global, the reference per thread: the autograd engine's
// device threads inherit the dispatch mode but not this thread's variables, and read the index the
// same way (their first lookup, or the first after a change, picks it up). As before, a ShardedParams
// must not be destroyed while another thread runs ops on its params.
struct StorageIndex {
  struct Entry {
    const void* storage;
    ShardedParams* owner;
    int64_t bucket;
  };
  std::vector<Entry> entries;  // sorted by storage (no live ShardedParams: no index at all)

  const Entry* find(const void* storage) const {
    const auto it = std::lower_bound(entries.begin(), entries.end(), storage, [](const Entry& e, const void* s) {
      return std::less<const void*>()(e.storage, s);
    });
    return it != entries.end() && it->storage == storage ? &*it : nullptr;
  }
};

// Every live ShardedParams' buckets, under registry_mutex. A global list, not a thread-local one (above).
std::mutex registry_mutex;
std::map<ShardedParams*, std::vector<StorageIndex::Entry>>& registry() {
  static std::map<ShardedParams*, std::vector<StorageIndex::Entry>> live;
  return live;
}
std::shared_ptr<const StorageIndex> published_index;  // under registry_mutex; null when none is live
std::atomic<uint64_t> index_generation{0};            // written under registry_mutex
thread_local std::shared_ptr<const StorageIndex> thread_index;
thread_local uint64_t thread_index_generation = 0;

// registry_mutex held: publishes the index of registry()'s buckets.
void publish_index_locked() {
  std::shared_ptr<StorageIndex> index;
  if (!registry().empty()) {
    index = std::make_shared<StorageIndex>();
    for (const auto& [owner, entries] : registry())
      index->entries.insert(index->entries.end(), entries.begin(), entries.end());
    std::sort(index->entries.begin(), index->entries.end(),
              [](const StorageIndex::Entry& a, const StorageIndex::Entry& b) {
                return std::less<const void*>()(a.storage, b.storage);
              });
  }
  published_index = std::move(index);
  index_generation.fetch_add(1, std::memory_order_release);
}

// The index this thread reads (Note [Finding a bucket's storage without a lock]); null: no ShardedParams lives.
const StorageIndex* current_index() {
  if (index_generation.load(std::memory_order_acquire) != thread_index_generation) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    thread_index = published_index;
    thread_index_generation = index_generation.load(std::memory_order_relaxed);
  }
  return thread_index.get();
}

void release_storage(const at::Tensor& full) {
  c10::StorageImpl* storage = full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, full.device()));
  storage->set_nbytes(0);
}

void grow_storage(const at::Tensor& full, int64_t nbytes) {
  c10::StorageImpl* storage = full.storage().unsafeGetStorageImpl();
  if (static_cast<int64_t>(storage->nbytes()) == nbytes) return;
  TORCH_INTERNAL_ASSERT(storage->allocator() != nullptr, "ShardedParams: a bucket storage without an allocator");
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

}  // namespace

ShardedParams::ShardedParams(const BucketLayout& layout, std::vector<NamedParam>& params, std::vector<Bucket> buckets,
                             const std::vector<int64_t>& unit_of_param, std::vector<std::string> unit_names)
    : unit_of_param_(unit_of_param) {
  TORCH_INTERNAL_ASSERT(buckets.size() == layout.buckets.size() && unit_of_param.size() == params.size(),
                        "ShardedParams: ", buckets.size(), " buckets and ", unit_of_param.size(), " units for ",
                        layout.buckets.size(), " buckets and ", params.size(), " params");
  units_.resize(unit_names.size());
  used_in_forward_.assign(units_.size(), false);
  position_.assign(units_.size(), -1);
  for (size_t u = 0; u < units_.size(); ++u) units_[u].name = std::move(unit_names[u]);
  for (int64_t unit : unit_of_param_) ++units_[unit].num_params;
  places_.resize(params.size());
  c10::NoGradGuard no_grad;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const BucketSpan& span = layout.buckets[b];
    const BufferKey& key = layout.buffers[span.buffer].key;
    BucketState state;
    state.info = std::move(buckets[b]);
    TORCH_INTERNAL_ASSERT(state.info.group, "ShardedParams: no group for ", state.info.what);
    state.unit = unit_of_param_[span.params.front()];
    for (int64_t i : span.params) {
      TORCH_INTERNAL_ASSERT(unit_of_param_[i] == state.unit, "ShardedParams: ", state.info.what,
                            " holds params of two units (", units_[state.unit].name, ", ",
                            units_[unit_of_param_[i]].name, ")");
    }
    // Zeroed: the padding stays zero in every gather.
    state.full = at::zeros({span.numel()}, at::TensorOptions().dtype(key.param_dtype).device(key.device));
    state.nbytes = static_cast<int64_t>(state.full.nbytes());
    for (int64_t i : span.params) {
      const ParamSlot& slot = layout.slots[i];
      at::Tensor& param = params[i].param;
      at::Tensor view = state.full.narrow(0, slot.offset - span.begin, slot.numel).view(param.sizes());
      view.copy_(param.detach());
      places_[i] = {params[i].name, static_cast<int64_t>(b), slot.offset - span.begin, slot.numel};
      param.set_data(view);  // same TensorImpl (modules, optimizers, autograd keep it), the bucket's storage
    }
    const c10d::ProcessGroup& group = *state.info.group;
    const int64_t n = span.numel() / group.getSize();
    state.shard = state.full.narrow(0, group.getRank() * n, n).clone();
    bucket_of_storage_[state.full.storage().unsafeGetStorageImpl()] = static_cast<int64_t>(b);
    units_[state.unit].buckets.push_back(static_cast<int64_t>(b));
    resident_ += state.nbytes + static_cast<int64_t>(state.shard.nbytes());
    buckets_.push_back(std::move(state));
  }
  for (Unit& unit : units_) unit.state = UnitState::kGathered;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    release_all_locked();
    peak_ = resident_;  // counted from here: construction holds each param whole once, as the module did
  }
  std::vector<StorageIndex::Entry> entries;
  for (const auto& [storage, bucket] : bucket_of_storage_) entries.push_back({storage, this, bucket});
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[this] = std::move(entries);
  publish_index_locked();
}

ShardedParams::~ShardedParams() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().erase(this);
    publish_index_locked();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<InFlightCollective> in_flight;
  for (const BucketState& b : buckets_) {
    if (b.work) in_flight.push_back({b.work, b.info.group.get(), "all-gather of " + b.info.what});
  }
  wait_or_abandon(in_flight, "a sharded-parameter gather (optim_grads_params)");
}

void ShardedParams::note_resident() { peak_ = std::max(peak_, resident_); }

void ShardedParams::launch_gather(int64_t u) {
  Unit& unit = units_[u];
  TORCH_INTERNAL_ASSERT(unit.state == UnitState::kReleased);
  // The gathers' own ops must not come back here (they write the bucket storages).
  const c10::impl::ExcludeDispatchKeyGuard no_use(kUseMode);
  for (int64_t b : unit.buckets) {
    BucketState& bucket = buckets_[b];
    grow_storage(bucket.full, bucket.nbytes);
    resident_ += bucket.nbytes;
    if (skip_collective(*bucket.info.group)) {
      bucket.full.copy_(bucket.shard);  // a group of one: the shard is the bucket
      continue;
    }
    bucket.work = all_gather_into(*bucket.info.group, bucket.full, bucket.shard, bucket.info.what);
  }
  note_resident();
  unit.state = UnitState::kInFlight;
  ++gathers_;
}

void ShardedParams::wait_gather(int64_t u) {
  Unit& unit = units_[u];
  const c10::impl::ExcludeDispatchKeyGuard no_use(kUseMode);
  std::exception_ptr failure;  // the first failed wait; the unit's other gathers are still waited for
  for (int64_t b : unit.buckets) {
    BucketState& bucket = buckets_[b];
    if (!bucket.work) continue;
    auto work = std::move(bucket.work);
    bucket.work.reset();
    try {
      wait_collective(work, *bucket.info.group, bucket.info.what);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) {
    // A failed gather (a peer gone, a timeout) wrote nothing to trust: the unit goes back to no bytes, so that
    // nothing reads what was never written as values (a read fails instead; the error says why).
    for (int64_t b : unit.buckets) {
      release_storage(buckets_[b].full);
      resident_ -= buckets_[b].nbytes;
    }
    unit.state = UnitState::kReleased;
    unit.prefetched = false;
    std::rethrow_exception(failure);
  }
  unit.state = UnitState::kGathered;
}

void ShardedParams::release(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state == UnitState::kReleased) return;
  if (unit.state == UnitState::kInFlight) wait_gather(u);  // a collective still writes the storage
  for (int64_t b : unit.buckets) {
    release_storage(buckets_[b].full);
    resident_ -= buckets_[b].nbytes;
  }
  unit.state = UnitState::kReleased;
  unit.prefetched = false;
  unit.grads_ready = 0;
}

std::string ShardedParams::param_at(int64_t b, const at::Tensor& t) const {
  const int64_t offset = t.storage_offset();
  for (const ParamPlace& place : places_) {
    if (place.bucket == b && place.offset <= offset && offset < place.offset + place.numel) {
      return "parameter '" + place.name + "'";
    }
  }
  return "a tensor in the storage of " + buckets_[b].info.what;  // the bucket's padding
}

namespace {
std::atomic<uint64_t> ops_begun{0};  // OpScope ids, unique across threads
thread_local uint64_t current_op = 0;
}  // namespace

// Ops a kernel runs inside another op (addmm expanding its bias) share the outermost op's id: they must
// not release the units of its other arguments either.
ShardedParams::OpScope::OpScope() : previous_(current_op) {
  if (current_op == 0) current_op = ++ops_begun;
}
ShardedParams::OpScope::~OpScope() { current_op = previous_; }

void ShardedParams::use(int64_t bucket, const at::Tensor& t, const char* op, Access access) {
  const int64_t u = buckets_[bucket].unit;
  const bool backward = torch::autograd::get_current_node() != nullptr;
  Unit& unit = units_[u];
  // Between steps: no collective that only this rank would launch (Note [Sharded parameters]).
  if (!backward && scopes_open_ == 0) {
    if (access == Access::kView) return;                     // no values read
    if (unit.state == UnitState::kInFlight) wait_gather(u);  // launched by every rank (a prefetch)
    TORCH_CHECK(
        unit.state == UnitState::kGathered, "ShardedParams: ", op, " reads ", param_at(bucket, t), " (FSDP unit '",
        unit.name, "') outside a forward through DistributedDataParallel and outside backward, while ",
        "its unit is released (data_parallel_sharding_strategy 'optim_grads_params' keeps only this ",
        "rank's shards between steps). Gathering it here would be a collective that only the ranks ",
        "reading it launch: a hang, or shards mixed up with another collective. Run the module's forward ",
        "through the wrapper, read params inside DistributedDataParallel::gather_full_params() (called on ",
        "every rank), from Python through ddp.state_dict() (on every rank: whole copies), or read a checkpoint");
    return;
  }
  unit.op = current_op;
  if (unit.state == UnitState::kGathered && current_ == u && !backward) return;  // the common case: no change
  if (!backward && holds_ == 0) {
    // Note [Sharded parameters]: a forward moving to unit u releases the others in use, but not the
    // units of this op's other arguments (OpScope).
    for (int64_t other = 0; other < num_units(); ++other) {
      const bool same_op = current_op != 0 && units_[other].op == current_op;
      if (other != u && !same_op && units_[other].state == UnitState::kGathered) release(other);
    }
  }
  if (unit.state == UnitState::kReleased) launch_gather(u);
  if (unit.state == UnitState::kInFlight) {
    if (unit.prefetched) ++prefetch_hits_;
    unit.prefetched = false;
    wait_gather(u);
  }
  current_ = u;
  if (!backward && !used_in_forward_[u]) {
    used_in_forward_[u] = true;
    forward_use_order_.push_back(u);
  }
  const int64_t next = next_unit(u, backward);
  if (next >= 0 && units_[next].state == UnitState::kReleased) {
    launch_gather(next);
    units_[next].prefetched = true;
  }
}

int64_t ShardedParams::next_unit(int64_t u, bool backward) const {
  // The last whole forward's order of first uses, when u was in it; else registration order.
  const int64_t step = backward ? -1 : 1;
  if (position_[u] < 0) return u + step >= 0 && u + step < num_units() ? u + step : -1;
  const int64_t p = position_[u] + step;
  return p >= 0 && p < static_cast<int64_t>(order_.size()) ? order_[p] : -1;
}

void ShardedParams::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_all_locked();
  if (holds_ > 0) gather_all_locked();  // inside gather_full_params(): the new shards, whole
}

void ShardedParams::release_after_use() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (holds_ == 0) release_all_locked();
}

void ShardedParams::hold_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++holds_;
  gather_all_locked();
}

void ShardedParams::end_hold() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(holds_ > 0, "ShardedParams: end_hold() without hold_all()");
  if (--holds_ == 0) release_all_locked();
}

void ShardedParams::leave_whole(const std::vector<at::Tensor>& params) {
  std::lock_guard<std::mutex> lock(mutex_);
  gather_all_locked();
  const c10::impl::ExcludeDispatchKeyGuard no_use(kUseMode);  // the copies are plain tensors
  c10::NoGradGuard no_grad;
  for (const at::Tensor& param : params) {
    if (!param.has_storage() || bucket_of_storage_.count(param.storage().unsafeGetStorageImpl()) == 0) continue;
    param.set_data(param.detach().clone());
  }
  release_all_locked();
}

void ShardedParams::release_all_locked() {
  for (int64_t u = 0; u < num_units(); ++u) release(u);
  current_ = -1;
}

void ShardedParams::gather_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  gather_all_locked();
}

void ShardedParams::gather_all_locked() {
  for (int64_t u = 0; u < num_units(); ++u) {
    if (units_[u].state == UnitState::kReleased) launch_gather(u);
  }
  for (int64_t u = 0; u < num_units(); ++u) {
    if (units_[u].state == UnitState::kInFlight) wait_gather(u);
    units_[u].prefetched = false;
  }
}

void ShardedParams::grad_ready(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& unit = units_[unit_of_param_[param]];
  if (++unit.grads_ready < unit.num_params || holds_ > 0) return;
  release(unit_of_param_[param]);  // its last gradient of this backward: no op of it is left
  if (current_ == unit_of_param_[param]) current_ = -1;
}

std::vector<at::Tensor> ShardedParams::use_units_of(const std::vector<at::Tensor>& tensors, const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> used;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const auto it = bucket_of_storage_.find(t.storage().unsafeGetStorageImpl());
    if (it == bucket_of_storage_.end()) continue;  // not a param (an activation, a frozen param)
    use(it->second, t, what, Access::kRead);
    used.push_back(t);
  }
  return used;
}

int64_t ShardedParams::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return resident_;
}

int64_t ShardedParams::peak_resident_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void ShardedParams::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = resident_;
}

int64_t ShardedParams::shard_bytes() const {
  int64_t bytes = 0;
  for (const BucketState& b : buckets_) bytes += static_cast<int64_t>(b.shard.nbytes());
  return bytes;
}

int64_t ShardedParams::whole_bytes() const {
  int64_t bytes = 0;
  for (const BucketState& b : buckets_) bytes += b.nbytes;
  return bytes;
}

int64_t ShardedParams::largest_unit_bytes() const {
  int64_t largest = 0;
  for (const Unit& unit : units_) {
    int64_t bytes = 0;
    for (int64_t b : unit.buckets) bytes += buckets_[b].nbytes;
    largest = std::max(largest, bytes);
  }
  return largest;
}

int64_t ShardedParams::gathers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gathers_;
}

int64_t ShardedParams::prefetch_hits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return prefetch_hits_;
}

bool ShardedParams::on_use(const at::Tensor& t, const char* op, Access access) {
  // No lock: Note [Finding a bucket's storage without a lock].
  const StorageIndex* index = current_index();
  if (index == nullptr) return false;
  if (!t.defined() || !t.has_storage()) return true;
  const StorageIndex::Entry* entry = index->find(t.storage().unsafeGetStorageImpl());
  ShardedParams* owner = entry != nullptr ? entry->owner : nullptr;
  const int64_t bucket = entry != nullptr ? entry->bucket : -1;
  // Not under registry_mutex: a gather waits for the other ranks, which may be threads of this process.
  if (owner != nullptr) {
    std::lock_guard<std::mutex> lock(owner->mutex_);
    TORCH_CHECK(access != Access::kWrite, "ShardedParams: ", op, " writes ", owner->param_at(bucket, t),
                " (FSDP unit '", owner->units_[owner->buckets_[bucket].unit].name,
                "') in place under data_parallel_sharding_strategy ",
                "'optim_grads_params': its values are a gathered copy of the shards, so the write would be lost when ",
                "the unit is released, and backward would gather the old values again. Change params through the ",
                "DistributedOptimizer or a checkpoint load; compute a modified copy in forward instead (w * 2, not ",
                "w.mul_(2)); or use 'optim'");
    owner->use(bucket, t, op, access);
  }
  return true;
}

ShardedParams::UseScope::UseScope(ShardedParams* params, bool forward) : params_(params), forward_(forward) {
  if (params_ == nullptr) return;
  c10::impl::tls_set_dispatch_key_included(kUseMode, true);  // and left on: Note [Sharded parameters]
  std::lock_guard<std::mutex> lock(params_->mutex_);
  ++params_->scopes_open_;
  if (!forward_) return;
  for (Unit& unit : params_->units_) unit.grads_ready = 0;
  params_->used_in_forward_.assign(params_->units_.size(), false);
  params_->forward_use_order_.clear();
}

ShardedParams::UseScope::~UseScope() {
  if (params_ == nullptr) return;
  {  // this forward's order of first uses: the next prefetches follow it (Note [Sharded parameters])
    std::lock_guard<std::mutex> lock(params_->mutex_);
    --params_->scopes_open_;
    if (forward_ && !params_->forward_use_order_.empty()) {
      params_->order_ = params_->forward_use_order_;
      params_->position_.assign(params_->units_.size(), -1);
      for (size_t p = 0; p < params_->order_.size(); ++p)
        params_->position_[params_->order_[p]] = static_cast<int64_t>(p);
    }
  }
  try {
    params_->release_after_use();
  } catch (...) {  // a failed gather: the forward's own error is the one to see
  }
}

}  // namespace meshddp
