// Which dim of a mesh is the tensor-parallel one: the one rule, used by DistributedDataParallel for a
// C++ DeviceMesh and by the Python package (meshddp._C.tp_dim_of) for a torch DeviceMesh. Pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshddp {

// The one dim besides `dp_dim` with more than one rank ("" when there is none), given the mesh's dim
// names and sizes. More than one such dim, or no dim named `dp_dim`, is an error naming the dims.
// The TP layers record the group they were parallelized over in each param's Placement, and
// GradBuffer checks that it is this dim's group, so a plan over another dim is an error, not a
// silent skip.
std::string tp_dim_of(const std::vector<std::string>& dim_names, const std::vector<int64_t>& dim_sizes,
                      const std::string& dp_dim);
// The same over several DP dims (e.g. {"dp", "cp"}: gradients are reduced over their flattened group):
// the one dim outside all of them with more than one rank. One dim: exactly the overload above.
std::string tp_dim_of(const std::vector<std::string>& dim_names, const std::vector<int64_t>& dim_sizes,
                      const std::vector<std::string>& dp_dims);

}  // namespace meshddp
