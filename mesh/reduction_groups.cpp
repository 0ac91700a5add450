#include "mesh/reduction_groups.h"

#include "mesh/mesh_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace meshddp {

// Note [Reduction groups]
// A parameter's gradient is summed over exactly the ranks that hold a replica of it:
//  * a dense parameter is replicated over DP and CP (CP splits activations, not weights), so it is
//    reduced over the flattened DP x CP group: flattened_groups(sizes, names, {"dp", "cp"});
//  * an expert parameter lives on one rank of each EP group, and is replicated over the ranks holding
//    the same experts: the expert-data-parallel group;
//  * TP-sharded parameters are never summed over TP (each TP rank holds a different shard), so TP
//    stays fixed in every group above.
// Layout, as Megatron-core's RankGenerator (megatron/core/parallel_state.py, default order
// "tp-cp-ep-dp-pp"): the dense generator lays ranks out as (pp, dp, cp, tp) row-major, the expert one
// as (pp, edp, ep, etp) with etp = tp; so EP takes the innermost part of the flattened DP x CP index
// (consecutive ranks of the data-parallel group) and expert DP the outer part (every ep-th one). Here
// the data-parallel group is flattened in the user's mesh order, so a (dp, cp, tp) mesh reproduces
// Megatron's groups exactly (tests/mesh/reduction_groups_test.cpp compares them). Megatron's
// expert_tensor_parallel_size != tp is not offered: the non-data-parallel dims stay fixed.
// Hierarchical ZeRO-1 follows Megatron's create_hierarchical_groups([DP/K, K]): instances are
// contiguous blocks of DP/K ranks of a data-parallel group, the cross-instance groups take the ranks
// at the same position in each block.

namespace {

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? separator : "") + items[i];
  return out;
}

std::string describe_dims(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", '" : "'") + names[i] + "'";
  return out;
}

int64_t product(const std::vector<int64_t>& sizes) {
  int64_t p = 1;
  for (int64_t s : sizes) p *= s;
  return p;
}

// Sizes of the dims at `dims` (indices).
std::vector<int64_t> sizes_at(const std::vector<int64_t>& sizes, const std::vector<int64_t>& dims) {
  std::vector<int64_t> out;
  for (int64_t d : dims) out.push_back(sizes[d]);
  return out;
}

// The divisors of n, for "pick one of ..." in messages.
std::string divisors(int64_t n) {
  std::ostringstream out;
  bool first = true;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    out << (first ? "" : ", ") << d;
    first = false;
  }
  return out.str();
}

void check_ep_size(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                   const std::vector<std::string>& data_parallel_dims, int64_t ep_size) {
  const auto dims = mesh_dim_subset(names, data_parallel_dims);
  const int64_t group_size = product(sizes_at(sizes, dims));
  std::vector<std::string> dim_names;
  std::vector<int64_t> dim_sizes;
  for (int64_t d : dims) {
    dim_names.push_back(names[d]);
    dim_sizes.push_back(sizes[d]);
  }
  TORCH_CHECK(ep_size >= 1 && group_size % ep_size == 0, "expert parallel: EP size ", ep_size, " does not divide the ",
              group_size, " ranks of the data-parallel group ", describe_mesh_shape(dim_sizes, dim_names), " of mesh ",
              describe_mesh_shape(sizes, names),
              "; EP is carved out of those ranks (as in Megatron-core), so pick an EP size among ",
              divisors(group_size));
}

void check_instances(const RankGroups& groups, int64_t instances, const std::string& what) {
  TORCH_CHECK(!groups.empty(), "hierarchical ZeRO-1: no ", what, " groups to cut into optimizer instances");
  int64_t highest = 0;
  for (const auto& group : groups) {
    for (int64_t r : group) highest = std::max(highest, r);
  }
  validate_rank_groups(groups, highest + 1, what);
  const int64_t group_size = static_cast<int64_t>(groups.front().size());
  for (const auto& group : groups) {
    TORCH_CHECK(static_cast<int64_t>(group.size()) == group_size, "hierarchical ZeRO-1: the ", what,
                " groups differ in size (", describe_ranks(groups.front()), " vs ", describe_ranks(group),
                "); optimizer instances need groups of one size");
  }
  TORCH_CHECK(instances >= 1 && group_size % instances == 0, "hierarchical ZeRO-1: ", instances,
              " optimizer instances do not divide the ", group_size, " ranks of each ", what,
              " group; each instance takes the same number of those ranks, so pick a number of instances among ",
              divisors(group_size));
}

}  // namespace

std::vector<int64_t> mesh_dim_subset(const std::vector<std::string>& names, const std::vector<std::string>& dims) {
  TORCH_CHECK(!dims.empty(), "DeviceMesh: no dims given to flatten; name at least one of ", describe_dims(names));
  std::vector<int64_t> indices;
  for (const auto& dim : dims) {
    const int64_t d = mesh_dim_index(names, dim);
    TORCH_CHECK(std::find(indices.begin(), indices.end(), d) == indices.end(), "DeviceMesh: dim '", dim,
                "' appears twice in the dims to flatten (", describe_dims(dims), "); name each dim once");
    indices.push_back(d);
  }
  std::vector<std::string> in_mesh_order;
  for (const auto& name : names) {
    if (std::find(dims.begin(), dims.end(), name) != dims.end()) in_mesh_order.push_back(name);
  }
  TORCH_CHECK(std::is_sorted(indices.begin(), indices.end()), "DeviceMesh: the dims to flatten (", describe_dims(dims),
              ") are not in mesh order (", describe_dims(names), "); give them as ", describe_dims(in_mesh_order),
              ": the mesh order fixes the ranks' order in the flattened group");
  return indices;
}

