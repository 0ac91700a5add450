// Checkpoint directories: the crash-safe layout, the manifest, and the collective save and load of
// a list of tensor pieces over the whole mesh. What goes into a checkpoint is the callers' business
// (DistributedOptimizer::checkpoint_tensors, plugin/training_checkpoint.h); this file only stores pieces and
// finds them again, at any DP x TP. The format is described in docs/reference/checkpoints.md.
//
// Note [Checkpoint layout and commit protocol]
//   <dir>/step-<N>/rank<R>.safetensors   one per rank R of the world group: the pieces it owns
//   <dir>/step-<N>/manifest.json         written last, by world rank 0: tensors (global shape, TP
//                                        placement, pieces), files (size, CRC32C), step, values
//   <dir>/latest                         "step-<N>\n": the newest complete checkpoint
// Save: (1) rank 0 creates step-<N>/ (refusing to touch the step `latest` names) and picks a save id;
// all ranks agree. (2) every rank writes its file, fsyncs it, reads it back and checks its CRC; all
// ranks agree and send rank 0 their file's size, CRC and pieces. (3) rank 0 writes manifest.json
// (temp file, fsync, rename, directory fsync; with "parent": Note [The live run]), then `latest`
// the same way, then prunes (keep_last); all ranks agree. Any failure up to `latest` makes every rank
// throw the same error, before `latest` moves: the previous checkpoint stays untouched and `latest`
// keeps naming it. A pruning failure after that is a warning (the save is committed). A step
// directory without manifest.json is incomplete and never loaded. An async save runs the same three
// phases, phase 2 (and rank 0's phase 3 writes) on a writer thread, every agreement at step boundaries
// (Note [Async save protocol] in checkpoint/async_save.h; the phases: checkpoint/save_phases.h).
// Load: every rank resolves the step directory (`latest`, or the step asked for) and all agree
// (agree_on_checkpoint); every rank reads the manifest and all compare its save id; then each rank verifies every W-th
// file in full (size, save id, CRC32C), reads what it needs into temporaries and checks the model against the manifest;
// all ranks agree; only then do callers copy the temporaries into their state (commit_loaded). Nothing changes on any
// rank unless every rank succeeded.
#pragma once

#include "../mesh/placement.h"
#include "checkpoint_values.h"
#include "lineage.h"
#include "reshard.h"
#include "save_options.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

namespace meshddp {

struct Manifest;  // checkpoint/manifest.h

// One rank's piece of one tensor of the checkpoint.
struct CheckpointTensor {
  std::string key;                    // unique in the checkpoint: "model/<param or buffer>", "optim/exp_avg/<param>"...
  at::Tensor data;                    // save: elements [begin, end) of the local tensor (numel end - begin, any
                                      // device/layout); load: where they go (written only by commit_loaded)
  std::vector<int64_t> global_shape;  // the whole tensor, as if TP were 1
  TpSlice slice;                      // which TP chunk the local tensor is (dim -1: all of it)
  int64_t begin = 0, end = 0;         // flat element range of the local tensor
  bool optional = false;              // load: absent from the checkpoint is fine (the result is undefined)
};

TpSlice tp_slice_of(const Placement& placement);  // Shard(d) -> {d, tp_size, tp_rank}; others -> whole
std::vector<int64_t> global_shape_of(const at::Tensor& local, const Placement& placement);

struct CheckpointMesh {
  c10::intrusive_ptr<c10d::ProcessGroup> world;                // every rank of the mesh: saves and loads agree over it
  int64_t dp_rank = 0, dp_size = 1, tp_rank = 0, tp_size = 1;  // recorded in the manifest, for people
  int64_t pp_size = 1;  // pipeline stages (each holds other params): world = dp x tp x pp
};

struct CheckpointMeta {
  int64_t step = 0;                              // names the directory: step-<step>
  CheckpointValues values;                       // world rank 0's are saved
  std::optional<CheckpointOptimizer> optimizer;  // e.g. {"adamw", 12}; none without an optimizer
};

// Collective over mesh.world. Writes <dir>/step-<meta.step>/ as in the Note and moves `latest` to
// it; returns that directory. Throws on every rank, with every failing rank's error, if any fails.
std::string save_checkpoint_files(const CheckpointMesh& mesh, const std::string& dir, const CheckpointMeta& meta,
                                  const std::vector<CheckpointTensor>& tensors,
                                  const CheckpointSaveOptions& options = {});

// Collective over mesh.world: every rank resolves `dir` itself (resolve_checkpoint: `step`, or the
// live run's newest) and all compare. Returns the step directory, the same on every rank; nullopt
// when `allow_none` and no rank finds any checkpoint (holds_no_checkpoint). Throws on every rank when
// any rank cannot resolve it, and when ranks found different things (a directory on some ranks only,
// node-local disks that differ), naming what each rank found.
std::optional<std::string> agree_on_checkpoint(const CheckpointMesh& mesh, const std::string& dir,
                                               std::optional<int64_t> step, bool allow_none);

class CheckpointReader {
 public:
  // Collective: the ranks agree on the step directory (agree_on_checkpoint), every rank parses and
  // checks its manifest (checkpoint/manifest.h) and all compare its save id; throws on
  // every rank if any rank cannot, or they differ.
  CheckpointReader(const CheckpointMesh& mesh, const std::string& dir, std::optional<int64_t> step = std::nullopt);

  const std::string& path() const { return path_; }  // <dir>/step-<N>
  const CheckpointMeta& meta() const { return meta_; }
  const Manifest& manifest() const { return *manifest_; }  // checkpoint/manifest.h
  bool has(const std::string& key) const;

  // Collective: verifies files (size, CRC32C, header: save id, rank, every piece's dtype, shape and
  // checksum), checks `wanted` against the manifest (missing, reshaped, dtype;
  // and keys under "model/" in the checkpoint that are not in `model_keys`: a model that lost a
  // tensor), reads every wanted piece (any DP x TP) into new CPU tensors of wanted.data's dtype.
  // Throws on every rank, naming file, rank and expected vs actual, if any rank fails.
  std::vector<at::Tensor> read(const std::vector<CheckpointTensor>& wanted, const std::set<std::string>& model_keys);

  // Collective, instead of read() on a rank that failed between the constructor and read() (the
  // others are in read()): reports `error` in read()'s agreement, so every rank throws it, none hangs.
  [[noreturn]] void fail(const std::exception& error);

 private:
  CheckpointMesh mesh_;
  std::string path_;
  std::shared_ptr<const Manifest> manifest_;  // parsed and checked by the constructor
  CheckpointMeta meta_;
};

// Expert parallel: different ranks hold different params (each EP rank its own experts), so one
// rank's model lacks tensors the checkpoint rightly holds. The "model/" keys of every rank (`mine`
// on each), gathered over mesh.world, for CheckpointReader::read's check of tensors the model lacks.
// Collective over mesh.world; call it on every rank before the CheckpointReader.
std::set<std::string> model_keys_of_every_rank(const CheckpointMesh& mesh, const std::set<std::string>& mine);

// Copies each loaded tensor into its wanted.data (skipping undefined ones). Local; cannot fail on
// shapes read() produced.
void commit_loaded(const std::vector<CheckpointTensor>& wanted, const std::vector<at::Tensor>& loaded);

}  // namespace meshddp
