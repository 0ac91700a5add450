// The bucket collectives of a step: launched in bucket order as buckets fill (or all at
// finish_grad_sync()), waited for in the same order, with the cross-instance all-reduce of
// hierarchical ZeRO-1 chained in the wait. Part of GradBuffer (grad_buffer.h); construction, hooks
// and the step's bookkeeping are in grad_buffer.cpp.
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"

#include <c10/util/Exception.h>

#include <string>

namespace meshddp {

void GradBuffer::launch_ready_buckets_in_order() {
  while (next_bucket_ < static_cast<int64_t>(buckets_.size()) && buckets_[next_bucket_].pending == 0) {
    launch_bucket(next_bucket_++);
    ++launched_by_hooks_;
  }
}

void GradBuffer::launch_bucket(int64_t b) {
  Bucket& bucket = buckets_[b];
  TORCH_INTERNAL_ASSERT(!bucket.launched, "bucket ", b, " launched twice");
  if (shards_grads_ && !bucket.storage.defined()) acquire_bucket_storage(b);  // got no gradient: zeros
  zero_stale_slots_of_bucket(b);  // params that got no gradient this step contribute zeros
  at::Tensor data = bucket_data(b);
  // The local values (the collective replaces them), or what the hook sends instead (its cast:
  // launch_reduction). The counts are members, on the current stream, which the collective's stream
  // waits for at launch (Note [Stream lifetimes of collective temporaries], comm_hook.h).
  if (counts_nonfinite()) count_nonfinite(b, data);
  const BucketReduction& r = bucket.reduction;
  // Pre-divided by the whole DP (x CP) size, every kind of bucket, also where its group has one rank
  // and no collective runs (an expert-DP group of one at EP = DP: Note [Expert gradient scale]).
  if (r.divisor > 1) data.div_(static_cast<double>(r.divisor));
  bucket.launched = true;
  state_ = StepState::kReducing;
  if (r.tied_group) return launch_tied_sum(b, data);  // its DP reduction follows in the wait
  launch_reduction(b);
}

void GradBuffer::launch_reduction(int64_t b) {
  Bucket& bucket = buckets_[b];
  const BucketReduction& r = bucket.reduction;
  at::Tensor data = bucket_data(b);
  CommHookBucket hooked{b, data, data, false, nullptr, bucket_description(b), {}};
  if (counts_nonfinite()) hooked.count_sent = [this, b](const at::Tensor& sent) { count_nonfinite(b, sent); };
  if (r.tp_partial) {
    // Partial over TP: one all-reduce over the whole mesh sums over TP and, pre-divided, averages
    // over DP. The whole bucket is then valid (the optimizer reads its shard of it).
    if (debug_sequence_) check_collective_sequence(b, *r.group, "all-reduce (TP-partial)");
    hooked.group = r.group.get();
    hooked.what += " (TP-partial: summed over TP)";
  } else if (!skip_collective(*r.group)) {
    if (debug_sequence_) {
      check_collective_sequence(b, *r.group, config_.use_distributed_optimizer ? "reduce-scatter" : "all-reduce");
    }
    hooked.group = r.group.get();
    if (config_.use_distributed_optimizer) hooked.output = reduced_shard(b), hooked.reduce_scatter = true;
  }
  if (hooked.group != nullptr) {
    CommHookWork launched = comm_hook_->launch(hooked);
    bucket.work = std::move(launched.work);
    bucket.finish = std::move(launched.finish);
  }
}

// Note [Hierarchical ZeRO-1]
// With K optimizer instances (Megatron's num_distributed_optimizer_instances) a bucket, pre-divided
// by the whole D, is reduce-scattered within this rank's instance (D/K ranks) by the comm hook, as a
// flat ZeRO-1 bucket is; its shard then holds the instance's partial sum. Once that reduce-scatter
// and the hook's write-back are done, the shard is SUM all-reduced over the K ranks at the same
// position in each instance: every instance then holds the D-mean, sharded 1/(D/K). The all-reduce
// must start after the reduce-scatter completes on this bucket, so it is chained here, in the wait
// (bucket order, like the launches, hence the same order on every rank): bucket b's all-reduce runs
// while bucket b+1's reduce-scatter is waited for. It sums in the buffer's dtype whatever the comm
// hook (a compression hook compresses the intra-instance reduce-scatter only). TP-partial buckets,
// all-reduced over the whole mesh, need no second step. Expert buckets are split into instances too
// (as Megatron-core's intra-instance expert-DP group): reduce-scattered over this instance's expert-DP
// ranks (SyncGroups::expert_instance, expert-DP / K of them), then all-reduced across the instances
// over the same K-rank group as dense buckets (its ranks hold the same experts).
void GradBuffer::wait_launched_buckets() {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.tied_work) finish_tied_sum(static_cast<int64_t>(b));  // then launches its DP reduction
    if (bucket.work) {
      auto work = std::move(bucket.work);
      bucket.work.reset();
      wait_collective(work, *bucket.reduction.group, bucket_description(static_cast<int64_t>(b)));
    }
    if (bucket.finish) {
      auto finish = std::move(bucket.finish);
      bucket.finish = nullptr;
      finish();
    }
    if (bucket.launched && bucket.reduction.cross_group && !skip_collective(*bucket.reduction.cross_group)) {
      if (debug_sequence_) {
        check_collective_sequence(static_cast<int64_t>(b), *bucket.reduction.cross_group,
                                  "all-reduce (across instances)");
      }
      bucket.cross_work = all_reduce_sum(*bucket.reduction.cross_group, reduced_shard(static_cast<int64_t>(b)),
                                         bucket_description(static_cast<int64_t>(b)) + " across optimizer instances");
    }
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (!bucket.cross_work) continue;
    auto work = std::move(bucket.cross_work);
    bucket.cross_work.reset();
    wait_collective(work, *bucket.reduction.cross_group,
                    bucket_description(static_cast<int64_t>(b)) + " across optimizer instances");
  }
}

