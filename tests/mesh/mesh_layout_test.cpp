// Rank <-> coordinate arithmetic and mesh validation: no process groups.
#include "mesh/mesh_layout.h"

#include "tests/support/error_of.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using ::testing::HasSubstr;

using meshddp::test::error_of;

namespace {}  // namespace

TEST(MeshLayout, CoordinatesAreRowMajorWithTpInnermost) {
  const std::vector<int64_t> sizes{2, 3};  // dp=2, tp=3
  for (int64_t rank = 0; rank < 6; ++rank) {
    auto c = mesh_coordinates(rank, sizes);
    EXPECT_EQ(c[0], rank / 3) << "rank " << rank;
    EXPECT_EQ(c[1], rank % 3) << "rank " << rank;
    EXPECT_EQ(mesh_rank(c, sizes), rank);
  }
}

TEST(MeshLayout, GroupRanksShareEveryOtherCoordinate) {
  const std::vector<int64_t> sizes{2, 2};
  EXPECT_EQ(mesh_group_ranks(0, sizes, 0), (std::vector<int64_t>{0, 2}));  // dp group of rank 0
  EXPECT_EQ(mesh_group_ranks(3, sizes, 0), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(mesh_group_ranks(2, sizes, 1), (std::vector<int64_t>{2, 3}));  // tp group of rank 2
  const std::vector<int64_t> three_d{2, 2, 2};
  EXPECT_EQ(mesh_group_ranks(5, three_d, 1), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(mesh_group_ranks(5, three_d, 0), (std::vector<int64_t>{1, 5}));
}

TEST(MeshLayout, GroupKeysDifferAcrossGroupsAndAgreeWithinOne) {
  EXPECT_EQ(mesh_group_key("dp", mesh_group_ranks(0, {2, 2}, 0)), mesh_group_key("dp", mesh_group_ranks(2, {2, 2}, 0)));
  EXPECT_NE(mesh_group_key("dp", mesh_group_ranks(0, {2, 2}, 0)), mesh_group_key("dp", mesh_group_ranks(1, {2, 2}, 0)));
  EXPECT_EQ(mesh_group_key("tp", {2, 3}), "tp/ranks=2,3");
}

TEST(MeshLayout, RejectsWorldSizeThatIsNotTheProductOfTheDims) {
  auto msg = error_of([] { validate_mesh({2, 3}, {"dp", "tp"}, 8, 0); });
  EXPECT_THAT(msg, HasSubstr("dp(2) x tp(3) = 6 ranks != WORLD_SIZE(8)"));
}

TEST(MeshLayout, RejectsRankOutOfRange) {
  auto msg = error_of([] { validate_mesh({2, 2}, {"dp", "tp"}, 4, 4); });
  EXPECT_THAT(msg, HasSubstr("rank 4 is out of range [0, 4)"));
}

TEST(MeshLayout, RejectsUnknownDimName) {
  auto msg = error_of([] { mesh_dim_index({"dp", "tp"}, "pp"); });
  EXPECT_THAT(msg, HasSubstr("unknown dim name 'pp'"));
  EXPECT_THAT(msg, HasSubstr("'dp', 'tp'"));
}

TEST(MeshLayout, RejectsDuplicateNamesMismatchedLengthsAndEmptySizes) {
  EXPECT_THAT(error_of([] { validate_mesh({2, 2}, {"dp", "dp"}, 4, 0); }), HasSubstr("'dp' appears twice"));
  EXPECT_THAT(error_of([] { validate_mesh({2, 2}, {"dp"}, 4, 0); }), HasSubstr("2 dim sizes but 1 dim names"));
  EXPECT_THAT(error_of([] { validate_mesh({2, 0}, {"dp", "tp"}, 0, 0); }), HasSubstr("dim 'tp' has size 0"));
  EXPECT_THAT(error_of([] { validate_mesh({}, {}, 1, 0); }), HasSubstr("at least one dim"));
}

// Note [CUDA device of a rank]: the index arithmetic, without a GPU.
TEST(MeshLayout, CudaDeviceIndexComesFromTheCallerThenLocalRankThenRankModuloGpus) {
  EXPECT_EQ(cuda_device_index(/*requested=*/2, "5", /*rank=*/7, /*device_count=*/8), 2);  // the caller wins
  EXPECT_EQ(cuda_device_index(-1, "5", 13, 8), 5);                                        // then LOCAL_RANK
  EXPECT_EQ(cuda_device_index(-1, nullptr, 13, 8), 5);                                    // then rank % GPUs
  EXPECT_EQ(cuda_device_index(-1, "", 3, 2), 1);
  EXPECT_EQ(cuda_device_index(-1, "0", 0, 1), 0);
}

TEST(MeshLayout, CudaDeviceIndexErrorsNameTheSourceAndTheVisibleGpus) {
  EXPECT_THAT(error_of([] { cuda_device_index(-1, "4", 12, 4); }),
              HasSubstr("rank 12 would use GPU 4 (from LOCAL_RANK=4) but this process sees 4 GPU(s)"));
  EXPECT_THAT(error_of([] { cuda_device_index(1, "0", 0, 1); }), HasSubstr("from MeshOptions::device_index=1"));
  EXPECT_THAT(error_of([] { cuda_device_index(-1, "1x", 1, 8); }),
              HasSubstr("LOCAL_RANK=1x is not a non-negative integer"));
  EXPECT_THAT(error_of([] { cuda_device_index(-1, "-1", 1, 8); }),
              HasSubstr("LOCAL_RANK=-1 is not a non-negative integer"));
  EXPECT_THAT(error_of([] { cuda_device_index(-1, "0", 0, 0); }), HasSubstr("this process sees no GPU (rank 0)"));
}
