// Collective progress: per process group, a count of the collectives this rank has launched on it,
// published to the c10d store in the background, so that a rank waiting too long for a collective
// can name the ranks that have not reached it. Used by mesh/collectives.h (launch and wait); a
// DeviceMesh built from a store registers its groups. Off the hot path by construction: see Note
// [Progress records].
//
// Note [Progress records]
//   launch     (every collective, collectives.cpp) one registry lookup, one atomic increment and a
//              (Work*, launch number) write into a 64-entry ring: ~0.1 us, no store traffic.
//   publish    one background thread per process writes each group's count to the store key
//              <mesh prefix>/<group>/progress/<group rank> when it changed, at most once per
//              publish interval (report_after / 4, or timeout / 4 with reports off; clamped to
//              [10 ms, 5 s]).
//   wait       waits report_after; only then (a rank that is already late) reads the peers' keys:
//              2 store reads per peer, once per report; reports at report_after, then 2x, 4x, ...
//   A peer "has not reached" launch n when its published count is < n. A count is at most one
//   publish interval old, so a peer that arrived within that interval may still be listed (the
//   report says so); a stopped peer never is missed.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
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

// Called for every collective launched on `group`: counts it and remembers `work`'s launch number.
void note_collective_launch(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work);

// The report threshold of `group`'s record; nullopt when the group has none (or it is 0 = off).
std::optional<std::chrono::milliseconds> collective_report_after(const c10d::ProcessGroup& group);

// The collective timeout the group was registered with; nullopt when it has no record.
std::optional<std::chrono::milliseconds> collective_timeout(const c10d::ProcessGroup& group);

// "launch #7 on this group; ranks that have not reached it: 1 (at launch #6); ..." for a wait on
// `work` that has lasted `waited`; empty if the group has no record. Reads the store.
std::string describe_collective_progress(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work);

}  // namespace meshddp