void GradBuffer::finish_grad_sync() {
  check_trainable_params_unchanged("finish_grad_sync()");
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == StepState::kSynced) return;
  // Note [A last micro-batch reduced as a non-last one]: nothing arrived since that flush, so the step's
  // gradients are all in the shards; one more round of reduce-scatters would be one the other ranks skip.
  const bool all_reduced =
      shards_grads_ && !is_last_microbatch_ && state_ == StepState::kIdle && microbatches_reduced_ > 0;
  const bool final_round = !all_reduced;
  while (final_round && next_bucket_ < static_cast<int64_t>(buckets_.size())) launch_bucket(next_bucket_++);
  if (shards_grads_) {
    complete_launched_buckets();  // Note [Sharded gradients]: into the shards, blocks back to the pool
    flush_queued_ = false;
    if (debug_sequence_) check_microbatch_reductions_agree(microbatches_reduced_ + (final_round ? 1 : 0));
  } else {
    wait_launched_buckets();
  }
  for (Slot& slot : slots_) slot.ready = true;
  state_ = StepState::kSynced;
  ++syncs_completed_;
  if (config_.check_for_nan_in_grad) raise_if_nonfinite();
}

void GradBuffer::check_collective_sequence(int64_t b, c10d::ProcessGroup& group, const char* kind) {
  // Every rank of `group` says which collective it is about to launch; all must say the same.
  std::string mine = std::to_string(b) + " " + kind + " " + std::to_string(layout_.buckets[b].numel()) + " " +
                     c10::toString(layout_.buffers[layout_.buckets[b].buffer].key.grad_dtype) + " " +
                     comm_hook_->name();
  if (shards_grads_) mine += ", micro-batch reduction " + std::to_string(microbatches_reduced_) + " of the step";
  check_same_on_group(group, mine, layout_.buffers[layout_.buckets[b].buffer].key.device,
                      "the MESHDDP_DEBUG_SYNC check of " + bucket_description(b));
}

// Note [A last micro-batch reduced as a non-last one]
//   Under "optim_grads" each backward of a non-last micro-batch ends with a round of reduce-scatters
//   (Note [Sharded gradients]), so ranks must run as many backward passes per step. A rank that never
//   marks its last micro-batch as the last (every backward under no_sync(), then finish_grad_sync()) has
//   run its last round at the end of that backward, as a rank that marks it runs it in that backward:
//   finish_grad_sync() launches nothing more for it ("optim" and "no_shard", which communicate once per
//   step, are indifferent to this). Debug mode compares each rank's count of rounds at the end of the
//   step: a rank with one more backward (two backward calls in a micro-batch, a micro-batch skipped on
//   one rank) is named there instead of hanging in a reduce-scatter the others never launch.
void GradBuffer::check_microbatch_reductions_agree(int64_t reductions) {
  if (buckets_.empty() || skip_collective(*buckets_[0].reduction.group)) return;
  check_same_on_group(*buckets_[0].reduction.group,
                      "end of step after " + std::to_string(reductions) + " micro-batch reduction(s)",
                      layout_.buffers[layout_.buckets[0].buffer].key.device,
                      "the MESHDDP_DEBUG_SYNC check of the step's micro-batch reductions (optim_grads)");
}

void GradBuffer::check_same_on_group(c10d::ProcessGroup& group, const std::string& mine, c10::Device device,
                                     const std::string& what) {
  const auto all = all_gather_strings(group, mine, what, device);
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r] == all[0], "GradBuffer (MESHDDP_DEBUG_SYNC): the bucket collectives diverge across ranks of ",
                describe_group(group), ": rank 0 launches [bucket index, kind, numel, dtype, comm hook] = [", all[0],
                "] while rank ", r, " launches [", all[r], "]. Ranks must build the same model and DdpConfig, ",
                "register the same comm hook, and run the same backward sequence (same micro-batch settings, ",
                "no_sync() on every rank alike; under optim_grads the same number of backward passes per step, ",
                "each of which reduce-scatters)");
  }
}

}  // namespace meshddp
