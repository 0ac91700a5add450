#include "mesh/mesh_layout.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <set>
#include <sstream>

namespace meshddp {

std::string describe_mesh_shape(const std::vector<int64_t>& sizes, const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (d > 0) out << " x ";
    out << (d < names.size() ? names[d] : std::string("?")) << "(" << sizes[d] << ")";
  }
  return out.str();
}

void validate_mesh(const std::vector<int64_t>& sizes, const std::vector<std::string>& names, int64_t world_size,
                   int64_t rank) {
  TORCH_CHECK(!sizes.empty(), "DeviceMesh: the mesh needs at least one dim; got an empty shape");
  TORCH_CHECK(sizes.size() == names.size(), "DeviceMesh: ", sizes.size(), " dim sizes but ", names.size(),
              " dim names; give one name per dim (e.g. sizes {2, 2} with names {\"dp\", \"tp\"})");
  std::set<std::string> seen;
  int64_t product = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    TORCH_CHECK(!names[d].empty(), "DeviceMesh: dim ", d, " has an empty name");
    TORCH_CHECK(seen.insert(names[d]).second, "DeviceMesh: dim name '", names[d], "' appears twice in ",
                describe_mesh_shape(sizes, names), "; dim names must be unique");
    TORCH_CHECK(sizes[d] >= 1, "DeviceMesh: dim '", names[d], "' has size ", sizes[d],
                "; every dim needs size >= 1 in ", describe_mesh_shape(sizes, names));
    product *= sizes[d];
  }
  TORCH_CHECK(product == world_size, "DeviceMesh: ", describe_mesh_shape(sizes, names), " = ", product,
              " ranks != WORLD_SIZE(", world_size, "); launch ", product,
              " ranks or change the mesh so the product of its dims is ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "DeviceMesh: rank ", rank, " is out of range [0, ", world_size, ") for ",
              describe_mesh_shape(sizes, names));
}

int64_t mesh_dim_index(const std::vector<std::string>& names, std::string_view name) {
  for (size_t d = 0; d < names.size(); ++d) {
    if (names[d] == name) return static_cast<int64_t>(d);
  }
  std::ostringstream known;
  for (size_t d = 0; d < names.size(); ++d) known << (d ? ", " : "") << "'" << names[d] << "'";
  TORCH_CHECK(false, "DeviceMesh: unknown dim name '", name, "'; this mesh has dims ", known.str());
}

std::vector<int64_t> mesh_coordinates(int64_t rank, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> coords(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    coords[d] = rank % sizes[d];
    rank /= sizes[d];
  }
  return coords;
}

int64_t mesh_rank(const std::vector<int64_t>& coords, const std::vector<int64_t>& sizes) {
  TORCH_INTERNAL_ASSERT(coords.size() == sizes.size());
  int64_t rank = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    TORCH_INTERNAL_ASSERT(coords[d] >= 0 && coords[d] < sizes[d]);
    rank = rank * sizes[d] + coords[d];
  }
  return rank;
}

std::vector<int64_t> mesh_group_ranks(int64_t rank, const std::vector<int64_t>& sizes, int64_t dim) {
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < static_cast<int64_t>(sizes.size()));
  auto coords = mesh_coordinates(rank, sizes);
  std::vector<int64_t> ranks;
  ranks.reserve(sizes[dim]);
  for (int64_t i = 0; i < sizes[dim]; ++i) {
    coords[dim] = i;
    ranks.push_back(mesh_rank(coords, sizes));
  }
  return ranks;
}

std::string mesh_group_key(const std::string& dim_name, const std::vector<int64_t>& group_ranks) {
  std::ostringstream key;
  key << dim_name << "/ranks=";
  for (size_t i = 0; i < group_ranks.size(); ++i) key << (i ? "," : "") << group_ranks[i];
  return key.str();
}

int64_t cuda_device_index(int64_t requested, const char* local_rank_env, int64_t rank, int64_t device_count) {
  TORCH_CHECK(device_count > 0, "DeviceMesh: a CUDA mesh, but this process sees no GPU (rank ", rank,
              "); check CUDA_VISIBLE_DEVICES and the driver (nvidia-smi), or use a CPU mesh");
  std::string source;
  int64_t index = 0;
  if (requested >= 0) {
    source = "MeshOptions::device_index=" + std::to_string(requested);
    index = requested;
  } else if (local_rank_env != nullptr && *local_rank_env != '\0') {
    source = std::string("LOCAL_RANK=") + local_rank_env;
    size_t used = 0;
    bool parsed = false;
    try {
      index = std::stoll(local_rank_env, &used);
      parsed = used == std::strlen(local_rank_env) && index >= 0;
    } catch (const std::exception&) {
    }
    TORCH_CHECK(parsed, "DeviceMesh: ", source, " is not a non-negative integer (rank ", rank,
                "); torchrun sets it to the process's index on its node");
  } else {
    return rank % device_count;
  }
  TORCH_CHECK(index < device_count, "DeviceMesh: rank ", rank, " would use GPU ", index, " (from ", source,
              ") but this process sees ", device_count, " GPU(s); start at most ", device_count,
              " processes per node (torchrun --nproc-per-node), or fix CUDA_VISIBLE_DEVICES");
  return index;
}

}  // namespace meshddp
