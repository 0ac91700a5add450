// Python bindings of the data-parallel side of a pipeline schedule (docs/guide/pipelines.md). The per-chunk
// controls are methods of _Ddp (meshddp_module.cpp); these are the free functions. Errors are the
// C++ ones (RuntimeError, same text).
#include "plugin/python/pipeline_bindings.h"

#include "mesh/pipeline_groups.h"
#include "plugin/pipeline.h"
#include "plugin/python/python_ddp.h"

namespace meshddp::python {

void bind_pipeline(py::module_& m) {
  m.def(
      "finalize_model_grads",
      [](const std::vector<PythonDdp*>& chunks, std::optional<int64_t> num_tokens,
         std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> pp_group) {
        std::vector<DdpEngine*> engines(chunks.begin(), chunks.end());
        FinalizeOptions options;
        options.num_tokens = num_tokens;
        options.pp_group = pp_group.value_or(nullptr);
        py::gil_scoped_release release;  // collectives
        return finalize_model_grads(engines, options);
      },
      py::arg("chunks"), py::arg("num_tokens") = py::none(), py::arg("pp_group") = py::none(),
      "finishes every chunk's gradient sync (the tied-across-stages sum included); with num_tokens, divides the "
      "buffers by the global token count (summed over DP; taken from pp_group's last rank when given). Returns "
      "that count, or -1 without num_tokens");
  m.def("declare_tied_across_stages", &declare_tied_across_stages, py::arg("param"),
        "declares `param` one copy of a weight tied across pipeline stages (embedding on the first stage, LM head "
        "on the last): summed over the embedding group before the DP reduction");
  m.def("is_tied_across_stages", &is_tied_across_stages, py::arg("param"));
  m.def("embedding_groups", &embedding_groups, py::arg("sizes"), py::arg("names"), py::arg("pp_dim") = kPipelineDim,
        "per pipeline (ranks differing only along pp_dim), [first stage, last stage]; middle stages alone");
}

}  // namespace meshddp::python
