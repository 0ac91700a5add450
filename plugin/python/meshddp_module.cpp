// The pybind11 module meshddp._C: binds PythonDdp, DistributedOptimizer and their configs. Thin:
// argument conversion, GIL release around anything that may wait on a collective, and C++ errors
// turned into Python RuntimeErrors with the same text. The Python-facing API (DeviceMesh handling,
// DTensor params, no_sync()) is in meshddp/*.py.
#include "optimizer/distributed_optimizer.h"
#include "plugin/linear_with_grad_in_buffer.h"
#include "plugin/python/python_ddp.h"

#include <torch/csrc/utils/pybind.h>

#include <execinfo.h>
#include <unistd.h>

#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;
using meshddp::DdpConfig;
using meshddp::DistributedOptimizer;
using meshddp::DistributedOptimizerConfig;
using meshddp::PythonDdp;

namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// Config fields settable by keyword, each by its C++ name.
template <typename Config>
struct Field {
  const char* name;
  bool Config::*flag = nullptr;
  double Config::*number = nullptr;
};

template <typename Config>
std::string field_names(const std::vector<Field<Config>>& fields, const char* extra) {
  std::string out;
  for (const auto& f : fields) out += std::string(out.empty() ? "" : ", ") + f.name;
  return out + extra;
}

// Sets `config`'s fields from keyword arguments; an unknown keyword is a TypeError naming it.
template <typename Config, typename Special>
void set_fields(Config& config, const py::kwargs& kwargs, const std::vector<Field<Config>>& fields, const char* type,
                const char* extra_names, Special special) {
  for (const auto& item : kwargs) {
    const auto key = py::cast<std::string>(item.first);
    bool done = special(key, item.second);
    for (const auto& f : fields) {
      if (done || key != f.name) continue;
      if (f.flag) config.*(f.flag) = py::cast<bool>(item.second);
      if (f.number) config.*(f.number) = py::cast<double>(item.second);
      done = true;
    }
    if (!done) {
      throw py::type_error(std::string(type) + ": no field '" + key + "'; the fields are " +
                           field_names(fields, extra_names));
    }
  }
}

DdpConfig make_ddp_config(const py::kwargs& kwargs) {
  static const std::vector<Field<DdpConfig>> fields = {
      {"overlap_grad_reduce", &DdpConfig::overlap_grad_reduce},
      {"grad_reduce_in_fp32", &DdpConfig::grad_reduce_in_fp32},
      {"pad_for_reduce_scatter", &DdpConfig::pad_for_reduce_scatter},
      {"find_unused_parameters", &DdpConfig::find_unused_parameters},
      {"gradient_accumulation_fusion", &DdpConfig::gradient_accumulation_fusion},
      {"use_distributed_optimizer", &DdpConfig::use_distributed_optimizer},
      {"broadcast_from_rank0", &DdpConfig::broadcast_from_rank0},
      {"verify_model_across_ranks", &DdpConfig::verify_model_across_ranks},
  };
  DdpConfig config;
  set_fields(config, kwargs, fields, "DdpConfig", ", bucket_bytes, comm_hook", [&](const std::string& key, py::handle value) {
    if (key == "comm_hook") {
      config.comm_hook = py::cast<std::string>(value);
      return true;
    }
    if (key != "bucket_bytes") return false;
    const auto bytes = py::cast<int64_t>(value);
    TORCH_CHECK(bytes >= 0, "DdpConfig: bucket_bytes = ", bytes, " is negative; give bytes (0 = one bucket per parameter)");
    config.bucket_bytes = static_cast<size_t>(bytes);
    return true;
  });
  config.validate();
  return config;
}

meshddp::OptimizerKind parse_kind(const std::string& kind) {
  if (kind == "adamw") return meshddp::OptimizerKind::kAdamW;
  if (kind == "sgd") return meshddp::OptimizerKind::kSgd;
  TORCH_CHECK(false, "OptimizerConfig: kind must be 'adamw' or 'sgd', got '", kind, "'");
}

