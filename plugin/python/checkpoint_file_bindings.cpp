#include "plugin/python/checkpoint_file_bindings.h"

#include "checkpoint/json.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/whole_checkpoint.h"

#include <ATen/ATen.h>

namespace meshddp::python {
namespace {

py::dict values_dict(const CheckpointValues& values) {
  py::dict out;
  for (const auto& [name, value] : values) std::visit([&](const auto& v) { out[py::str(name)] = py::cast(v); }, value);
  return out;
}

}  // namespace

void bind_checkpoint_files(py::module_& m) {
  m.def(
      "_read_whole_checkpoint",
      [](const std::string& dir, std::optional<int64_t> step, bool with_optimizer) {
        WholeCheckpoint whole;
        {
          py::gil_scoped_release release;
          whole = read_whole_checkpoint(dir, step, with_optimizer);
        }
        py::list tensors;
        for (auto& [key, tensor] : whole.tensors) tensors.append(py::make_tuple(key, tensor));
        return py::make_tuple(whole.path, whole.meta.step, values_dict(whole.meta.values),
                              json_text(optimizer_json(whole.meta.optimizer), -1, /*lossy=*/false), tensors);
      },
      py::arg("dir"), py::arg("step"), py::arg("with_optimizer"),
      "(step directory, step, values, optimizer as JSON text, [(key, whole tensor)]): every model tensor of a "
      "checkpoint (and with_optimizer every other one) TP-unsharded, read and checked as a load reads it");
  m.def(
      "_load_safetensors",
      [](const std::string& path) {
        const SafetensorsHeader header = read_safetensors_header(path, file_bytes(path));
        TORCH_CHECK(header.data_start + header.data_bytes() == file_bytes(path), "'", path, "' has ", file_bytes(path),
                    " bytes but its header ends its data at byte ", header.data_start + header.data_bytes());
        py::dict tensors;
        for (const auto& [name, t] : header.tensors) {
          at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(scalar_type_from_safetensors(t.dtype)));
          if (t.end > t.begin) read_file_range(path, header.data_start + t.begin, t.end - t.begin, out.data_ptr());
          tensors[py::str(name)] = out;
        }
        return py::make_tuple(tensors, header.metadata);
      },
      py::arg("path"), "(name -> tensor, metadata) of a safetensors file, its header checked as a checkpoint's");
}

}  // namespace meshddp::python
