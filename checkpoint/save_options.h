// What a checkpoint save is told (CheckpointSaveOptions) and what an asynchronous one reports
// (AsyncSaveStart, AsyncSaveReport): plain values, so that the public save entry points
// (plugin/training_checkpoint.h, plugin/checkpoint_saver.h) declare them without the store behind
// them (checkpoint/store.h, checkpoint/async_save.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace meshddp {

struct CheckpointSaveOptions {
  int64_t keep_last = 0;  // > 0: after a save, keep the newest K checkpoints of the live run (this one,
                          // the one it continues, ...: Note [The live run]) and delete every other
                          // step directory; 0 = keep everything
  // true: the save returns after a snapshot of the tensors to host memory, a background thread writes
  // them, and the commit follows at a later step boundary (checkpoint/async_save.h; only through
  // AsyncCheckpointSave or plugin/checkpoint_saver.h's CheckpointSaver). false: the call returns committed.
  bool async_save = false;
  // An async save started while the previous one is still being written: kWait waits for the previous
  // one (and commits it) first, kRefuse throws on every rank naming the step still being written.
  enum class IfBusy { kWait, kRefuse };
  IfBusy if_busy = IfBusy::kWait;
  // Tests: called on each rank before its file is written (on the writer thread of an async save).
  std::function<void(const std::string& path)> before_file_written;
  // Tests: called on each rank after its file is written and verified; throwing from it is a crash
  // between files (the save fails everywhere and nothing is committed).
  std::function<void(const std::string& path)> after_file_written;
};

struct AsyncSaveReport {
  enum class Kind {
    kNone,       // no save was pending
    kPending,    // still being written (or committed) in the background
    kCommitted,  // `latest` names it
    kFailed,     // nothing committed; `latest` still names the previous checkpoint; `message` says why
  };
  Kind kind = Kind::kNone;
  int64_t step = -1;
  std::string path;        // <dir>/step-<N>
  std::string message;     // kFailed: the same text on every rank, naming each failing rank and its file
  double write_ms = 0;     // this rank's background write of its file (write, fsync, read back, CRC)
  int64_t file_bytes = 0;  // this rank's file
  bool failed() const { return kind == Kind::kFailed; }
};

struct AsyncSaveStart {
  std::string path;          // <dir>/step-<N>
  AsyncSaveReport previous;  // the save start() waited for (kind kNone when none was pending)
  double wait_ms = 0;        // waiting for it (IfBusy::kWait)
  double snapshot_ms = 0;    // copying the pieces to host memory
  double prepare_ms = 0;     // phase 1: the step directory and the save id (one agreement)
  double sync_ms = 0;        // a synchronous save (CheckpointSaver without async_save): all of it
  double stall_ms() const { return wait_ms + snapshot_ms + prepare_ms + sync_ms; }
};

}  // namespace meshddp
