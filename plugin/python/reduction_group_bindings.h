// Python bindings of mesh/reduction_groups.h's pure functions (meshddp._C.flattened_groups, ...).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace meshddp::python {

namespace py = pybind11;

void bind_reduction_groups(py::module_& m);

}  // namespace meshddp::python
