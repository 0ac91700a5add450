// DeviceMesh beyond per-dim groups, ranks as threads over Gloo: groups over flattened dims and over
// partitions from mesh/reduction_groups.h (expert parallel, expert DP, optimizer instances) on a
// dp2 x cp2 x tp2 mesh. Rank r contributes 2^r, so each all-reduce's sum names exactly its members.
#include "mesh/collectives.h"
#include "mesh/device_mesh.h"
#include "mesh/mesh_layout.h"
#include "mesh/reduction_groups.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>

using namespace meshddp;
using ::testing::HasSubstr;

namespace {

const std::vector<int64_t> kSizes = {2, 2, 2};
const std::vector<std::string> kNames = {"dp", "cp", "tp"};

// All-reduces 2^rank over `group` and checks the sum is that of exactly `expected_ranks`.
void expect_sums_exactly(const DeviceMesh& mesh, c10d::ProcessGroup& group, const std::vector<int64_t>& expected_ranks,
                         const std::string& what) {
  auto t = at::full({3}, static_cast<double>(1 << mesh.rank()), at::kFloat);
  all_reduce_sum_now(group, t, "test " + what);
  double expected = 0;
  for (int64_t r : expected_ranks) expected += 1 << r;
  EXPECT_TRUE(at::all(t == expected).item<bool>())
      << what << " on rank " << mesh.rank() << ": " << t[0].item<float>() << " != " << expected;
  EXPECT_EQ(group.getSize(), static_cast<int64_t>(expected_ranks.size())) << what;
}

}  // namespace

TEST(DeviceMeshGroups, AThreeDimMeshGivesEachDimItsGroupAndEachRankItsCoordinates) {
  test::run_on_mesh(kSizes, kNames, [](DeviceMesh& mesh) {
    EXPECT_EQ(mesh.ndim(), 3);
    EXPECT_EQ(mesh.coordinates(), mesh_coordinates(mesh.rank(), kSizes));
    for (const auto& dim : kNames) expect_sums_exactly(mesh, *mesh[dim], mesh.group_ranks(dim), dim);
    expect_sums_exactly(mesh, *mesh.world(), {0, 1, 2, 3, 4, 5, 6, 7}, "world");
  });
}

TEST(DeviceMeshGroups, AnAllReduceOverTheFlattenedDpCpGroupSumsExactlyTheRanksSharingTp) {
  test::run_on_mesh(kSizes, kNames, [](DeviceMesh& mesh) {
    const auto dp_cp = mesh.flattened({"dp", "cp"});
    const auto ranks = mesh.flattened_ranks({"dp", "cp"});
    // Rank r = dp * 4 + cp * 2 + tp: the dp+cp group holds the four ranks with r's tp coordinate.
    const int64_t tp = mesh.rank() % 2;
    EXPECT_EQ(ranks, (std::vector<int64_t>{tp, tp + 2, tp + 4, tp + 6}));
    EXPECT_EQ(dp_cp->getRank(), mesh.rank() / 2);  // its rank in the group follows the flattened order
    expect_sums_exactly(mesh, *dp_cp, ranks, "dp+cp");
    expect_sums_exactly(mesh, *mesh.flattened({"dp", "tp"}), mesh.flattened_ranks({"dp", "tp"}), "dp+tp");
    expect_sums_exactly(mesh, *mesh.flattened({"cp", "tp"}), mesh.flattened_ranks({"cp", "tp"}), "cp+tp");
  });
}

TEST(DeviceMeshGroups, FlattenedGroupsAreMadeOnceAndOneDimOrAllDimsReuseTheMeshsGroups) {
  test::run_on_mesh(kSizes, kNames, [](DeviceMesh& mesh) {
    const auto first = mesh.flattened({"dp", "cp"});
    EXPECT_EQ(mesh.flattened({"dp", "cp"}).get(), first.get());
    const DeviceMesh copy = mesh;  // copies share the groups made on demand
    EXPECT_EQ(copy.flattened({"dp", "cp"}).get(), first.get());
    EXPECT_EQ(mesh.flattened({"cp"}).get(), mesh["cp"].get());
    EXPECT_EQ(mesh.flattened({"dp", "cp", "tp"}).get(), mesh.world().get());
  });
  // A dim of size 1 adds no member: dp x cp(1) is the dp group.
  test::run_on_mesh({2, 1, 2}, kNames,
                    [](DeviceMesh& mesh) { EXPECT_EQ(mesh.flattened({"dp", "cp"}).get(), mesh["dp"].get()); });
}

