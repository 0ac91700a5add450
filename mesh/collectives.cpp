#include "mesh/collectives.h"

#include "mesh/collective_progress.h"
#include "mesh/switches.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <string_view>
#include <thread>

namespace meshddp {
namespace {

void check_operand(const c10d::ProcessGroup& group, const at::Tensor& t, const char* role, const char* op,
                   const std::string& what) {
  TORCH_CHECK(t.defined(), "meshddp ", op, " of ", what, " on ", describe_group(group), ": ", role,
              " tensor is undefined");
  TORCH_CHECK(t.layout() == c10::kStrided && t.is_contiguous(), "meshddp ", op, " of ", what, " on ",
              describe_group(group), ": ", role, " tensor must be dense and contiguous; got sizes ", t.sizes(),
              " strides ", t.strides());
}

// One Work standing for several launched as one collective (Gloo's in-place all-gather below):
// done when all are, waited in order, failing with the first failure.
class AllOfWork : public c10d::Work {
 public:
  // (Inside a c10d::Work subclass, `Work` names c10d::Work: spell out meshddp::Work.)
  explicit AllOfWork(std::vector<meshddp::Work> parts) : parts_(std::move(parts)) {}
  bool isCompleted() override {
    return std::all_of(parts_.begin(), parts_.end(), [](const meshddp::Work& w) { return w->isCompleted(); });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (const meshddp::Work& w : parts_) w->wait(timeout);
    return true;
  }

