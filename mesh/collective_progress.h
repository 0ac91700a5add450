// Collective progress: per process group, a count of the collectives this rank has launched on it,
// published to the c10d store in the background, so that a rank waiting too long for a collective
// can name the ranks that have not reached it. Used by mesh/collectives.h (launch and wait); a
// DeviceMesh built from a store registers its groups. Off the hot path by construction: see Note
// [Progress records].
//
// Note [Progress records]
//   launch     (every collective, collectives.cpp) one registry lookup, one atomic increment and a
//              (Work*, launch number, label, launch time) write into a 64-entry ring: no store traffic.
//   publish    one background thread per process writes each group's count to the store key
//              <mesh prefix>/<group>/progress/<group rank> when it changed, at most once per
//              publish interval (report_after / 4, or timeout / 4 with reports off; clamped to
//              [10 ms, 5 s]).
//   wait       waits report_after; only then (a rank that is already late) reads the peers' keys:
//              2 store reads per peer, once per report; reports at report_after, then 2x, 4x, ...
//   A peer "has not reached" launch n when its published count is < n. Each count is published
//   with its time (republished every interval even when unchanged, and by a waiting rank right
//   before it reports), and the report gives each count's age: a count seconds old is a peer whose
//   process is stopped or gone, not one that is slow; a peer that arrived within the last
//   interval may still be listed.
//
// Note [Divergent collectives]
//   Ranks in different collectives wait for each other forever: rank 0 in a checkpoint save's
//   all-gather on the world group, rank 1 in the next step's gradient all-reduce on the DP group.
//   So a wait that lasts longer than the check interval (report_after / 8, or timeout / 8 with
//   reports off; clamped to [50 ms, 2 s]) publishes a wait record, "<group rank>/wait" in the store
//   of each of the rank's groups (which collective: group, launch number, label; and the rank's
//   launch count on each of its groups), withdrawn when the wait ends, and reads the records of its
//   group's peers at each interval. It is a divergence, certain, when
//     (a) a peer waits on the same group at the same launch number in another collective (label),
//         or at a lower number in another collective than this rank launched under that number;
//     (b) a peer that has not reached this collective waits on another group, in a collective this
//         rank belongs to and has not reached: each waits for the other (seen at two checks in a
//         row, so that counts a fraction of an interval old cannot fake it).
//   A peer that moved past (waits at a higher launch number) finds it from its side by (a). The
//   rank that finds it writes the error under "divergence" in each of its groups' stores, where the
//   other waiting ranks read it at their next check (or when their collective fails because the
//   finder left), and throws: every rank fails within a few check intervals, naming both
//   collectives and ranks. Labels are compared without device indices (cuda:0 vs cuda:1). A slow or stopped peer has no
//   wait record (or one this rank can still satisfy): the plain stuck report, and the timeout.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace meshddp {

// Registers `group` (whose rank r is global rank global_ranks[r]) for progress records under
// `store` (a store private to the group, e.g. a PrefixStore). Publishes count 0 now. A group
// registered again replaces its old record. The record lives as long as the group.
void register_collective_progress(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                  c10::intrusive_ptr<c10d::Store> store, std::vector<int64_t> global_ranks,
                                  std::chrono::milliseconds report_after, std::chrono::milliseconds timeout);

// Called for every collective launched on `group`: counts it and remembers `work`'s launch number
// and `label` (the operation and what it is for, e.g. "all-reduce of gradient bucket 0 of 2 (...)").
void note_collective_launch(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work,
                            const std::string& label = "");

// The labels of the last (up to 64) collectives launched on `group`, oldest first, each numbered by
// its launch ("#12 all-reduce of gradient bucket 0 of 2 (...)"); empty when the group has no record.
// For tests and reports: which collectives a step ran, and when.
std::vector<std::string> recent_collective_labels(const c10d::ProcessGroup& group);

// The report threshold of `group`'s record; nullopt when the group has none (or it is 0 = off).
std::optional<std::chrono::milliseconds> collective_report_after(const c10d::ProcessGroup& group);

// The collective timeout the group was registered with; nullopt when it has no record.
std::optional<std::chrono::milliseconds> collective_timeout(const c10d::ProcessGroup& group);

// "launch #7 on this group; ranks that have not reached it: 1 (at launch #6); ..." for a wait on
// `work` that has lasted `waited`; empty if the group has no record. Reads the store.
std::string describe_collective_progress(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work);

// When `work` was launched on `group` (steady clock); nullopt when the group has no record or the
// launch is no longer among its last 64.
std::optional<std::chrono::steady_clock::time_point> collective_launch_time(const c10d::ProcessGroup& group,
                                                                            const c10::intrusive_ptr<c10d::Work>& work);

// Publishes this rank's launch counts on every group it belongs to now (with their time).
void publish_collective_progress_now(const c10d::ProcessGroup& group);

// The divergence error another rank of `group` published (Note [Divergent collectives]), or "": a
// collective that fails because that rank gave up and left reports this instead.
std::string published_divergence(const c10d::ProcessGroup& group);

// Watches one wait on `group` for a divergence (Note [Divergent collectives]). Construct it when
// the wait starts; call check() every check_every() while it lasts. The destructor withdraws the
// wait record. Inert (every() is nullopt) for a group without a progress record.
class DivergenceWatch {
 public:
  DivergenceWatch(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work);
  ~DivergenceWatch();
  DivergenceWatch(const DivergenceWatch&) = delete;
  DivergenceWatch& operator=(const DivergenceWatch&) = delete;

  std::optional<std::chrono::milliseconds> check_every() const;
  // Publishes this rank's wait record and reads the peers'. Returns the error to fail with on every
  // rank ("meshddp: ranks are in different collectives ..."), or "" while none is certain.
  std::string check();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace meshddp
