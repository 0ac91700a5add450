// The pybind11 module meshddp._C: binds PythonDdp, DistributedOptimizer and their configs. Thin:
// argument conversion, GIL release around anything that may wait on a collective, and C++ errors
// turned into Python RuntimeErrors with the same text. The Python-facing API (DeviceMesh handling,
// DTensor params, no_sync()) is in meshddp/*.py.
#include "checkpoint/store.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "grad_buffer/tensor_subclass_values.h"
#include "mesh/collective_progress.h"
#include "mesh/launch_round.h"
#include "mesh/pipeline_groups.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "optimizer/shard_layout.h"
#include "plugin/ddp_config_fields.h"
#include "plugin/python/async_checkpoint_bindings.h"
#include "plugin/python/checkpoint_file_bindings.h"
#include "plugin/python/config_bindings.h"
#include "plugin/python/pipeline_bindings.h"
#include "plugin/python/python_ddp.h"
#include "plugin/python/reduction_group_bindings.h"
#include "plugin/python/training_bindings.h"
#include "plugin/tp_dim.h"
#include "tp/linear_with_grad_in_buffer.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <exception>
#include <execinfo.h>
#include <optional>
#include <string>
#include <tuple>
#include <unistd.h>
#include <vector>

// The optimizer-only checkpoint (DistributedOptimizer::save_checkpoint / load_checkpoint), deprecated
// for users, is still read, written and tested here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace py = pybind11;
using meshddp::DdpConfig;
using meshddp::DistributedOptimizer;
using meshddp::DistributedOptimizerConfig;
using meshddp::PythonDdp;

namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// The holder of an engine object: its destructor may wait for collectives still in flight (bucket
// reductions, param all-gathers), which may need another thread to take the GIL (a Gloo worker
// dropping a tensor's last Python reference): so it runs with the GIL released. Not while the
// interpreter finalizes: a thread that takes the GIL then is ended by Python, so keep it.
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* p) const {
    if (PyGILState_Check() && !_Py_IsFinalizing()) {
      py::gil_scoped_release release;
      delete p;
    } else {
      delete p;
    }
  }
};
template <typename T>
using EngineHolder = std::unique_ptr<T, DeleteWithoutGil<T>>;

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