 private:
  std::vector<meshddp::Work> parts_;
};

bool is_gloo(const c10d::ProcessGroup& group) {
  return group.getBackendType() == c10d::ProcessGroup::BackendType::GLOO;
}

// Every launch passes through here: counted and labelled for the hang report and the divergence
// check (mesh/collective_progress.h).
Work launched(const c10d::ProcessGroup& group, Work work, const char* op, const std::string& what) {
  note_collective_launch(group, work, std::string(op) + " of " + what);
  return work;
}

}  // namespace

bool skip_collective(const c10d::ProcessGroup& group) {
  return group.getSize() == 1 && !switch_on(Switch::kForceCollectives);
}

std::string describe_group(const c10d::ProcessGroup& group) {
  std::ostringstream out;
  out << "group '" << group.getGroupName() << "' (rank " << group.getRank() << " of " << group.getSize() << ")";
  return out.str();
}

namespace {

Work all_reduce(c10d::ProcessGroup& group, const at::Tensor& tensor, c10d::ReduceOp::RedOpType op,
                const std::string& what) {
  check_operand(group, tensor, "the", "all-reduce", what);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  return launched(group, group.allreduce(tensors, options), "all-reduce", what);
}

}  // namespace

Work all_reduce_sum(c10d::ProcessGroup& group, const at::Tensor& tensor, const std::string& what) {
  return all_reduce(group, tensor, c10d::ReduceOp::SUM, what);
}

void all_reduce_max_now(c10d::ProcessGroup& group, const at::Tensor& tensor, const std::string& what) {
  wait_collective(all_reduce(group, tensor, c10d::ReduceOp::MAX, what), group, what);
}

Work reduce_scatter_sum(c10d::ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                        const std::string& what) {
  check_operand(group, output, "output", "reduce-scatter", what);
  check_operand(group, input, "input", "reduce-scatter", what);
  TORCH_CHECK(input.numel() == output.numel() * group.getSize() && input.scalar_type() == output.scalar_type() &&
                  input.device() == output.device(),
              "meshddp reduce-scatter of ", what, " on ", describe_group(group), ": input has ", input.numel(), " ",
              input.scalar_type(), " elements on ", input.device(), ", expected output.numel() (", output.numel(),
              ") x group size (", group.getSize(), ") of ", output.scalar_type(), " on ", output.device());
  // Gloo has no reduce-scatter: its _reduce_scatter_base clones the input in the calling thread (the
  // backward hook, for gradient buckets), all-reduces the clone and copies the shard out on wait.
  // When `output` is `input`'s own shard, an in-place all-reduce of `input` leaves the same SUM in
  // it with no clone and no copy (see the contract on what `input` holds afterwards).
  const int64_t n = output.numel();
  if (is_gloo(group) && output.is_alias_of(input) &&
      output.storage_offset() == input.storage_offset() + group.getRank() * n) {
    return all_reduce(group, input, c10d::ReduceOp::SUM, what);
  }
  at::Tensor out = output;
  at::Tensor in = input;
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  return launched(group, group._reduce_scatter_base(out, in, options), "reduce-scatter", what);
}

Work all_gather_into(c10d::ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                     const std::string& what) {
  check_operand(group, output, "output", "all-gather", what);
  check_operand(group, input, "input", "all-gather", what);
  TORCH_CHECK(output.numel() == input.numel() * group.getSize() && input.scalar_type() == output.scalar_type() &&
                  input.device() == output.device(),
              "meshddp all-gather of ", what, " on ", describe_group(group), ": output has ", output.numel(), " ",
              output.scalar_type(), " elements on ", output.device(), ", expected input.numel() (", input.numel(),
              ") x group size (", group.getSize(), ") of ", input.scalar_type(), " on ", input.device());
  // Gloo's _allgather_base allocates a fresh output-sized tensor, gathers into it and copies it out
  // chunk by chunk. When `input` is `output`'s own slice at rank * n (ZeRO-1's param buffer), one
  // in-place broadcast per rank from that rank's slice moves the same bytes with no allocation and
  // no copy, bit-exact for every dtype.
  const int64_t n = input.numel();
  if (is_gloo(group) && input.is_alias_of(output) &&
      input.storage_offset() == output.storage_offset() + group.getRank() * n) {
    std::vector<Work> parts;
    for (int root = 0; root < group.getSize(); ++root) {
      std::vector<at::Tensor> slice{output.narrow(0, root * n, n)};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      parts.push_back(group.broadcast(slice, options));
    }
    return launched(group, c10::make_intrusive<AllOfWork>(std::move(parts)), "all-gather", what);
  }
  at::Tensor out = output;
  at::Tensor in = input;
  return launched(group, group._allgather_base(out, in), "all-gather", what);
}

Work broadcast_from(c10d::ProcessGroup& group, const at::Tensor& tensor, int root, const std::string& what) {
  check_operand(group, tensor, "the", "broadcast", what);
  TORCH_CHECK(root >= 0 && root < group.getSize(), "meshddp broadcast of ", what, " on ", describe_group(group),
              ": root ", root, " is not a rank of the group");
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return launched(group, group.broadcast(tensors, options), "broadcast", what);
}

namespace {

// Waits in slices: at each check interval the divergence watch (Note [Divergent collectives] in
// collective_progress.h); after report_after (when set), then 2x, 4x, ... a line on stderr naming
// the ranks that have not reached the collective. Returns "" when the work finishes (rethrowing its
// failure), or the divergence error to fail with.
std::string wait_watching(const Work& work, c10d::ProcessGroup& group, const std::string& what,
                          std::optional<std::chrono::milliseconds> report_after) {
  using Clock = std::chrono::steady_clock;
  DivergenceWatch watch(group, work);
  const auto check_every = watch.check_every().value_or(report_after.value_or(std::chrono::seconds(1)));
  const auto start = Clock::now();
  auto next_report = report_after ? start + *report_after : Clock::time_point::max();
  auto next_check = start + check_every;
  while (true) {
    const auto slice = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                  std::min(next_report, next_check) - Clock::now()));
    try {
      work->wait(slice);
      return "";
    } catch (const std::exception&) {
      // Either this slice ran out, or the work failed: a completed work says which.
      if (work->isCompleted()) {
        work->wait();
        return "";
      }
    }
    const auto now = Clock::now();
    if (now >= next_check) {
      const std::string divergence = watch.check();
      if (!divergence.empty()) return divergence;
      next_check = now + check_every;
    }
    if (now >= next_report) {
      publish_collective_progress_now(group);  // peers read this rank's counts fresh
      std::fprintf(stderr, "meshddp: [rank %d of %s] still waiting after %.1f s for the collective for %s; %s\n",
                   group.getRank(), ("group '" + group.getGroupName() + "'").c_str(),
                   std::chrono::duration<double>(now - start).count(), what.c_str(),
                   describe_collective_progress(group, work).c_str());
      std::fflush(stderr);
      next_report = start + 2 * (now - start);  // report again when the wait has doubled
    }
  }
}

}  // namespace

