// Python bindings of the checkpoint readers (checkpoint/whole_checkpoint.h, checkpoint/safetensors.h):
// meshddp._C._read_whole_checkpoint and _load_safetensors, what meshddp/consolidate.py reads with.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace meshddp::python {

namespace py = pybind11;

void bind_checkpoint_files(py::module_& m);

}  // namespace meshddp::python
