// GradBuffer: the flat gradient buffers of a set of parameters, their buckets, the autograd hooks
// that fill them, and the bucket collectives over the data-parallel group. One instance per wrapped
// model. It owns no optimizer and no module: it sees parameters and a DP process group. ZeRO-1's
// param buffer and all-gather: grad_buffer/param_buffer.h (owned here, built with the layout).
// Note [One step, as GradBuffer sees it]
//   zero_grad_buffer()          state: idle; every slot 0 or stale (Note [Slots written in place]);
//                               param.grad() is its slot's view
//   backward (micro-batches)    gradients enter the slots (the first overwrites a stale slot, later ones
//                               accumulate); only on the last micro-batch does a
//                               hook mark its param ready (state: reducing). A bucket whose params
//                               are all ready is ready; ready buckets launch strictly in bucket index
//                               order (overlap on), so every rank issues the same collectives in the
//                               same order whatever order its hooks fire in.
//   finish_grad_sync()          launches, in order, every bucket not yet launched (a param that got
//                               no gradient contributes its slot as it is: zeros, or what earlier
//                               micro-batches accumulated), waits for all (state: synced).
// With gradient_accumulation_fusion, layers may write gradients straight into their slots, and
// zero_grad_buffer() leaves those slots to be overwritten: see Note [Slots written in place].
// Each bucket is pre-divided by the DP size and SUM-reduced over its reduction group: a DP mean on
// every backend (Gloo has no AVG), exact for power-of-two sizes. With
// use_distributed_optimizer the collective is a reduce-scatter into this rank's shard of the bucket;
// the rest of the bucket is then scratch. Reduction groups: dense params over DP (x CP), expert (MoE)
// params over the expert-data-parallel group, in buffers and buckets of their own (Note [Bucket
// layout]; BucketReduction below). Hierarchical ZeRO-1 (num_distributed_optimizer_instances = K, dense
// buckets): still pre-divided by the whole D; reduce-scattered within the instance, then the shard
// all-reduced across instances once its reduce-scatter (and comm hook write-back) is done: Note
// [Hierarchical ZeRO-1] in bucket_sync.cpp.
#pragma once

#include "../mesh/placement.h"
#include "bucket_layout.h"
#include "bucket_reduction.h"
#include "bucket_storage_pool.h"
#include "comm_hook.h"
#include "grad_buffer_config.h"
#include "grad_buffer_handle.h"
#include "grad_in_place.h"
#include "named_param.h"
#include "nonfinite_count.h"
#include "param_buffer.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace meshddp {

// Counters of a GradBuffer, for tests, benchmarks and reports.
struct SyncStats {
  int64_t syncs_completed = 0;            // steps that completed finish_grad_sync() since construction
  int64_t buckets_launched = 0;           // this step (reset by zero_grad_buffer())
  int64_t buckets_launched_by_hooks = 0;  // of those, launched during backward (overlap at work)
  int64_t grads_written_in_place = 0;     // params whose gradient was written in place this step
  int64_t grads_accumulated = 0;          // params that got a gradient since zero_grad_buffer() (no_sync() too)
};

class GradBuffer {
 public:
  // Lays out `params` (registration order; only the trainable ones: requires_grad; a tensor listed
  // under several names once, see deduplicate_params), allocates one
  // zeroed flat buffer per (param dtype, grad dtype, device), points each param's grad at its slot
  // (same dtype) and installs the hooks. `dp_group` is the group the buckets are reduced over.
  // Which params train is fixed here: freezing or unfreezing one later makes zero_grad_buffer() and
  // finish_grad_sync() throw naming it (re-wrap the model after changing requires_grad). Params
  // must be dense tensors with storage (not sparse, not on the meta device): an error names any other.
  GradBuffer(std::vector<NamedParam> params, c10::intrusive_ptr<c10d::ProcessGroup> dp_group, GradBufferConfig config);
  // Same, with the TP-aware groups (placements are read from the registry, mesh/placement.h).
  GradBuffer(std::vector<NamedParam> params, SyncGroups groups, GradBufferConfig config);
  // Replaces the communication hook (the config's comm_hook until then) with `hook`, PyTorch DDP's
  // register_comm_hook. Call between steps, with the same kind of hook on every rank: the hook's
  // collectives must match across ranks. Throws if a step's gradient sync has begun.
  void register_comm_hook(std::shared_ptr<CommHook> hook);
  const CommHook& comm_hook() const { return *comm_hook_; }

  // Removes the hooks; waits for collectives still in flight (they write into the buffers).
  ~GradBuffer();
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  // false: backward only accumulates into the buffer (micro-batches before the last); true (default):
  // backward marks params ready and, with overlap, launches buckets. Set before backward.
  void set_is_last_microbatch(bool is_last);
  bool is_last_microbatch() const;