// Note [Waiting on NCCL]
// ProcessGroupNCCL's wait() makes the caller's current CUDA stream wait for the collective and
// returns at once: the host does not block, which is what keeps bucket collectives, the optimizer
// step and the param all-gather asynchronous on GPUs. Its wait(timeout) does block, but when the
// timeout passes it aborts the communicator and throws, so waiting in slices (as on Gloo, to print
// the stuck report) would kill a healthy collective at the first slice. So on NCCL groups:
//   - by default wait_collective calls wait(): stream-ordered. A hung or failed collective is
//     caught by c10d's watchdog after MeshOptions::timeout; it logs "Watchdog caught collective
//     operation timeout: WorkNCCL(SeqNum=<n>, OpType=<op>, ...)" under the group's name (meshddp
//     names NCCL groups like "dp/ranks=0,2") and takes the process down (SIGABRT; with
//     TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_NCCL_TRACE_BUFFER_SIZE>0 it dumps the flight recorder).
//     <n> counts the collectives on that group, the same count as the "launch #" of meshddp's
//     stuck reports.
//   - with MESHDDP_NCCL_BLOCKING_WAIT=1 (debug; it costs a host sync per wait) it polls on the host
//     (wait_collective_polling): the stuck report every doubling as on Gloo, and, a margin before the
//     group's timeout counted from the launch (polling_deadline), an error naming the bucket, the
//     group and the ranks that have not arrived: before the watchdog's abort, so that it prints.
bool nccl_blocking_wait() { return switch_on(Switch::kNcclBlockingWait); }

