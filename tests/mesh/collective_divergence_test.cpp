// Ranks in different collectives (Note [Divergent collectives] in mesh/collective_progress.h): they
// would wait for each other until the timeout; instead every rank fails within seconds naming both
// collectives and ranks. And the stuck report's counts say how old they are. Ranks are threads over
// one HashStore, with short intervals.
#include "mesh/collective_progress.h"
#include "mesh/collectives.h"
#include "mesh/device_mesh.h"
#include "tests/support/rank_threads.h"

#include <ATen/ops/ones.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <thread>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

namespace {

using Clock = std::chrono::steady_clock;

void run_mesh_with(std::vector<int64_t> sizes, std::vector<std::string> names, MeshOptions options,
                   const std::function<void(DeviceMesh&)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  int world = 1;
  for (int64_t s : sizes) world *= static_cast<int>(s);
  run_ranks(world, [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_store(store, rank, world, sizes, names, options);
    fn(mesh);
  });
}

}  // namespace

// A 2 x 1 (dp x tp) mesh: rank 0 waits in an all-reduce on the world group (a checkpoint save only it
// makes), rank 1 in the next step's gradient all-reduce on the DP group. Each waits for the other.
// With a 2 s report threshold (checks every 0.25 s) and a 30 s timeout, both fail in seconds with
// the same error naming both. Before: both waited for the 30 s timeout, the stuck report naming
// only the "missing" peer.
TEST(CollectiveDivergence, RanksWaitingInCollectivesOfDifferentGroupsFailWithinSecondsNamingBoth) {
  MeshOptions options;
  options.timeout = std::chrono::seconds(30);
  options.stuck_report_after = std::chrono::seconds(2);
  std::vector<std::string> errors(2);
  std::vector<double> seconds(2);
  std::atomic<int> failed{0};
  run_mesh_with({2, 1}, {"dp", "tp"}, options, [&](DeviceMesh& mesh) {
    c10d::ProcessGroup& group = mesh.rank() == 0 ? *mesh.world() : *mesh["dp"];
    const std::string what = mesh.rank() == 0 ? "the checkpoint save's agreement" : "gradient bucket 0 of 1";
    const auto start = Clock::now();
    auto t = at::ones({4});
    Work work = all_reduce_sum(group, t, what);
    try {
      wait_collective(work, group, what);
    } catch (const c10::Error& e) {
      errors[mesh.rank()] = e.what_without_backtrace();
    }
    seconds[mesh.rank()] = std::chrono::duration<double>(Clock::now() - start).count();
    ++failed;
    while (failed < 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    // Join the other rank's collective, so both Gloo works finish before the groups are destroyed.
    c10d::ProcessGroup& other = mesh.rank() == 0 ? *mesh["dp"] : *mesh.world();
    all_reduce_sum(other, at::ones({4}), "the test's clean-up")->wait();
    work->wait();
  });
  for (int r = 0; r < 2; ++r) {
    std::cout << "[ rank " << r << " failed after " << seconds[r] << " s: " << errors[r] << " ]" << std::endl;
    EXPECT_THAT(errors[r], HasSubstr("meshddp: ranks are in different collectives, so none of them can finish"));
    EXPECT_THAT(errors[r], HasSubstr("all-reduce of the checkpoint save's agreement (launch #2 on group "
                                     "'meshddp/world/ranks=0,1')"));
    EXPECT_THAT(errors[r],
                HasSubstr("all-reduce of gradient bucket 0 of 1 (launch #2 on group 'meshddp/dp/ranks=0,1')"));
    EXPECT_THAT(errors[r], HasSubstr("each waits for the other"));
    EXPECT_LT(seconds[r], 10.0) << "seconds, not the 30 s timeout";
  }
}

// A slow peer is not a divergence: rank 1 computes for 1.5 s before the same all-reduce; rank 0
// waits (checks every 50 ms, reports at 0.4 s) and completes. The report gives the age of rank 1's
// count. Before: "1 (at launch #1)" with no age, however old the count.
TEST(CollectiveDivergence, ASlowPeerIsReportedWithTheAgeOfItsCountAndNotFailed) {
  MeshOptions options;
  options.timeout = kTestTimeout;
  options.stuck_report_after = std::chrono::milliseconds(400);
  testing::internal::CaptureStderr();
  run_mesh_with({2}, {"dp"}, options, [&](DeviceMesh& mesh) {
    if (mesh.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    auto t = at::ones({4});
    all_reduce_sum_now(*mesh["dp"], t, "the test's all-reduce");
    EXPECT_EQ(t[0].item<float>(), 2.0f);
  });
  const std::string err = testing::internal::GetCapturedStderr();
  std::cout << err;
  EXPECT_THAT(err,
              HasSubstr("still waiting after 0.4 s for the collective for the test's all-reduce; it is launch #2 on "
                        "this group; rank(s) that have not reached it (global ranks): 1 (at launch #1, as of 0."));
  EXPECT_THAT(err, HasSubstr(" s ago) (each count as of the time given; counts are republished every 0.1 s"));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("different collectives")));
}

