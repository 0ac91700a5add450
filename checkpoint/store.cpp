#include "checkpoint/store.h"

#include "mesh/collectives.h"
#include "checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>
#include <random>
#include <sstream>

namespace meshddp {
namespace {

constexpr const char* kManifest = "manifest.json";

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

std::string step_name(int64_t step) { return "step-" + std::to_string(step); }

// Every rank's status (a JSON object; "error" set on failure), on every rank.
std::vector<JsonValue> agree(c10d::ProcessGroup& world, const JsonValue& mine, const std::string& what) {
  std::vector<JsonValue> all;
  for (const std::string& text : all_gather_strings(world, mine.dump(), what)) all.push_back(JsonValue::parse(text, what));
  return all;
}

// "" when no rank failed; else one line per distinct error, naming the ranks.
std::string errors_of(const std::vector<JsonValue>& statuses) {
  std::vector<std::pair<std::string, std::vector<size_t>>> errors;
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].has("error")) continue;
    const std::string& e = statuses[r].at("error", "status").as_string("status");
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

JsonValue status_ok() { return JsonValue(JsonValue::Object{}); }
JsonValue status_error(const std::string& e) { return JsonValue(JsonValue::Object{{"error", JsonValue(e)}}); }

std::string new_save_id() {
  std::random_device device;
  std::mt19937_64 gen((static_cast<uint64_t>(device()) << 32) ^ device() ^
                      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()));
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(gen()));
  return buf;
}

