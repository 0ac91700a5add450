// Reduction-group arithmetic (mesh/reduction_groups.h) as pure functions: checked by property loops
// over every mesh shape of 1 to 4 dims of sizes 1 to 3, and against Megatron-core's rank layouts.
#include "mesh/reduction_groups.h"

#include "mesh/mesh_layout.h"

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>

using namespace meshddp;
using ::testing::HasSubstr;

namespace {

const std::vector<std::string> kNames = {"a", "b", "c", "d"};

// Every shape of 1..4 dims with sizes 1..3, with dims named a, b, c, d.
std::vector<std::vector<int64_t>> all_shapes() {
  std::vector<std::vector<int64_t>> shapes;
  std::function<void(std::vector<int64_t>)> extend = [&](std::vector<int64_t> shape) {
    if (!shape.empty()) shapes.push_back(shape);
    if (shape.size() == 4) return;
    for (int64_t s = 1; s <= 3; ++s) {
      auto longer = shape;
      longer.push_back(s);
      extend(longer);
    }
  };
  extend({});
  return shapes;
}

std::vector<std::string> names_of(const std::vector<int64_t>& shape) {
  return {kNames.begin(), kNames.begin() + static_cast<int64_t>(shape.size())};
}

// Every non-empty subset of the dims, in mesh order.
std::vector<std::vector<std::string>> all_dim_subsets(const std::vector<std::string>& names) {
  std::vector<std::vector<std::string>> subsets;
  for (uint32_t mask = 1; mask < (1u << names.size()); ++mask) {
    std::vector<std::string> subset;
    for (size_t d = 0; d < names.size(); ++d) {
      if (mask & (1u << d)) subset.push_back(names[d]);
    }
    subsets.push_back(subset);
  }
  return subsets;
}

int64_t product(const std::vector<int64_t>& sizes) {
  int64_t p = 1;
  for (int64_t s : sizes) p *= s;
  return p;
}

int64_t size_over(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                  const std::vector<std::string>& dims) {
  int64_t p = 1;
  for (int64_t d : mesh_dim_subset(names, dims)) p *= sizes[d];
  return p;
}

std::vector<int64_t> divisors_of(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

// Do ranks r and s have the same coordinates along every dim outside `dims`?
bool differ_only_in(int64_t r, int64_t s, const std::vector<int64_t>& sizes, const std::vector<int64_t>& dims) {
  const auto a = mesh_coordinates(r, sizes);
  const auto b = mesh_coordinates(s, sizes);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (a[d] != b[d] && std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) == dims.end()) return false;
  }
  return true;
}

std::string describe(const std::vector<int64_t>& shape, const std::vector<std::string>& dims) {
  return describe_mesh_shape(shape, names_of(shape)) + " over " + flattened_dims_name(dims);
}

