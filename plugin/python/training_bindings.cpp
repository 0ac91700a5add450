#include "plugin/python/training_bindings.h"

#include "common/grad_norm.h"
#include "grad_buffer/glob_match.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/run_stats.h"
#include "mesh/config_fields.h"
#include "mesh/process_group_factory.h"
#include "optimizer/lr_scheduler.h"
#include "plugin/python/python_ddp.h"

#include <string>
#include <utility>
#include <vector>

namespace meshddp::python {

namespace {

template <typename Style>
Style style_from_text(const std::string& text, const char* field) {
  for (Style s : {Style::kConstant, Style::kLinear, Style::kCosine}) {
    if (text == to_string(s)) return s;
  }
  throw py::value_error(std::string("LrScheduleConfig: ") + field + " must be 'constant', 'linear' or 'cosine', got '" +
                        text + "'");
}

// LrScheduleConfig(**fields): every field as a keyword, validated (LrScheduleConfig::validate) when
// the scheduler is built.
LrScheduleConfig schedule_config_from(const py::kwargs& kwargs) {
  LrScheduleConfig c;
  for (const auto& [key, value] : kwargs) {
    const auto name = py::cast<std::string>(key);
    if (name == "max_lr")
      c.max_lr = py::cast<double>(value);
    else if (name == "min_lr")
      c.min_lr = py::cast<double>(value);
    else if (name == "init_lr")
      c.init_lr = py::cast<double>(value);
    else if (name == "warmup_steps")
      c.warmup_steps = py::cast<int64_t>(value);
    else if (name == "decay_steps")
      c.decay_steps = py::cast<int64_t>(value);
    else if (name == "decay_style")
      c.decay_style = style_from_text<LrDecayStyle>(py::cast<std::string>(value), "decay_style");
    else if (name == "start_wd")
      c.start_wd = py::cast<double>(value);
    else if (name == "end_wd")
      c.end_wd = py::cast<double>(value);
    else if (name == "wd_incr_steps")
      c.wd_incr_steps = py::cast<int64_t>(value);
    else if (name == "wd_incr_style")
      c.wd_incr_style = style_from_text<WdIncrStyle>(py::cast<std::string>(value), "wd_incr_style");
    else
      throw py::type_error("LrScheduleConfig: unknown field '" + name + "'; the fields are max_lr, min_lr, init_lr, " +
                           "warmup_steps, decay_steps, decay_style, start_wd, end_wd, wd_incr_steps, wd_incr_style");
  }
  c.validate();
  return c;
}

}  // namespace

void bind_training(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<LrScheduleConfig>(m, "LrScheduleConfig",
                               "meshddp's LR schedule (Megatron's OptimizerParamScheduler): linear warm-up, then "
                               "constant / linear / cosine decay to min_lr; optionally a weight decay from start_wd "
                               "to end_wd (optimizer/lr_scheduler.h)")
      .def(py::init([](const py::kwargs& kwargs) { return schedule_config_from(kwargs); }))
      .def_readonly("max_lr", &LrScheduleConfig::max_lr)
      .def_readonly("min_lr", &LrScheduleConfig::min_lr)
      .def_readonly("init_lr", &LrScheduleConfig::init_lr)
      .def_readonly("warmup_steps", &LrScheduleConfig::warmup_steps)
      .def_readonly("decay_steps", &LrScheduleConfig::decay_steps)
      .def_property_readonly("decay_style", [](const LrScheduleConfig& c) { return to_string(c.decay_style); })
      .def_readonly("start_wd", &LrScheduleConfig::start_wd)
      .def_readonly("end_wd", &LrScheduleConfig::end_wd)
      .def_readonly("wd_incr_steps", &LrScheduleConfig::wd_incr_steps)
      .def_property_readonly("wd_incr_style", [](const LrScheduleConfig& c) { return to_string(c.wd_incr_style); })
      .def("schedules_weight_decay", &LrScheduleConfig::schedules_weight_decay);
  m.def("lr_at", &lr_at, py::arg("config"), py::arg("steps"), "the LR after `steps` optimizer steps");
  m.def("weight_decay_at", &weight_decay_at, py::arg("config"), py::arg("steps"),
        "the weight decay after `steps` optimizer steps (the config must schedule it)");
  // The schedule's step count and its state (meshddp.LrScheduler applies the values to optimizers).
  py::class_<LrScheduler>(m, "_LrScheduler")
      .def(py::init<LrScheduleConfig>())
      .def("step", &LrScheduler::step, py::arg("increment") = 1)
      .def("steps", &LrScheduler::steps)
      .def("lr", &LrScheduler::lr)
      .def("weight_decay", &LrScheduler::weight_decay)
      .def_property_readonly("config", &LrScheduler::config)
      .def("state", &LrScheduler::state)
      .def("load_state", &LrScheduler::load_state, py::arg("state"), py::arg("use_checkpoint_config") = false);

  // Over a list of DDP engines: every model chunk this rank holds (one on a plain mesh).
  const auto buffers_of = [](const std::vector<PythonDdp*>& chunks) {
    std::vector<GradBufferHandle> buffers;
    for (PythonDdp* chunk : chunks) buffers.push_back(chunk->grad_buffer());
    return buffers;
  };
  // The model chunks a rank of the pipeline holds (meshddp.pipelining.PipelineStage: its schedule's stages
  // per rank), for the norm's and the step's check that every chunk is given (grad_buffer/run_stats.h).
  m.def("_declare_pipeline_chunks",
        [](const PythonDdp& ddp, int64_t chunks) { declare_pipeline_chunks(&*ddp.grad_buffer(), chunks); });
  m.def("_pipeline_chunks_of", [](const PythonDdp& ddp) { return pipeline_chunks_of(&*ddp.grad_buffer()); });
  m.def(
      "_grad_norm", [buffers_of](const std::vector<PythonDdp*>& chunks) { return grad_norm(buffers_of(chunks)); },
      Release());
  m.def(
      "_clip_grad_norm_",
      [buffers_of](const std::vector<PythonDdp*>& chunks, double max_norm, bool error_if_nonfinite) {
        return clip_grad_norm_(buffers_of(chunks), max_norm, error_if_nonfinite);
      },
      py::arg("chunks"), py::arg("max_norm"), py::arg("error_if_nonfinite"), Release());
  m.def("_glob_match", [](const std::string& pattern, const std::string& text) { return glob_match(pattern, text); });
  m.def(
      "_verify_same_settings",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group,
         const std::vector<std::pair<std::string, std::string>>& settings, const std::string& who,
         const std::string& what) {
        ensure_cpu_backend(*group, who);
        verify_same_settings_across_ranks(*group, settings, who, what);
      },
      Release());
}

}  // namespace meshddp::python