JsonValue values_to_json(const CheckpointValues& values) {
  JsonValue::Object o;
  for (const auto& [k, v] : values) {
    if (const auto* i = std::get_if<int64_t>(&v)) {
      o[k] = JsonValue(*i);
    } else if (const auto* d = std::get_if<double>(&v)) {
      o[k] = JsonValue(*d);
    } else {
      o[k] = JsonValue(std::get<std::string>(v));
    }
  }
  return JsonValue(std::move(o));
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// What is wrong with one file of the checkpoint in `step_dir`, checked in full ("" if nothing):
// its size; its header (save id, rank, step, rank 0's values and optimizer, and for each piece the
// manifest puts there: the tensor, its dtype and shape; no tensor the manifest does not list); its
// CRC32C and each piece's checksum (Note [Manifest and piece checksums]).
std::string file_problem(const std::string& step_dir, const std::string& name, const Manifest& m) {
  const ManifestFile& f = m.files.at(name);
  const std::string path = step_dir + "/" + name;
  const std::string who = "file '" + path + "' (written by rank " + std::to_string(f.rank) + ")";
  if (!path_exists(path)) return who + " is missing";
  const int64_t bytes = file_bytes(path);
  if (bytes != f.bytes) {
    return who + " has " + std::to_string(bytes) + " bytes but the manifest says " + std::to_string(f.bytes) +
           " (truncated, or from another save)";
  }
  SafetensorsHeader h;
  try {
    h = read_safetensors_header(path, bytes);
  } catch (const std::exception& e) {
    return who + ": " + message_of(e);
  }
  if (bytes != h.data_start + h.data_bytes()) {  // before the CRC pass: a huge (sparse) tail would take hours
    return who + " has " + std::to_string(bytes) + " bytes but its header ends its data at byte " +
           std::to_string(h.data_start + h.data_bytes()) + " (bytes appended, or not a file a save wrote)";
  }
  auto meta = [&](const char* key) {
    auto it = h.metadata.find(key);
    return it == h.metadata.end() ? std::string("(none)") : it->second;
  };
  if (meta("save_id") != m.save_id) {
    return who + " is from another save (save id " + meta("save_id") + ", step " + meta("step") +
           ") than this checkpoint's (save id " + m.save_id + ", step " + std::to_string(m.step) + ")";
  }
  if (meta("rank") != std::to_string(f.rank)) return who + " says it was written by rank " + meta("rank") + " (renamed?)";
  if (meta("step") != std::to_string(m.step)) return who + " says it holds step " + meta("step") + " but the manifest says " + std::to_string(m.step);
  if (f.rank == 0) {  // rank 0's file also records the values and the optimizer's state summary
    for (const auto& [key, saved] : {std::pair{"values", values_to_json(m.values).dump()}, std::pair{"optimizer", m.optimizer.dump()}}) {
      if (meta(key) != saved) return who + " records " + key + " " + meta(key) + " but the manifest says " + saved;
    }
  }
  struct Expected {
    int64_t begin, end;  // bytes of the file
    const std::string* key;
    const ManifestTensor* tensor;
    const ManifestPiece* piece;
  };
  std::vector<Expected> pieces;
  for (const auto& [key, t] : m.tensors) {
    for (const ManifestPiece& p : t.pieces) {
      if (p.file != name) continue;
      auto it = h.tensors.find(key);
      if (it == h.tensors.end()) return who + " has no tensor '" + key + "' though the manifest puts a piece of it there";
      const SafetensorsTensor& st = it->second;
      if (st.dtype != t.dtype || st.shape != std::vector<int64_t>{p.end - p.begin}) {
        return who + " holds '" + key + "' as " + st.dtype + " " + shape_str(st.shape) + " but the manifest says " +
               t.dtype + " [" + std::to_string(p.end - p.begin) + "]";
      }
      pieces.push_back({h.data_start + st.begin, h.data_start + st.end, &key, &t, &p});
    }
  }
  if (pieces.size() != h.tensors.size()) {
    return who + " holds " + std::to_string(h.tensors.size()) + " tensors but the manifest lists " +
           std::to_string(pieces.size()) + " pieces in it (from another save?)";
  }
  std::sort(pieces.begin(), pieces.end(), [](const Expected& a, const Expected& b) { return a.begin < b.begin; });
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Expected& e : pieces) ranges.push_back({e.begin, e.end});
  const WrittenFile actual = checksum_file(path, ranges);
  if (actual.crc != f.crc) {
    return who + " has CRC32C " + crc_hex(actual.crc) + " but the manifest says " + crc_hex(f.crc) + ": its bytes are corrupt";
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ManifestPiece& p = *pieces[i].piece;
    if (piece_checksum(actual.tensor_crcs[i], m.save_id, *pieces[i].key, *pieces[i].tensor, p) != p.crc) {
      return who + ": its bytes of '" + *pieces[i].key + "' do not have the checksum the manifest gives for elements [" +
             std::to_string(p.begin) + ", " + std::to_string(p.end) + ") of TP chunk " + std::to_string(p.tp_rank) +
             " (a piece relabelled or moved to another range, rank or tensor, or its tensor's dtype, shape, dim or tp_size " +
             "edited)";
    }
  }
  return "";
}

}  // namespace

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
  c10d::ProcessGroup& world = *mesh.world;
  const int64_t rank = world.getRank(), world_size = world.getSize();
  const std::string name = step_name(meta.step), step_dir = dir + "/" + name;
  const std::string context = "checkpoint save of step " + std::to_string(meta.step) + " to '" + step_dir + "'";
  auto fail_if_any = [&](const std::vector<JsonValue>& statuses, const std::string& stage) {
    const std::string errors = errors_of(statuses);
    TORCH_CHECK(errors.empty(), context, " failed (", stage, "); nothing was committed and `latest` still names the ",
                "previous checkpoint:", errors);
  };

  // (1) Rank 0 prepares the directory and picks the save id; every rank checks it saves the same step.
  JsonValue mine = status_ok();
  mine.object()["step"] = JsonValue(meta.step);
  if (rank == 0) {
    try {
      make_directories(dir);
      // A rollback saving over the abandoned timeline's newest (resumed from step-4, saving step-8
      // while `latest` names the old step-8): `latest` first moves back to the live run.
      const std::string live = live_checkpoint(dir);
      // A damaged `latest` (a load refuses it; the run was resumed with an explicit step) is
      // replaced by this save's, as a missing one is.
      const auto latest_name = [&]() -> std::string {
        try {
          return read_latest_pointer(dir);
        } catch (const c10::Error&) {
          return "";
        }
      };
      if (latest_name() == name && !live.empty() && live != name && path_exists(dir + "/" + live + "/" + kManifest)) {
        write_file_atomically(dir + "/latest", live + "\n");
      }
      TORCH_CHECK(latest_name() != name, "'", step_dir, "' is the latest complete checkpoint; a save never ",
                  "overwrites it (save under another step, or delete it first)");
      remove_tree(step_dir);
      make_directories(step_dir);
      fsync_path(dir);
      mine.object()["save_id"] = JsonValue(new_save_id());
    } catch (const std::exception& e) {
      mine = status_error(message_of(e));
    }
  }
  std::vector<JsonValue> statuses = agree(world, mine, "checkpoint save: prepare");
  fail_if_any(statuses, "preparing the directory");
  for (int64_t r = 0; r < world_size; ++r) {
    const int64_t s = statuses[r].at("step", "status").as_int("step");
    TORCH_CHECK(s == meta.step, context, " failed: rank ", r, " saves step ", s, " but rank ", rank, " step ",
                meta.step, "; every rank must save the same step");
  }
  const std::string save_id = statuses[0].at("save_id", "rank 0's status").as_string("save_id");

  // (2) Every rank writes, fsyncs and verifies its file.
  const std::string file = checkpoint_file_name(rank);
  mine = status_ok();
  try {
    std::vector<std::pair<std::string, at::Tensor>> named;
    JsonValue::Array pieces;
    for (const CheckpointTensor& t : tensors) {
      TORCH_CHECK(t.data.numel() == t.end - t.begin, "checkpoint save: tensor '", t.key, "' has ", t.data.numel(),
                  " elements for the range [", t.begin, ", ", t.end, ")");
      named.push_back({t.key, t.data.reshape({-1})});
      pieces.push_back(JsonValue(JsonValue::Object{
          {"key", JsonValue(t.key)},
          {"dtype", JsonValue(safetensors_dtype(t.data.scalar_type()))},
          {"shape", JsonValue(JsonValue::Array(t.global_shape.begin(), t.global_shape.end()))},
          {"dim", JsonValue(t.slice.dim)},
          {"tp_size", JsonValue(t.slice.tp_size)},
          {"tp_rank", JsonValue(t.slice.tp_rank)},
          {"begin", JsonValue(t.begin)},
          {"end", JsonValue(t.end)}}));
    }
    std::map<std::string, std::string> metadata = {
        {"format", kCheckpointFormat}, {"save_id", save_id}, {"step", std::to_string(meta.step)},
        {"rank", std::to_string(rank)}, {"world_size", std::to_string(world_size)}};
    if (rank == 0) {  // the manifest's too; a load compares them (file_problem): bound by this file's CRC
      metadata["values"] = values_to_json(meta.values).dump();
      metadata["optimizer"] = meta.optimizer.dump();
    }
    const WrittenFile written = write_safetensors_file(step_dir + "/" + file, named, metadata);
    for (size_t i = 0; i < tensors.size(); ++i) {  // ties each piece's bytes to its place (checkpoint/manifest.h)
      const CheckpointTensor& t = tensors[i];
      ManifestTensor as_listed;  // as the manifest will list it (step 3)
      as_listed.dtype = safetensors_dtype(t.data.scalar_type());
      as_listed.shape = t.global_shape;
      as_listed.dim = t.slice.dim;
      as_listed.tp_size = t.slice.tp_size;
      ManifestPiece piece;
      piece.tp_rank = t.slice.tp_rank;
      piece.begin = t.begin;
      piece.end = t.end;
      pieces[i].object()["crc32c"] =
          JsonValue(crc_hex(piece_checksum(written.tensor_crcs[i], save_id, t.key, as_listed, piece)));
    }
    if (options.after_file_written) options.after_file_written(step_dir + "/" + file);
    mine.object()["file"] = JsonValue(JsonValue::Object{
        {"name", JsonValue(file)}, {"rank", JsonValue(rank)}, {"dp_rank", JsonValue(mesh.dp_rank)},
        {"tp_rank", JsonValue(mesh.tp_rank)}, {"bytes", JsonValue(written.bytes)}, {"crc32c", JsonValue(crc_hex(written.crc))}});
    mine.object()["pieces"] = JsonValue(std::move(pieces));
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  statuses = agree(world, mine, "checkpoint save: files");
  fail_if_any(statuses, "writing the files");

  // (3) Rank 0 writes the manifest, then moves `latest`, then prunes.
  mine = status_ok();
  if (rank == 0) {
    try {
      JsonValue manifest;
      JsonValue::Object& m = manifest.object();
      m["format"] = JsonValue(kCheckpointFormat);
      m["version"] = JsonValue(kCheckpointVersion);
      m["save_id"] = JsonValue(save_id);
      m["step"] = JsonValue(meta.step);
      m["mesh"] = JsonValue(JsonValue::Object{{"world_size", JsonValue(world_size)},
                                              {"dp_size", JsonValue(mesh.dp_size)},
                                              {"tp_size", JsonValue(mesh.tp_size)}});
      m["values"] = values_to_json(meta.values);
      m["optimizer"] = meta.optimizer;
      JsonValue::Object files, entries;
      for (int64_t r = 0; r < world_size; ++r) {
        const JsonValue& f = statuses[r].at("file", "status");
        files[f.at("name", "file").as_string("name")] = f;
        for (const JsonValue& p : statuses[r].at("pieces", "status").as_array("pieces")) {
          const std::string& key = p.at("key", "piece").as_string("key");
          JsonValue entry(JsonValue::Object{{"dtype", p.at("dtype", key)},
                                            {"shape", p.at("shape", key)},
                                            {"dim", p.at("dim", key)},
                                            {"tp_size", p.at("tp_size", key)}});
          auto it = entries.find(key);
          if (it == entries.end()) {
            it = entries.emplace(key, entry).first;
            it->second.object()["pieces"] = JsonValue(JsonValue::Array{});
          }
          for (const char* field : {"dtype", "shape", "dim", "tp_size"}) {
            TORCH_CHECK(it->second.at(field, key).dump() == entry.at(field, key).dump(), "tensor '", key, "' has ",
                        field, " ", entry.at(field, key).dump(), " on rank ", r, " but ",
                        it->second.at(field, key).dump(), " on a lower rank");
          }
          it->second.object()["pieces"].array().push_back(JsonValue(JsonValue::Object{
              {"file", JsonValue(checkpoint_file_name(r))}, {"tp_rank", p.at("tp_rank", key)},
              {"begin", p.at("begin", key)}, {"end", p.at("end", key)}, {"crc32c", p.at("crc32c", key)}}));
        }
      }
      m["files"] = JsonValue(std::move(files));
      m["tensors"] = JsonValue(std::move(entries));
      const std::string parent = live_checkpoint(dir);  // Note [The live run]
      m["parent"] = parent.empty() || parent == name ? JsonValue() : JsonValue(parent);
      const std::string text = manifest_text(manifest);
      parse_manifest(text, step_dir + "/" + kManifest);  // what a load will check, checked before the commit
      write_file_atomically(step_dir + "/" + kManifest, text);
      write_file_atomically(dir + "/latest", name + "\n");
    } catch (const std::exception& e) {
      mine = status_error(message_of(e));
    }
    // Committed from here on: a pruning failure is reported as what it is, and the save succeeds.
    if (!mine.has("error") && options.keep_last > 0) {
      try {
        prune_checkpoints(dir, name, options.keep_last);
      } catch (const std::exception& e) {
        mine.object()["prune_error"] = JsonValue(message_of(e));
      }
    }
  }
  statuses = agree(world, mine, "checkpoint save: commit");
  fail_if_any(statuses, "writing the manifest");
  note_live_checkpoint(dir, name);
  if (rank == 0 && statuses[0].has("prune_error")) {
    std::fprintf(stderr,
                 "meshddp: warning: checkpoint '%s' is saved and committed (`latest` names it), but pruning the older "
                 "checkpoints (keep_last %lld) failed: %s. They stay on disk; the next save with keep_last prunes "
                 "again\n",
                 step_dir.c_str(), static_cast<long long>(options.keep_last),
                 statuses[0].at("prune_error", "status").as_string("prune_error").c_str());
    std::fflush(stderr);
  }
  return step_dir;
}

