// Python bindings of the pipeline helpers (plugin/pipeline.h, mesh/pipeline_groups.h):
// meshddp._C.finalize_model_grads, declare_tied_across_stages, embedding_groups.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace meshddp::python {

namespace py = pybind11;

void bind_pipeline(py::module_& m);

}  // namespace meshddp::python
