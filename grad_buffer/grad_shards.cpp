// GradBuffer under the "optim_grads" sharding strategy (ZeRO-2): the persistent shard buffers, the
// pool of whole-bucket blocks, and the per-micro-batch flush. Part of GradBuffer (grad_buffer.h);
// the launches themselves are bucket_sync.cpp's, unchanged.
//
// Note [Sharded gradients]
//   Under "optim" every rank holds the whole flat gradient buffer; a bucket's reduce-scatter leaves
//   its mean in this rank's shard and the rest of the bucket is scratch. Under "optim_grads" there is
//   no whole buffer: per flat buffer a rank holds its shards of every bucket, one after the other
//   (shard_buffers_, 1/DP of the buffer, what DistributedOptimizer steps: bucket_shard()), and a bucket
//   is given a whole-bucket block from a pool (BucketStoragePool, one kind per flat buffer, blocks the
//   size of its largest bucket) when its first gradient of a micro-batch arrives, or at its launch.
//   Gradients are added into the block (param.grad is released after each hook: no param's .grad is
//   a view of the buffer), the bucket launches in order as before, and once its reduce-scatter is
//   waited for (with K optimizer instances, the cross-instance all-reduce too) its reduced shard is
//   added into the shard buffer and the block goes back to the pool. A bucket needing a block when
//   kBucketsInFlight blocks of its kind are in use first completes the oldest launched bucket (any
//   kind: completions stay in bucket order, as the launches, so every group sees the same sequence on
//   every rank); when no launched bucket is left to complete (buckets filled out of order) the pool
//   grows by a block. A rank's gradient storage is thus its shards plus a few buckets, not the buffer.
//   Micro-batches: every micro-batch's buckets are reduce-scattered and accumulated into the shards
//   (Megatron-FSDP's way), so that no whole bucket outlives its micro-batch: the hooks mark params
//   ready on every micro-batch, and at the end of a non-last micro-batch's backward (a callback queued
//   on the autograd engine, as torch's DDP finalizes its backward) the rest are launched and all are
//   completed. Cost: one reduce-scatter of the whole buffer per micro-batch (k per step for k
//   micro-batches; "optim" and "no_shard" communicate once per step). The DP mean stays exact: each
//   micro-batch's bucket is pre-divided by DP as before, and the shards sum the micro-batches.
//   Not supported (refused at construction): params tied across pipeline stages (their embedding-group
//   sum is chained in the wait, which would interleave with other launches on the DP group). Layers'
//   in-place gradient writes (gradient_accumulation_fusion) are not used: every gradient goes through
//   autograd. Under check_for_nan_in_grad with a compression comm hook, overflow in the reduced values
//   is not counted (the blocks are gone after the sync); what each rank sends is.
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/lazy_zeros.h"
#include "mesh/collectives.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