// The ranks shared by two groups.
std::vector<int64_t> common(std::vector<int64_t> a, std::vector<int64_t> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::vector<int64_t> out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace

TEST(ReductionGroups, FlattenedGroupsPutEveryRankInExactlyOneGroupOfTheProductSizeForEveryShape) {
  for (const auto& shape : all_shapes()) {
    for (const auto& dims : all_dim_subsets(names_of(shape))) {
      const auto groups = flattened_groups(shape, names_of(shape), dims);
      SCOPED_TRACE(describe(shape, dims));
      EXPECT_NO_THROW(validate_rank_groups(groups, product(shape), "test"));
      EXPECT_EQ(static_cast<int64_t>(groups.size()), product(shape) / size_over(shape, names_of(shape), dims));
      for (const auto& group : groups)
        EXPECT_EQ(static_cast<int64_t>(group.size()), size_over(shape, names_of(shape), dims));
      EXPECT_TRUE(std::is_sorted(groups.begin(), groups.end()));
    }
  }
}

TEST(ReductionGroups, AParamReplicatedOverDimsIsReducedOverExactlyTheRanksWhoseCoordinatesDifferOnlyInThem) {
  for (const auto& shape : all_shapes()) {
    const auto names = names_of(shape);
    for (const auto& dims : all_dim_subsets(names)) {
      SCOPED_TRACE(describe(shape, dims));
      const auto indices = mesh_dim_subset(names, dims);
      const auto groups = flattened_groups(shape, names, dims);
      for (int64_t r = 0; r < product(shape); ++r) {
        const auto ranks = flattened_group_ranks(r, shape, names, dims);
        EXPECT_EQ(ranks, group_containing(groups, r, "test"));
        const std::set<int64_t> members(ranks.begin(), ranks.end());
        for (int64_t s = 0; s < product(shape); ++s) {
          EXPECT_EQ(members.count(s) == 1, differ_only_in(r, s, shape, indices)) << "ranks " << r << " and " << s;
        }
      }
    }
  }
}

TEST(ReductionGroups, FlattenedGroupsAreOrderedRowMajorOverTheirDimsLikeTorchFlatten) {
  // dp(2) x cp(2) x tp(2): rank = dp * 4 + cp * 2 + tp; the dp+cp group of rank 1 (tp = 1) is
  // (dp, cp) = (0,0), (0,1), (1,0), (1,1) -> 1, 3, 5, 7, as mesh["dp", "cp"]._flatten() orders it.
  EXPECT_EQ(flattened_group_ranks(1, {2, 2, 2}, {"dp", "cp", "tp"}, {"dp", "cp"}), (std::vector<int64_t>{1, 3, 5, 7}));
  EXPECT_EQ(flattened_group_ranks(6, {2, 2, 2}, {"dp", "cp", "tp"}, {"dp", "tp"}), (std::vector<int64_t>{2, 3, 6, 7}));
  EXPECT_EQ(flattened_dims_name({"dp", "cp"}), "dp+cp");
}

TEST(ReductionGroups, OneFlattenedDimIsThatDimsGroupAndTwoDimMeshesGiveTodaysDataParallelGroups) {
  for (const auto& shape : all_shapes()) {
    const auto names = names_of(shape);
    for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
      for (int64_t r = 0; r < product(shape); ++r) {
        EXPECT_EQ(flattened_group_ranks(r, shape, names, {names[d]}), mesh_group_ranks(r, shape, d))
            << describe_mesh_shape(shape, names) << " dim " << names[d] << " rank " << r;
      }
    }
  }
  for (int64_t dp = 1; dp <= 4; ++dp) {
    for (int64_t tp = 1; tp <= 4; ++tp) {
      for (int64_t r = 0; r < dp * tp; ++r) {
        EXPECT_EQ(flattened_group_ranks(r, {dp, tp}, {"dp", "tp"}, {"dp"}), mesh_group_ranks(r, {dp, tp}, 0));
      }
      // With EP 1 and one optimizer instance, every new kind of group is today's DP group or a rank alone.
      const auto dp_groups = flattened_groups({dp, tp}, {"dp", "tp"}, {"dp"});
      EXPECT_EQ(expert_data_parallel_groups({dp, tp}, {"dp", "tp"}, {"dp"}, 1), dp_groups);
      EXPECT_EQ(optimizer_instance_groups(dp_groups, 1, "dp"), dp_groups);
      for (const auto& group : expert_parallel_groups({dp, tp}, {"dp", "tp"}, {"dp"}, 1)) EXPECT_EQ(group.size(), 1u);
      for (const auto& group : cross_instance_groups(dp_groups, 1, "dp")) EXPECT_EQ(group.size(), 1u);
    }
  }
}

TEST(ReductionGroups, ExpertParallelAndExpertDataParallelGroupsCutEveryDataParallelGroupForEveryShapeAndEpSize) {
  for (const auto& shape : all_shapes()) {
    const auto names = names_of(shape);
    for (const auto& dims : all_dim_subsets(names)) {
      const int64_t dp_size = size_over(shape, names, dims);
      const auto dp_groups = flattened_groups(shape, names, dims);
      for (int64_t ep : divisors_of(dp_size)) {
        SCOPED_TRACE(describe(shape, dims) + " EP " + std::to_string(ep));
        const auto ep_groups = expert_parallel_groups(shape, names, dims, ep);
        const auto edp_groups = expert_data_parallel_groups(shape, names, dims, ep);
        EXPECT_NO_THROW(validate_rank_groups(ep_groups, product(shape), "ep"));
        EXPECT_NO_THROW(validate_rank_groups(edp_groups, product(shape), "edp"));
        for (int64_t r = 0; r < product(shape); ++r) {
          const auto& dp_group = group_containing(dp_groups, r, "dp");
          const auto& ep_group = group_containing(ep_groups, r, "ep");
          const auto& edp_group = group_containing(edp_groups, r, "edp");
          ASSERT_EQ(static_cast<int64_t>(ep_group.size()), ep);
          ASSERT_EQ(static_cast<int64_t>(edp_group.size()), dp_size / ep);
          // Both lie inside the rank's data-parallel group and meet only at the rank itself.
          EXPECT_EQ(common(ep_group, dp_group).size(), ep_group.size());
          EXPECT_EQ(common(edp_group, dp_group).size(), edp_group.size());
          EXPECT_EQ(common(ep_group, edp_group), std::vector<int64_t>{r});
          // EP: consecutive ranks of the data-parallel group; expert DP: same index modulo EP.
          const auto index = std::find(dp_group.begin(), dp_group.end(), r) - dp_group.begin();
          const auto block = index / ep * ep;
          EXPECT_EQ(ep_group, std::vector<int64_t>(dp_group.begin() + block, dp_group.begin() + block + ep));
          for (size_t i = 0; i < edp_group.size(); ++i) EXPECT_EQ(edp_group[i], dp_group[index % ep + i * ep]);
        }
      }
    }
  }
}

