// Asynchronous checkpoint saves over one world group: the same files, manifest and commit as
// save_checkpoint_files (checkpoint/store.h), but the caller pays only a copy of its pieces to host
// memory at the step boundary; a writer thread writes, fsyncs and verifies this rank's file while
// training goes on, and the commit follows at a later step boundary. No collectives on the writer
// thread. Whole training states go through plugin/checkpoint_saver.h; docs/reference/checkpoints.md has the guide.
//
// Note [Async save protocol]
// Collectives from two threads on one Gloo or NCCL group are unsafe (their order would differ
// between ranks), and a second group made from the store for a writer thread would still need the
// ranks to agree, at a step boundary, on *when* a failure is reported, or one rank would throw at
// step 7 and another at step 8 and the next collective would hang. So every agreement runs on the
// caller's thread, at calls every rank makes at the same step boundary (start, poll, wait), over
// mesh.world; the writer thread only writes files:
//   start   (1) the snapshot: each piece copied into a host buffer of this object (reused while the
//               pieces keep their sizes and dtypes; pinned for CUDA tensors). (2) Phase 1 of the sync
//               save, collective: rank 0 makes step-<N>/ and picks the save id. (3) The writer thread
//               starts phase 2 on the snapshot: this rank's file, written, fsynced, read back, CRC checked.
//   poll    Nothing while no save is pending. Else one small all-gather: is each rank's writer done?
//           When every rank's is: an all-gather of the phase 2 statuses (as the sync save's); any
//           error -> every rank reports the same failure naming each failing rank and its file, the
//           save is dropped, `latest` never moved. Else rank 0 builds the manifest and its writer
//           thread writes it, then `latest`, then prunes (phase 3); a later poll's all-gather carries
//           rank 0's result to every rank: committed (and noted as the live run's newest), or failed.
//   wait    poll until the save is committed or failed, each rank first waiting for its own writer.
// Every rank sees the same gathered statuses, so every rank takes the same branch at the same call.
// A process killed at any point leaves what a killed sync save leaves: a step directory without a
// manifest (never loaded), or a committed one. One save at a time: start() while one is pending
// waits for it (IfBusy::kWait; it is committed first) or refuses (kRefuse), on every rank alike (the
// ranks' if_busy is agreed first).
#pragma once

#include "store.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace meshddp {

class AsyncCheckpointSave {
 public:
  explicit AsyncCheckpointSave(CheckpointMesh mesh);
  // Joins the writer thread. A save still pending is not committed (a destructor cannot agree with
  // the other ranks): it is named on stderr as abandoned, `latest` still naming the previous one.
  ~AsyncCheckpointSave();
  AsyncCheckpointSave(const AsyncCheckpointSave&) = delete;
  AsyncCheckpointSave& operator=(const AsyncCheckpointSave&) = delete;

  // Collective over mesh.world, at a step boundary (no gradient sync or param gather of this rank in
  // flight that would change the tensors while they are copied). Snapshots `tensors`, prepares
  // <dir>/step-<meta.step>/ and starts writing this rank's file in the background; returns what it
  // stalled. A save still pending is waited for first, or refused (options.if_busy), on every rank.
  // Throws on every rank when phase 1 fails (nothing started) or the save is refused; a failure of the
  // save it waited for is then named first, in the same message.
  AsyncSaveStart start(const std::string& dir, const CheckpointMeta& meta, const std::vector<CheckpointTensor>& tensors,
                       const CheckpointSaveOptions& options);

  // Collective over mesh.world, before a save of step `step` to `dir` while one is pending (start()
  // calls it; so does CheckpointSaver's synchronous save): agrees options.if_busy over mesh.world
  // (refused on every rank, naming each rank's value, when they differ: the ranks would take different
  // branches), then waits for the pending save (kWait) or, if it is still being written, refuses the
  // new one (kRefuse). Returns the pending save's report (kNone when none was pending).
  AsyncSaveReport settle_pending(int64_t step, const std::string& dir, const CheckpointSaveOptions& options);

  // Collective over mesh.world, at every step boundary (every rank, the same calls): advances the
  // pending save (Note [Async save protocol]); kNone without one, no communication then.
  AsyncSaveReport poll();
  // Collective: waits until the pending save is committed or failed (kNone without one).
  AsyncSaveReport wait();

  bool pending() const { return pending_ != nullptr; }
  int64_t pending_step() const;
  // Host memory held for snapshots: this rank's pieces' bytes, kept between saves.
  int64_t snapshot_bytes() const;

 private:
  struct Pending;
  AsyncSaveReport advance(bool block);
  // start() once no save is pending: the snapshot, phase 1 and the writer thread.
  AsyncSaveStart start_after_settling(const std::string& dir, const CheckpointMeta& meta,
                                      const std::vector<CheckpointTensor>& tensors,
                                      const CheckpointSaveOptions& options, AsyncSaveStart out);
  CheckpointMesh mesh_;
  std::vector<at::Tensor> buffers_;  // reused while the pieces keep their sizes and dtypes
  std::unique_ptr<Pending> pending_;
};

}  // namespace meshddp
