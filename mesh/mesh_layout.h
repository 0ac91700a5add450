// Rank <-> coordinate arithmetic of an N-D device mesh, row-major like PyTorch's DeviceMesh (the
// last dim is innermost: for (dp, tp), rank = dp_index * tp_size + tp_index). Pure host logic: no
// process groups, no communication, so every rule here is unit-testable on its own.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace meshddp {

// Throws (with every operand in the message) unless: the shape and names have the same non-zero
// length, every size is >= 1, names are non-empty and unique, prod(sizes) == world_size and
// 0 <= rank < world_size.
void validate_mesh(const std::vector<int64_t>& sizes, const std::vector<std::string>& names, int64_t world_size,
                   int64_t rank);

// Index of `name` in `names`; throws naming the known dims if it is not one of them.
int64_t mesh_dim_index(const std::vector<std::string>& names, std::string_view name);

// Coordinates of `rank` in a mesh of `sizes` (row-major).
std::vector<int64_t> mesh_coordinates(int64_t rank, const std::vector<int64_t>& sizes);

// Global rank at `coords` (row-major).
int64_t mesh_rank(const std::vector<int64_t>& coords, const std::vector<int64_t>& sizes);

// The global ranks of the group along `dim` that contains `rank`: all ranks that share every other
// coordinate with it, ordered by their coordinate along `dim` (so a rank's index in this list is its
// rank inside that group).
std::vector<int64_t> mesh_group_ranks(int64_t rank, const std::vector<int64_t>& sizes, int64_t dim);

// A key naming that group, the same on every member and different for every other group of any dim,
// e.g. "dp/ranks=1,3". Used as the store prefix under which the group rendezvouses.
std::string mesh_group_key(const std::string& dim_name, const std::vector<int64_t>& group_ranks);

// The GPU index of `rank` on a CUDA mesh (Note [CUDA device of a rank] in device_mesh.cpp):
// `requested` when >= 0 (MeshOptions::device_index), else LOCAL_RANK (`local_rank_env`, null when
// unset), else rank % device_count (one process per GPU without a launcher). Throws naming the
// source of the index when it is not an integer or not below `device_count` (the GPUs this process
// sees: CUDA_VISIBLE_DEVICES applies), or when no GPU is visible.
int64_t cuda_device_index(int64_t requested, const char* local_rank_env, int64_t rank, int64_t device_count);

// "dp(2) x tp(3)" for messages.
std::string describe_mesh_shape(const std::vector<int64_t>& sizes, const std::vector<std::string>& names);

}  // namespace meshddp