DistributedOptimizerConfig make_optimizer_config(const py::kwargs& kwargs) {
  static const std::vector<Field<DistributedOptimizerConfig>> fields = {
      {"lr", nullptr, &DistributedOptimizerConfig::lr},
      {"weight_decay", nullptr, &DistributedOptimizerConfig::weight_decay},
      {"beta1", nullptr, &DistributedOptimizerConfig::beta1},
      {"beta2", nullptr, &DistributedOptimizerConfig::beta2},
      {"eps", nullptr, &DistributedOptimizerConfig::eps},
      {"momentum", nullptr, &DistributedOptimizerConfig::momentum},
      {"clip_grad_norm", nullptr, &DistributedOptimizerConfig::clip_grad_norm},
      {"overlap_param_gather", &DistributedOptimizerConfig::overlap_param_gather},
  };
  DistributedOptimizerConfig config;
  set_fields(config, kwargs, fields, "OptimizerConfig", ", kind, groups", [&](const std::string& key, py::handle value) {
    if (key == "kind") {
      config.kind = parse_kind(py::cast<std::string>(value));
    } else if (key == "groups") {
      // [(pattern, lr or None, weight_decay or None), ...]
      using Rule = std::tuple<std::string, std::optional<double>, std::optional<double>>;
      config.groups.clear();
      for (const auto& [pattern, lr, wd] : py::cast<std::vector<Rule>>(value)) config.groups.push_back({pattern, lr, wd});
    } else {
      return false;
    }
    return true;
  });
  config.validate();
  return config;
}

std::vector<meshddp::NamedTensor> named_tensors(const std::vector<std::pair<std::string, at::Tensor>>& items) {
  std::vector<meshddp::NamedTensor> out;
  for (const auto& [name, tensor] : items) out.push_back({name, tensor});
  return out;
}

// A process that ends in std::terminate (a joinable std::thread destroyed, an exception escaping a
// destructor or a thread) otherwise says only "terminate called without an active exception". Say
// where: the C++ backtrace, with write(2) only (the interpreter may be half torn down), then the
// handler that was there before (libstdc++'s prints the exception, if any, and aborts).
std::terminate_handler previous_terminate_handler = nullptr;

[[noreturn]] void report_terminate() {
  static const char kHead[] =
      "meshddp: std::terminate was called (a joinable std::thread destroyed, or a C++ exception escaping a "
      "thread or a destructor); C++ backtrace of the calling thread:\n";
  [[maybe_unused]] ssize_t written = write(STDERR_FILENO, kHead, sizeof(kHead) - 1);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  if (previous_terminate_handler != nullptr) previous_terminate_handler();
  std::abort();
}