namespace {

// Rank 1 of a 2-rank "dp" mesh publishes a wait record in the format of Note [Divergent
// collectives] (as a rank blocked in `peer_label` at launch #2 would), without launching anything;
// rank 0 then all-reduces `label` (its launch #2) with 50 ms checks. Rank 1 joins rank 0's
// all-reduce once rank 0's wait has ended (or after `join_after`). Returns rank 0's error, or "".
std::string wait_beside_a_peer_record(const std::string& label, const std::string& peer_label,
                                      std::chrono::milliseconds join_after) {
  MeshOptions options;
  options.timeout = kTestTimeout;
  options.stuck_report_after = std::chrono::milliseconds(400);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::string error;
  std::atomic<bool> published{false}, done{false};
  run_ranks(2, [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_store(store, rank, 2, {2}, {"dp"}, options);
    const std::string group = "meshddp/dp/ranks=0,1";
    if (rank == 1) {
      const std::string record = "7\n" + group + "\n2\nall-reduce of " + peer_label + "\n1 " + group + "\n";
      store->set(group + "/progress/1/wait", std::vector<uint8_t>(record.begin(), record.end()));
      published = true;
      const auto start = Clock::now();
      while (!done && Clock::now() - start < join_after) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      store->deleteKey(group + "/progress/1/wait");
      all_reduce_sum(*mesh["dp"], at::ones({4}), peer_label)->wait();  // rank 0's launch #2
      return;
    }
    while (!published) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    try {
      all_reduce_sum_now(*mesh["dp"], at::ones({4}), label);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    done = true;
  });
  return error;
}

}  // namespace

// Rule (a): a peer waiting at the same launch number of the same group in another collective is a
// divergence at the first check. The same collective whose label differs only by the device index
// (each rank's own GPU) is not: rank 0 waits until rank 1 joins.
TEST(CollectiveDivergence, APeerWaitingInAnotherCollectiveAtTheSameLaunchFailsAtOnce) {
  const auto start = Clock::now();
  const std::string error =
      wait_beside_a_peer_record("the loss report", "gradient bucket 0 of 1", std::chrono::seconds(20));
  EXPECT_THAT(error, HasSubstr("rank 0 waits in the collective for all-reduce of the loss report (launch #2 on group "
                               "'meshddp/dp/ranks=0,1') while rank 1 waits in the collective for all-reduce of "
                               "gradient bucket 0 of 1 (launch #2 on group 'meshddp/dp/ranks=0,1'): the same launch "
                               "on the same group is a different collective on each"));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
  EXPECT_EQ(wait_beside_a_peer_record("bucket 0 (4 elements on cuda:0)", "bucket 0 (4 elements on cuda:1)",
                                      std::chrono::milliseconds(600)),
            "");
}