  // Launches every bucket not launched yet, in order, then waits for all. Afterwards each slot holds
  // the DP mean. Call once per step, after the last backward; calling it again is a no-op.
  void finish_grad_sync();
  // Launches now, in bucket order, every bucket not launched yet (a param that got no gradient
  // contributes its slot as it is), without waiting: a pipeline schedule starts a chunk's sync after
  // its last backward micro-batch, whatever set_is_last_microbatch() says. A gradient that arrives
  // afterwards in this step is an error naming the param. No-op once the step's sync finished.
  void start_grad_sync();
  // Multiplies every flat gradient buffer by `factor` (not param.grad(): with fp32 main grads or
  // ZeRO-1 that is not where the optimizer reads). Between micro-batches, or after
  // finish_grad_sync() and before the optimizer step; throws while a bucket collective is in flight.
  void scale_gradients(double factor);
  // Whether this step's sync has finished (finish_grad_sync() ran since zero_grad_buffer()), and
  // whether it has begun (a bucket launched or a param reported ready).
  bool grad_sync_finished() const;
  bool grad_sync_started() const;

  // Zeroes the buffers and resets bucket state for the next step. Throws if bucket collectives are
  // in flight (finish_grad_sync() first): zeroing under a running collective corrupts it. Slots whose
  // gradient a layer wrote in place (write_grad_in_place) in the last step are not zeroed but marked stale: the next
  // write overwrites them, and a slot still stale when its bucket launches is zeroed then (a param that got no
  // gradient). Until its param's first gradient of the step, such a slot (and param.grad(), its view) still reads the
  // last step's values.
  void zero_grad_buffer();

  // Throws, naming the params that have not reported a gradient, if this step's sync has begun but
  // finish_grad_sync() has not run. `who` names the caller in the message.
  void check_no_sync_pending(const char* who) const;

  // The main gradient of param `index` (registration order among trainable params): a view into its
  // flat buffer, shaped like the param (fp32 with grad_reduce_in_fp32). Under "optim_grads" there is no
  // whole gradient after the sync (a rank keeps its shard of each bucket: bucket_shard()): throws
  // naming the param.
  const at::Tensor& main_grad(int64_t index) const;
  // The dtype of param `index`'s main gradient (under every strategy).
  c10::ScalarType main_grad_dtype(int64_t index) const;
  const Placement& placement(int64_t index) const { return slots_[index].placement; }
  // Flat grad buffer `i` (one per BucketLayout::buffers entry; undefined under "optim_grads", which
  // holds no whole buffer), and the bytes of the gradient storage this rank holds: the flat buffers,
  // or under "optim_grads" its shards plus the pooled bucket-sized buffers allocated so far.
  const at::Tensor& buffer(int64_t i) const { return buffers_[i]; }
  int64_t grad_buffer_bytes() const;
  // This rank's shard of bucket `b` (valid after finish_grad_sync() with the distributed optimizer):
  // 1/DP, 1/expert-DP for expert buckets, 1/(D/K) within its instance with K optimizer instances
  // (bucket_reduction(b)). Under "optim_grads" a view of the persistent shard buffer (the same tensor
  // every step), which accumulates the step's micro-batches.
  at::Tensor bucket_shard(int64_t b) const;
  const BucketReduction& bucket_reduction(int64_t b) const { return buckets_[b].reduction; }
  // Whether param `index` is an expert param (reduced over groups().expert_dp).
  bool is_expert(int64_t index) const;
  // With the distributed optimizer: the flat param buffer of which every param is a view, and its
  // all-gather (grad_buffer/param_buffer.h). Null otherwise.
  ParamBuffer* param_buffer() const { return param_buffer_.get(); }

  // Per bucket, the number of non-finite values in this rank's local gradient when the bucket was
  // launched (before the collective), as an int64 tensor on the buffer's device (no host sync). With
  // the distributed optimizer only; zeros for buckets not launched this step.
  at::Tensor local_nonfinite_counts() const;
  // The same counts by param (index in params(); 0 for params of buckets not launched this step),
  // on the host: one copy from the device, for reports. With the distributed optimizer or
  // check_for_nan_in_grad.
  std::vector<int64_t> local_nonfinite_counts_by_param() const;
  const SyncGroups& groups() const { return groups_; }
  const BucketLayout& layout() const { return layout_; }
  const std::vector<NamedParam>& params() const { return params_; }
  const GradBufferConfig& config() const { return config_; }
  SyncStats stats() const;

