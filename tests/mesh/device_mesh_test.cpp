// DeviceMesh over Gloo with ranks as threads: groups per dim, the right members, env errors.
#include "mesh/device_mesh.h"

#include "mesh/collectives.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <arpa/inet.h>
#include <chrono>
#include <cstdlib>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace meshddp;
using ::testing::HasSubstr;

TEST(DeviceMesh, GivesEachRankItsCoordinatesAndGroupSizes) {
  test::run_on_mesh({2, 2}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    EXPECT_EQ(mesh.coordinate("dp"), mesh.rank() / 2);
    EXPECT_EQ(mesh.coordinate("tp"), mesh.rank() % 2);
    EXPECT_EQ(mesh["dp"]->getSize(), 2);
    EXPECT_EQ(mesh["tp"]->getSize(), 2);
    EXPECT_EQ(mesh["dp"]->getRank(), mesh.coordinate("dp"));
    EXPECT_EQ(mesh["tp"]->getRank(), mesh.coordinate("tp"));
  });
}

// Rank r contributes 2^r: each sum identifies exactly which ranks were in the group.
TEST(DeviceMesh, EachDimGroupSumsExactlyItsMembersOnTwoByTwo) {
  test::run_on_mesh({2, 2}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    for (const std::string dim : {"dp", "tp"}) {
      auto t = at::full({5}, static_cast<double>(1 << mesh.rank()), at::kFloat);
      all_reduce_sum_now(*mesh[dim], t, "test " + dim);
      double expected = 0;
      for (int64_t r : mesh.group_ranks(dim)) expected += 1 << r;
      EXPECT_TRUE(at::all(t == expected).item<bool>()) << dim << " on rank " << mesh.rank() << ": " << t;
    }
  });
}

TEST(DeviceMesh, FourByOneAndOneByFourMeshesHaveTrivialGroups) {
  test::run_on_mesh({4, 1}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    EXPECT_EQ(mesh["dp"]->getSize(), 4);
    EXPECT_EQ(mesh["tp"]->getSize(), 1);
    auto t = at::full({3}, static_cast<double>(1 << mesh.rank()), at::kFloat);
    all_reduce_sum_now(*mesh["dp"], t, "test");
    EXPECT_TRUE(at::all(t == 15.0).item<bool>());
  });
  test::run_on_mesh({1, 4}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    EXPECT_EQ(mesh["dp"]->getSize(), 1);
    EXPECT_EQ(mesh.coordinate("tp"), mesh.rank());
  });
}

TEST(DeviceMesh, FromGroupsRejectsGroupsOfTheWrongSizeOrRank) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  MeshOptions options;
  options.timeout = test::kTestTimeout;
  test::run_ranks(2, [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_store(store, rank, 2, {2}, {"dp"}, options);
    try {  // a group of 2 given for a dim of size 1
      DeviceMesh::from_groups({1, 2}, {"dp", "tp"}, rank, {mesh["dp"], mesh["dp"]});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("the group for dim 'dp' has 2 ranks, expected 1"));
    }
    try {  // the group's rank order does not match the mesh's
      DeviceMesh::from_groups({2}, {"dp"}, 1 - rank, {mesh["dp"]});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("rank " + std::to_string(1 - rank) + " has coordinate"));
    }
  });
}

TEST(DeviceMesh, FromEnvNamesTheMissingVariable) {
  const char* saved = std::getenv("MASTER_PORT");
  std::string saved_value = saved ? saved : "";
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  unsetenv("MASTER_PORT");
  try {
    DeviceMesh::from_env({1, 1}, {"dp", "tp"});
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("environment variable MASTER_PORT"));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("torchrun"));
  }
  setenv("WORLD_SIZE", "3", 1);
  setenv("MASTER_PORT", "29999", 1);
  try {
    DeviceMesh::from_env({2, 2}, {"dp", "tp"});
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("dp(2) x tp(2) = 4 ranks != WORLD_SIZE(3)"));
  }
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
  if (saved) setenv("MASTER_PORT", saved_value.c_str(), 1);
}

// A store that cannot be reached (a wrong MASTER_ADDR, a closed port) or served (a port in use)
// fails naming MASTER_ADDR and MASTER_PORT and what to check, not only c10d's socket error.
TEST(DeviceMesh, FromEnvNamesMasterAddrAndPortWhenTheStoreCannotBeReachedOrServed) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  MeshOptions options;
  options.timeout = std::chrono::milliseconds(1000);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  try {  // rank 0 serves the store, but the port is taken
    DeviceMesh::from_env({1, 1}, {"dp", "tp"}, options);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("DeviceMesh::from_env: rank 0 of 1 cannot serve the TCPStore on MASTER_ADDR=127.0.0.1 "
                          "MASTER_PORT=" +
                          port));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("A port in use: pick a free MASTER_PORT"));
  }
  close(listener);  // now nothing listens there
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  try {
    DeviceMesh::from_env({2, 1}, {"dp", "tp"}, options);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("DeviceMesh::from_env: rank 1 of 2 cannot reach the TCPStore at MASTER_ADDR=127.0.0.1 "
                          "MASTER_PORT=" +
                          port + " (rank 0 serves it) within the timeout of 1000 ms: "));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Check that MASTER_ADDR names a host this node can reach"));
  }
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(v);
}

// Ranks that disagree on the mesh shape would wait for different groups' rendezvous until the
// 10-minute store timeout; they must all fail at once, naming rank 0's shape and the other one.
TEST(DeviceMesh, ShapesThatDifferAcrossRanksFailWithinSecondsNamingBoth) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(4);
  const auto start = std::chrono::steady_clock::now();
  test::run_ranks(4, [&](int rank) {
    const std::vector<int64_t> sizes = rank == 3 ? std::vector<int64_t>{4, 1} : std::vector<int64_t>{2, 2};
    try {
      DeviceMesh::from_store(store, rank, 4, sizes, {"dp", "tp"});
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("DeviceMesh: the ranks disagree on the mesh shape: rank 0 has dp(2) x tp(2), "
                                     "rank 3 has dp(4) x tp(1)"))
        << "rank " << r;
  }
}
