// Python bindings of mesh/reduction_groups.h: which global ranks share a parameter on an N-D mesh
// (flattened DP x CP groups, expert parallel and expert-data-parallel groups, hierarchical ZeRO-1
// instances). Pure functions of the mesh's shape and dim names, the same arithmetic as the C++
// engine's, so a Python trainer on a torch DeviceMesh builds exactly the groups meshddp reduces over
// (meshddp.DistributedDataParallel checks its flattened DP group against flattened_group_ranks).
// Errors are the C++ ones (RuntimeError, same text).
#include "plugin/python/reduction_group_bindings.h"

#include "mesh/reduction_groups.h"

namespace meshddp::python {

void bind_reduction_groups(py::module_& m) {
  m.def("flattened_group_ranks", &flattened_group_ranks, py::arg("rank"), py::arg("sizes"), py::arg("names"),
        py::arg("dims"),
        "the ranks (indices into the mesh, row-major) of `rank`'s group over the flattened `dims` (given in mesh "
        "order), ordered as torch's mesh[dims]._flatten() orders them");
  m.def("flattened_groups", &flattened_groups, py::arg("sizes"), py::arg("names"), py::arg("dims"),
        "every group over the flattened `dims`, one per combination of the other dims' coordinates");
  m.def("expert_parallel_groups", &expert_parallel_groups, py::arg("sizes"), py::arg("names"),
        py::arg("data_parallel_dims"), py::arg("ep_size"),
        "the EP groups (Megatron-core's layout): blocks of ep_size consecutive ranks of each group over the "
        "flattened data_parallel_dims");
  m.def("expert_data_parallel_groups", &expert_data_parallel_groups, py::arg("sizes"), py::arg("names"),
        py::arg("data_parallel_dims"), py::arg("ep_size"),
        "the expert-data-parallel groups (ranks holding the same experts: every ep_size-th rank of a data-parallel "
        "group), over which expert gradients are reduced");
  m.def("optimizer_instance_groups", &optimizer_instance_groups, py::arg("data_parallel_groups"), py::arg("instances"),
        py::arg("what"),
        "hierarchical ZeRO-1: each data-parallel group cut into `instances` contiguous blocks (the optimizer "
        "state is sharded within a block); `what` names the groups in errors");
  m.def("cross_instance_groups", &cross_instance_groups, py::arg("data_parallel_groups"), py::arg("instances"),
        py::arg("what"),
        "hierarchical ZeRO-1: the ranks at the same position in each instance of a data-parallel group (the "
        "shards are all-reduced over these)");
}

}  // namespace meshddp::python
