// ParamGather: the per-bucket all-gather of updated parameter shards into the flat param buffer
// (ZeRO-1), either waited at once or overlapped with the next forward.
//
// Note [Waiting for parameters in forward without module hooks]
// LibTorch's C++ modules have no forward pre-hooks, and their forward() calls children directly,
// so there is no module boundary to hook. The one interception point on *using* a parameter is the
// dispatcher. While gathers are pending, ForwardScope (entered by DistributedDataParallel::forward)
// turns on a thread-local dispatch mode whose fallback looks at each op's tensor arguments: an
// argument that lives in the param buffer range of a bucket whose gather is still in flight makes
// the op wait for exactly that bucket first. So each layer waits only for the bucket holding its
// own parameters, in whatever order the forward touches them, and nothing can read a stale
// parameter inside the forward. Gathers are launched in forward order (last bucket first: bucket 0
// holds the last-registered parameters). Once nothing is pending the mode switches itself off; it
// costs nothing when no gather is pending. The mode key is c10's TESTING_ONLY_GenericMode, the only
// generic TLS mode key free for C++ use (Python dispatch modes use the Python key).
// The thread that launched the gathers (start(async), in the optimizer's step) waits the same way
// outside DistributedDataParallel::forward too, e.g. in a forward through the raw module (Note
// [Raw-module forward after an overlapped step], param_gather.cpp). Other threads (a checkpoint
// writer, an evaluation thread) call wait_all() first.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace meshddp {

class ParamGather {
 public:
  struct Bucket {
    at::Tensor full;                               // the bucket's range of the param buffer (all ranks' shards)
    at::Tensor shard;                              // this rank's shard of it (a view into `full`)
    std::string what;                              // for messages
    c10::intrusive_ptr<c10d::ProcessGroup> group;  // the all-gather runs over it: the bucket's DP (or expert-DP) group
  };
  explicit ParamGather(std::vector<Bucket> buckets);
  ~ParamGather();

  // Launches every bucket's all-gather (forward order). async=false waits for all of them here;
  // async=true leaves them in flight, and ops on this thread that read a pending bucket wait for it.
  // Throws if a previous gather is still pending (call wait_all() first).
  void start(bool async);
  // Blocks until every pending gather is done.
  void wait_all();
  int64_t pending() const;

  // While alive on this thread, ops that read a parameter of a pending bucket wait for it first.
  class ForwardScope {
   public:
    explicit ForwardScope(ParamGather* gather);
    ~ForwardScope();
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;

   private:
    ParamGather* gather_ = nullptr;
    bool previous_mode_ = false;
  };

  // Statistics of the last forward: gathers pending when it began, and buckets it waited for.
  int64_t pending_at_last_forward_start() const { return pending_at_forward_start_; }
  int64_t waited_in_last_forward() const { return waited_in_forward_; }

  // Waits for the bucket whose param range holds `t`'s storage, if it is pending. Returns whether
  // anything is still pending. Used by the dispatch-mode fallback.
  bool wait_if_pending(const at::Tensor& t);

 private:
  void wait_bucket(size_t b);  // mutex held

  std::vector<Bucket> buckets_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  mutable std::mutex mutex_;
  int64_t pending_ = 0;
  int64_t pending_at_forward_start_ = 0;
  int64_t waited_in_forward_ = 0;
};

}  // namespace meshddp
