// ShardedParams: the params of a GradBuffer under the "optim_grads_params" sharding strategy (ZeRO-3):
// this rank's shard of every bucket (persistent, what the DistributedOptimizer steps), and each
// bucket's whole storage, whose bytes exist only while its FSDP unit is in use. Gathering on use,
// prefetching and releasing live here; the bucket layout (units never share a bucket) is
// bucket_layout.h's, the units fsdp_units.h's. Not the gradients: those are ZeRO-2's (grad_shards.cpp).
//
// Note [Sharded parameters]
//   Storage. Each bucket's params are views of one tensor of its own (`full`, padding included); its
//   StorageImpl is kept for good, and releasing the unit sets its bytes to none (as FSDP2 resizes its
//   storages to 0): params, the views ops took of them and the tensors autograd saved all keep
//   pointing at that StorageImpl, so once the unit is gathered again (the bytes re-grown and the
//   bucket all-gathered from the shards) they read its values again. A rank's resident param storage
//   is therefore its shards plus the units in use (resident_bytes()).
//   Gather on use. LibTorch modules have no forward pre-hooks (Note [Waiting for parameters in forward
//   without module hooks], param_gather.h), so the same thread-local dispatch mode intercepts every
//   op: an argument whose StorageImpl is a released (or still gathering) bucket's makes the op wait
//   for its whole unit first. The mode is turned on by the first forward through
//   DistributedDataParallel (UseScope) and stays on in that thread while a ShardedParams lives; the
//   autograd engine carries the thread's dispatch state into backward (GraphTask's ThreadLocalState),
//   so backward's ops that read saved params gather them the same way (tested: the backward of a
//   released unit reads gathered values, sharded_params_test.cpp).
//   Order. In forward, using unit u releases every other gathered unit but those of the same op's other
//   arguments (OpScope: a tied weight with its own bias) (a forward moves from unit to
//   unit; a unit used again later, such as an embedding tied to the output layer, is gathered again)
//   and prefetches the unit after u: its all-gathers are launched, and waited for only when an op
//   reads it. "After" follows the order of first uses that the last forward through a UseScope
//   recorded (as FSDP2 records it; before the first forward, registration order, which may differ: a
//   module may register its final norm before its blocks). The end of the forward releases every
//   unit. In backward (an op inside the autograd engine: get_current_node()), using u prefetches the
//   unit before it in that order, and a unit is released once every param of it has reported its
//   gradient this backward (GradBuffer's hook calls grad_ready()); a param that gets no gradient
//   keeps its unit until the step. The step writes the new shards and releases every unit
//   (start_param_sync()): after it no whole param exists, and the next forward gathers on use.
//   Outside forward and backward. A gather is a collective: every rank of the bucket's group must
//   launch it, in the same order. Inside a forward through DistributedDataParallel (a UseScope) or
//   backward, every rank runs the same ops; between them (logging a param on rank 0, a raw module's
//   forward on some ranks) nothing says so, and a gather only some ranks launch hangs, or pairs with
//   another collective and mixes up shards silently. So an op there that reads a released unit is
//   refused naming the param and its unit; a unit still gathered (gather_all(), or a unit whose params
//   got no gradient) is read as it is, and nothing is prefetched; a view (p.detach()) reads nothing.
//   Reads every rank makes alike (the TP replica check) open a UseScope that is not a forward.
//   Whole params on purpose. DistributedDataParallel::gather_full_params() (every rank calls it) holds
//   every unit gathered (hold_all()): forwards and backwards inside it release nothing, a step's
//   release_all() gathers the new shards at once, and the scope's end releases every unit. A module
//   outliving its wrapper: the wrapper's destructor gathers every unit and points each param at a plain
//   copy (leave_whole()), or the params would hold no bytes once this object is gone (Note [A module
//   outliving its ZeRO-3 wrapper], plugin/ddp_engine_controls.cpp, says why a copy and when not).
//   Whole matrices (shard_policy "whole_param"): the layout only re-places params within their buckets
//   so that each rank's equal (padded) shard holds whole params (Note [Whole-param ownership]); the
//   shards, the gathers and the units are the same as for byte ranges.
//   Writes. A gathered unit is a copy of the shards: an op that writes a param in place (param.mul_()
//   in forward, param.copy_() under NoGradGuard, a torch optimizer's step) would be lost when the
//   unit is released, and backward would re-gather the old values (gradients of weights the forward
//   did not use). So such an op is refused naming the param, on a thread with the mode on; the
//   shards change only through the DistributedOptimizer or a checkpoint load.
//   Compiled code reads storage without any op, so nothing above sees it: torch.compile of the wrapper
//   gathers each compiled section's units itself, before its forward and again before its backward
//   (use_units_of(); Note [Compiled sections under optim_grads_params], plugin/python/meshddp/_compiled_sections.py).
//   Cost: while a ShardedParams lives, every op on a thread with the mode on passes the mode's boxed
//   fallback, which looks up each tensor argument's storage among the live buckets without a lock (Note
//   [Finding a bucket's storage without a lock], sharded_params.cpp). Measured on CPU
//   (bench/sharded_params_dispatch_bench.cpp): ~10 ns a lookup; ~150-170 ns added to a tiny op in all,
//   most of it the fallback's boxing, not the lookup.
//   Not here: the gradient path is ZeRO-2's unchanged (reduce-scatter per bucket, per micro-batch).
#pragma once

