// The phases of one collective checkpoint save (save_phases.h): agreement over the world group,
// phase 1 (the step directory and the save id), phase 2 (this rank's file), phase 3 (the manifest,
// the commit and pruning). Their callers: save_checkpoint_files (store.cpp) and AsyncCheckpointSave.
#include "checkpoint/save_phases.h"

#include "checkpoint/file_check.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "mesh/collectives.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>

namespace meshddp::save_phases {
namespace {

std::string step_name(int64_t step) { return "step-" + std::to_string(step); }

std::string new_save_id() {
  std::random_device device;
  std::mt19937_64 gen((static_cast<uint64_t>(device()) << 32) ^ device() ^
                      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()));
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(gen()));
  return buf;
}

}  // namespace

// (Written lossy: an error message holding invalid UTF-8 must still arrive, or the other ranks hang.)
std::vector<Json> agree(c10d::ProcessGroup& world, const Json& mine, const std::string& what) {
  std::vector<Json> all;
  for (const std::string& text : all_gather_strings(world, json_text(mine, -1, /*lossy=*/true), what)) {
    all.push_back(parse_json(text, what));
  }
  return all;
}

std::string errors_of(const std::vector<Json>& statuses) {
  std::vector<std::pair<std::string, std::vector<size_t>>> errors;
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].contains("error")) continue;
    const std::string& e = json_string(statuses[r]["error"], "status");
    auto it = std::find_if(errors.begin(), errors.end(), [&](const auto& x) { return x.first == e; });
    if (it == errors.end()) {
      errors.push_back({e, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream out;
  for (const auto& [e, ranks] : errors) {
    out << "\n  rank" << (ranks.size() > 1 ? "s " : " ");
    for (size_t i = 0; i < ranks.size(); ++i) out << (i ? "," : "") << ranks[i];
    out << ": " << e;
  }
  return out.str();
}

Save::Save(const CheckpointMesh& m, const std::string& d, const CheckpointMeta& mt)
    : mesh(m),
      dir(d),
      meta(mt),
      rank(m.world->getRank()),
      world_size(m.world->getSize()),
      name(step_name(mt.step)),
      step_dir(d + "/" + name) {}

std::vector<Json> Save::agree_after(const std::string& what, const std::function<void(Json&)>& work) const {
  Json mine = status_ok();
  try {
    work(mine);
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  return agree(*mesh.world, mine, "checkpoint save: " + what);
}

std::string latest_after_failure(const std::string& dir) {
  if (!path_exists(dir + "/latest")) return "no checkpoint was committed yet in '" + dir + "'";
  try {
    return "`latest` still names the previous checkpoint (" + read_latest_pointer(dir) + ")";
  } catch (const std::exception&) {
    return "`latest` still names the previous checkpoint";
  }
}

std::string Save::failure(const std::string& stage, const std::string& errors, const std::string& removed) const {
  return "checkpoint save of step " + std::to_string(meta.step) + " to '" + step_dir + "' failed (" + stage +
         "); nothing was committed and " + latest_after_failure(dir) + removed + ":" + errors;
}

void Save::refuse(const std::string& why) const {
  if (rank == 0) {  // the step directory phase 1 made, still empty
    try {
      remove_tree(step_dir);
      fsync_path(dir);
    } catch (const std::exception&) {
      // The refusal below is what matters; an empty directory is harmless.
    }
  }
  TORCH_CHECK(false, "checkpoint save of step ", meta.step, " to '", step_dir, "' refused on every rank: ", why,
              "; nothing was committed and ", latest_after_failure(dir));
}

void Save::fail_if_any(const std::vector<Json>& statuses, const std::string& stage, bool written) const {
  const std::string errors = errors_of(statuses);
  if (errors.empty()) return;
  std::string removed;
  if (written && rank == 0) {
    try {
      remove_tree(step_dir);
      fsync_path(dir);
      removed = "; its step directory was removed";
    } catch (const std::exception& e) {
      removed = "; removing its step directory failed too (" + message_of(e) + "): delete it by hand";
    }
  }
  TORCH_CHECK(false, failure(stage, errors, removed));
}

namespace {

// Phase 1, on rank 0: creates an empty step directory (never the one `latest` names) and picks the save id.
std::string prepare_step_directory(const Save& s) {
  make_directories(s.dir);
  // A rollback saving over the abandoned timeline's newest (resumed from step-4, saving step-8
  // while `latest` names the old step-8): `latest` first moves back to the live run.
  const std::string live = live_checkpoint(s.dir);
  // A damaged `latest` (a load refuses it; the run was resumed with an explicit step) is
  // replaced by this save's, as a missing one is.
  const auto latest_name = [&]() -> std::string {
    try {
      return read_latest_pointer(s.dir);
    } catch (const c10::Error&) {
      return "";
    }
  };
  if (latest_name() == s.name && !live.empty() && live != s.name && path_exists(s.dir + "/" + live + "/" + kManifest)) {
    write_file_atomically(s.dir + "/latest", live + "\n");
  }
  TORCH_CHECK(latest_name() != s.name, "'", s.step_dir, "' is the latest complete checkpoint; a save never ",
              "overwrites it (save under another step, or delete it first)");
  remove_tree(s.step_dir);
  make_directories(s.step_dir);
  fsync_path(s.dir);
  return new_save_id();
}

}  // namespace

std::string prepare(const Save& s, bool async_save) {
  const std::vector<Json> statuses = s.agree_after("prepare", [&](Json& status) {
    status["step"] = s.meta.step;
    status["async_save"] = async_save;
    if (s.rank == 0) status["save_id"] = prepare_step_directory(s);
  });
  s.fail_if_any(statuses, "preparing the directory");
  // Each rank's async_save: ranks that disagree would go separate ways after this agreement (the
  // synchronous ones into the file agreement, the asynchronous ones back to training).
  std::ostringstream flags;
  bool same = true;
  for (int64_t r = 0; r < s.world_size; ++r) {
    const bool theirs = json_bool(json_at(statuses[r], "async_save", "status"), "async_save");
    same = same && theirs == async_save;
    flags << (r ? ", " : "") << "rank " << r << " " << (theirs ? "true" : "false");
  }
  if (!same) {
    s.refuse(
        "the ranks disagree on async_save (save_checkpoint(..., async_save=) in Python, "
        "CheckpointSaveOptions::async_save in C++): " +
        flags.str() +
        "; an asynchronous save is finished by collectives at later step boundaries, so every rank must "
        "pass the same value (decide it from the step, never from the rank)");
  }
  for (int64_t r = 0; r < s.world_size; ++r) {
    const int64_t step = json_int(json_at(statuses[r], "step", "status"), "step");
    TORCH_CHECK(step == s.meta.step, "checkpoint save of step ", s.meta.step, " to '", s.step_dir, "' failed: rank ", r,
                " saves step ", step, " but rank ", s.rank, " step ", s.meta.step,
                "; every rank must save the same step");
  }
  return json_string(json_at(statuses[0], "save_id", "rank 0's status"), "save_id");
}

void write_rank_file(const Save& s, const std::string& save_id, const std::vector<CheckpointTensor>& tensors,
                     const CheckpointSaveOptions& options, Json& status) {
  const std::string file = checkpoint_file_name(s.rank);
  std::vector<std::pair<std::string, at::Tensor>> named;
  Json pieces = Json::array();
  for (const CheckpointTensor& t : tensors) {
    TORCH_CHECK(t.data.numel() == t.end - t.begin, "checkpoint save: tensor '", t.key, "' has ", t.data.numel(),
                " elements for the range [", t.begin, ", ", t.end, ")");
    named.push_back({t.key, t.data.reshape({-1})});
    pieces.push_back({{"key", t.key},
                      {"dtype", safetensors_dtype(t.data.scalar_type())},
                      {"shape", t.global_shape},
                      {"dim", t.slice.dim},
                      {"tp_size", t.slice.tp_size},
                      {"tp_rank", t.slice.tp_rank},
                      {"begin", t.begin},
                      {"end", t.end}});
  }
  std::map<std::string, std::string> metadata = {{"format", kCheckpointFormat},
                                                 {"save_id", save_id},
                                                 {"step", std::to_string(s.meta.step)},
                                                 {"rank", std::to_string(s.rank)},
                                                 {"world_size", std::to_string(s.world_size)}};
  if (s.rank == 0) {  // the manifest's too; a load compares them (file_problem): bound by this file's CRC
    metadata["values"] = json_text(values_to_json(s.meta.values));
    metadata["optimizer"] = json_text(optimizer_json(s.meta.optimizer));
  }
  if (options.before_file_written) options.before_file_written(s.step_dir + "/" + file);
  const WrittenFile written = write_safetensors_file(s.step_dir + "/" + file, named, metadata);
  for (size_t i = 0; i < tensors.size(); ++i) {  // ties each piece's bytes to its place (checkpoint/manifest.h)
    const CheckpointTensor& t = tensors[i];
    ManifestTensor as_listed;  // as the manifest will list it (phase 3)
    as_listed.dtype = safetensors_dtype(t.data.scalar_type());
    as_listed.shape = t.global_shape;
    as_listed.dim = t.slice.dim;
    as_listed.tp_size = t.slice.tp_size;
    ManifestPiece piece;
    piece.tp_rank = t.slice.tp_rank;
    piece.begin = t.begin;
    piece.end = t.end;
    pieces[i]["crc32c"] = crc_hex(piece_checksum(written.tensor_crcs[i], save_id, t.key, as_listed, piece));
  }
  if (options.after_file_written) options.after_file_written(s.step_dir + "/" + file);
  status["file"] = {{"name", file},
                    {"rank", s.rank},
                    {"dp_rank", s.mesh.dp_rank},
                    {"tp_rank", s.mesh.tp_rank},
                    {"bytes", written.bytes},
                    {"crc32c", crc_hex(written.crc)}};
  status["pieces"] = std::move(pieces);
}

// Each tensor's pieces are gathered from every rank (which must agree on its dtype, shape and placement).
Json manifest_of(const Save& s, const std::string& save_id, const std::vector<Json>& statuses) {
  Json m;
  m["format"] = kCheckpointFormat;
  m["version"] = kCheckpointVersion;
  m["save_id"] = save_id;
  m["step"] = s.meta.step;
  m["mesh"] = {{"world_size", s.world_size}, {"dp_size", s.mesh.dp_size}, {"tp_size", s.mesh.tp_size}};
  if (s.mesh.pp_size > 1) m["mesh"]["pp_size"] = s.mesh.pp_size;
  m["values"] = values_to_json(s.meta.values);
  m["optimizer"] = optimizer_json(s.meta.optimizer);
  Json files = Json::object(), entries = Json::object();
  for (int64_t r = 0; r < s.world_size; ++r) {
    const Json& f = json_at(statuses[r], "file", "status");
    files[json_string(json_at(f, "name", "file"), "name")] = f;
    for (const Json& p : json_array(json_at(statuses[r], "pieces", "status"), "pieces")) {
      const std::string& key = json_string(json_at(p, "key", "piece"), "key");
      const Json entry = {{"dtype", json_at(p, "dtype", key)},
                          {"shape", json_at(p, "shape", key)},
                          {"dim", json_at(p, "dim", key)},
                          {"tp_size", json_at(p, "tp_size", key)}};
      if (!entries.contains(key)) {
        entries[key] = entry;
        entries[key]["pieces"] = Json::array();
      }
      Json& listed = entries[key];
      for (const char* field : {"dtype", "shape", "dim", "tp_size"}) {
        if (json_text(listed[field]) == json_text(entry[field])) continue;
        // A TP-sharded tensor's global shape is its piece's times the TP size: pieces of different sizes
        // (a dim the TP size does not divide: torch.chunk's last chunk is shorter) give different ones.
        const bool uneven_tp = std::string(field) == "shape" && entry["dim"].is_number_integer() &&
                               entry["dim"].get<int64_t>() >= 0 && json_text(listed["dim"]) == json_text(entry["dim"]);
        TORCH_CHECK(false, "tensor '", key, "' has ", field, " ", json_text(entry[field]), " on rank ", r, " but ",
                    json_text(listed[field]), " on a lower rank",
                    uneven_tp ? std::string("; it is sharded over TP on dim ") + json_text(entry["dim"]) +
                                    " and its TP pieces differ in size there (a dim the TP size " +
                                    json_text(entry["tp_size"]) +
                                    " does not divide): checkpoints hold equal TP chunks; choose a TP size "
                                    "that divides it, or pad the dim to a multiple of the TP size"
                              : std::string());
      }
      listed["pieces"].push_back({{"file", checkpoint_file_name(r)},
                                  {"tp_rank", json_at(p, "tp_rank", key)},
                                  {"begin", json_at(p, "begin", key)},
                                  {"end", json_at(p, "end", key)},
                                  {"crc32c", json_at(p, "crc32c", key)}});
    }
  }
  m["files"] = std::move(files);
  m["tensors"] = std::move(entries);
  const std::string parent = live_checkpoint(s.dir);  // Note [The live run]
  m["parent"] = parent.empty() || parent == s.name ? Json() : Json(parent);
  return m;
}

// The manifest is checked as a load will check it before it is written.
void commit_manifest(const Save& s, const Json& manifest, const CheckpointSaveOptions& options, Json& status) {
  const std::string text = manifest_text(manifest);
  try {  // what a load will check, checked before the commit
    parse_manifest(text, s.step_dir + "/" + kManifest);
  } catch (const c10::Error& e) {
    // Nothing was edited: the pieces given to the save do not make a checkpoint (a bug in the caller).
    std::string what = e.what_without_backtrace();
    const std::string edited = " (the manifest is damaged or was edited; load another step, or save again)";
    if (const auto at = what.find(edited); at != std::string::npos) what.erase(at, edited.size());
    TORCH_CHECK(false, "the tensors the ranks gave this save do not make a loadable checkpoint (e.g. a tensor ",
                "held by some ranks only that was not saved as theirs, such as an expert tensor not declared ",
                "one), so it was not committed: ", what);
  }
  write_file_atomically(s.step_dir + "/" + kManifest, text);
  write_file_atomically(s.dir + "/latest", s.name + "\n");
  if (options.keep_last <= 0) return;
  try {
    prune_checkpoints(s.dir, s.name, options.keep_last);
  } catch (const std::exception& e) {
    status["prune_error"] = message_of(e);
  }
}

void warn_if_pruning_failed(const Save& s, const Json& rank0_status, const CheckpointSaveOptions& options) {
  if (s.rank != 0 || !rank0_status.contains("prune_error")) return;
  std::fprintf(stderr,
               "meshddp: warning: checkpoint '%s' is saved and committed (`latest` names it), but pruning the older "
               "checkpoints (keep_last %lld) failed: %s. They stay on disk; the next save with keep_last prunes "
               "again\n",
               s.step_dir.c_str(), static_cast<long long>(options.keep_last),
               json_string(rank0_status["prune_error"], "prune_error").c_str());
  std::fflush(stderr);
}

}  // namespace meshddp::save_phases