namespace {

[[noreturn]] void fail_collective(const Work& work, c10d::ProcessGroup& group, const std::string& what,
                                  const std::string& error) {
  // A peer that found a divergence gave up and left, which failed this collective: say why.
  const std::string divergence = published_divergence(group);
  TORCH_CHECK(divergence.empty(), divergence, "\n(On ", describe_group(group), " the collective for ", what,
              " then failed: ", error, ")");
  // A dead peer fails the collective on every live rank at once, maybe before any of them has
  // republished its count since the launch: publish this rank's now, and when the failure came
  // early (not a timeout, whose deadline must not slip: Note [Waiting on NCCL]) give the peers' a
  // moment to arrive, so that live peers are not reported by counts older than this launch.
  publish_collective_progress_now(group);
  const auto launched = collective_launch_time(group, work);
  const auto timeout = collective_timeout(group);
  if (launched && timeout && std::chrono::steady_clock::now() - *launched < *timeout / 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const std::string progress = describe_collective_progress(group, work);
  TORCH_CHECK(false, "meshddp: the collective for ", what, " on ", describe_group(group),
              " failed or timed out: ", error, progress.empty() ? "" : "\nProgress: " + progress,
              "\nIf this is a timeout, another rank is likely stuck or issued different collectives; "
              "run every rank with the same model and config, and check the other ranks' errors");
}

}  // namespace

std::chrono::milliseconds polling_deadline(std::chrono::milliseconds backend_timeout) {
  return backend_timeout - std::min<std::chrono::milliseconds>(backend_timeout / 10, std::chrono::seconds(30));
}

namespace {

void wait_collective_polling_unnoted(const Work& work, c10d::ProcessGroup& group, const std::string& what,
                                     std::chrono::milliseconds backend_timeout) {
  TORCH_INTERNAL_ASSERT(work, "wait_collective_polling on a null Work for ", what);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // The backend's clock runs from the launch (a bucket launched in backward and waited in
  // finish_grad_sync() has waited since then), so meshddp's does too.
  const auto launched = collective_launch_time(group, work).value_or(start);
  const auto deadline = launched + polling_deadline(backend_timeout);
  const auto report_after = collective_report_after(group);
  auto next_report = report_after ? start + *report_after : Clock::time_point::max();
  DivergenceWatch watch(group, work);
  const auto check_every = watch.check_every();
  auto next_check = check_every ? start + *check_every : Clock::time_point::max();
  while (!work->isCompleted()) {
    const auto now = Clock::now();
    if (now >= next_check) {
      const std::string divergence = watch.check();
      TORCH_CHECK(divergence.empty(), divergence);
      next_check = now + *check_every;
    }
    if (now >= deadline) {
      const auto since_launch = std::chrono::duration_cast<std::chrono::milliseconds>(now - launched);
      std::string error = "no completion " + std::to_string(since_launch.count()) +
                          " ms after its launch (host polling; meshddp's deadline, " +
                          std::to_string(polling_deadline(backend_timeout).count()) +
                          " ms, comes before the group's timeout of " + std::to_string(backend_timeout.count()) +
                          " ms)";
      try {
        work->wait(std::chrono::milliseconds(1));  // NCCL: c10d aborts the communicator and throws
      } catch (const std::exception& e) {
        error += "; the backend says: " + std::string(e.what());
      }
      fail_collective(work, group, what, error);
    }
    if (now >= next_report) {
      publish_collective_progress_now(group);
      const double waited = std::chrono::duration<double>(now - start).count();
      std::fprintf(stderr, "meshddp: [rank %d of %s] still waiting after %.1f s for the collective for %s; %s\n",
                   group.getRank(), ("group '" + group.getGroupName() + "'").c_str(), waited, what.c_str(),
                   describe_collective_progress(group, work).c_str());
      std::fflush(stderr);
      next_report = start + 2 * (now - start);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  try {
    work->wait();  // completed: rethrows a failure; on NCCL also orders the current stream after it
  } catch (const std::exception& e) {
    fail_collective(work, group, what, e.what());
  }
}

}  // namespace

// `has_stuck_report` (the header's name) means: the group has a progress record, which brings the
// stuck report when stuck_report_after > 0 and the divergence checks always (Note [Divergent
// collectives] in collective_progress.h); kReporting then waits in slices with both between them.
WaitMode choose_wait_mode(c10d::ProcessGroup::BackendType backend, bool nccl_blocking_wait, bool watched) {
  if (backend == c10d::ProcessGroup::BackendType::NCCL)
    return nccl_blocking_wait ? WaitMode::kPolling : WaitMode::kWait;
  return watched ? WaitMode::kReporting : WaitMode::kWait;
}

namespace {

std::mutex failed_mutex;
std::string& first_failure() {
  static std::string error;
  return error;
}

// Keeps `group` alive until the process exits (Note [Abandoned collectives]): never freed, on purpose.
void keep_until_exit(c10d::ProcessGroup& group) {
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>();
  std::lock_guard<std::mutex> lock(failed_mutex);
  kept->push_back(c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(&group));
}

// Runs `wait`, recording what it throws as a failed collective (Note [Abandoned collectives]).
template <typename F>
void noting_failure(c10d::ProcessGroup& group, F&& wait) {
  try {
    wait();
  } catch (const std::exception& e) {
    note_failed_collective(e.what());
    keep_until_exit(group);
    throw;
  }
}

}  // namespace

std::string failed_collective() {
  std::lock_guard<std::mutex> lock(failed_mutex);
  return first_failure();
}

void note_failed_collective(const std::string& error) {
  std::lock_guard<std::mutex> lock(failed_mutex);
  if (first_failure().empty()) first_failure() = error.empty() ? "(no message)" : error;
}

void wait_or_abandon(const std::vector<InFlightCollective>& works, const std::string& owner) noexcept {
  try {
    const std::string failure = failed_collective();
    if (failure.empty()) {
      for (const InFlightCollective& w : works) {
        try {
          if (w.work) w.work->wait();
        } catch (const std::exception&) {
          // Destruction must not throw; the failure was (or will be) reported by whoever waits for it.
        }
      }
      return;
    }
    std::ostringstream abandoned;
    int64_t n = 0;
    for (const InFlightCollective& w : works) {
      if (!w.work || w.work->isCompleted()) continue;
      abandoned << (n++ ? "; " : "") << w.what << " on " << (w.group ? describe_group(*w.group) : "its group");
      if (w.group) keep_until_exit(*w.group);
    }
    if (n == 0) return;
    std::fprintf(
        stderr,
        "meshddp: warning: %s destroyed after a failed collective (%s); not waiting for its %lld collective(s) "
        "still in flight, which may never finish (abandoned to the backend): %s\n",
        owner.c_str(), failure.substr(0, failure.find('\n')).c_str(), static_cast<long long>(n),
        abandoned.str().c_str());
    std::fflush(stderr);
  } catch (...) {
    // Destruction must not throw.
  }
}

namespace {

void wait_collective_unnoted(const Work& work, c10d::ProcessGroup& group, const std::string& what) {
  TORCH_INTERNAL_ASSERT(work, "wait_collective on a null Work for ", what);
  const auto report_after = collective_report_after(group);
  const bool watched = collective_timeout(group).has_value();  // a progress record: reports and divergence checks
  const WaitMode mode = choose_wait_mode(group.getBackendType(), nccl_blocking_wait(), watched);
  if (mode == WaitMode::kPolling) {
    wait_collective_polling_unnoted(work, group, what, collective_timeout(group).value_or(std::chrono::minutes(10)));
    return;
  }
  std::string divergence;
  try {
    if (mode == WaitMode::kReporting) {
      divergence = wait_watching(work, group, what, report_after);
    } else {
      work->wait();
    }
  } catch (const std::exception& e) {
    fail_collective(work, group, what, e.what());
  }
  TORCH_CHECK(divergence.empty(), divergence);
}

}  // namespace

void wait_collective(const Work& work, c10d::ProcessGroup& group, const std::string& what) {
  noting_failure(group, [&] { wait_collective_unnoted(work, group, what); });
}

void wait_collective_polling(const Work& work, c10d::ProcessGroup& group, const std::string& what,
                             std::chrono::milliseconds backend_timeout) {
  noting_failure(group, [&] { wait_collective_polling_unnoted(work, group, what, backend_timeout); });
}

std::vector<std::string> all_gather_strings(c10d::ProcessGroup& group, const std::string& text, const std::string& what,
                                            c10::Device device) {
  const int64_t n = group.getSize();
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor lens = at::zeros({n}, longs);
  wait_collective(
      all_gather_into(group, lens, at::full({1}, static_cast<int64_t>(text.size()), longs), what + " (sizes)"), group,
      what);
  lens = lens.cpu();
  const int64_t max_len = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor mine = at::zeros({max_len}, at::kByte);
  std::memcpy(mine.data_ptr<uint8_t>(), text.data(), text.size());
  at::Tensor all = at::zeros({max_len * n}, at::TensorOptions().dtype(at::kByte).device(device));
  wait_collective(all_gather_into(group, all, mine.to(device), what), group, what);
  all = all.cpu();
  std::vector<std::string> out;
  for (int64_t r = 0; r < n; ++r) {
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * max_len, lens[r].item<int64_t>());
  }
  return out;
}

void all_reduce_sum_now(c10d::ProcessGroup& group, const at::Tensor& tensor, const std::string& what) {
  wait_collective(all_reduce_sum(group, tensor, what), group, what);
}

}  // namespace meshddp