TEST(ReductionGroups, OptimizerInstancesAreContiguousBlocksAndCrossInstanceGroupsTakeTheSamePositionInEach) {
  for (const auto& shape : all_shapes()) {
    const auto names = names_of(shape);
    for (const auto& dims : all_dim_subsets(names)) {
      const int64_t dp_size = size_over(shape, names, dims);
      const auto dp_groups = flattened_groups(shape, names, dims);
      for (int64_t k : divisors_of(dp_size)) {
        SCOPED_TRACE(describe(shape, dims) + " instances " + std::to_string(k));
        const auto intra = optimizer_instance_groups(dp_groups, k, "dp");
        const auto inter = cross_instance_groups(dp_groups, k, "dp");
        EXPECT_NO_THROW(validate_rank_groups(intra, product(shape), "intra"));
        EXPECT_NO_THROW(validate_rank_groups(inter, product(shape), "inter"));
        for (int64_t r = 0; r < product(shape); ++r) {
          const auto& dp_group = group_containing(dp_groups, r, "dp");
          const auto& mine = group_containing(intra, r, "intra");
          const auto& across = group_containing(inter, r, "inter");
          ASSERT_EQ(static_cast<int64_t>(mine.size()), dp_size / k);
          ASSERT_EQ(static_cast<int64_t>(across.size()), k);
          EXPECT_EQ(common(mine, across), std::vector<int64_t>{r});
          const auto index = std::find(dp_group.begin(), dp_group.end(), r) - dp_group.begin();
          const auto per = dp_size / k;
          EXPECT_EQ(mine, std::vector<int64_t>(dp_group.begin() + index / per * per,
                                               dp_group.begin() + (index / per + 1) * per));
          for (int64_t i = 0; i < k; ++i) EXPECT_EQ(across[i], dp_group[index % per + i * per]);
        }
      }
    }
  }
}