std::string flattened_dims_name(const std::vector<std::string>& dims) { return join(dims, "+"); }

std::vector<int64_t> flattened_group_ranks(int64_t rank, const std::vector<int64_t>& sizes,
                                           const std::vector<std::string>& names,
                                           const std::vector<std::string>& dims) {
  validate_mesh(sizes, names, product(sizes), rank);
  const auto indices = mesh_dim_subset(names, dims);
  const auto inner_sizes = sizes_at(sizes, indices);
  auto coords = mesh_coordinates(rank, sizes);
  std::vector<int64_t> ranks;
  for (int64_t i = 0; i < product(inner_sizes); ++i) {
    const auto inner = mesh_coordinates(i, inner_sizes);
    for (size_t k = 0; k < indices.size(); ++k) coords[indices[k]] = inner[k];
    ranks.push_back(mesh_rank(coords, sizes));
  }
  return ranks;
}

RankGroups flattened_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                            const std::vector<std::string>& dims) {
  const int64_t world_size = product(sizes);
  validate_mesh(sizes, names, world_size, 0);
  const auto indices = mesh_dim_subset(names, dims);
  RankGroups groups;
  // A group's first rank is its member at coordinate 0 along every flattened dim; ranks ascend, so
  // the groups come out ordered by first rank.
  for (int64_t r = 0; r < world_size; ++r) {
    const auto coords = mesh_coordinates(r, sizes);
    if (std::all_of(indices.begin(), indices.end(), [&](int64_t d) { return coords[d] == 0; })) {
      groups.push_back(flattened_group_ranks(r, sizes, names, dims));
    }
  }
  return groups;
}

RankGroups expert_parallel_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                                  const std::vector<std::string>& data_parallel_dims, int64_t ep_size) {
  check_ep_size(sizes, names, data_parallel_dims, ep_size);
  return contiguous_subgroups(flattened_groups(sizes, names, data_parallel_dims), ep_size);
}

RankGroups expert_data_parallel_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                                       const std::vector<std::string>& data_parallel_dims, int64_t ep_size) {
  check_ep_size(sizes, names, data_parallel_dims, ep_size);
  return strided_subgroups(flattened_groups(sizes, names, data_parallel_dims), ep_size);
}

RankGroups optimizer_instance_groups(const RankGroups& data_parallel_groups, int64_t instances,
                                     const std::string& what) {
  check_instances(data_parallel_groups, instances, what);
  return contiguous_subgroups(data_parallel_groups,
                              static_cast<int64_t>(data_parallel_groups.front().size()) / instances);
}

RankGroups cross_instance_groups(const RankGroups& data_parallel_groups, int64_t instances, const std::string& what) {
  check_instances(data_parallel_groups, instances, what);
  return strided_subgroups(data_parallel_groups, static_cast<int64_t>(data_parallel_groups.front().size()) / instances);
}

RankGroups contiguous_subgroups(const RankGroups& groups, int64_t block_size) {
  RankGroups out;
  for (const auto& group : groups) {
    const int64_t size = static_cast<int64_t>(group.size());
    TORCH_INTERNAL_ASSERT(block_size >= 1 && size % block_size == 0, "block of ", block_size, " in a group of ", size);
    for (int64_t start = 0; start < size; start += block_size) {
      out.emplace_back(group.begin() + start, group.begin() + start + block_size);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

RankGroups strided_subgroups(const RankGroups& groups, int64_t stride) {
  RankGroups out;
  for (const auto& group : groups) {
    const int64_t size = static_cast<int64_t>(group.size());
    TORCH_INTERNAL_ASSERT(stride >= 1 && size % stride == 0, "stride ", stride, " in a group of ", size);
    for (int64_t first = 0; first < stride; ++first) {
      std::vector<int64_t> sub;
      for (int64_t i = first; i < size; i += stride) sub.push_back(group[i]);
      out.push_back(std::move(sub));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void validate_rank_groups(const RankGroups& groups, int64_t world_size, const std::string& what) {
  TORCH_CHECK(!groups.empty(), "process groups '", what, "': no groups given; give a partition of ranks 0..",
              world_size - 1);
  std::vector<int64_t> group_of(world_size, -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(!groups[g].empty(), "process groups '", what, "': group ", g, " is empty");
    for (int64_t r : groups[g]) {
      TORCH_CHECK(r >= 0 && r < world_size, "process groups '", what, "': group ", g, " (", describe_ranks(groups[g]),
                  ") names rank ", r, ", outside [0, ", world_size, ")");
      TORCH_CHECK(group_of[r] < 0, "process groups '", what, "': rank ", r, " is in group ", group_of[r], " (",
                  describe_ranks(groups[group_of[r]]), ") and in group ", g, " (", describe_ranks(groups[g]),
                  "); every rank must be in exactly one group");
      group_of[r] = static_cast<int64_t>(g);
    }
  }
  for (int64_t r = 0; r < world_size; ++r) {
    TORCH_CHECK(group_of[r] >= 0, "process groups '", what, "': rank ", r, " is in no group; every rank of the ",
                world_size, " must be in exactly one");
  }
}

const std::vector<int64_t>& group_containing(const RankGroups& groups, int64_t rank, const std::string& what) {
  for (const auto& group : groups) {
    if (std::find(group.begin(), group.end(), rank) != group.end()) return group;
  }
  TORCH_CHECK(false, "process groups '", what, "': rank ", rank, " is in none of the ", groups.size(), " groups");
}

std::string describe_ranks(const std::vector<int64_t>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? "," : "") << ranks[i];
  return out.str();
}

}  // namespace meshddp
