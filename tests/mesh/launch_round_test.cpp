// Launch rounds (Note [Launch rounds], mesh/launch_round.h): the ranks of each launch on one store
// agree on a round no earlier launch had, whatever the earlier launches left in the store; a mesh
// rebuilt on torchrun's agent store (kept across restarts) connects instead of meeting the dead
// launch's entries; a rank that never joins is named.
#include "mesh/launch_round.h"

#include "mesh/collectives.h"
#include "mesh/device_mesh.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cstdlib>
#include <set>

using namespace meshddp;
using ::testing::HasSubstr;

namespace {

std::vector<int64_t> launch(c10d::Store& store, int world_size) {
  std::vector<int64_t> rounds(world_size);
  test::run_ranks(world_size, [&](int rank) {
    rounds[rank] = agree_on_launch_round(store, "job/launch", rank, world_size, test::kTestTimeout);
  });
  return rounds;
}

// Sets TORCHELASTIC_USE_AGENT_STORE=True for one test, as torchrun's elastic agent does for its workers.
struct AgentStoreEnv {
  AgentStoreEnv() { setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1); }
  ~AgentStoreEnv() { unsetenv("TORCHELASTIC_USE_AGENT_STORE"); }
};

}  // namespace

TEST(LaunchRound, EachLaunchAgreesOnARoundNoEarlierLaunchHad) {
  c10d::HashStore store;
  EXPECT_EQ(launch(store, 4), std::vector<int64_t>(4, 1));
  // A launch killed mid-handshake: ranks 2 and 3 asked, rank 0 never answered.
  store.set("job/launch/ask/2", std::vector<uint8_t>{'x'});
  store.set("job/launch/ask/3", std::vector<uint8_t>{'y'});
  EXPECT_EQ(launch(store, 4), std::vector<int64_t>(4, 2));
  EXPECT_EQ(launch(store, 2), std::vector<int64_t>(2, 3));  // a node gone: fewer ranks
  EXPECT_EQ(launch(store, 4), std::vector<int64_t>(4, 4));  // and back
}

TEST(LaunchRound, RankZeroNamesTheRanksThatNeverJoined) {
  c10d::HashStore store;
  std::string error;
  test::run_ranks(2, [&](int rank) {
    const auto call = [&] { agree_on_launch_round(store, "job/launch", rank, 4, std::chrono::milliseconds(300)); };
    if (rank == 0) error = test::error_of(call);
    if (rank == 1) call();
  });
  EXPECT_THAT(error, HasSubstr("DeviceMesh: rank 0 waited 300 ms for ranks 2,3 of 4 to join launch round 1"));
}

// A worker killed and restarted by torchrun's agent meets its peers again in the agent's store,
// which still holds the first launch's group rendezvous entries under the same keys.
TEST(LaunchRound, AMeshRebuiltOnTheAgentStoreConnectsAfterARestart) {
  AgentStoreEnv env;
  auto store = c10::make_intrusive<c10d::HashStore>();
  MeshOptions options;
  options.timeout = std::chrono::seconds(10);
  for (int launch_number = 1; launch_number <= 3; ++launch_number) {
    test::run_ranks(4, [&](int rank) {
      DeviceMesh mesh = DeviceMesh::from_store(store, rank, 4, {2, 2}, {"dp", "tp"}, options);
      auto t = at::full({3}, static_cast<double>(1 << rank), at::kFloat);
      all_reduce_sum_now(*mesh.world(), t, "the test's all-reduce");
      EXPECT_TRUE(at::all(t == 15.0).item<bool>()) << "launch " << launch_number << ", rank " << rank << ": " << t;
    });
  }
}
