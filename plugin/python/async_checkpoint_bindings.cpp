#include "plugin/python/async_checkpoint_bindings.h"

#include "checkpoint/async_save.h"
#include "optimizer/distributed_optimizer.h"

namespace meshddp::python {
namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// (kind, step, path, message, write_ms): kind "none", "pending", "committed" or "failed".
py::tuple report_tuple(const AsyncSaveReport& r) {
  const char* kinds[] = {"none", "pending", "committed", "failed"};
  return py::make_tuple(kinds[static_cast<int>(r.kind)], r.step, r.path, r.message, r.write_ms);
}

}  // namespace

void bind_async_checkpoint(py::module_& m) {
  // One per optimizer: the snapshot buffers and the writer thread of its async saves. The calls are
  // collectives over the optimizer's checkpoint group, made at step boundaries on every rank.
  py::class_<AsyncCheckpointSave>(m, "_AsyncCheckpointSave")
      .def(py::init([](DistributedOptimizer& o) { return std::make_unique<AsyncCheckpointSave>(o.checkpoint_mesh()); }),
           py::keep_alive<1, 2>())
      .def(
          "start",
          [](AsyncCheckpointSave& a, DistributedOptimizer& o, const std::string& dir, int64_t keep_last, bool refuse) {
            CheckpointMeta meta;
            meta.optimizer = o.checkpoint_info();
            meta.step = meta.optimizer->step;
            CheckpointSaveOptions options;
            options.keep_last = keep_last;
            options.async_save = true;
            options.if_busy = refuse ? CheckpointSaveOptions::IfBusy::kRefuse : CheckpointSaveOptions::IfBusy::kWait;
            const AsyncSaveStart s = a.start(dir, meta, o.checkpoint_tensors(/*for_save=*/true), options);
            py::gil_scoped_acquire gil;
            return py::make_tuple(s.path, s.stall_ms(), s.wait_ms, s.snapshot_ms, report_tuple(s.previous));
          },
          Release())
      .def(
          "poll",
          [](AsyncCheckpointSave& a) {
            const AsyncSaveReport r = a.poll();
            py::gil_scoped_acquire gil;
            return report_tuple(r);
          },
          Release())
      .def(
          "wait",
          [](AsyncCheckpointSave& a) {
            const AsyncSaveReport r = a.wait();
            py::gil_scoped_acquire gil;
            return report_tuple(r);
          },
          Release())
      .def_property_readonly("pending", &AsyncCheckpointSave::pending)
      .def_property_readonly("snapshot_bytes", &AsyncCheckpointSave::snapshot_bytes);
}

}  // namespace meshddp::python