// The tensor holding a DTensor's values, its `_local_tensor`, for the param dispatch mode (Note [Tensor
// subclasses under the param modes], grad_buffer/tensor_subclass_values.h); undefined for anything else.
at::Tensor subclass_local_tensor(const at::Tensor& t) {
  if (_Py_IsFinalizing()) return {};
  py::gil_scoped_acquire gil;
  py::object wrapped = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  PyObject* local = wrapped ? PyObject_GetAttrString(wrapped.ptr(), "_local_tensor") : nullptr;
  if (local == nullptr) {
    PyErr_Clear();
    return {};
  }
  const py::object holder = py::reinterpret_steal<py::object>(local);
  return THPVariable_Check(local) ? THPVariable_Unpack(local) : at::Tensor();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  install_terminate_report();
  meshddp::set_tensor_subclass_values(&subclass_local_tensor);
  m.def(
      "linear_with_grad_in_buffer",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
        return meshddp::linear_with_grad_in_buffer(input, weight, bias.value_or(at::Tensor()));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(),
      "torch.nn.functional.linear whose backward writes the weight and bias gradients straight into "
      "their slots of a meshddp DistributedDataParallel's flat gradient buffer (docs/guide/python.md)");
  m.def(
      "_register_collective_progress",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const c10::intrusive_ptr<c10d::Store>& store,
         std::vector<int64_t> global_ranks, double report_after_s, double timeout_s) {
        TORCH_CHECK(report_after_s >= 0 && timeout_s > 0,
                    "meshddp.DistributedDataParallel: stuck_report_after must be ",
                    ">= 0 (0 = off) and timeout > 0 (seconds), got ", report_after_s, " and ", timeout_s);
        auto ms = [](double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0)); };
        c10::intrusive_ptr<c10d::Store> records = store;
        if (meshddp::store_outlives_launch()) {  // Note [Launch rounds]: none of a dead launch's records
          py::gil_scoped_release no_gil;
          const int64_t round =
              meshddp::agree_on_launch_round(*store, "launch", group->getRank(), group->getSize(), ms(timeout_s));
          records = c10::make_intrusive<c10d::PrefixStore>("round" + std::to_string(round), store);
        }
        meshddp::register_collective_progress(group, records, std::move(global_ranks), ms(report_after_s),
                                              ms(timeout_s));
      },
      py::arg("group"), py::arg("store"), py::arg("global_ranks"), py::arg("report_after_s"), py::arg("timeout_s"),
      "registers a c10d group for meshddp's stuck report and timeout (mesh/collective_progress.h); the store must be "
      "private to the group and the same on all its ranks");
  m.def("tp_dim_of",
        static_cast<std::string (*)(const std::vector<std::string>&, const std::vector<int64_t>&, const std::string&)>(
            &meshddp::tp_dim_of),
        py::arg("dim_names"), py::arg("dim_sizes"), py::arg("dp_dim"),
        "the C++ rule for which mesh dim is TP: the one dim besides dp_dim with more than one rank ('' if none)");
  m.def("tp_dim_of",
        static_cast<std::string (*)(const std::vector<std::string>&, const std::vector<int64_t>&,
                                    const std::vector<std::string>&)>(&meshddp::tp_dim_of),
        py::arg("dim_names"), py::arg("dim_sizes"), py::arg("dp_dims"),
        "the same over several DP dims (gradients averaged over their flattened group): the one dim outside them "
        "with more than one rank ('' if none)");
  meshddp::python::bind_reduction_groups(m);
  meshddp::python::bind_async_checkpoint(m);
  meshddp::python::bind_checkpoint_files(m);
  meshddp::python::bind_pipeline(m);
  meshddp::python::bind_training(m);
  m.def("_declare_expert_param", &meshddp::declare_expert_param, py::arg("param"),
        "marks a param's (local) tensor as an expert param (mesh/placement.h), before DDP is built");
  m.def("_is_expert_param", &meshddp::is_expert_param, py::arg("param"));
  m.doc() = "meshddp's C++ engine (GradBuffer, DistributedOptimizer); use the meshddp package, not this module";

  // c10::Error -> RuntimeError with the message as written in C++ (no C++ backtrace).
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  py::class_<DdpConfig> ddp_config(
      m, "DdpConfig",
      "meshddp's DdpConfig: the C++ fields by the same names (DdpConfig.field_names()), "
      "as keywords or properties; validate() checks the ranges (DistributedDataParallel does, after the ranks "
      "agreed on them)");
  meshddp::python::bind_config_fields(ddp_config, meshddp::kDdpConfigFields, "DdpConfig");

  py::class_<DistributedOptimizerConfig> optimizer_config(
      m, "DistributedOptimizerConfig",
      "meshddp's DistributedOptimizerConfig (alias: OptimizerConfig): the C++ fields by the same names "
      "(DistributedOptimizerConfig.field_names()), as "
      "keywords or properties; validate() checks the ranges (DistributedOptimizer does, after the ranks agreed on "
      "them); kind = 'adamw' | 'sgd', fused_step = 'auto' | 'always' | "
      "'never', groups = [(pattern, lr or None, weight_decay or None)]");
  meshddp::python::bind_config_fields(optimizer_config, meshddp::kOptimizerConfigFields, "DistributedOptimizerConfig");
  m.attr("OptimizerConfig") = optimizer_config;  // the short name, an alias (as in C++)

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

  py::class_<PythonDdp::ForwardScope>(m, "_ForwardScope");
  py::class_<PythonDdp::CompiledSectionScope>(m, "_CompiledSectionScope")
      .def("params", &PythonDdp::CompiledSectionScope::params);

  py::class_<PythonDdp, EngineHolder<PythonDdp>>(m, "_Ddp")
      .def(py::init([](const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                       const std::vector<std::tuple<std::string, at::Tensor, at::Tensor, int64_t>>& dtensors,
                       c10::intrusive_ptr<c10d::ProcessGroup> dp_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> world_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> tp_group, int64_t tp_rank,
                       int64_t tp_size, const std::vector<int64_t>& dp_global_ranks, const DdpConfig& config,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> embedding_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> expert_dp_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> instance_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> cross_instance_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> expert_instance_group,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> pipeline_group) {
             std::vector<meshddp::DtensorParam> dts;
             for (const auto& [name, leaf, local, dim] : dtensors) dts.push_back({name, leaf, local, dim});
             // The TP group: the TP broadcast of replicated params and the TP-replica check (DdpEngine).
             // Hierarchical ZeRO-1: buckets reduce-scatter over the instance, the DP group stays whole.
             // The world group (the optimizer's gradient norm and non-finite check, check_for_nan_in_grad:
             // SyncGroups::stats_group) is then at least the whole DP group, as the C++ mesh constructor
             // has it: with no TP dim there is none, and the instance in its place would give each
             // instance its own norm (the other instances' ranks 0), clipping and skipping apart.
             if (!world_group && instance_group) world_group = dp_group;
             meshddp::SyncGroups groups{instance_group.value_or(dp_group), world_group.value_or(nullptr), tp_rank,
                                        tp_size, tp_group.value_or(nullptr), cross_instance_group.value_or(nullptr),
                                        expert_dp_group.value_or(nullptr)};
             groups.embedding = embedding_group.value_or(nullptr);  // weights tied across pipeline stages
             groups.pipeline = pipeline_group.value_or(nullptr);    // norms and non-finite checks span the stages
             // Expert buckets sharded within the instance (SyncGroups::expert_instance; EP 1: the instance).
             groups.expert_instance = expert_instance_group.value_or(nullptr);
             py::gil_scoped_release release;  // the checks and broadcast are collectives
             return EngineHolder<PythonDdp>(new PythonDdp(named_tensors(params), named_tensors(buffers), std::move(dts),
                                                          std::move(groups), dp_global_ranks, config,
                                                          instance_group ? dp_group : c10::intrusive_ptr<c10d::ProcessGroup>()));
           }),
           py::arg("params"), py::arg("buffers"), py::arg("dtensors"), py::arg("dp_group"), py::arg("world_group"),
           py::arg("tp_group"), py::arg("tp_rank"), py::arg("tp_size"), py::arg("dp_global_ranks"), py::arg("config"),
           py::arg("embedding_group") = py::none(), py::arg("expert_dp_group") = py::none(),
           py::arg("instance_group") = py::none(), py::arg("cross_instance_group") = py::none(),
           py::arg("expert_instance_group") = py::none(), py::arg("pipeline_group") = py::none())
      .def("set_dtensor_grads", &PythonDdp::set_dtensor_grads)
      // The controls a pipeline schedule drives (plugin/pipeline.h, docs/guide/pipelines.md).
      .def("start_grad_sync", &PythonDdp::start_grad_sync, Release())
      .def("set_requires_gradient_sync", &PythonDdp::set_requires_gradient_sync, py::arg("requires_sync"))
      .def("requires_gradient_sync", &PythonDdp::requires_gradient_sync)
      .def("scale_gradients", &PythonDdp::scale_gradients, py::arg("factor"), Release())
      .def("broadcast_params", &PythonDdp::broadcast_params, Release())
      .def("check_tied_params_identical", &PythonDdp::check_tied_params_identical, Release())
      .def("grad_sync_finished", &PythonDdp::grad_sync_finished)
      .def("finish_grad_sync", &PythonDdp::finish_grad_sync, Release())
      .def("zero_grad_buffer", &PythonDdp::zero_grad_buffer, Release())
      .def("buffers_broadcast_due", &PythonDdp::buffers_broadcast_due)
      .def("set_buffers_broadcast_due", &PythonDdp::set_buffers_broadcast_due, py::arg("due"))
      .def("set_is_last_microbatch", &PythonDdp::set_is_last_microbatch)
      .def("is_last_microbatch", [](const PythonDdp& d) { return d.grad_buffer()->is_last_microbatch(); })
      .def("check_before_forward", &PythonDdp::check_before_forward, Release())  // TP check, buffer broadcast
      .def("open_forward_scope", &PythonDdp::open_forward_scope, Release())
      .def("mark_unused", &PythonDdp::mark_unused, Release())
      .def("main_grad", &PythonDdp::main_grad)
      .def("param_names", &PythonDdp::param_names)
      .def("grad_buffer_bytes", [](const PythonDdp& d) { return d.grad_buffer()->grad_buffer_bytes(); })
      // "optim_grads_params" (ZeRO-3): the sharded params (python_ddp.h); gathers and releases are collectives.
      .def("intercept_param_reads_in_this_thread", &PythonDdp::intercept_param_reads_in_this_thread)
      .def("gather_all_params", &PythonDdp::gather_all_params, Release())
      .def("release_all_params", &PythonDdp::release_all_params, Release())
      .def("param_shard_pieces", &PythonDdp::param_shard_pieces)
      .def("param_storage_bytes", &PythonDdp::param_storage_bytes)
      .def("peak_param_storage_bytes", &PythonDdp::peak_param_storage_bytes)
      .def("reset_peak_param_storage", &PythonDdp::reset_peak_param_storage)
      .def("param_shard_bytes", &PythonDdp::param_shard_bytes)
      .def("fsdp_unit_names", &PythonDdp::fsdp_unit_names)
      // torch.compile(ddp) under "optim_grads_params": each compiled section's units (meshddp/_compiled_sections.py).
      .def("open_compiled_section", &PythonDdp::open_compiled_section, py::arg("inputs"), Release())
      .def("gather_for_compiled_backward", &PythonDdp::gather_for_compiled_backward, py::arg("params"), Release())
      .def("num_buckets", [](const PythonDdp& d) { return d.grad_buffer()->layout().buckets.size(); })
      // Per bucket (is_expert, the size of the group it is sharded over, the size of its cross-instance
      // group or 0): how ZeRO-1 shards each bucket (grad_buffer/bucket_reduction.h), for tests.
      .def("_bucket_sharding",
           [](const PythonDdp& d) {
             std::vector<std::tuple<bool, int64_t, int64_t>> out;
             const auto& buffer = *d.grad_buffer();
             for (size_t b = 0; b < buffer.layout().buckets.size(); ++b) {
               const auto& r = buffer.bucket_reduction(static_cast<int64_t>(b));
               out.emplace_back(r.expert, r.shard_size, r.cross_group ? r.cross_group->getSize() : 0);
             }
             return out;
           })
      // Per trainable param (its name, the global index of its bucket = the bucket's place in launch
      // order): where a compiled graph is split so each section's backward ends by filling whole buckets
      // (meshddp/compile.py).
      .def("_param_buckets",
           [](const PythonDdp& d) {
             std::vector<std::pair<std::string, int64_t>> out;
             const meshddp::GradBuffer& buffer = d.grad_buffer();
             for (size_t i = 0; i < buffer.params().size(); ++i) {
               out.emplace_back(buffer.params()[i].name, buffer.layout().slots[i].bucket);
             }
             return out;
           })
      .def("buckets_launched_by_hooks", [](const PythonDdp& d) { return d.grad_buffer()->stats().buckets_launched_by_hooks; })
      .def("grads_written_in_place", [](const PythonDdp& d) { return d.grad_buffer()->stats().grads_written_in_place; })
      // Around writing new values into the params (load_state_dict): no sync pending, pending param
      // all-gathers done first (they would overwrite what is loaded); afterwards the distributed
      // optimizer refreshes its fp32 masters before its next step.
      .def("before_params_written",
           [](PythonDdp& d, const std::string& who) {
             d.grad_buffer()->check_no_sync_pending(who.c_str());
             if (meshddp::ParamGather* gather = d.param_gather()) gather->wait_all();
           },
           Release())
      .def("notify_params_changed",
           [](PythonDdp& d) {
             if (meshddp::ParamBuffer* params = d.grad_buffer().param_buffer()) params->notify_params_changed();
           })
      .def("pending_param_gathers",
           [](PythonDdp& d) {
             const meshddp::ParamGather* gather = d.param_gather();
             return gather ? gather->pending() : 0;
           })
      // Before reading the params (state_dict): pending param all-gathers (ZeRO-1 with
      // overlap_param_gather) finish first, so the values read are this step's.
      .def(
          "finish_param_gathers",
          [](PythonDdp& d) {
            if (meshddp::ParamGather* gather = d.param_gather()) gather->wait_all();
          },
          Release())
      // Whether a gradient sync has begun (a backward of the last micro-batch) and finish_grad_sync()
      // has not ended it: a torch optimizer's step now would read unsynced gradients (meshddp/_guards.py).
      .def("sync_pending",
           [](const PythonDdp& d) {
             try {
               d.grad_buffer()->check_no_sync_pending("");
               return false;
             } catch (const c10::Error&) {
               return true;
             }
           })
      // Whether gradients were accumulated since zero_grad_buffer() (backwards under no_sync()) and no
      // sync has begun: a torch optimizer's step now would read each rank's local gradients (_guards.py).
      .def("unsynced_grads_accumulated",
           [](const PythonDdp& d) {
             const meshddp::GradBufferHandle buffer = d.grad_buffer();
             return buffer->stats().grads_accumulated > 0 && !buffer->grad_sync_started() &&
                    !buffer->grad_sync_finished();
           })
      // Waits for the pending param all-gathers of the buckets holding `tensors` (a module's own params,
      // in its forward pre-hook: meshddp/_guards.py).
      .def(
          "wait_param_gathers_of",
          [](PythonDdp& d, const std::vector<at::Tensor>& tensors) {
            meshddp::ParamGather* gather = d.param_gather();
            if (gather == nullptr) return;
            for (const at::Tensor& t : tensors) {
              if (!gather->wait_if_pending(t)) return;
            }
          },
          Release())
      // ZeRO-1 ownership for DistributedOptimizer.state_dict(): for DP rank `dp_rank` (any, not only
      // this one: the layout is a pure function of the params, the config and the DP size), per
      // segment (param name, first element in the flattened local param, numel, the param's numel).
      // A param lies in one bucket, so each rank owns at most one contiguous range of it.
      .def("zero1_segments",
           [](const PythonDdp& d, int64_t dp_rank) {
             const meshddp::GradBuffer& buffer = d.grad_buffer();
             TORCH_CHECK(dp_rank >= 0 && dp_rank < buffer.groups().dp_size(), "meshddp: dp_rank ", dp_rank, " is not in [0, ",
                         buffer.groups().dp_size(), ")");
             std::vector<std::tuple<std::string, int64_t, int64_t, int64_t>> out;
             for (const auto& shard : meshddp::shard_buckets(buffer.layout(), dp_rank, buffer.groups().dp_size())) {
               for (const auto& seg : shard.segments) {
                 const meshddp::NamedParam& p = buffer.params()[seg.param];
                 out.emplace_back(p.name, seg.param_offset, seg.numel, p.param.numel());
               }
             }
             return out;
           })
      .def_property_readonly("config", [](const PythonDdp& d) { return d.config(); });  // a copy: read-only

  py::class_<DistributedOptimizer, EngineHolder<DistributedOptimizer>>(m, "_DistributedOptimizer")
      .def(py::init([](PythonDdp& ddp, const DistributedOptimizerConfig& config) {
             py::gil_scoped_release release;  // the settings agreement is a collective
             return EngineHolder<DistributedOptimizer>(new DistributedOptimizer(ddp.grad_buffer(), config));
           }),
           py::keep_alive<1, 2>())
      .def("step", &DistributedOptimizer::step, Release())
      .def_static("step_together", &DistributedOptimizer::step_together, py::arg("chunks"), Release())
      .def("finish_param_sync", &DistributedOptimizer::finish_param_sync, Release())
      .def("reload_masters_from_params", &DistributedOptimizer::reload_masters_from_params, Release())
      .def(
          "save_checkpoint",
          [](DistributedOptimizer& o, const std::string& dir, int64_t keep_last) {
            meshddp::CheckpointSaveOptions options;
            options.keep_last = keep_last;
            return o.save_checkpoint(dir, options);
          },
          py::arg("dir"), py::arg("keep_last") = 0, Release())
      .def(
          "load_checkpoint", [](DistributedOptimizer& o, const std::string& dir) { return o.load_checkpoint(dir); },
          Release())
      // DistributedOptimizer.state_dict(): this rank's optimizer state as views (no copies) into its
      // shards, per segment (state kind: "master" (bf16/fp16 params only: an fp32 param is its own
      // master), "exp_avg", "exp_avg_sq" or "momentum_buffer"; param name; view; first element in the
      // flattened local param). Note [What a ZeRO-1 rank saves] in optimizer/checkpoint.cpp.
      .def(
          "state_pieces",
          [](DistributedOptimizer& o) {
            std::vector<std::tuple<std::string, std::string, at::Tensor, int64_t>> out;
            for (const auto& piece : o.checkpoint_tensors(/*for_save=*/false)) {
              if (piece.key.rfind("optim/", 0) != 0) continue;
              const std::string rest = piece.key.substr(6);
              const size_t slash = rest.find('/');
              TORCH_INTERNAL_ASSERT(slash != std::string::npos, "checkpoint key '", piece.key, "'");
              out.emplace_back(rest.substr(0, slash), rest.substr(slash + 1), piece.data, piece.begin);
            }
            return out;
          },
          Release())
      // DistributedOptimizer.load_state_dict(), after the state was written into the views of
      // state_pieces(): the step count, the masters into the param buffer, the param all-gather.
      .def(
          "finish_state_dict_load",
          [](DistributedOptimizer& o, int64_t step) {
            TORCH_CHECK(step >= 0, "meshddp.DistributedOptimizer.load_state_dict: step must be >= 0, got ", step);
            std::vector<meshddp::CheckpointTensor> wanted = o.checkpoint_tensors(/*for_save=*/false);
            std::vector<at::Tensor> loaded;
            for (const auto& piece : wanted) loaded.push_back(piece.data);
            o.finish_checkpoint_load(wanted, loaded, step);
          },
          py::arg("step"), Release())
      .def("set_lr", &DistributedOptimizer::set_lr, py::arg("lr"))
      .def("set_group_lr", &DistributedOptimizer::set_group_lr, py::arg("group"), py::arg("lr"))
      .def("set_weight_decay", &DistributedOptimizer::set_weight_decay, py::arg("weight_decay"))
      .def("group_of", &DistributedOptimizer::group_of, py::arg("param"))
      .def("set_group_weight_decay", &DistributedOptimizer::set_group_weight_decay, py::arg("group"),
           py::arg("weight_decay"))
      .def("lr", &DistributedOptimizer::lr)
      .def("num_groups", &DistributedOptimizer::num_groups)
      .def("group_lr", &DistributedOptimizer::group_lr, py::arg("group"))
      .def("group_weight_decay", &DistributedOptimizer::group_weight_decay, py::arg("group"))
      .def("steps_taken", &DistributedOptimizer::steps_taken)
      .def("lr_of", &DistributedOptimizer::lr_of)
      .def("muon_params", &DistributedOptimizer::muon_params)
      .def("memory",
           [](const DistributedOptimizer& o) {
             const auto m = o.memory();
             return py::dict(py::arg("param_buffer_bytes") = m.param_buffer_bytes,
                             py::arg("grad_buffer_bytes") = m.grad_buffer_bytes,
                             py::arg("master_weight_bytes") = m.master_weight_bytes,
                             py::arg("optimizer_state_bytes") = m.optimizer_state_bytes,
                             py::arg("grad_scratch_bytes") = m.grad_scratch_bytes, py::arg("total") = m.total());
           })
      .def_property_readonly("config", [](const DistributedOptimizer& o) { return o.config(); });  // a copy
}
