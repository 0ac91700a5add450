// Communication hooks: how a GradBuffer reduces one bucket, pluggable per buffer like PyTorch DDP's
// register_comm_hook, plus the built-in bf16 and fp16 compression hooks. This file knows buckets and
// groups, not autograd: GradBuffer decides when a bucket launches (in bucket order), pre-divides it
// by the DP size, and calls the hook to launch its reduction; the hook's collectives go through
// mesh/collectives.h like every other.
//
// Note [Communication hooks, meshddp's shape]
//   PyTorch: CommHookInterface::runHook(GradBucket&) returns a Future<Tensor>; the Reducer copies the
//   future's tensor into the bucket when it differs from it, and the hook divides by the world size.
//   meshddp: CommHook::launch(CommHookBucket) returns a CommHookWork, the c10d Work to wait on plus a
//   finish() that GradBuffer runs after waiting for it (on the thread that waits, i.e. in
//   finish_grad_sync()): the write-back into the bucket. The bucket arrives pre-divided (a DP mean
//   after a SUM on every backend, Gloo has no AVG), and the hook's job is one SUM reduction over
//   `group` whose result must land in `output`: the whole bucket (all-reduce: plain and TP-partial
//   buckets) or this rank's shard of it (ZeRO-1's reduce-scatter; the rest of the bucket is then
//   scratch the hook may overwrite). No hook is the built-in SUM in the buffer's own dtype.
//
// Note [Compression hooks: accuracy]
//   bf16_compress / fp16_compress cast the pre-divided bucket to the low dtype, reduce it there and
//   copy the result back (PyTorch's bf16_compress_hook / fp16_compress_hook, same order of
//   operations except that the division by DP happens before the cast, in the buffer's dtype). Each
//   element then carries the rounding of its cast (relative up to 2^-8 for bf16, 2^-11 for fp16:
//   their unit roundoff) plus that of every partial sum the collective forms in the low dtype.
//   fp16's range (max 65504, subnormals below 6e-5) can overflow or flush small gradients; a
//   non-finite reduced gradient makes the distributed optimizer skip the step. Halves the bytes
//   moved; costs a cast pass and a copy-back. Measured: docs/reference/cpp_api.md, "Communication hooks".
//
// Note [Stream lifetimes of collective temporaries]
//   On NCCL a collective runs on c10d's own stream; at launch that stream waits for the current
//   (compute) stream, and wait_collective() makes the current stream wait for it (a stream wait, the
//   host goes on: Note [Waiting on NCCL]). A tensor a collective reads or writes must therefore stay
//   allocated until the collective has finished on its stream, and its memory must not be handed to
//   other work before then. meshddp's rule: every temporary a collective touches stays referenced by
//   the host until after the wait that orders the current stream behind the collective, and is
//   allocated on the current stream; once it is dropped the caching allocator returns its block to
//   that stream's pool, where any later use is ordered after the wait. So no record_stream is needed
//   (c10d also keeps a collective's tensors referenced from its Work until the wait, whether or not
//   TORCH_NCCL_AVOID_RECORD_STREAMS is set). The sites:
//   - the compression hooks' low-precision copy: captured by finish(), which GradBuffer runs and
//     drops only after wait_collective() (comm_hook.cpp);
//   - the bucket itself, the ZeRO-1 param buffer, the non-finite counts by piece: members, alive
//     until the buffer is destroyed or zero_grad_buffer() (which runs after finish_grad_sync()'s
//     waits) drops them (grad_buffer.cpp);
//   - the non-finite total and the optimizer's statistics: locals of the function that launches,
//     waits and only then reads them (nonfinite_check.cpp, distributed_optimizer.cpp).
//   Work launched on one current stream must be waited with the same current stream (meshddp's calls
//   all run on the caller's current stream: keep backward and finish_grad_sync() on one stream).
#pragma once

#include "../mesh/collectives.h"
#include "grad_buffer_config.h"  // kNoCommHook, kBf16CompressHook, kFp16CompressHook

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <memory>
#include <string>

namespace meshddp {

// One bucket's reduction, as a hook sees it.
struct CommHookBucket {
  int64_t index = 0;  // bucket index in the buffer's layout (launch order)
  at::Tensor data;    // the whole bucket (padding included), already divided by the DP size
  at::Tensor output;  // where the SUM over `group` must land: `data` itself (all-reduce), or this
                      // rank's 1/size shard of it (reduce_scatter), a view into `data`
  bool reduce_scatter = false;
  c10d::ProcessGroup* group = nullptr;  // the DP group, or the whole mesh for TP-partial buckets
  std::string what;                     // "gradient bucket 3 of 5 (...)" for messages
  // Set when the buffer counts non-finite values (check_for_nan_in_grad, the distributed optimizer):
  // the buffer has counted `data`; a hook that sends another tensor (e.g. a compressed copy, where
  // a cast to fp16 may overflow) calls it with that tensor, same numel as `data`, before launching
  // its collective, and the count of what is sent replaces that of `data`. Empty otherwise.
  std::function<void(const at::Tensor& sent)> count_sent;
};

// What a hook launched: the collective to wait on, and what to run once it is done.
struct CommHookWork {
  Work work;                     // null when nothing was launched (a group of one rank)
  std::function<void()> finish;  // e.g. copy the reduced low-precision bucket back; may be empty
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // A short name for messages and the cross-rank settings check, e.g. "bf16_compress".
  virtual std::string name() const = 0;
  // Launches the reduction of `bucket` (asynchronously where the backend allows); called with the
  // GradBuffer's lock held, from a backward hook or from finish_grad_sync(), in bucket order.
  virtual CommHookWork launch(const CommHookBucket& bucket) = 0;
};

// The built-in: the bucket is SUM-reduced in its own dtype, in place (no hook, today's path).
class SumCommHook : public CommHook {
 public:
  std::string name() const override { return "none"; }
  CommHookWork launch(const CommHookBucket& bucket) override;
};

// Casts the bucket to `dtype` (bf16 or fp16), reduces it in that dtype and copies the result into
// the bucket's output. A bucket already in `dtype` is reduced in place with no copy.
class CompressCommHook : public CommHook {
 public:
  explicit CompressCommHook(c10::ScalarType dtype);
  std::string name() const override;
  CommHookWork launch(const CommHookBucket& bucket) override;

 private:
  c10::ScalarType dtype_;
};

// The built-in hook named `name` ("none", "bf16_compress", "fp16_compress"); throws naming the
// choices for any other name.
std::shared_ptr<CommHook> make_comm_hook(const std::string& name);

}  // namespace meshddp
