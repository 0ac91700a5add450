// The one checked path every meshddp collective goes through. Each call checks its operands, says in
// every error what it was for (e.g. "bucket 3 of the bf16 grad buffer"), on which group and rank,
// and returns c10d Work to wait on with wait_collective(). No averaging op: Gloo has no AVG, so
// callers pre-scale and SUM (exact for power-of-two group sizes).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace meshddp {

using Work = c10::intrusive_ptr<c10d::Work>;

// In-place SUM all-reduce of a contiguous dense tensor.
Work all_reduce_sum(c10d::ProcessGroup& group, const at::Tensor& tensor, const std::string& what);

// output (numel n) receives the SUM over the group of input's slice [rank*n, (rank+1)*n);
// input.numel() must equal n * group size. Both contiguous, same dtype and device. Afterwards
// input's contents are unspecified: on Gloo, when output is input's own shard (the slice at
// rank * n), this is an in-place all-reduce of input (Gloo emulates reduce-scatter with a clone and
// a full all-reduce anyway), so input holds the whole SUM.
Work reduce_scatter_sum(c10d::ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                        const std::string& what);

// output (numel n * group size) receives every rank's input (numel n) in rank order. input may be
// output's own slice at rank * n (in place; on Gloo that runs as one broadcast per rank, no copy).
Work all_gather_into(c10d::ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                     const std::string& what);

// tensor on every rank becomes group-rank `root`'s tensor.
Work broadcast_from(c10d::ProcessGroup& group, const at::Tensor& tensor, int root, const std::string& what);

// Blocks until `work` finishes. A failure or the group's timeout becomes an error that names `what`
// (and, for a group with a progress record, which ranks had not reached it). While it waits longer
// than the group's report threshold (MeshOptions::stuck_report_after), it prints to stderr, at the
// threshold and each time the wait doubles, a line naming the group, `what` (e.g. the bucket) and
// the ranks that have not launched this collective yet (mesh/collective_progress.h).
// On NCCL groups see Note [Waiting on NCCL] in collectives.cpp: a stream wait (the host goes on),
// or with MESHDDP_NCCL_BLOCKING_WAIT=1 wait_collective_polling, which fails before the group's timeout.
void wait_collective(const Work& work, c10d::ProcessGroup& group, const std::string& what);

// Blocks the host until `work` completes by polling isCompleted() (never wait(slice): on NCCL a
// wait with a timeout aborts the communicator when the slice runs out), printing the stuck report
// like wait_collective. `backend_timeout` is the group's own collective timeout, after which c10d
// gives up on the work by itself (NCCL's watchdog aborts the communicator and takes the process
// down; Gloo fails the work), counted from the launch. meshddp's deadline comes first, at
// polling_deadline(backend_timeout) after the launch (after the start of the wait when the launch is
// not on record): it fails with an error naming `what`, the group and the ranks that have not
// arrived, then lets the backend abort. Any backend.
void wait_collective_polling(const Work& work, c10d::ProcessGroup& group, const std::string& what,
                             std::chrono::milliseconds backend_timeout);

// meshddp's polling deadline for a group whose collectives time out after `backend_timeout`: a
// margin earlier, 1/10 of the timeout and at most 30 s (9.5 min of c10d's 10-minute default), so the
// named error prints before c10d's watchdog (which checks every few hundred ms) aborts. Pure.
std::chrono::milliseconds polling_deadline(std::chrono::milliseconds backend_timeout);

// MESHDDP_NCCL_BLOCKING_WAIT=1 (debug switch, mesh/switches.h): wait_collective polls on
// NCCL groups, so a hang is reported naming the bucket instead of by c10d's watchdog alone.
bool nccl_blocking_wait();

// How wait_collective waits on a group (Note [Waiting on NCCL]); pure, so testable without a GPU.
enum class WaitMode {
  kWait,       // work->wait(): on NCCL a stream wait (the host goes on), elsewhere a blocking wait
  kReporting,  // wait(slice) in doubling slices with the stuck report between them (never on NCCL)
  kPolling,    // wait_collective_polling, failing before the group's timeout
};
WaitMode choose_wait_mode(c10d::ProcessGroup::BackendType backend, bool nccl_blocking_wait, bool has_stuck_report);

// Convenience: launch and wait.
void all_reduce_sum_now(c10d::ProcessGroup& group, const at::Tensor& tensor, const std::string& what);
// In-place MAX all-reduce, launched and waited (e.g. the max logit of a vocab-parallel softmax).
void all_reduce_max_now(c10d::ProcessGroup& group, const at::Tensor& tensor, const std::string& what);

// Every rank's `text`, in group-rank order, on every rank (two all-gathers: lengths, then padded
// bytes). Tensors go through `device` (CUDA for NCCL groups; Gloo takes either).
std::vector<std::string> all_gather_strings(c10d::ProcessGroup& group, const std::string& text, const std::string& what,
                                            c10::Device device = c10::Device(c10::kCPU));

// Note [Abandoned collectives]
//   Once a collective failed in this process (a divergence, a timeout, a peer that left: whatever
//   wait_collective threw), the collectives still in flight on its groups may never finish: their
//   peers have given up too, or wait in other collectives. A destructor that waited for them (the
//   flat buffers' bucket reductions and param all-gathers of the failed step) would hang the exit of
//   every rank until the group's timeout (30 min by default), or forever on a group without one.
//   So after a failure, destructors leave their in-flight work to the backend, which holds references
//   to its tensors (Gloo in the work, NCCL by recording the stream), and say on stderr what they
//   abandoned. Without a failure they wait as before (Gloo's wait ends at the group's timeout at the
//   latest; NCCL's is a stream wait). c10d's Gloo group, destroyed at exit, would wait for its stuck
//   collectives too (joining its threads, each up to the group's timeout): the group of a failed
//   wait, and of each abandoned collective, is kept alive until the process exits, so that it exits
//   at once, which also fails its peers' stuck collectives (their connections close).

// The error of the first collective that failed in this process (wait_collective or
// wait_collective_polling threw), "" while none has. Thread-safe.
std::string failed_collective();
// Records `error` as a failed collective (the first one is kept). Called by the waits; for tests.
void note_failed_collective(const std::string& error);

// One collective a destructor finds in flight: its work, its group and what it was for.
struct InFlightCollective {
  Work work;
  c10d::ProcessGroup* group = nullptr;
  std::string what;
};
// For destructors (Note [Abandoned collectives]): waits for each of `works` (never throwing), unless a
// collective failed in this process; then waits for none, and prints one line on stderr naming
// `owner`, the failure and each collective not yet completed, which it abandons.
void wait_or_abandon(const std::vector<InFlightCollective>& works, const std::string& owner) noexcept;

// Whether a collective on `group` can be skipped: a group of one rank, unless the environment sets
// MESHDDP_FORCE_COLLECTIVES=1 (test/debug switch, mesh/switches.h: run every collective even
// at size 1, e.g. so a one-GPU run exercises NCCL and its stream ordering).
bool skip_collective(const c10d::ProcessGroup& group);

// "group 'dp/ranks=0,2' (rank 1 of 2)" for messages.
std::string describe_group(const c10d::ProcessGroup& group);

}  // namespace meshddp
