// The full check of one rank file against the manifest: checkpoint/file_check.h.
#include "checkpoint/file_check.h"

#include "checkpoint/json.h"
#include "checkpoint/safetensors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <tuple>

namespace meshddp {

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

Json values_to_json(const CheckpointValues& values) {
  Json o = Json::object();
  for (const auto& [k, v] : values) {
    if (const auto* i = std::get_if<int64_t>(&v)) {
      o[k] = *i;
    } else if (const auto* d = std::get_if<double>(&v)) {
      TORCH_CHECK(std::isfinite(*d), "checkpoint save: value '", k, "' is ", *d, "; a saved number must be finite");
      o[k] = *d;
    } else {
      o[k] = std::get<std::string>(v);
    }
  }
  return o;
}

namespace {

// `text` (JSON) as this build writes it, so that a value recorded by any build compares by content
// (a double written as 0.10000000000000001 by an older build is 0.1 here); "" if it is not JSON.
std::string rewritten(const std::string& text) {
  try {
    return json_text(parse_json(text, "a recorded value"));
  } catch (const c10::Error&) {
    return "";
  }
}

}  // namespace

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
  if (meta("rank") != std::to_string(f.rank))
    return who + " says it was written by rank " + meta("rank") + " (renamed?)";
  if (meta("step") != std::to_string(m.step))
    return who + " says it holds step " + meta("step") + " but the manifest says " + std::to_string(m.step);
  if (f.rank == 0) {  // rank 0's file also records the values and the optimizer's state summary
    for (const auto& [key, saved] : {std::pair{"values", json_text(values_to_json(m.values))},
                                     std::pair{"optimizer", json_text(optimizer_json(m.optimizer))}}) {
      if (rewritten(meta(key)) != saved)
        return who + " records " + key + " " + meta(key) + " but the manifest says " + saved;
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
      if (it == h.tensors.end())
        return who + " has no tensor '" + key + "' though the manifest puts a piece of it there";
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
  // By (begin, end): an empty piece (a tensor smaller than the group that splits it) starts where the
  // next one does, and must come first.
  std::sort(pieces.begin(), pieces.end(),
            [](const Expected& a, const Expected& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Expected& e : pieces) ranges.push_back({e.begin, e.end});
  const WrittenFile actual = checksum_file(path, ranges);
  if (actual.crc != f.crc) {
    return who + " has CRC32C " + crc_hex(actual.crc) + " but the manifest says " + crc_hex(f.crc) +
           ": its bytes are corrupt";
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ManifestPiece& p = *pieces[i].piece;
    if (piece_checksum(actual.tensor_crcs[i], m.save_id, *pieces[i].key, *pieces[i].tensor, p) != p.crc) {
      return who + ": its bytes of '" + *pieces[i].key +
             "' do not have the checksum the manifest gives for elements [" + std::to_string(p.begin) + ", " +
             std::to_string(p.end) + ") of TP chunk " + std::to_string(p.tp_rank) +
             " (a piece relabelled or moved to another range, rank or tensor, or its tensor's dtype, shape, dim or "
             "tp_size " +
             "edited)";
    }
  }
  return "";
}

}  // namespace meshddp
