// Python bindings of checkpoint/async_save.h for DistributedOptimizer.save_checkpoint(async_save=True)
// (meshddp._C._AsyncCheckpointSave; the Python side is meshddp/optimizer.py).
#pragma once

#include <torch/csrc/utils/pybind.h>

// The optimizer-only checkpoint (DistributedOptimizer::save_checkpoint / load_checkpoint), deprecated
// for users, is still read, written and tested here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace meshddp::python {

namespace py = pybind11;

void bind_async_checkpoint(py::module_& m);

}  // namespace meshddp::python