namespace meshddp {

namespace {
constexpr int64_t kBucketsInFlight = 2;  // blocks per kind before a new bucket waits for the oldest launched one
}  // namespace

void BucketStoragePool::add_kind(int64_t capacity, at::TensorOptions options) {
  kinds_.push_back(Kind{capacity, options, {}, 0});
}

at::Tensor BucketStoragePool::acquire(int64_t kind) {
  Kind& k = kinds_[kind];
  if (!k.free.empty()) {
    at::Tensor block = std::move(k.free.back());
    k.free.pop_back();
    return block;
  }
  ++k.allocated;
  return at::empty({k.capacity}, k.options);
}

void BucketStoragePool::release(int64_t kind, at::Tensor block) {
  TORCH_INTERNAL_ASSERT(block.defined() && block.numel() == kinds_[kind].capacity, "a foreign block given back");
  kinds_[kind].free.push_back(std::move(block));
}

int64_t BucketStoragePool::bytes() const {
  int64_t bytes = 0;
  for (const Kind& k : kinds_) {
    bytes += k.allocated * k.capacity * static_cast<int64_t>(c10::elementSize(k.options.dtype().toScalarType()));
  }
  return bytes;
}

void GradBuffer::build_grad_shards() {
  const auto num_buffers = static_cast<int64_t>(layout_.buffers.size());
  std::vector<int64_t> shard_numel(num_buffers, 0), largest(num_buffers, 0), shard_offset(buckets_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketSpan& span = layout_.buckets[b];
    const BucketReduction& r = buckets_[b].reduction;
    TORCH_INTERNAL_ASSERT(span.numel() % r.shard_size == 0, "bucket ", b, " is not padded to its group's size");
    shard_offset[b] = shard_numel[span.buffer];
    shard_numel[span.buffer] += span.numel() / r.shard_size;
    largest[span.buffer] = std::max(largest[span.buffer], span.numel());
  }
  for (int64_t k = 0; k < num_buffers; ++k) {
    const auto options =
        at::TensorOptions().dtype(layout_.buffers[k].key.grad_dtype).device(layout_.buffers[k].key.device);
    shard_buffers_.push_back(lazy_zeros(shard_numel[k], options));
    storage_pool_.add_kind(largest[k], options);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const BucketSpan& span = layout_.buckets[b];
    grad_shards_.push_back(
        shard_buffers_[span.buffer].narrow(0, shard_offset[b], span.numel() / buckets_[b].reduction.shard_size));
  }
}

void GradBuffer::acquire_bucket_storage(int64_t b) {
  const BucketSpan& span = layout_.buckets[b];
  // Only buckets launched before b: at its own launch (no gradient arrived) b is already counted in
  // next_bucket_, and completing it first would wait for a collective not launched yet.
  while (storage_pool_.free_blocks(span.buffer) == 0 &&
         storage_pool_.allocated_blocks(span.buffer) >= kBucketsInFlight &&
         next_to_complete_ < std::min(next_bucket_, b)) {
    complete_bucket(next_to_complete_++);
  }
  Bucket& bucket = buckets_[b];
  bucket.storage_block = storage_pool_.acquire(span.buffer);
  bucket.storage = bucket.storage_block.narrow(0, 0, span.numel());
  bucket.storage.zero_();
  for (int64_t i : span.params) {
    const ParamSlot& slot = layout_.slots[i];
    slots_[i].main_grad = bucket.storage.narrow(0, slot.offset - span.begin, slot.numel).view(params_[i].param.sizes());
  }
}

void GradBuffer::complete_bucket(int64_t b) {
  Bucket& bucket = buckets_[b];
  TORCH_INTERNAL_ASSERT(bucket.launched && bucket.storage.defined(), "bucket ", b, " completed before its launch");
  const BucketReduction& r = bucket.reduction;
  const std::string what = bucket_description(b);
  if (bucket.work) {
    auto work = std::move(bucket.work);
    bucket.work.reset();
    wait_collective(work, *r.group, what);
  }
  if (bucket.finish) {
    auto finish = std::move(bucket.finish);
    bucket.finish = nullptr;
    finish();
  }
  // Note [Hierarchical ZeRO-1] (bucket_sync.cpp): the shard's all-reduce across instances, here at once.
  if (r.cross_group && !skip_collective(*r.cross_group)) {
    if (debug_sequence_) check_collective_sequence(b, *r.cross_group, "all-reduce (across instances)");
    const std::string across = what + " across optimizer instances";
    wait_collective(all_reduce_sum(*r.cross_group, reduced_shard(b), across), *r.cross_group, across);
  }
  grad_shards_[b].add_(reduced_shard(b));
  for (int64_t i : layout_.buckets[b].params) slots_[i].main_grad = at::Tensor();
  storage_pool_.release(layout_.buckets[b].buffer, std::move(bucket.storage_block));
  bucket.storage_block = bucket.storage = at::Tensor();
}

void GradBuffer::complete_launched_buckets() {
  while (next_to_complete_ < next_bucket_) complete_bucket(next_to_complete_++);
}

void GradBuffer::queue_microbatch_flush() {
  if (flush_queued_) return;
  flush_queued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this, alive = alive_] {
    if (*alive) flush_microbatch();
  });
}

void GradBuffer::flush_microbatch() {
  c10::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!flush_queued_) return;  // zero_grad_buffer() or finish_grad_sync() came first
  flush_queued_ = false;
  while (next_bucket_ < static_cast<int64_t>(buckets_.size())) launch_bucket(next_bucket_++);
  complete_launched_buckets();
  reset_microbatch_state();
}

void GradBuffer::reset_microbatch_state() {
  for (Slot& slot : slots_) slot.ready = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    TORCH_INTERNAL_ASSERT(!bucket.work && !bucket.storage.defined(), "bucket ", b, " still in flight");
    bucket.pending = static_cast<int64_t>(layout_.buckets[b].params.size());
    bucket.launched = false;
    bucket.carried_counts = bucket.nonfinite.piece_counts;  // this step's so far (count_nonfinite adds them)
  }
  next_bucket_ = 0;
  next_to_complete_ = 0;
  ++microbatches_reduced_;
  state_ = StepState::kIdle;  // as after a non-last micro-batch under the other strategies
}

}  // namespace meshddp