#include "bucket_layout.h"
#include "named_param.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace meshddp {

class ShardedParams {
 public:
  struct Bucket {
    std::string what;                              // for messages
    c10::intrusive_ptr<c10d::ProcessGroup> group;  // its all-gather runs over it (DP or expert-DP)
  };
  // Copies each param of `params` (the layout's, in its order) into its bucket's storage, points the
  // param at it, keeps this rank's shard of every bucket and releases every unit. `unit_of_param` and
  // `unit_names` come from assign_fsdp_units() (the layout was built with them: one unit a bucket).
  ShardedParams(const BucketLayout& layout, std::vector<NamedParam>& params, std::vector<Bucket> buckets,
                const std::vector<int64_t>& unit_of_param, std::vector<std::string> unit_names);
  ~ShardedParams();
  ShardedParams(const ShardedParams&) = delete;
  ShardedParams& operator=(const ShardedParams&) = delete;

  // Bucket b's whole storage (no bytes while its unit is released) and this rank's shard of it.
  const at::Tensor& bucket_full(int64_t b) const { return buckets_[b].full; }
  const at::Tensor& bucket_shard(int64_t b) const { return buckets_[b].shard; }
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  const std::string& unit_name(int64_t u) const { return units_[u].name; }
  int64_t unit_of_bucket(int64_t b) const { return buckets_[b].unit; }

  // Releases every unit (waiting for gathers in flight first): after the optimizer wrote new shards,
  // or after a load. The next use gathers again.
  void release_all();
  // Gathers every unit and keeps it until the next release (to read every whole param at once).
  void gather_all();
  // DistributedDataParallel::gather_full_params(): gathers every unit and keeps every one whole, through
  // forwards and backwards, until as many end_hold() as hold_all() were called; then releases them.
  // A release_all() in between (a step wrote new shards, a load) gathers the new values again.
  void hold_all();
  void end_hold();
  // Expires when this object is destroyed: a gather_full_params() scope that outlives its wrapper (destroyed
  // inside the scope) ends without touching it.
  std::weak_ptr<const void> lifetime() const { return lifetime_; }
  // For a module outliving its wrapper: gathers every unit and points each of `params` (tensors in
  // these buckets' storages) at a plain copy of its whole value (Note [Sharded parameters]).
  void leave_whole(const std::vector<at::Tensor>& params);
  // Called once a param's gradient of this backward is in (GradBuffer's hook): releases its unit
  // when it was the unit's last.
  void grad_ready(int64_t param);
  // For code whose reads of params no op interception sees (a compiled section of the wrapped module: Note
  // [Compiled sections under optim_grads_params], plugin/python/meshddp/_compiled_sections.py): uses each of
  // `tensors` that lives in a bucket's storage as an op reading it would (its unit gathered and waited for; in
  // forward the other units released, in backward none; the next unit prefetched), and returns those tensors.
  // In forward, hold one OpScope over this call and the code's run: every unit used here, and by the ops of
  // that code the interception does see (extern kernels), is then kept until it ends. `what` names the code
  // in messages.
  std::vector<at::Tensor> use_units_of(const std::vector<at::Tensor>& tensors, const char* what);

  // Bytes of param storage this rank holds now: its shards plus the buckets of the units in use or
  // in flight; the most it held since construction or reset_peak(); the shards alone; and the bytes
  // of every bucket whole (what "optim" holds).
  int64_t resident_bytes() const;
  int64_t peak_resident_bytes() const;
  void reset_peak();
  int64_t shard_bytes() const;
  int64_t whole_bytes() const;
  // Bytes of the largest unit's buckets, whole.
  int64_t largest_unit_bytes() const;
  // Units gathered (on use or prefetched) since construction, and of those, how many a prefetch had
  // launched before their first use.
  int64_t gathers() const;
  int64_t prefetch_hits() const;

