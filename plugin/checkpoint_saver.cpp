#include "plugin/checkpoint_saver.h"

#include "checkpoint/async_save.h"
#include "plugin/training_state_pieces.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>

namespace meshddp {

CheckpointSaver::CheckpointSaver(TrainingState state, OnFailure on_failure)
    : state_(state),
      on_failure_(on_failure),
      async_(std::make_unique<AsyncCheckpointSave>(checkpoint_mesh_of(state))) {}
CheckpointSaver::CheckpointSaver(PipelineTrainingState state, OnFailure on_failure)
    : state_(state),
      on_failure_(on_failure),
      async_(std::make_unique<AsyncCheckpointSave>(checkpoint_mesh_of(state))) {}

AsyncSaveStart CheckpointSaver::save(const std::string& dir, int64_t step, const CheckpointValues& values,
                                     const CheckpointSaveOptions& options) {
  TrainingStatePieces pieces =
      std::visit([&](const auto& state) { return training_state_pieces(state, step, values); }, state_);
  if (options.async_save) {
    AsyncSaveStart started = async_->start(dir, pieces.meta, pieces.tensors, options);
    handle(started.previous);
    return started;
  }
  AsyncSaveStart started;
  auto t0 = std::chrono::steady_clock::now();
  if (async_->pending()) {
    // The ranks' if_busy agreed, then the pending async save waited for, or this save refused.
    started.previous = async_->settle_pending(step, dir, options);
    if (options.if_busy == CheckpointSaveOptions::IfBusy::kWait) {
      started.wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    handle(started.previous);
  }
  t0 = std::chrono::steady_clock::now();
  started.path = save_checkpoint_files(pieces.mesh, dir, pieces.meta, pieces.tensors, options);
  started.sync_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return started;
}

CheckpointSaver::~CheckpointSaver() = default;

bool CheckpointSaver::pending() const { return async_->pending(); }

int64_t CheckpointSaver::snapshot_bytes() const { return async_->snapshot_bytes(); }

AsyncSaveReport CheckpointSaver::step_boundary() { return handle(async_->poll()); }

AsyncSaveReport CheckpointSaver::wait() { return handle(async_->wait()); }

const AsyncSaveReport& CheckpointSaver::handle(const AsyncSaveReport& report) const {
  if (!report.failed()) return report;
  TORCH_CHECK(on_failure_ != OnFailure::kThrow, report.message);
  std::fprintf(stderr, "meshddp: warning: %s (training goes on)\n", report.message.c_str());
  std::fflush(stderr);
  return report;
}

}  // namespace meshddp
