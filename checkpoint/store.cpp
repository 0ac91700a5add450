#include "checkpoint/store.h"

#include "checkpoint/file_check.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/save_phases.h"
#include "mesh/collectives.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <sstream>

namespace meshddp {

using save_phases::kManifest;
using save_phases::status_error;
using save_phases::status_ok;

using save_phases::agree;
using save_phases::errors_of;

TpSlice tp_slice_of(const Placement& p) {
  if (!p.is_shard() || p.tp_size == 1) return {};
  return {p.dim, p.tp_size, p.tp_rank};
}

std::vector<int64_t> global_shape_of(const at::Tensor& local, const Placement& p) {
  std::vector<int64_t> shape(local.sizes().begin(), local.sizes().end());
  if (p.is_shard()) shape[p.dim] *= p.tp_size;
  return shape;
}

std::string save_checkpoint_files(const CheckpointMesh& mesh, const std::string& dir, const CheckpointMeta& meta,
                                  const std::vector<CheckpointTensor>& tensors, const CheckpointSaveOptions& options) {
  TORCH_CHECK(mesh.world, "checkpoint save: no world group");
  const save_phases::Save s(mesh, dir, meta);
  // (1) Rank 0 prepares the directory and picks the save id; every rank checks it saves the same step
  // and agrees on async_save (before refusing it here: a rank that refused alone would leave the
  // others waiting in the agreement).
  const std::string save_id = save_phases::prepare(s, options.async_save);
  if (options.async_save) {
    s.refuse(
        "options.async_save needs an AsyncCheckpointSave (checkpoint/async_save.h) or a CheckpointSaver "
        "(plugin/checkpoint_saver.h), which own the writer thread; save_checkpoint_files saves synchronously");
  }
  // (2) Every rank writes, fsyncs and verifies its file.
  std::vector<Json> statuses =
      s.agree_after("files", [&](Json& status) { save_phases::write_rank_file(s, save_id, tensors, options, status); });
  s.fail_if_any(statuses, "writing the files", /*written=*/true);

  // (3) Rank 0 writes the manifest, then moves `latest`, then prunes.
  statuses = s.agree_after("commit", [&](Json& status) {
    if (s.rank == 0) save_phases::commit_manifest(s, save_phases::manifest_of(s, save_id, statuses), options, status);
  });
  s.fail_if_any(statuses, "writing the manifest", /*written=*/true);
  note_live_checkpoint(dir, s.name);
  save_phases::warn_if_pruning_failed(s, statuses[0], options);
  return s.step_dir;
}

std::optional<std::string> agree_on_checkpoint(const CheckpointMesh& mesh, const std::string& dir,
                                               std::optional<int64_t> step, bool allow_none) {
  TORCH_CHECK(mesh.world, "checkpoint load: no world group");
  c10d::ProcessGroup& world = *mesh.world;
  Json mine = status_ok();
  try {
    if (allow_none && !step && holds_no_checkpoint(dir)) {
      mine["none"] = dir;  // nothing to resume from: a fresh start
    } else {
      mine["found"] = resolve_checkpoint(dir, step);
    }
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  const std::vector<Json> statuses = agree(world, mine, "checkpoint load: resolve");
  const std::string errors = errors_of(statuses);
  auto finding = [](const Json& s) { return s.contains("none") ? Json("none") : s; };
  bool same = true;
  for (const Json& s : statuses) same = same && finding(s) == finding(statuses[0]);
  if (!same) {
    std::string found;
    for (size_t r = 0; r < statuses.size(); ++r) {
      found += "\n  rank " + std::to_string(r) + ": " +
               (statuses[r].contains("error")  ? "error: " + json_string(statuses[r]["error"], "error")
                : statuses[r].contains("none") ? "no checkpoint (" + json_string(statuses[r]["none"], "none") +
                                                     " is missing or holds no complete step)"
                                               : json_string(json_at(statuses[r], "found", "status"), "found"));
    }
    TORCH_CHECK(false, "checkpoint load from '", dir,
                "': the ranks found different checkpoints; nothing was loaded on ",
                "any rank. Every rank must see the same checkpoint directory (a filesystem shared by every node, the ",
                "same path on every rank). What each rank found:", found);
  }
  TORCH_CHECK(errors.empty(), "checkpoint load from '", dir, "' failed; nothing was loaded on any rank:", errors);
  if (statuses[0].contains("none")) return std::nullopt;
  return json_string(json_at(statuses[0], "found", "status"), "found");
}

CheckpointReader::CheckpointReader(const CheckpointMesh& mesh, const std::string& dir, std::optional<int64_t> step)
    : mesh_(mesh) {
  TORCH_CHECK(mesh_.world, "checkpoint load: no world group");
  c10d::ProcessGroup& world = *mesh_.world;
  path_ = *agree_on_checkpoint(mesh_, dir, step, /*allow_none=*/false);
  Json mine = status_ok();
  manifest_ = std::make_shared<const Manifest>();  // empty until parsed: a rank that fails reports no save id
  try {
    const std::string path = path_ + "/" + kManifest;
    manifest_ = std::make_shared<const Manifest>(parse_manifest(read_file(path, kMaxManifestBytes, "manifest"), path));
    const std::string dir_name = path_.substr(path_.rfind('/') + 1);
    TORCH_CHECK(checkpoint_step_of(dir_name) == manifest_->step, "checkpoint: '", path, "' holds step ",
                manifest_->step, " but its directory is named '", dir_name,
                "' (a step directory renamed or copied under another name?); ",
                "a step directory holds the step it is named after: rename it to step-", manifest_->step,
                " or pick another checkpoint");
    meta_.step = manifest_->step;
    meta_.values = manifest_->values;
    meta_.optimizer = manifest_->optimizer;
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  if (!manifest_->save_id.empty()) mine["save_id"] = manifest_->save_id;
  const std::vector<Json> statuses = agree(world, mine, "checkpoint load: manifest");
  const std::string errors = errors_of(statuses);
  TORCH_CHECK(errors.empty(), "checkpoint load from '", path_, "' failed; nothing was loaded on any rank:", errors);
  std::string ids;
  for (size_t r = 0; r < statuses.size(); ++r)
    ids += "\n  rank " + std::to_string(r) + ": " + json_text(statuses[r], -1, true);
  for (const Json& s : statuses) {
    TORCH_CHECK(s == statuses[0], "checkpoint load from '", path_, "': the ranks read manifests of ",
                "different saves (a directory that differs between nodes); nothing was loaded on any rank. Every ",
                "rank must see the same checkpoint directory. Each rank's manifest:", ids);
  }
  note_live_checkpoint(dir, path_.substr(path_.rfind('/') + 1));
}

void CheckpointReader::fail(const std::exception& error) {
  const std::string errors = errors_of(agree(*mesh_.world, status_error(message_of(error)), "checkpoint load: read"));
  TORCH_CHECK(false, "checkpoint load from '", path_, "' failed; nothing was loaded on any rank:", errors);
}

namespace {

// What a load finds wrong, the first 8 (more would bury them), and once at the end the way out of
// each kind found: a model of other names or sizes, or of another dtype, than the one saved.
struct Problems {
  std::vector<std::string> found;
  bool model_differs = false, dtype_differs = false;
  void add(const std::string& p) {
    if (found.size() < 8) found.push_back(p);
  }
  std::string text() const {
    std::string t;
    for (const std::string& p : found) t += (t.empty() ? "" : "; ") + p;
    if (model_differs) {
      t += ". The model here is not the one saved: build it with the same modules, names and sizes as at the "
           "save (its DP x TP layout may differ)";
    }
    if (dtype_differs) t += ". Cast the model to the dtype it was saved in before the load (params and buffers)";
    return t;
  }
};

// Read phase 1: the model against the manifest (a model tensor the model lacks; a wanted tensor
// missing, of another global shape, or for the model of another dtype).
void check_model_against_manifest(const Manifest& m, const std::vector<CheckpointTensor>& wanted,
                                  const std::set<std::string>& model_keys, Problems& problems) {
  for (const auto& [key, entry] : m.tensors) {
    if (key.rfind("model/", 0) == 0 && model_keys.count(key) == 0) {
      problems.add("the checkpoint has '" + key + "' (global shape " + shape_str(entry.shape) +
                   ") but this model has no such parameter or buffer");
      problems.model_differs = true;
    }
  }
  for (const CheckpointTensor& w : wanted) {
    auto it = m.tensors.find(w.key);
    if (it == m.tensors.end()) {
      if (!w.optional)
        problems.add("the checkpoint has no '" + w.key + "' (global shape " + shape_str(w.global_shape) +
                     " here): the model or the optimizer differs from the saved one");
      continue;
    }
    if (it->second.shape != w.global_shape) {
      problems.add("'" + w.key + "' has global shape " + shape_str(it->second.shape) + " in the checkpoint but " +
                   shape_str(w.global_shape) + " here");
      problems.model_differs = true;
    }
    const std::string& saved_dtype = it->second.dtype;
    if (w.key.rfind("model/", 0) == 0 && saved_dtype != safetensors_dtype(w.data.scalar_type())) {
      problems.add("'" + w.key + "' is " + saved_dtype + " in the checkpoint but " +
                   safetensors_dtype(w.data.scalar_type()) + " here");
      problems.dtype_differs = true;
    }
  }
}

// Read phase 3: the elements of `w` (any DP x TP) from the pieces of `entry` in `step_dir`'s files, as
// a new CPU tensor of w.data's dtype. Reads stay within the bounds the header and the manifest were
// checked against; `headers` caches each file's header.
at::Tensor read_wanted(const std::string& step_dir, const ManifestTensor& entry, const CheckpointTensor& w,
                       std::map<std::string, SafetensorsHeader>& headers) {
  const c10::ScalarType saved_type = scalar_type_from_safetensors(entry.dtype);
  const int64_t item = static_cast<int64_t>(c10::elementSize(saved_type));
  std::vector<Piece> saved;
  for (const ManifestPiece& p : entry.pieces) saved.push_back({{entry.dim, entry.tp_size, p.tp_rank}, p.begin, p.end});
  const std::vector<PieceCopy> copies = plan_copies(w.global_shape, saved, Piece{w.slice, w.begin, w.end});
  TORCH_INTERNAL_ASSERT(covered_numel(copies) == w.end - w.begin, "'", w.key, "': the manifest's pieces were ",
                        "checked to cover every element");
  at::Tensor out = at::empty({w.end - w.begin}, at::TensorOptions().dtype(saved_type));
  auto* dest = static_cast<char*>(out.data_ptr());
  for (const PieceCopy& c : copies) {
    const ManifestPiece& piece = entry.pieces[c.source];
    const std::string path = step_dir + "/" + piece.file;
    auto h = headers.find(path);
    if (h == headers.end()) h = headers.emplace(path, read_safetensors_header(path, file_bytes(path))).first;
    auto t = h->second.tensors.find(w.key);
    TORCH_CHECK(t != h->second.tensors.end(), "file '", path, "' has no tensor '", w.key, "' though the manifest ",
                "says it does (from another save?)");
    const int64_t piece_bytes = (piece.end - piece.begin) * item;
    TORCH_CHECK(t->second.dtype == entry.dtype && t->second.end - t->second.begin == piece_bytes, "file '", path,
                "' holds ", t->second.end - t->second.begin, " bytes of ", t->second.dtype, " for '", w.key,
                "' but the manifest says ", piece_bytes, " bytes of ", entry.dtype);
    read_file_range(path, h->second.data_start + t->second.begin + c.source_offset * item, c.numel * item,
                    dest + c.dest_offset * item);
  }
  return out.scalar_type() == w.data.scalar_type() ? out : out.to(w.data.scalar_type());
}

}  // namespace

std::vector<at::Tensor> CheckpointReader::read(const std::vector<CheckpointTensor>& wanted,
                                               const std::set<std::string>& model_keys) {
  c10d::ProcessGroup& world = *mesh_.world;
  const int64_t rank = world.getRank(), world_size = world.getSize();
  std::vector<at::Tensor> loaded(wanted.size());
  Json mine = status_ok();
  try {
    Problems problems;  // (1) the model against the manifest
    check_model_against_manifest(*manifest_, wanted, model_keys, problems);
    // (2) Every world_size-th file, verified in full.
    int64_t index = 0;
    for (const auto& [name, f] : manifest_->files) {
      if (index++ % world_size != rank) continue;
      const std::string p = file_problem(path_, name, *manifest_);
      if (!p.empty()) problems.add(p);
    }
    // (3) Every wanted piece (any rank's damage shows in the agreement below).
    std::map<std::string, SafetensorsHeader> headers;
    for (size_t i = 0; i < wanted.size() && problems.found.empty(); ++i) {
      auto it = manifest_->tensors.find(wanted[i].key);
      if (it != manifest_->tensors.end()) loaded[i] = read_wanted(path_, it->second, wanted[i], headers);
    }
    if (!problems.found.empty()) mine = status_error(problems.text());
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  const std::string errors = errors_of(agree(world, mine, "checkpoint load: read"));
  TORCH_CHECK(errors.empty(), "checkpoint load from '", path_, "' failed; nothing was loaded on any rank:", errors);
  return loaded;
}

std::set<std::string> model_keys_of_every_rank(const CheckpointMesh& mesh, const std::set<std::string>& mine) {
  std::string text;
  for (const std::string& key : mine) text += key + "\n";
  std::set<std::string> all;
  for (const std::string& keys :
       all_gather_strings(*mesh.world, text, "checkpoint load: the model keys of every rank")) {
    std::istringstream lines(keys);
    for (std::string line; std::getline(lines, line);) all.insert(line);
  }
  return all;
}

bool CheckpointReader::has(const std::string& key) const { return manifest_->tensors.count(key) > 0; }

void commit_loaded(const std::vector<CheckpointTensor>& wanted, const std::vector<at::Tensor>& loaded) {
  TORCH_INTERNAL_ASSERT(wanted.size() == loaded.size());
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < wanted.size(); ++i) {
    if (!loaded[i].defined()) continue;
    at::Tensor dest = wanted[i].data;
    TORCH_INTERNAL_ASSERT(dest.numel() == loaded[i].numel(), wanted[i].key);
    if (dest.is_contiguous()) {
      dest.view({-1}).copy_(loaded[i]);
    } else {
      dest.copy_(loaded[i].view(dest.sizes()));
    }
  }
}

}  // namespace meshddp