void install_terminate_report() {
  void* frame[1];
  backtrace(frame, 1);  // loads libgcc's unwinder now, not inside the handler
  std::terminate_handler previous = std::set_terminate(report_terminate);
  if (previous != report_terminate) previous_terminate_handler = previous;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  install_terminate_report();
  m.def(
      "linear_with_grad_in_buffer",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
        return meshddp::linear_with_grad_in_buffer(input, weight, bias.value_or(at::Tensor()));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
      "torch.nn.functional.linear whose backward writes the weight and bias gradients straight into "
      "their slots of a meshddp DistributedDataParallel's flat gradient buffer (docs/python.md)");
  m.doc() = "meshddp's C++ engine (GradBuffer, DistributedOptimizer); use the meshddp package, not this module";

  // c10::Error -> RuntimeError with the message as written in C++ (no C++ backtrace).
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  py::class_<DdpConfig>(m, "DdpConfig",
                        "meshddp's DdpConfig: the C++ fields by the same names, validated on construction")
      .def(py::init(&make_ddp_config))
      .def_property_readonly("bucket_bytes", [](const DdpConfig& c) { return static_cast<int64_t>(c.bucket_bytes); })
      .def_readonly("overlap_grad_reduce", &DdpConfig::overlap_grad_reduce)
      .def_readonly("grad_reduce_in_fp32", &DdpConfig::grad_reduce_in_fp32)
      .def_readonly("pad_for_reduce_scatter", &DdpConfig::pad_for_reduce_scatter)
      .def_readonly("find_unused_parameters", &DdpConfig::find_unused_parameters)
      .def_readonly("use_distributed_optimizer", &DdpConfig::use_distributed_optimizer)
      .def_readonly("broadcast_from_rank0", &DdpConfig::broadcast_from_rank0)
      .def_readonly("verify_model_across_ranks", &DdpConfig::verify_model_across_ranks)
      .def_readonly("comm_hook", &DdpConfig::comm_hook)
      .def("__repr__", [](const DdpConfig& c) {
        return "DdpConfig(bucket_bytes=" + std::to_string(c.bucket_bytes) +
               ", overlap_grad_reduce=" + (c.overlap_grad_reduce ? "True" : "False") +
               ", grad_reduce_in_fp32=" + (c.grad_reduce_in_fp32 ? "True" : "False") +
               ", find_unused_parameters=" + (c.find_unused_parameters ? "True" : "False") +
               ", use_distributed_optimizer=" + (c.use_distributed_optimizer ? "True" : "False") +
               ", comm_hook='" + c.comm_hook + "')";
      });

  py::class_<DistributedOptimizerConfig>(m, "OptimizerConfig",
                                         "meshddp's DistributedOptimizerConfig: the C++ fields by the same names "
                                         "(kind = 'adamw' | 'sgd'; groups = [(pattern, lr, weight_decay)])")
      .def(py::init(&make_optimizer_config))
      .def_property_readonly("kind", [](const DistributedOptimizerConfig& c) {
        return c.kind == meshddp::OptimizerKind::kAdamW ? "adamw" : "sgd";
      })
      .def_readonly("lr", &DistributedOptimizerConfig::lr)
      .def_readonly("weight_decay", &DistributedOptimizerConfig::weight_decay)
      .def_readonly("beta1", &DistributedOptimizerConfig::beta1)
      .def_readonly("beta2", &DistributedOptimizerConfig::beta2)
      .def_readonly("eps", &DistributedOptimizerConfig::eps)
      .def_readonly("momentum", &DistributedOptimizerConfig::momentum)
      .def_readonly("clip_grad_norm", &DistributedOptimizerConfig::clip_grad_norm)
      .def_readonly("overlap_param_gather", &DistributedOptimizerConfig::overlap_param_gather);

  py::class_<meshddp::StepResult>(m, "StepResult")
      .def_readonly("skipped", &meshddp::StepResult::skipped)
      .def_readonly("grad_norm", &meshddp::StepResult::grad_norm)
      .def_readonly("clipped", &meshddp::StepResult::clipped)
      .def_readonly("report", &meshddp::StepResult::report)
      .def("__repr__", [](const meshddp::StepResult& r) {
        return "StepResult(skipped=" + std::string(r.skipped ? "True" : "False") +
               ", grad_norm=" + std::to_string(r.grad_norm) + ", clipped=" + (r.clipped ? "True" : "False") +
               (r.report.empty() ? "" : ", report='" + r.report + "'") + ")";
      });

  py::class_<meshddp::ParamGather::ForwardScope>(m, "_ForwardScope");

  py::class_<PythonDdp>(m, "_Ddp")
      .def(py::init([](const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                       const std::vector<std::tuple<std::string, at::Tensor, at::Tensor, int64_t>>& dtensors,
                       c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> world_group, int64_t tp_rank,
                       int64_t tp_size, const std::vector<int64_t>& dp_global_ranks, const DdpConfig& config) {
             std::vector<meshddp::DtensorParam> dts;
             for (const auto& [name, leaf, local, dim] : dtensors) dts.push_back({name, leaf, local, dim});
             meshddp::SyncGroups groups{std::move(dp_group), world_group.value_or(nullptr), tp_rank, tp_size};
             py::gil_scoped_release release;  // the checks and broadcast are collectives
             return std::make_unique<PythonDdp>(named_tensors(params), named_tensors(buffers), std::move(dts),
                                                std::move(groups), dp_global_ranks, config);
           }),
           py::arg("params"), py::arg("buffers"), py::arg("dtensors"), py::arg("dp_group"), py::arg("world_group"),
           py::arg("tp_rank"), py::arg("tp_size"), py::arg("dp_global_ranks"), py::arg("config"))
      .def("set_dtensor_grads", &PythonDdp::set_dtensor_grads)
      .def("finish_grad_sync", &PythonDdp::finish_grad_sync, Release())
      .def("zero_grad_buffer", &PythonDdp::zero_grad_buffer, Release())
      .def("set_is_last_microbatch", &PythonDdp::set_is_last_microbatch)
      .def("is_last_microbatch", [](const PythonDdp& d) { return d.grad_buffer().is_last_microbatch(); })
      .def("check_before_forward", &PythonDdp::check_before_forward)
      .def("open_forward_scope", &PythonDdp::open_forward_scope, Release())
      .def("mark_unused", &PythonDdp::mark_unused)
      .def("main_grad", &PythonDdp::main_grad)
      .def("param_names", &PythonDdp::param_names)
      .def("grad_buffer_bytes",
           [](const PythonDdp& d) {
             int64_t bytes = 0;
             for (const auto& spec : d.grad_buffer().layout().buffers) {
               bytes += spec.numel * static_cast<int64_t>(c10::elementSize(spec.key.grad_dtype));
             }
             return bytes;
           })
      .def("num_buckets", [](const PythonDdp& d) { return d.grad_buffer().layout().buckets.size(); })
      .def("buckets_launched_by_hooks", [](const PythonDdp& d) { return d.grad_buffer().buckets_launched_by_hooks(); })
      .def("grads_written_in_place", [](const PythonDdp& d) { return d.grad_buffer().grads_written_in_place(); })
      // Around writing new values into the params (load_state_dict): no sync pending, pending param
      // all-gathers done first (they would overwrite what is loaded); afterwards the distributed
      // optimizer refreshes its fp32 masters before its next step.
      .def("before_params_written",
           [](PythonDdp& d, const std::string& who) {
             d.grad_buffer().check_no_sync_pending(who.c_str());
             if (meshddp::ParamGather* gather = d.grad_buffer().param_gather()) gather->wait_all();
           },
           Release())
      .def("notify_params_changed", [](PythonDdp& d) { d.grad_buffer().notify_params_changed(); })
      // Before reading the params (state_dict): pending param all-gathers (ZeRO-1 with
      // overlap_param_gather) finish first, so the values read are this step's.
      .def(
          "finish_param_gathers",
          [](PythonDdp& d) {
            if (meshddp::ParamGather* gather = d.grad_buffer().param_gather()) gather->wait_all();
          },
          Release())
      .def_property_readonly("config", &PythonDdp::config);

  py::class_<DistributedOptimizer>(m, "_DistributedOptimizer")
      .def(py::init([](PythonDdp& ddp, const DistributedOptimizerConfig& config) {
             return std::make_unique<DistributedOptimizer>(ddp.grad_buffer(), config);
           }),
           py::keep_alive<1, 2>())
      .def("step", &DistributedOptimizer::step, Release())
      .def("finish_param_sync", &DistributedOptimizer::finish_param_sync, Release())
      .def("reload_masters_from_params", &DistributedOptimizer::reload_masters_from_params, Release())
      .def("save_checkpoint",
           [](DistributedOptimizer& o, const std::string& dir, int64_t keep_last) {
             meshddp::CheckpointSaveOptions options;
             options.keep_last = keep_last;
             return o.save_checkpoint(dir, options);
           },
           py::arg("dir"), py::arg("keep_last") = 0, Release())
      .def("load_checkpoint", [](DistributedOptimizer& o, const std::string& dir) { return o.load_checkpoint(dir); },
           Release())
      .def("set_lr", &DistributedOptimizer::set_lr, py::arg("lr"))
      .def("set_group_lr", &DistributedOptimizer::set_group_lr, py::arg("group"), py::arg("lr"))
      .def("steps_taken", &DistributedOptimizer::steps_taken)
      .def("lr_of", &DistributedOptimizer::lr_of)
      .def("memory", [](const DistributedOptimizer& o) {
        const auto m = o.memory();
        return py::dict(py::arg("param_buffer_bytes") = m.param_buffer_bytes,
                        py::arg("grad_buffer_bytes") = m.grad_buffer_bytes,
                        py::arg("master_weight_bytes") = m.master_weight_bytes,
                        py::arg("optimizer_state_bytes") = m.optimizer_state_bytes,
                        py::arg("grad_scratch_bytes") = m.grad_scratch_bytes, py::arg("total") = m.total());
      })
      .def_property_readonly("config", &DistributedOptimizer::config);
}