  // Called by the autograd hook of param `index` once its gradient has been accumulated.
  void on_grad_accumulated(int64_t index);
  // For a param whose gradient is added into its slot by someone other than its own AccumulateGrad
  // (e.g. a DTensor param's, whose .grad wraps the slot of its local tensor; the caller then calls
  // on_grad_accumulated() itself): zero_grad_buffer() zeroes its slot every step, since no hook of
  // this buffer sees that gradient arrive to overwrite a stale slot.
  void zero_slot_every_step(int64_t index);

  // Marks ready (gradient 0 this step) every param whose gradient accumulator cannot be reached from
  // `outputs`' autograd graph, launching buckets that thereby complete. Only on the last
  // micro-batch, and only when some output requires grad (an evaluation forward, e.g. under
  // NoGradGuard, has no graph and leaves the sync state alone); a no-op otherwise. Returns how many
  // params were marked.
  int64_t mark_unreachable_params_ready(const std::vector<at::Tensor>& outputs);

 private:
  struct AccumulationPreHook;  // calls before_grad_accumulation()
  friend at::Tensor meshddp::write_grad_in_place(const at::Tensor&, GradSlotWriter, SlotDtypes);

  enum class StepState { kIdle, kReducing, kSynced };
  // A trainable param's slot: fixed at construction, then its state in this step.
  struct Slot {
    at::Tensor main_grad;  // a view into its flat buffer, shaped like the param
    Placement placement;
    at::Tensor grad_placeholder;  // a zero of its shape (expanded scalar), or undefined: see write_grad_in_place()
    std::shared_ptr<torch::autograd::Node> accumulator;  // the param keeps only a weak_ptr to it
    uintptr_t post_hook_key = 0;
    bool zero_every_step = false;  // see zero_slot_every_step()
    bool ready = false;            // reported its gradient on the last micro-batch (or marked unused)
    // Note [Slots written in place] (grad_in_place.cpp): the slot holds stale data (not zeroed; the
    // next write overwrites it); the param got a gradient since zero_grad_buffer() (so the next
    // zero_grad_buffer() leaves its slot stale); that gradient was written in place.
    bool stale = false;
    bool got_grad = false;
    bool written_in_place = false;
  };
  // Per bucket, with the distributed optimizer or check_for_nan_in_grad: its pieces
  // (nonfinite_count.h) and their offsets on the buffer's device, set once; this step's count per
  // piece and in all (device tensors; undefined until the bucket launches).
  struct BucketNonfinite {
    NonfinitePieces pieces;
    at::Tensor offsets;
    at::Tensor piece_counts;
    at::Tensor total;
  };
  // A bucket: how it is reduced, fixed at construction, then its state in this step.
  struct Bucket {
    BucketReduction reduction;
    BucketNonfinite nonfinite;
    int64_t pending = 0;  // params not yet ready
    bool launched = false;
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> finish;               // the comm hook's write-back, run after `work`
    c10::intrusive_ptr<c10d::Work> cross_work;  // hierarchical ZeRO-1: the all-reduce over reduction.cross_group
    c10::intrusive_ptr<c10d::Work> tied_work;   // tied across stages: the sum over reduction.tied_group
    // "optim_grads": the pooled block holding the whole bucket while it is filled and reduced (undefined
    // otherwise), its first numel() elements (bucket_data()), and the non-finite counts of this step's
    // earlier micro-batches.
    at::Tensor storage_block;
    at::Tensor storage;
    at::Tensor carried_counts;
  };

  // Called before autograd accumulates into param `index` during a backward with create_graph=true
  // (grad mode on), where AccumulateGrad would replace .grad by `.grad + new` out of place: .grad is
  // released so that it receives only the new gradient, which on_grad_accumulated() adds into the
  // slot. Without this, the slot's earlier micro-batches would be counted twice.
  // Also (a pre-hook on AccumulateGrad, so before autograd touches .grad): takes out the placeholder
  // that write_grad_in_place() handed out (the gradient is already in the slot), and, when the slot
  // is stale, releases .grad so that on_grad_accumulated() overwrites the slot instead of adding.
  // Returns the gradients AccumulateGrad is to see.
  std::vector<at::Tensor> before_grad_accumulation(int64_t index, std::vector<at::Tensor> grads);
  // See grad_buffer/grad_in_place.h: calls `write` with param `index`'s slot and returns the
  // placeholder gradient, or returns an undefined tensor (and calls nothing) when the gradient cannot
  // go in place. Called from a layer's backward, before the param's hook.
  at::Tensor write_grad_in_place(int64_t index, GradSlotWriter write);