TEST(DeviceMeshGroups, ExpertParallelAndExpertDataParallelGroupsWithEp2SumExactlyTheirMembers) {
  test::run_on_mesh(kSizes, kNames, [](DeviceMesh& mesh) {
    const auto ep_groups = expert_parallel_groups(kSizes, kNames, {"dp", "cp"}, 2);
    const auto edp_groups = expert_data_parallel_groups(kSizes, kNames, {"dp", "cp"}, 2);
    const auto ep = mesh.group_of("ep", ep_groups);
    const auto edp = mesh.group_of("expert_dp", edp_groups);
    // Megatron-core's layout (tests/mesh/reduction_groups_test.cpp): EP {0,2} {1,3} {4,6} {5,7}, expert
    // DP {0,4} {1,5} {2,6} {3,7}.
    const int64_t r = mesh.rank();
    expect_sums_exactly(mesh, *ep, {r & ~2, r | 2}, "ep");
    expect_sums_exactly(mesh, *edp, {r & ~4, r | 4}, "expert_dp");
    EXPECT_EQ(mesh.group_of("ep", ep_groups).get(), ep.get());
  });
}

TEST(DeviceMeshGroups, OptimizerInstanceAndCrossInstanceGroupsSumExactlyTheirMembers) {
  test::run_on_mesh(kSizes, kNames, [](DeviceMesh& mesh) {
    const auto dp_cp = flattened_groups(kSizes, kNames, {"dp", "cp"});
    const auto intra = mesh.group_of("zero_instance", optimizer_instance_groups(dp_cp, 2, "dp+cp"));
    const auto inter = mesh.group_of("zero_cross_instance", cross_instance_groups(dp_cp, 2, "dp+cp"));
    // Two instances of the dp+cp group {tp, tp+2, tp+4, tp+6}: {tp, tp+2} and {tp+4, tp+6}.
    const int64_t r = mesh.rank();
    expect_sums_exactly(mesh, *intra, {r & ~2, r | 2}, "zero_instance");
    expect_sums_exactly(mesh, *inter, {r & ~4, r | 4}, "zero_cross_instance");
  });
}

// Ranks asking for different groups would wait at different rendezvous until the timeout; they must
// all fail at once naming rank 0's groups and the other rank's.
TEST(DeviceMeshGroups, GroupsThatDifferAcrossRanksFailWithinSecondsNamingBoth) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  MeshOptions options;
  options.timeout = test::kTestTimeout;
  std::vector<std::string> errors(4);
  const auto start = std::chrono::steady_clock::now();
  test::run_ranks(4, [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_store(store, rank, 4, {4}, {"dp"}, options);
    const RankGroups groups = rank == 3 ? RankGroups{{0, 2}, {1, 3}} : RankGroups{{0, 1}, {2, 3}};
    try {
      mesh.group_of("ep", groups);
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("DeviceMesh: the ranks disagree on the groups named 'ep': rank 0 has [0,1][2,3], "
                                     "rank 3 has [0,2][1,3]"))
        << "rank " << r;
  }
}

TEST(DeviceMeshGroups, BadGroupsAndAReusedNameAreRefusedOnEveryRank) {
  test::run_on_mesh({4}, {"dp"}, [](DeviceMesh& mesh) {
    try {
      mesh.group_of("ep", {{0, 1}, {2}});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("process groups 'ep': rank 3 is in no group"));
    }
    mesh.group_of("ep", {{0, 1}, {2, 3}});
    try {
      mesh.group_of("ep", {{0, 2}, {1, 3}});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("the name 'ep' already names the groups [0,1][2,3], not [0,2][1,3]; give these groups "
                            "another name"));
    }
    try {
      mesh.flattened({"cp"});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("unknown dim name 'cp'; this mesh has dims 'dp'"));
    }
  });
}

TEST(DeviceMeshGroups, AMeshFromGroupsMakesFlattenedGroupsOverItsWorldGroupsStore) {
  test::run_on_mesh(kSizes, kNames, [](DeviceMesh& built) {
    DeviceMesh mesh = DeviceMesh::from_groups(kSizes, kNames, built.rank(), {built["dp"], built["cp"], built["tp"]},
                                              c10::DeviceType::CPU, built.world());
    expect_sums_exactly(mesh, *mesh.flattened({"dp", "cp"}), mesh.flattened_ranks({"dp", "cp"}), "dp+cp");
    DeviceMesh without_world =
        DeviceMesh::from_groups(kSizes, kNames, built.rank(), {built["dp"], built["cp"], built["tp"]});
    try {
      without_world.flattened({"dp", "cp"});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("without a world group that has a store"));
    }
  });
}
