// Which checkpoint of a directory a load takes and which ones a save may prune: the step directory
// names, `latest`, and the record of the live run (each manifest's "parent"). Local file reads only,
// no communication; the collective agreement on the result is in checkpoint/store.h. Used by the
// save and the load in checkpoint/store.cpp; the rule is documented in docs/reference/checkpoints.md.
//
// Note [The live run]
//   A run is a chain of checkpoints: each manifest records "parent", the step directory the run that
//   saved it had last loaded or saved in that directory (in this process), or null for a run that
//   started fresh. After a rollback (resume from an older step, then save) the new checkpoints hang
//   off the resume point and the newer ones of the old timeline are abandoned: no later checkpoint
//   names them as parent.
//   - latest: `latest` names the live run's newest checkpoint. Without `latest` (a crash between a
//     manifest and the pointer) the live run's head is the one complete checkpoint no other complete
//     checkpoint names as parent; when there are several such heads (a rollback whose pointer was
//     lost) a load refuses and lists them rather than guess.
//   - keep_last K: after a save, the K newest checkpoints of its chain (itself, its parent, ...) stay;
//     every other step directory (abandoned timelines, incomplete saves) is removed.
//   Manifests written before the record existed have no "parent": each is taken to continue the
//   next lower complete step (the old, linear assumption).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace meshddp {

// step-<N> -> N for N in [0, INT64_MAX] written without leading zeros (as the save names it); else
// -1. Pure.
int64_t checkpoint_step_of(const std::string& name);

struct CheckpointListing {
  std::vector<int64_t> complete;    // step directories with a manifest, ascending
  std::vector<int64_t> incomplete;  // step directories without one (a save that did not finish)
  std::string describe() const;     // " (complete: step-5 step-10; incomplete: none)"
};

// The step directories of `dir` (which must exist). Entries that look like step directories but are
// not (step-<digits> out of range or with leading zeros, or a file) are skipped with a warning on
// stderr, once per path and process.
CheckpointListing list_checkpoints(const std::string& dir);

constexpr int64_t kMaxLatestBytes = 4096;  // `latest` holds "step-<N>\n": 25 bytes at most
// The contents of `dir/latest` without its trailing newline; "" when there is no `latest`. Throws
// naming the file when it is not a regular file of at most kMaxLatestBytes holding exactly
// "step-<N>" and at most one newline.
std::string read_latest_pointer(const std::string& dir);

// Whether `dir` holds nothing a load could take or should have taken: it does not exist, or has no
// complete step directory and no `latest`. A fresh run may start there.
bool holds_no_checkpoint(const std::string& dir);

// The step directory a load of `dir` takes: step-<step>, or the live run's newest (Note [The live
// run]). Throws naming what is there when it cannot (no checkpoint, a damaged `latest`, a missing or
// incomplete step, several heads without `latest`), with the complete steps to choose from.
std::string resolve_checkpoint(const std::string& dir, std::optional<int64_t> step);

// The live run of this process in `dir`: the step directory name it last loaded or saved there
// ("" when none). Thread-safe; keyed by the directory's real path.
void note_live_checkpoint(const std::string& dir, const std::string& name);
std::string live_checkpoint(const std::string& dir);

// keep_last: removes every step directory of `dir` but the `keep_last` newest of `head`'s chain.
// Throws (naming the path) on the first thing it cannot read or remove.
void prune_checkpoints(const std::string& dir, const std::string& head, int64_t keep_last);

}  // namespace meshddp