  void install_hooks();
  void remove_hooks();
  void launch_ready_buckets_in_order();  // mutex held
  void launch_bucket(int64_t b);         // mutex held
  void launch_reduction(int64_t b);      // mutex held: bucket b's collective over its group (comm hook)
  // tied_params.cpp, mutex held: a bucket of params tied across pipeline stages is first summed over
  // the embedding group (launched by launch_bucket), then, once that is done, reduced over DP.
  void launch_tied_sum(int64_t b, const at::Tensor& data);
  void finish_tied_sum(int64_t b);
  void wait_launched_buckets();  // mutex held
  void reset_step_state();       // mutex held
  void point_grads_at_buffer();
  void zero_stale_slots_of_bucket(int64_t b);  // mutex held
  void zero_slots_for_next_step();             // mutex held; zero_grad_buffer()'s fill
  at::Tensor bucket_data(int64_t b) const;     // bucket b's range of its flat grad buffer, padding included
  at::Tensor reduced_shard(int64_t b) const;   // this rank's part of bucket_data(b): the reduce-scatter's output
  // grad_shards.cpp, "optim_grads" (Note [Sharded gradients]); mutex held unless said otherwise.
  void build_grad_shards();                // constructor: the shard buffers and the pool
  void acquire_bucket_storage(int64_t b);  // a pooled block for bucket b, zeroed; slots pointed at it
  void complete_bucket(int64_t b);         // wait, add the reduced shard into the shard buffer, release
  void complete_launched_buckets();        // complete_bucket() of every launched bucket, in order
  void queue_microbatch_flush();           // at the end of this backward: flush_microbatch()
  void flush_microbatch();                 // mutex NOT held: launch the rest, complete all, reset for the next
  void reset_microbatch_state();
  // sharded_params_setup.cpp, "optim_grads_params": the FSDP units of params_ (config's
  // fsdp_unit_modules).
  FsdpUnits fsdp_units() const;
  std::string bucket_description(int64_t b) const;
  void check_collective_sequence(int64_t b, c10d::ProcessGroup& group, const char* kind);  // debug mode
  // Debug mode, "optim_grads": every rank ends the step after as many micro-batch reductions.
  void check_microbatch_reductions_agree(int64_t reductions);
  void check_same_on_group(c10d::ProcessGroup& group, const std::string& mine, c10::Device device,
                           const std::string& what);
  std::string unready_param_names(size_t limit) const;
  // Throws naming `p` (an expert param) if this buffer has no expert-DP group, or if its gradient is TP-partial.
  // Throws naming the param if one was frozen (requires_grad_(false)) or unfrozen since construction:
  // the layout (which params have a slot) is fixed at construction. `who` names the caller.
  void check_trainable_params_unchanged(const char* who) const;
  // nonfinite_check.cpp, mutex held: whether buckets are counted, the count of bucket b's local
  // gradient (at its launch), this step's counts by param, and check_for_nan_in_grad's agreement and
  // error after the sync.
  bool counts_nonfinite() const { return config_.use_distributed_optimizer || config_.check_for_nan_in_grad; }
  void count_nonfinite(int64_t b, const at::Tensor& values);  // values: bucket b's data, or what a hook sends
  std::vector<int64_t> nonfinite_by_param() const;
  void raise_if_nonfinite();

  std::vector<NamedParam> params_;
  std::vector<NamedParam> frozen_params_;  // given but not trainable at construction (no slot)
  SyncGroups groups_;
  GradBufferConfig config_;
  int64_t dp_size_ = 1;
  BucketLayout layout_;
  std::vector<at::Tensor> buffers_;
  std::vector<Slot> slots_;  // per param
  std::unique_ptr<ParamBuffer> param_buffer_;
  // "optim_grads" (config_.shards_grads()): per flat buffer, this rank's shards of its buckets, one after
  // the other; per bucket, its view of them (bucket_shard()); the pool of whole-bucket blocks.
  bool shards_grads_ = false;
  std::vector<at::Tensor> shard_buffers_;
  std::vector<at::Tensor> grad_shards_;
  BucketStoragePool storage_pool_;
  std::shared_ptr<CommHook> comm_hook_;
  const bool debug_sequence_;  // MESHDDP_DEBUG_SYNC=1 or TORCH_DISTRIBUTED_DEBUG=DETAIL

  mutable std::mutex mutex_;
  StepState state_ = StepState::kIdle;
  bool is_last_microbatch_ = true;
  std::vector<Bucket> buckets_;
  int64_t next_bucket_ = 0;
  int64_t next_to_complete_ = 0;      // "optim_grads": buckets before it are reduced into their shards
  bool flush_queued_ = false;         // "optim_grads": this backward's flush_microbatch() is queued
  int64_t microbatches_reduced_ = 0;  // "optim_grads": micro-batches of this step flushed into the shards
  int64_t launched_by_hooks_ = 0;
  int64_t syncs_completed_ = 0;
  // Autograd has no way to remove a pre-hook: the ones this buffer adds hold this flag, cleared by
  // the destructor, and do nothing once it is false.
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
};

}  // namespace meshddp
