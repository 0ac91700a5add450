// Whole-training-state checkpoints that do not stop training: CheckpointSaver saves what
// save_checkpoint saves (plugin/training_checkpoint.h), synchronously or asynchronously
// (options.async_save: a host snapshot at the step boundary, a background write, the commit at a later
// step boundary; Note [Async save protocol] in checkpoint/async_save.h). It owns the snapshot buffers
// and the writer thread, so keep one per training loop. Guide and costs: docs/reference/checkpoints.md.
//
//   meshddp::CheckpointSaver saver(state);
//   for (step ...) {
//     saver.step_boundary();                      // every step, every rank: commits, reports failures
//     ... train one step ...
//     if (due) saver.save("ckpt", step + 1, values, {.async_save = true});
//   }
//   saver.wait();                                 // end of training: the last save committed
#pragma once

#include "../checkpoint/save_options.h"
#include "training_checkpoint.h"

#include <memory>
#include <variant>

namespace meshddp {

class AsyncCheckpointSave;  // checkpoint/async_save.h: the snapshot buffers and the writer thread

class CheckpointSaver {
 public:
  // What step_boundary() and wait() do when a background save failed (on any rank; every rank gets
  // the same report): kThrow throws it on every rank, kWarn prints it on every rank's stderr and
  // returns it (training goes on; `latest` still names the previous checkpoint).
  enum class OnFailure { kThrow, kWarn };
  explicit CheckpointSaver(TrainingState state, OnFailure on_failure = OnFailure::kThrow);
  // A pipeline rank's chunks (several DDPs, the checkpoint over every stage's ranks).
  explicit CheckpointSaver(PipelineTrainingState state, OnFailure on_failure = OnFailure::kThrow);

  // Collective over every rank of the mesh, at a step boundary. options.async_save: snapshots the
  // state and starts the background write (returns what it stalled); else saves and commits
  // (save_checkpoint), returning its time as sync_ms. Either way a pending async save is first waited
  // for (and committed), or with options.if_busy kRefuse the save is refused, on every rank, by name.
  AsyncSaveStart save(const std::string& dir, int64_t step, const CheckpointValues& values = {},
                      const CheckpointSaveOptions& options = {});

  // Collective: call at every step boundary on every rank (no communication while no save is
  // pending; one small all-gather while one is). Reports the pending save's progress: kCommitted
  // once, or kFailed (OnFailure).
  AsyncSaveReport step_boundary();
  // Collective: the end of training (or before a load): waits for the pending save and commits it.
  AsyncSaveReport wait();

  ~CheckpointSaver();  // joins the writer thread (AsyncCheckpointSave's destructor)
  bool pending() const;
  int64_t snapshot_bytes() const;  // host memory kept for snapshots

 private:
  const AsyncSaveReport& handle(const AsyncSaveReport& report) const;
  std::variant<TrainingState, PipelineTrainingState> state_;
  OnFailure on_failure_;
  std::unique_ptr<AsyncCheckpointSave> async_;
};

}  // namespace meshddp