// The groups Megatron-core makes, computed by running generate_masked_orthogonal_rank_groups and
// RankGenerator from NVIDIA/Megatron-LM megatron/core/parallel_state.py (commit d98e8a64, default
// order "tp-cp-ep-dp-pp", pp = 1), sorted by first rank. Dense: RankGenerator(tp, ep=1, dp, pp=1, cp);
// experts: RankGenerator(tp, ep, dp=world/(tp*ep), pp=1, cp=1).
TEST(ReductionGroups, MatchMegatronCoreOnDp2Cp2Tp2WithEp2) {
  const std::vector<int64_t> sizes = {2, 2, 2};
  const std::vector<std::string> names = {"dp", "cp", "tp"};
  EXPECT_EQ(flattened_groups(sizes, names, {"dp", "cp"}),
            (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));  // get_ranks("dp-cp")
  EXPECT_EQ(flattened_groups(sizes, names, {"cp"}), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));  // get_ranks("cp")
  EXPECT_EQ(flattened_groups(sizes, names, {"dp"}), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));  // get_ranks("dp")
  EXPECT_EQ(flattened_groups(sizes, names, {"tp"}), (RankGroups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));  // get_ranks("tp")
  EXPECT_EQ(expert_parallel_groups(sizes, names, {"dp", "cp"}, 2),
            (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));  // expert get_ranks("ep")
  EXPECT_EQ(expert_data_parallel_groups(sizes, names, {"dp", "cp"}, 2),
            (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));  // expert get_ranks("dp")
  // num_distributed_optimizer_instances = 2: ranks_with_cp[i*2:(i+1)*2] and create_hierarchical_groups level 1.
  const auto dp_cp = flattened_groups(sizes, names, {"dp", "cp"});
  EXPECT_EQ(optimizer_instance_groups(dp_cp, 2, "dp+cp"), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(cross_instance_groups(dp_cp, 2, "dp+cp"), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(ReductionGroups, MatchMegatronCoreOnDp4Tp2WithEp2AndOnDp8WithEp4) {
  EXPECT_EQ(flattened_groups({4, 2}, {"dp", "tp"}, {"dp"}), (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(expert_parallel_groups({4, 2}, {"dp", "tp"}, {"dp"}, 2), (RankGroups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(expert_data_parallel_groups({4, 2}, {"dp", "tp"}, {"dp"}, 2), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(expert_parallel_groups({8}, {"dp"}, {"dp"}, 4), (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(expert_data_parallel_groups({8}, {"dp"}, {"dp"}, 4), (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // The docstring example of generate_masked_orthogonal_rank_groups: sizes [tp, pp, dp] = [2, 4, 3]
  // in order tp-pp-dp is the row-major mesh (dp, pp, tp); its dp groups start [0, 8, 16], [1, 9, 17]
  // and end [7, 15, 23].
  const auto dp_groups = flattened_groups({3, 4, 2}, {"dp", "pp", "tp"}, {"dp"});
  EXPECT_EQ(dp_groups.front(), (std::vector<int64_t>{0, 8, 16}));
  EXPECT_EQ(dp_groups[1], (std::vector<int64_t>{1, 9, 17}));
  EXPECT_EQ(dp_groups.back(), (std::vector<int64_t>{7, 15, 23}));
}

TEST(ReductionGroups, BadDimsEpSizesAndInstanceCountsAreRefusedNamingWhatDividesWhat) {
  const std::vector<int64_t> sizes = {2, 2, 2};
  const std::vector<std::string> names = {"dp", "cp", "tp"};
  EXPECT_THAT(error_of([&] { flattened_groups(sizes, names, {"dp", "ep"}); }),
              HasSubstr("unknown dim name 'ep'; this mesh has dims 'dp', 'cp', 'tp'"));
  EXPECT_THAT(error_of([&] { flattened_groups(sizes, names, {"dp", "dp"}); }), HasSubstr("dim 'dp' appears twice"));
  EXPECT_THAT(error_of([&] { flattened_groups(sizes, names, {"cp", "dp"}); }),
              HasSubstr("are not in mesh order ('dp', 'cp', 'tp'); give them as 'dp', 'cp'"));
  EXPECT_THAT(error_of([&] { flattened_groups(sizes, names, {}); }), HasSubstr("no dims given to flatten"));
  EXPECT_THAT(error_of([&] { flattened_group_ranks(8, sizes, names, {"dp"}); }),
              HasSubstr("rank 8 is out of range [0, 8)"));
  EXPECT_THAT(error_of([&] { expert_parallel_groups(sizes, names, {"dp", "cp"}, 3); }),
              HasSubstr("EP size 3 does not divide the 4 ranks of the data-parallel group dp(2) x cp(2) of mesh "
                        "dp(2) x cp(2) x tp(2); EP is carved out of those ranks (as in Megatron-core), so pick an "
                        "EP size among 1, 2, 4"));
  EXPECT_THAT(error_of([&] { expert_data_parallel_groups(sizes, names, {"dp"}, 0); }),
              HasSubstr("EP size 0 does not divide the 2 ranks"));
  const auto dp_cp = flattened_groups(sizes, names, {"dp", "cp"});
  EXPECT_THAT(error_of([&] { optimizer_instance_groups(dp_cp, 3, "dp+cp"); }),
              HasSubstr("3 optimizer instances do not divide the 4 ranks of each dp+cp group; each instance takes "
                        "the same number of those ranks, so pick a number of instances among 1, 2, 4"));
  EXPECT_THAT(error_of([&] { cross_instance_groups({{0, 1}, {1, 2}}, 1, "x"); }),
              HasSubstr("rank 1 is in group 0 (0,1) and in group 1 (1,2)"));
  EXPECT_THAT(error_of([&] { validate_rank_groups({{0, 2}}, 3, "ep"); }), HasSubstr("'ep': rank 1 is in no group"));
  EXPECT_THAT(error_of([&] { group_containing({{0}}, 5, "ep"); }), HasSubstr("rank 5 is in none of the 1 groups"));
}
