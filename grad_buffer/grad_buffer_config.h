// GradBufferConfig: how a GradBuffer lays out and reduces its buckets, field by field with its
// sentinels, and the named values its fields take. Plain values only (no tensors, no groups), so that
// DdpConfig (plugin/distributed_data_parallel.h) derives from it without the GradBuffer behind it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshddp {

// 40 MiB: ~10M fp32 or ~20M bf16 gradients. Large enough that an NCCL/Gloo collective runs near its
// bandwidth peak (latency terms are small next to the transfer), small enough that a 1B-param model
// has dozens of buckets to overlap with backward. PyTorch DDP uses 25 MiB, Megatron 40M elements.
// docs/design.md has the sweep.
constexpr size_t kDefaultBucketBytes = size_t{40} << 20;

// The names GradBufferConfig::comm_hook takes.
constexpr const char* kNoCommHook = "none";
constexpr const char* kBf16CompressHook = "bf16_compress";
constexpr const char* kFp16CompressHook = "fp16_compress";

// The values GradBufferConfig::shard_policy takes.
inline constexpr const char* kByteRangeShards = "byte_range";
inline constexpr const char* kWholeParamShards = "whole_param";
// DdpConfig::data_parallel_sharding_strategy's values (Megatron-FSDP's names; docs/guide/sharding.md).
inline constexpr const char* kNoShard = "no_shard";
inline constexpr const char* kShardOptim = "optim";
inline constexpr const char* kShardOptimGrads = "optim_grads";
inline constexpr const char* kShardOptimGradsParams = "optim_grads_params";

struct GradBufferConfig {
  size_t bucket_bytes = kDefaultBucketBytes;  // a bucket closes once it reaches this; 0 = one bucket per parameter
  bool overlap_grad_reduce = true;            // launch bucket collectives from the hooks during backward;
                                              // false = all of them in finish_grad_sync()
  bool grad_reduce_in_fp32 = false;           // bf16/fp16 params keep fp32 main grads (accumulated and reduced in
                                     // fp32); param.grad() is released after each hook. No effect on fp32 params
  bool pad_for_reduce_scatter = false;       // pad buckets to a multiple of the DP size (see bucket_layout.h)
  bool find_unused_parameters = false;       // after each forward, walk the autograd graph from its outputs;
                                             // params it cannot reach are marked ready at once (gradient 0),
                                             // so the buckets after them still launch during backward. Costs
                                             // one graph walk per forward; off: such params block overlap of
                                             // their bucket and every later one (still correct)
  bool use_distributed_optimizer = false;    // ZeRO-1: implies the padding; each bucket is reduce-scattered
                                             // (DP rank r keeps the mean of its 1/DP shard of every bucket),
                                             // params become views of a flat param buffer laid out like the
                                             // grad buffer, and each bucket's local non-finite count is kept
  bool gradient_accumulation_fusion = true;  // (Megatron's name) layers that write a param's gradient straight
                                             // into its slot (grad_buffer/grad_in_place.h: meshddp::tp::Linear,
                                             // meshddp::linear_with_grad_in_buffer) may do so; such slots are
                                             // then overwritten on the first micro-batch instead of being
                                             // zeroed by zero_grad_buffer(). false: every gradient goes through
                                             // autograd and every slot is zeroed (for comparison and debugging)
  bool check_for_nan_in_grad = false;        // (Megatron's name) count each bucket's NaN/Inf before its collective;
                                             // finish_grad_sync() then throws on every rank, naming the param(s),
                                             // the rank(s) that produced them and the step. Costs one count per
                                             // bucket (CPU: one sum; CUDA: a device sync) and one tiny all-reduce
                                             // per step
  std::string comm_hook = kNoCommHook;       // how each bucket is reduced (grad_buffer/comm_hook.h): "none" = SUM in
                                             // the buffer's dtype; "bf16_compress" / "fp16_compress" = cast the
                                             // pre-divided bucket to bf16 / fp16, reduce in it, copy back (half the
                                             // bytes; rounding per Note [Compression hooks: accuracy]). Plain, ZeRO-1
                                             // and TP-partial buckets alike
  // (Megatron's name) hierarchical ZeRO-1: the DP group of D ranks is cut into K instances of D/K
  // consecutive ranks; each bucket is reduce-scattered within the instance (shards of 1/(D/K)), then the
  // shard is all-reduced across instances (SyncGroups::cross_instance). Needs use_distributed_optimizer
  // and a DeviceMesh (DistributedDataParallel makes the groups); K must divide D. 1 = flat ZeRO-1
  int64_t num_distributed_optimizer_instances = 1;
  // Which elements of each bucket a DP rank owns with use_distributed_optimizer: "byte_range" = the
  // contiguous 1/DP slice, cutting params anywhere (ZeRO-1); "whole_param" = each param whole on one
  // rank, bin-packed by Newton-Schulz cost (grad_buffer/whole_param_layout.h; needed by Muon). Both
  // reduce-scatter and all-gather the same way; whole_param pads buckets more
  std::string shard_policy = kByteRangeShards;
  // (Megatron-FSDP's name) what a DP rank keeps resident: "no_shard" = all-reduce, whole grads;
  // "optim" = ZeRO-1, the same as use_distributed_optimizer; "optim_grads" = ZeRO-2: also the
  // gradients, a rank keeping only its shard of each bucket after the bucket's reduce-scatter (full-size
  // gradient storage is a small pool of bucket-sized buffers in flight; every micro-batch is
  // reduce-scattered: Note [Sharded gradients] in grad_buffer/grad_shards.cpp). "" = from
  // use_distributed_optimizer ("optim" if set, else "no_shard"). "optim_grads_params" = ZeRO-3: also
  // the params, a rank keeping its shard of each bucket and a unit's whole params only while the unit
  // is in use (gathered on use, released after: Note [Sharded parameters] in
  // grad_buffer/sharded_params.h), gradients as under "optim_grads". "optim", "optim_grads" and
  // "optim_grads_params" turn use_distributed_optimizer on; "no_shard" with use_distributed_optimizer
  // is an error
  std::string data_parallel_sharding_strategy;
  // (Megatron-FSDP's name) "optim_grads_params" only: the modules whose params are gathered and
  // released together, as comma-separated module paths or globs ("blocks.*,wte"; '*' matches dots
  // too); a param belongs to the shortest matching path of its name, params of no match to one root
  // unit. "" = each top-level child module, and each element of a top-level list ("blocks.0", ...):
  // grad_buffer/fsdp_units.h. No bucket holds params of two units
  std::string fsdp_unit_modules;

  // Throws naming the field on a bad value. Called by every constructor that takes a config.
  void validate() const;
  // Throws on fields that do not go together (validate() checks each field alone, so that Python may
  // set them in any order): num_distributed_optimizer_instances > 1 without use_distributed_optimizer,
  // data_parallel_sharding_strategy "no_shard" with use_distributed_optimizer.
  // Called by GradBuffer and DistributedDataParallel before they build anything.
  void check_combination() const;
  // The strategy in effect: data_parallel_sharding_strategy, or "" resolved from use_distributed_optimizer.
  std::string sharding_strategy() const;
  bool shards_grads() const { return sharding_strategy() == kShardOptimGrads || shards_params(); }
  bool shards_params() const { return sharding_strategy() == kShardOptimGradsParams; }
  // Sets use_distributed_optimizer for "optim", "optim_grads" and "optim_grads_params" (after
  // check_combination()).
  void apply_sharding_strategy();
};

}  // namespace meshddp
