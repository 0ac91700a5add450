// Which global ranks share a parameter on an N-D device mesh: the groups its gradient is reduced
// over. Flattened groups over a subset of dims (DP x CP for dense params), expert parallel carved out
// of the data-parallel ranks as Megatron-core does (EP and expert-data-parallel groups), and the
// instances of a hierarchical ZeRO-1 (Megatron's num_distributed_optimizer_instances). Pure host
// logic on top of mesh/mesh_layout.h: no process groups, no communication. DeviceMesh::group_of()
// makes process groups from what these functions return (Note [Reduction groups] in the .cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

// A partition of a mesh's ranks into groups: each group lists global ranks in group-rank order, the
// groups are ordered by their first rank, and every rank of the mesh is in exactly one of them. The
// functions below compute the same RankGroups on every rank, which is what creating the groups needs
// (every rank creates them in the same order).
using RankGroups = std::vector<std::vector<int64_t>>;

// Indices of `dims` in `names`. Throws unless `dims` is non-empty, every name is a dim of the mesh,
// none repeats, and they are given in mesh order (the order fixes the ranks' order in a flattened
// group, so one spelling is accepted, e.g. {"dp", "cp"} on a dp x cp x tp mesh, not {"cp", "dp"}).
std::vector<int64_t> mesh_dim_subset(const std::vector<std::string>& names, const std::vector<std::string>& dims);

// "dp+cp": the name of the group over the flattened `dims`.
std::string flattened_dims_name(const std::vector<std::string>& dims);

// The group of `rank` over the flattened `dims`: every rank whose coordinates equal `rank`'s except
// along `dims`, ordered row-major over `dims` (last innermost), as torch's
// mesh["dp", "cp"]._flatten() orders them. A parameter replicated over `dims` is reduced over it.
// Throws on a bad mesh (validate_mesh), bad dims (mesh_dim_subset) or a rank outside the mesh.
std::vector<int64_t> flattened_group_ranks(int64_t rank, const std::vector<int64_t>& sizes,
                                           const std::vector<std::string>& names, const std::vector<std::string>& dims);

// All the groups over the flattened `dims`, one per combination of the other dims' coordinates.
RankGroups flattened_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                            const std::vector<std::string>& dims);

// Expert parallel (EP) carved out of the data-parallel ranks, as Megatron-core lays it out: each
// group over the flattened `data_parallel_dims` (e.g. {"dp", "cp"}) is cut into blocks of `ep_size`
// consecutive ranks; a block is an EP group (its ranks hold different experts, tokens move between
// them by all-to-all). The other dims (e.g. TP) stay fixed: expert tensor parallel = TP. Throws unless
// 1 <= ep_size and ep_size divides the size of the data-parallel group.
RankGroups expert_parallel_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                                  const std::vector<std::string>& data_parallel_dims, int64_t ep_size);

// The expert-data-parallel groups that go with expert_parallel_groups(): the data-parallel ranks at the
// same position inside their EP group, i.e. holding the same experts (every ep_size-th rank of a
// data-parallel group). An expert parameter's gradient is reduced over these. Same checks.
RankGroups expert_data_parallel_groups(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                                       const std::vector<std::string>& data_parallel_dims, int64_t ep_size);

// Hierarchical ZeRO-1 (Megatron's num_distributed_optimizer_instances): each group of
// `data_parallel_groups` (dense: flattened_groups over {"dp", "cp"}; experts:
// expert_data_parallel_groups) is cut into `instances` contiguous blocks. The optimizer state is
// sharded within a block (reduce-scatter, all-gather); these are the blocks. `what` names the groups
// in errors (e.g. "dp+cp"). Throws unless `data_parallel_groups` is a partition of some ranks and
// 1 <= instances divides the size of each group.
RankGroups optimizer_instance_groups(const RankGroups& data_parallel_groups, int64_t instances,
                                     const std::string& what);

// The groups across instances that go with optimizer_instance_groups(): the ranks at the same
// position in each instance of a data-parallel group; the shards are all-reduced over these. Same
// checks.
RankGroups cross_instance_groups(const RankGroups& data_parallel_groups, int64_t instances, const std::string& what);

// Generic cuts of each group of `groups` (all of the same size, divisible by the argument; checked by
// the callers above, asserted here): contiguous_subgroups takes blocks of `block_size` consecutive
// members; strided_subgroups takes members i, i + stride, i + 2 * stride, ... for i < stride. The
// result is ordered by first rank.
RankGroups contiguous_subgroups(const RankGroups& groups, int64_t block_size);
RankGroups strided_subgroups(const RankGroups& groups, int64_t stride);

// Throws (naming `what`) unless `groups` is non-empty, no group is empty, and every rank in
// [0, world_size) is in exactly one group.
void validate_rank_groups(const RankGroups& groups, int64_t world_size, const std::string& what);

// The group of `groups` containing `rank`; throws naming `what` if none does.
const std::vector<int64_t>& group_containing(const RankGroups& groups, int64_t rank, const std::string& what);

// "0,2,4,6" for keys and messages.
std::string describe_ranks(const std::vector<int64_t>& ranks);

}  // namespace meshddp
