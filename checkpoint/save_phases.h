// The phases of one collective checkpoint save (Note [Checkpoint layout and commit protocol] in
// checkpoint/store.h; defined in save_phases.cpp), for the two callers that run them:
// save_checkpoint_files (all three phases in one call) and AsyncCheckpointSave
// (checkpoint/async_save.h: phase 1 at the step boundary, phase 2 on a writer thread, phase 3's
// agreement at a later step boundary). Internal to checkpoint/.
#pragma once

#include "json.h"
#include "store.h"

#include <functional>
#include <string>
#include <vector>

namespace meshddp::save_phases {

constexpr const char* kManifest = "manifest.json";  // in each step directory, written last

// A rank's status in an agreement: an empty object, or {"error": message}.
inline Json status_ok() { return Json::object(); }
inline Json status_error(const std::string& e) { return Json{{"error", e}}; }

// Every rank's status (a JSON object; "error" set on failure), on every rank. Collective over `world`.
std::vector<Json> agree(c10d::ProcessGroup& world, const Json& mine, const std::string& what);
// "" when no rank failed; else one line per distinct error, naming the ranks.
std::string errors_of(const std::vector<Json>& statuses);

// One save's names and ranks; references its arguments, which must outlive it.
struct Save {
  const CheckpointMesh& mesh;
  const std::string& dir;
  const CheckpointMeta& meta;
  int64_t rank, world_size;
  std::string name, step_dir;  // step-<N>, <dir>/step-<N>

  Save(const CheckpointMesh& m, const std::string& d, const CheckpointMeta& mt);
  // Collective: every rank's status, after each rank sets its own (`work` throwing makes it an error status).
  std::vector<Json> agree_after(const std::string& what, const std::function<void(Json&)>& work) const;
  // Throws, naming every failing rank, when any status holds an error. After the directory was prepared
  // (`written`), rank 0 first removes this save's step directory (every rank is past its writes), so
  // that no half-written step stays behind.
  void fail_if_any(const std::vector<Json>& statuses, const std::string& stage, bool written = false) const;
  // The message of a failed save (fail_if_any's): `errors` is errors_of(...); `removed` what became of
  // the step directory ("" when it was left).
  std::string failure(const std::string& stage, const std::string& errors, const std::string& removed = "") const;
  // Throws `why` on every rank (called by every rank alike, after phase 1), rank 0 first removing the
  // still empty step directory.
  [[noreturn]] void refuse(const std::string& why) const;
};

// What a failed save left `latest` naming: "`latest` still names the previous checkpoint (step-4)", or
// "no checkpoint was committed yet in '<dir>'" when there is none.
std::string latest_after_failure(const std::string& dir);

// Phase 1, collective: rank 0 creates an empty step directory (never the one `latest` names) and picks
// the save id; every rank checks it saves the same step with the same `async_save` (this save's
// CheckpointSaveOptions::async_save). Returns the save id; throws on every rank.
std::string prepare(const Save& s, bool async_save);
// Phase 2, on every rank, no communication: writes, fsyncs and verifies this rank's file; `status`
// gets the file (size, CRC32C) and each piece with its checksum, for the manifest.
void write_rank_file(const Save& s, const std::string& save_id, const std::vector<CheckpointTensor>& tensors,
                     const CheckpointSaveOptions& options, Json& status);
// Phase 3, on rank 0, no communication: the manifest of the files every rank wrote (`statuses`, from
// phase 2); then writes it, moves `latest` (the commit) and prunes; a pruning failure goes into
// `status` as "prune_error" (the save stands).
Json manifest_of(const Save& s, const std::string& save_id, const std::vector<Json>& statuses);
void commit_manifest(const Save& s, const Json& manifest, const CheckpointSaveOptions& options, Json& status);
// After the commit, on rank 0: warns when rank 0's commit status holds a "prune_error".
void warn_if_pruning_failed(const Save& s, const Json& rank0_status, const CheckpointSaveOptions& options);

}  // namespace meshddp::save_phases
