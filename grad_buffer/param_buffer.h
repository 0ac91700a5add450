// ParamBuffer: the ZeRO-1 side of a GradBuffer built with use_distributed_optimizer. One flat param
// buffer per grad buffer (param dtype), laid out like it, of which every trainable param becomes a
// view (same TensorImpl, new storage), and the per-bucket all-gather that writes the updated shards
// back into it (ParamGather). It also keeps the params' version, which whoever caches copies of the
// params (the distributed optimizer's fp32 masters) compares to know when to refresh them.
#pragma once

#include "bucket_layout.h"
#include "fsdp_units.h"
#include "param_gather.h"
#include "sharded_params.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshddp {

struct NamedParam;

class ParamBuffer {
 public:
  // Allocates the flat param buffers of `layout`, copies each param of `params` (the layout's, in
  // its order) into its slot and points the param at it. `buckets[b]` gives bucket b's name (`what`)
  // and the group its all-gather runs over (its DP group, or expert-DP group for expert params);
  // `full` and `shard` are filled here: this rank's shard of a bucket is its group rank's 1/size of
  // it (buckets are padded to a multiple of that size).
  // With `units` ("optim_grads_params"), there is no flat buffer: each bucket's params live in a
  // storage of their own that exists only while their unit is in use, and this rank keeps its shards
  // (ShardedParams, Note [Sharded parameters]); the ParamGather then has no bucket.
  ParamBuffer(const BucketLayout& layout, std::vector<NamedParam>& params, std::vector<ParamGather::Bucket> buckets,
              const FsdpUnits* units = nullptr);
  ParamBuffer(const ParamBuffer&) = delete;
  ParamBuffer& operator=(const ParamBuffer&) = delete;

  // Bucket `b`'s range of its flat param buffer, padding included (under "optim_grads_params" its own
  // storage, without bytes while its unit is released).
  const at::Tensor& bucket_data(int64_t b) const { return bucket_data_[b]; }
  // Bytes of the flat param buffers (full, not sharded); under "optim_grads_params" the param storage
  // resident now (this rank's shards and the units in use).
  int64_t bytes() const;
  // "optim_grads_params": the sharded params (null under the other strategies).
  ShardedParams* sharded() const { return sharded_.get(); }
  // After the optimizer wrote this rank's shards: all-gathers them into the flat buffer (ZeRO-1, now or
  // overlapped with the next forward: ParamGather::start), or under "optim_grads_params" releases
  // every unit (the next use gathers it). finish_param_sync() waits for what start left in flight.
  void start_param_sync(bool async);
  void finish_param_sync() { gather_.wait_all(); }
  // The all-gather of updated param shards into the buffer.
  ParamGather& gather() { return gather_; }
  const ParamGather& gather() const { return gather_; }

  // Bumped by notify_params_changed(): see the file comment.
  int64_t params_version() const { return params_version_.load(); }
  // Call after writing new values into the params outside an optimizer step (loading weights).
  void notify_params_changed() { ++params_version_; }

  // Throws naming `p` if it no longer lives at `slot` of this buffer (its data was replaced after
  // wrapping). `who` names the caller.
  void check_param_in_place(const NamedParam& p, const ParamSlot& slot, const char* who) const;

 private:
  std::unique_ptr<ShardedParams> sharded_;  // before bucket_data_: its buckets' storages are bucket_data_
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> bucket_data_;  // per bucket: its range of buffers_
  std::vector<int64_t> bucket_begin_;    // per bucket: its first element's offset in its flat buffer
  ParamGather gather_;
  std::atomic<int64_t> params_version_{0};
};

}  // namespace meshddp
