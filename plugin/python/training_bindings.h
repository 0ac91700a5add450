// Python bindings of what a training loop needs besides DDP and the optimizer: the LR schedule
// (optimizer/lr_scheduler.h), the plain-DDP gradient norm and clipping (common/grad_norm.h), module-path
// glob matching (grad_buffer/glob_match.h) and the cross-rank settings check (mesh/config_fields.h).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace meshddp::python {

namespace py = pybind11;

void bind_training(py::module_& m);

}  // namespace meshddp::python