  // Open for a forward (DistributedDataParallel::forward): turns the gather-on-use mode on for this
  // thread (it stays on: backward needs it too) and releases every unit when the forward ends.
  // `forward` = false: for reads every rank makes alike outside a forward (the TP replica check):
  // units are gathered and released as in a forward, but the forward's order and its backward's
  // counts are left alone.
  class UseScope {
   public:
    explicit UseScope(ShardedParams* params, bool forward = true);
    ~UseScope();
    UseScope(const UseScope&) = delete;
    UseScope& operator=(const UseScope&) = delete;

   private:
    ShardedParams* params_ = nullptr;
    bool forward_ = true;
  };

  // What an op does with a tensor argument's values.
  enum class Access { kRead, kView, kWrite };
  // The dispatch-mode fallback's entry (param_gather.cpp): gathers `t`'s unit if `t` lives in a
  // released bucket of any live ShardedParams. Returns whether any ShardedParams is alive. Throws
  // when `op` writes `t` or reads it outside forward and backward while its unit is released; a view
  // taken there gathers nothing (Note [Sharded parameters]).
  static bool on_use(const at::Tensor& t, const char* op = "", Access access = Access::kRead);
  // Open by that fallback around one op's arguments: the units its arguments live in are all kept
  // while it runs (a forward moving to the unit of one argument does not release another argument's:
  // a tied weight and its own bias, `w_a + w_b` across two blocks); ops run inside it share its id.
  class OpScope {
   public:
    OpScope();
    ~OpScope();
    OpScope(const OpScope&) = delete;
    OpScope& operator=(const OpScope&) = delete;

   private:
    uint64_t previous_;
  };

 private:
  enum class UnitState { kReleased, kInFlight, kGathered };
  struct BucketState {
    at::Tensor full;
    at::Tensor shard;
    Bucket info;
    int64_t unit = 0;
    int64_t nbytes = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };
  struct Unit {
    std::string name;
    std::vector<int64_t> buckets;
    int64_t num_params = 0;
    int64_t grads_ready = 0;  // this backward
    UnitState state = UnitState::kReleased;
    bool prefetched = false;
    uint64_t op = 0;  // the OpScope that last used it (0: none)
  };
  struct ParamPlace {  // where param i lives, to name it from a tensor in its bucket's storage
    std::string name;
    int64_t bucket = 0;
    int64_t offset = 0;  // in the bucket's storage
    int64_t numel = 0;
  };
  // mutex_ held below.
  void use(int64_t bucket, const at::Tensor& t, const char* op, Access access);  // t lives in bucket's storage
  // The param of bucket b whose elements hold t's first one, named for messages.
  std::string param_at(int64_t b, const at::Tensor& t) const;
  void launch_gather(int64_t unit);
  void wait_gather(int64_t unit);
  void release(int64_t unit);
  void release_all_locked();
  void gather_all_locked();
  void release_after_use();  // a UseScope's end: every unit, unless held (hold_all())
  void note_resident();
  int64_t next_unit(int64_t u, bool backward) const;  // the unit to prefetch after u, or -1

  std::vector<BucketState> buckets_;
  std::vector<Unit> units_;
  std::vector<int64_t> unit_of_param_;
  std::vector<ParamPlace> places_;
  int64_t scopes_open_ = 0;  // UseScopes alive: a forward through the wrapper is running
  int64_t holds_ = 0;        // hold_all() not yet ended: every unit stays gathered
  std::shared_ptr<const void> lifetime_ = std::make_shared<int>(0);  // lifetime()
  std::unordered_map<const void*, int64_t> bucket_of_storage_;
  mutable std::mutex mutex_;
  int64_t resident_ = 0;
  int64_t peak_ = 0;
  int64_t gathers_ = 0;
  int64_t prefetch_hits_ = 0;
  int64_t current_ = -1;  // the unit the last op used (forward), -1 after a release of all
  // The units in the order of their first use in the last forward through a UseScope (order_, and
  // each unit's place in it or -1: position_), and that order being recorded in this forward.
  std::vector<int64_t> order_;
  std::vector<int64_t> position_;
  std::vector<bool> used_in_forward_;
  std::vector<int64_t> forward_use_order_;
};

}  // namespace meshddp
