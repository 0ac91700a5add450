#include "plugin/checkpoint_saver.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>

namespace meshddp {

CheckpointSaver::CheckpointSaver(TrainingState state, OnFailure on_failure)
    : state_(state), on_failure_(on_failure), async_(checkpoint_mesh_of(state)) {}
CheckpointSaver::CheckpointSaver(PipelineTrainingState state, OnFailure on_failure)
    : state_(state), on_failure_(on_failure), async_(checkpoint_mesh_of(state)) {}

AsyncSaveStart CheckpointSaver::save(const std::string& dir, int64_t step, const CheckpointValues& values,
                                     const CheckpointSaveOptions& options) {
  TrainingStatePieces pieces =
      std::visit([&](const auto& state) { return training_state_pieces(state, step, values); }, state_);
  if (options.async_save) {
    AsyncSaveStart started = async_.start(dir, pieces.meta, pieces.tensors, options);
    handle(started.previous);
    return started;
  }
  AsyncSaveStart started;
  auto t0 = std::chrono::steady_clock::now();
  if (async_.pending() && options.if_busy == CheckpointSaveOptions::IfBusy::kRefuse) {
    started.previous = async_.poll();  // collective: it may have finished since the last step boundary
    handle(started.previous);
    TORCH_CHECK(!async_.pending(), "checkpoint save of step ", step, " to '", dir, "/step-", step,
                "' refused: the async save of step ", async_.pending_step(),
                " is still being written (one save at a time; options.if_busy is IfBusy::kRefuse). Save at a ",
                "later step, or pass IfBusy::kWait to wait for it");
  } else if (async_.pending()) {
    started.previous = async_.wait();
    started.wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    handle(started.previous);
  }
  t0 = std::chrono::steady_clock::now();
  started.path = save_checkpoint_files(pieces.mesh, dir, pieces.meta, pieces.tensors, options);
  started.sync_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return started;
}

AsyncSaveReport CheckpointSaver::step_boundary() { return handle(async_.poll()); }

AsyncSaveReport CheckpointSaver::wait() { return handle(async_.wait()); }

const AsyncSaveReport& CheckpointSaver::handle(const AsyncSaveReport& report) const {
  if (!report.failed()) return report;
  TORCH_CHECK(on_failure_ != OnFailure::kThrow, report.message);
  std::fprintf(stderr, "meshddp: warning: %s (training goes on)\n", report.message.c_str());
  std::fflush(stderr);
  return report;
}

}  // namespace meshddp