std::optional<std::string> agree_on_checkpoint(const CheckpointMesh& mesh, const std::string& dir,
                                               std::optional<int64_t> step, bool allow_none) {
  TORCH_CHECK(mesh.world, "checkpoint load: no world group");
  c10d::ProcessGroup& world = *mesh.world;
  JsonValue mine = status_ok();
  try {
    if (allow_none && !step && holds_no_checkpoint(dir)) {
      mine.object()["none"] = JsonValue(dir);  // nothing to resume from: a fresh start
    } else {
      mine.object()["found"] = JsonValue(resolve_checkpoint(dir, step));
    }
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  const std::vector<JsonValue> statuses = agree(world, mine, "checkpoint load: resolve");
  const std::string errors = errors_of(statuses);
  auto finding = [](const JsonValue& s) { return s.has("none") ? std::string("none") : s.dump(); };
  bool same = true;
  for (const JsonValue& s : statuses) same = same && finding(s) == finding(statuses[0]);
  if (!same) {
    std::string found;
    for (size_t r = 0; r < statuses.size(); ++r) {
      found += "\n  rank " + std::to_string(r) + ": " +
               (statuses[r].has("error")  ? "error: " + statuses[r].at("error", "status").as_string("error")
                : statuses[r].has("none") ? "no checkpoint (" + statuses[r].at("none", "status").as_string("none") +
                                                " is missing or holds no complete step)"
                                          : statuses[r].at("found", "status").as_string("found"));
    }
    TORCH_CHECK(false, "checkpoint load from '", dir, "': the ranks found different checkpoints; nothing was loaded on ",
                "any rank. Every rank must see the same checkpoint directory (a filesystem shared by every node, the ",
                "same path on every rank). What each rank found:", found);
  }
  TORCH_CHECK(errors.empty(), "checkpoint load from '", dir, "' failed; nothing was loaded on any rank:", errors);
  if (statuses[0].has("none")) return std::nullopt;
  return statuses[0].at("found", "status").as_string("found");
}

CheckpointReader::CheckpointReader(const CheckpointMesh& mesh, const std::string& dir, std::optional<int64_t> step)
    : mesh_(mesh) {
  TORCH_CHECK(mesh_.world, "checkpoint load: no world group");
  c10d::ProcessGroup& world = *mesh_.world;
  path_ = *agree_on_checkpoint(mesh_, dir, step, /*allow_none=*/false);
  JsonValue mine = status_ok();
  try {
    const std::string path = path_ + "/" + kManifest;
    manifest_ = parse_manifest(read_file(path, kMaxManifestBytes, "manifest"), path);
    const std::string dir_name = path_.substr(path_.rfind('/') + 1);
    TORCH_CHECK(checkpoint_step_of(dir_name) == manifest_.step, "checkpoint: '", path, "' holds step ", manifest_.step,
                " but its directory is named '", dir_name, "' (a step directory renamed or copied under another name?); ",
                "a step directory holds the step it is named after: rename it to step-", manifest_.step,
                " or pick another checkpoint");
    meta_.step = manifest_.step;
    meta_.values = manifest_.values;
    meta_.optimizer = manifest_.optimizer;
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  if (!manifest_.save_id.empty()) mine.object()["save_id"] = JsonValue(manifest_.save_id);
  const std::vector<JsonValue> statuses = agree(world, mine, "checkpoint load: manifest");
  const std::string errors = errors_of(statuses);
  TORCH_CHECK(errors.empty(), "checkpoint load from '", path_, "' failed; nothing was loaded on any rank:", errors);
  std::string ids;
  for (size_t r = 0; r < statuses.size(); ++r) ids += "\n  rank " + std::to_string(r) + ": " + statuses[r].dump();
  for (const JsonValue& s : statuses) {
    TORCH_CHECK(s.dump() == statuses[0].dump(), "checkpoint load from '", path_, "': the ranks read manifests of ",
                "different saves (a directory that differs between nodes); nothing was loaded on any rank. Every ",
                "rank must see the same checkpoint directory. Each rank's manifest:", ids);
  }
  note_live_checkpoint(dir, path_.substr(path_.rfind('/') + 1));
}

void CheckpointReader::fail(const std::exception& error) {
  const std::string errors = errors_of(agree(*mesh_.world, status_error(message_of(error)), "checkpoint load: read"));
  TORCH_CHECK(false, "checkpoint load from '", path_, "' failed; nothing was loaded on any rank:", errors);
}

std::vector<at::Tensor> CheckpointReader::read(const std::vector<CheckpointTensor>& wanted,
                                               const std::set<std::string>& model_keys) {
  c10d::ProcessGroup& world = *mesh_.world;
  const int64_t rank = world.getRank(), world_size = world.getSize();
  std::vector<at::Tensor> loaded(wanted.size());
  JsonValue mine = status_ok();
  try {
    std::vector<std::string> problems;
    auto problem = [&](const std::string& p) {
      if (problems.size() < 8) problems.push_back(p);
    };

    // The model against the manifest.
    for (const auto& [key, entry] : manifest_.tensors) {
      if (key.rfind("model/", 0) == 0 && model_keys.count(key) == 0) {
        problem("the checkpoint has '" + key + "' (global shape " + shape_str(entry.shape) +
                ") but this model has no such parameter or buffer");
      }
    }
    for (const CheckpointTensor& w : wanted) {
      auto it = manifest_.tensors.find(w.key);
      if (it == manifest_.tensors.end()) {
        if (!w.optional) problem("the checkpoint has no '" + w.key + "' (global shape " + shape_str(w.global_shape) +
                                 " here): the model or the optimizer differs from the saved one");
        continue;
      }
      if (it->second.shape != w.global_shape) {
        problem("'" + w.key + "' has global shape " + shape_str(it->second.shape) + " in the checkpoint but " +
                shape_str(w.global_shape) + " here");
      }
      const std::string& saved_dtype = it->second.dtype;
      if (w.key.rfind("model/", 0) == 0 && saved_dtype != safetensors_dtype(w.data.scalar_type())) {
        problem("'" + w.key + "' is " + saved_dtype + " in the checkpoint but " +
                safetensors_dtype(w.data.scalar_type()) + " here");
      }
    }

    // Every world_size-th file, verified in full.
    int64_t index = 0;
    for (const auto& [name, f] : manifest_.files) {
      if (index++ % world_size != rank) continue;
      const std::string p = file_problem(path_, name, manifest_);
      if (!p.empty()) problem(p);
    }

    // Read every wanted piece (any rank's damage shows in the agreement below; reads here stay
    // within the bounds the header and the manifest were checked against).
    if (problems.empty()) {
      std::map<std::string, SafetensorsHeader> headers;
      for (size_t i = 0; i < wanted.size(); ++i) {
        const CheckpointTensor& w = wanted[i];
        auto it = manifest_.tensors.find(w.key);
        if (it == manifest_.tensors.end()) continue;
        const ManifestTensor& entry = it->second;
        const c10::ScalarType saved_type = scalar_type_from_safetensors(entry.dtype);
        const int64_t item = static_cast<int64_t>(c10::elementSize(saved_type));
        std::vector<Piece> saved;
        for (const ManifestPiece& p : entry.pieces) saved.push_back({{entry.dim, entry.tp_size, p.tp_rank}, p.begin, p.end});
        const Piece want{w.slice, w.begin, w.end};
        const std::vector<PieceCopy> copies = plan_copies(w.global_shape, saved, want);
        TORCH_INTERNAL_ASSERT(covered_numel(copies) == w.end - w.begin, "'", w.key, "': the manifest's pieces were ",
                              "checked to cover every element");
        at::Tensor out = at::empty({w.end - w.begin}, at::TensorOptions().dtype(saved_type));
        auto* dest = static_cast<char*>(out.data_ptr());
        for (const PieceCopy& c : copies) {
          const ManifestPiece& piece = entry.pieces[c.source];
          const std::string path = path_ + "/" + piece.file;
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
        loaded[i] = out.scalar_type() == w.data.scalar_type() ? out : out.to(w.data.scalar_type());
      }
    }
    if (!problems.empty()) {
      std::string text = problems[0];
      for (size_t i = 1; i < problems.size(); ++i) text += "; " + problems[i];
      mine = status_error(text);
    }
  } catch (const std::exception& e) {
    mine = status_error(message_of(e));
  }
  const std::string errors = errors_of(agree(world, mine, "checkpoint load: read"));
  TORCH_CHECK(errors.empty(), "checkpoint load from '", path_, "' failed; nothing was loaded on any rank:", errors);
  return loaded;
}

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
