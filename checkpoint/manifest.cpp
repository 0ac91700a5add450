#include "checkpoint/manifest.h"

#include "checkpoint/lineage.h"
#include "checkpoint/safetensors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>
#include <tuple>

namespace meshddp {
namespace {

constexpr const char* kChecksumKey = "\"manifest_crc32c\"";
constexpr int64_t kMaxElements = int64_t{1} << 60;  // per tensor: keeps every byte offset far from overflow

// Checks the fields of one manifest, naming the file and the field in each error.
class ManifestChecker {
 public:
  explicit ManifestChecker(const std::string& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    TORCH_CHECK(false, "checkpoint: manifest '", path_, "': ", field, " ", what,
                " (the manifest is damaged or was edited; load another step, or save again)");
  }

  const Json& member(const Json& object, const std::string& field, const std::string& key) const {
    if (!object.is_object()) fail(field, "is " + json_kind(object) + "; expected an object");
    if (!object.contains(key)) fail(field, "has no member '" + key + "'");
    return json_at(object, key, field);
  }
  const Json::object_t& object(const Json& v, const std::string& field) const {
    if (!v.is_object()) fail(field, "is " + json_kind(v) + "; expected an object");
    return json_object(v, field);
  }
  const Json::array_t& array(const Json& v, const std::string& field) const {
    if (!v.is_array()) fail(field, "is " + json_kind(v) + "; expected an array");
    return json_array(v, field);
  }
  const std::string& string(const Json& v, const std::string& field) const {
    if (!v.is_string()) fail(field, "is " + json_kind(v) + "; expected a string");
    return json_string(v, field);
  }
  int64_t integer(const Json& v, const std::string& field, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer()) {
      fail(field, "is " + json_kind(v) + " " + json_text(v, -1, true) + "; expected an integer in [" +
                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    const int64_t i = json_int(v, field);
    if (i < lo || i > hi) {
      fail(field, "is " + std::to_string(i) + "; expected an integer in [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "]");
    }
    return i;
  }
  bool boolean(const Json& v, const std::string& field) const {
    if (!v.is_boolean()) fail(field, "is " + json_kind(v) + "; expected true or false");
    return json_bool(v, field);
  }
  uint32_t crc(const Json& v, const std::string& field) const {
    const std::string& s = string(v, field);
    const bool ok =
        s.size() == 10 && s.compare(0, 2, "0x") == 0 && std::all_of(s.begin() + 2, s.end(), [](char c) {
          return std::isxdigit(static_cast<unsigned char>(c)) && !std::isupper(static_cast<unsigned char>(c));
        });
    if (!ok) fail(field, "is '" + s + "'; expected a CRC32C written as 0x and 8 lowercase hex digits");
    return static_cast<uint32_t>(std::stoul(s.substr(2), nullptr, 16));
  }

 private:
  std::string path_;
};

std::string json_quoted(const std::string& key) { return json_text(Json(key), -1, /*lossy=*/true); }

// The stored checksum's position in `text` (the first of its 8 hex digits), or npos when absent.
size_t checksum_position(const std::string& text, const ManifestChecker& check) {
  const size_t first = text.find(kChecksumKey);
  if (first == std::string::npos) return first;
  if (text.find(kChecksumKey, first + 1) != std::string::npos) check.fail("manifest_crc32c", "appears more than once");
  size_t pos = first + std::char_traits<char>::length(kChecksumKey);
  auto skip_space = [&] {
    while (pos < text.size() && (text[pos] == ' ' || text[pos] == '\n' || text[pos] == '\t' || text[pos] == '\r'))
      ++pos;
  };
  skip_space();
  if (pos >= text.size() || text[pos] != ':') check.fail("manifest_crc32c", "is not followed by ':'");
  ++pos;
  skip_space();
  if (text.compare(pos, 3, "\"0x") != 0 || pos + 12 > text.size() || text[pos + 11] != '"' ||
      !std::all_of(text.begin() + pos + 3, text.begin() + pos + 11,
                   [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
    check.fail("manifest_crc32c", "is not a string of 0x and 8 hex digits");
  }
  return pos + 3;
}

uint32_t content_checksum(std::string text, size_t digits) {
  text.replace(digits, 8, "00000000");
  return crc32c(text.data(), text.size());
}

CheckpointValues parse_values(const Json& json, const ManifestChecker& check) {
  CheckpointValues values;
  for (const auto& [k, v] : check.object(json, "values")) {
    if (v.is_number_integer()) {
      values[k] = json_int(v, k);
    } else if (v.is_number()) {
      values[k] = json_double(v, k);
    } else if (v.is_string()) {
      values[k] = json_string(v, k);
    } else {
      check.fail("values[" + json_quoted(k) + "]",
                 "is " + json_kind(v) + "; expected an integer, a number or a string");
    }
  }
  return values;
}

std::optional<CheckpointOptimizer> parse_optimizer(const Json& json, const ManifestChecker& check) {
  if (json.is_null()) return std::nullopt;
  CheckpointOptimizer optimizer;
  optimizer.kind = check.string(check.member(json, "optimizer", "kind"), "optimizer.kind");
  if (optimizer.kind != "adamw" && optimizer.kind != "sgd" && optimizer.kind != "muon")
    check.fail("optimizer.kind", "is '" + optimizer.kind + "'; expected 'adamw', 'sgd' or 'muon'");
  optimizer.step = check.integer(check.member(json, "optimizer", "step"), "optimizer.step", 0, INT64_MAX);
  if (json.contains("muon_adamw_params")) {
    optimizer.muon_adamw_params =
        check.string(check.member(json, "optimizer", "muon_adamw_params"), "optimizer.muon_adamw_params");
  }
  if (json.contains("muon_stacked_matrices")) {
    optimizer.muon_stacked_matrices =
        check.boolean(check.member(json, "optimizer", "muon_stacked_matrices"), "optimizer.muon_stacked_matrices");
  }
  return optimizer;
}

ManifestTensor parse_tensor(const Json& json, const std::string& field, const Manifest& m,
                            const ManifestChecker& check) {
  ManifestTensor t;
  t.dtype = check.string(check.member(json, field, "dtype"), field + ".dtype");
  int64_t item = 0;
  try {
    item = static_cast<int64_t>(c10::elementSize(scalar_type_from_safetensors(t.dtype)));
  } catch (const c10::Error&) {
    check.fail(field + ".dtype", "is '" + t.dtype + "', not a dtype this build reads");
  }
  const Json::array_t& shape = check.array(check.member(json, field, "shape"), field + ".shape");
  if (shape.size() > 64) check.fail(field + ".shape", "has " + std::to_string(shape.size()) + " dims; at most 64");
  int64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    t.shape.push_back(check.integer(shape[d], field + ".shape[" + std::to_string(d) + "]", 0, kMaxElements));
    if (__builtin_mul_overflow(numel, t.shape.back(), &numel) || numel > kMaxElements / item) {
      check.fail(field + ".shape", "has more than 2^60 bytes");
    }
  }
  const int64_t ndim = static_cast<int64_t>(t.shape.size());
  t.dim = check.integer(check.member(json, field, "dim"), field + ".dim", -1, ndim - 1);
  t.tp_size = check.integer(check.member(json, field, "tp_size"), field + ".tp_size", 1, m.tp_size);
  if ((t.dim < 0) != (t.tp_size == 1)) {
    check.fail(field, "has dim " + std::to_string(t.dim) + " and tp_size " + std::to_string(t.tp_size) +
                          "; a tensor is either sharded (dim >= 0, tp_size > 1) or not (dim -1, tp_size 1)");
  }
  if (t.dim >= 0 && t.shape[t.dim] % t.tp_size != 0) {
    check.fail(field + ".shape", "has " + std::to_string(t.shape[t.dim]) + " on dim " + std::to_string(t.dim) +
                                     ", which does not split into " + std::to_string(t.tp_size) + " TP chunks");
  }
  const int64_t chunk_numel = numel / t.tp_size;
  std::set<std::string> files_used;
  const Json::array_t& pieces = check.array(check.member(json, field, "pieces"), field + ".pieces");
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string pf = field + ".pieces[" + std::to_string(i) + "]";
    ManifestPiece p;
    p.file = check.string(check.member(pieces[i], pf, "file"), pf + ".file");
    if (m.files.count(p.file) == 0) {
      check.fail(pf + ".file", "is " + json_quoted(p.file) +
                                   ", which is not one of the checkpoint's files (rank00000.safetensors ...)");
    }
    if (!files_used.insert(p.file).second)
      check.fail(pf + ".file", "names " + p.file + " for a second piece of this tensor");
    p.tp_rank = check.integer(check.member(pieces[i], pf, "tp_rank"), pf + ".tp_rank", 0, t.tp_size - 1);
    p.begin = check.integer(check.member(pieces[i], pf, "begin"), pf + ".begin", 0, chunk_numel);
    p.end = check.integer(check.member(pieces[i], pf, "end"), pf + ".end", p.begin, chunk_numel);
    p.crc = check.crc(check.member(pieces[i], pf, "crc32c"), pf + ".crc32c");
    t.pieces.push_back(p);
  }
  // Exact coverage: per TP chunk, the pieces sorted by begin tile [0, chunk_numel) with no gap and no overlap.
  std::sort(t.pieces.begin(), t.pieces.end(), [](const ManifestPiece& a, const ManifestPiece& b) {
    return std::tie(a.tp_rank, a.begin, a.end) < std::tie(b.tp_rank, b.begin, b.end);
  });
  size_t i = 0;
  for (int64_t chunk = 0; chunk < t.tp_size; ++chunk) {
    int64_t covered = 0;
    for (; i < t.pieces.size() && t.pieces[i].tp_rank == chunk; ++i) {
      const ManifestPiece& p = t.pieces[i];
      if (p.begin != covered) {
        check.fail(field + ".pieces", std::string(p.begin < covered ? "overlap" : "leave a gap") + " in TP chunk " +
                                          std::to_string(chunk) + ": a piece in " + p.file + " is [" +
                                          std::to_string(p.begin) + ", " + std::to_string(p.end) +
                                          ") but the pieces before it end at " + std::to_string(covered));
      }
      covered = p.end;
    }
    if (covered != chunk_numel) {
      check.fail(field + ".pieces", "cover " + std::to_string(covered) + " of the " + std::to_string(chunk_numel) +
                                        " elements of TP chunk " + std::to_string(chunk));
    }
  }
  return t;
}

}  // namespace

std::string checkpoint_file_name(int64_t rank) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "rank%05lld.safetensors", static_cast<long long>(rank));
  return buf;
}

uint32_t piece_checksum(uint32_t data_crc, const std::string& save_id, const std::string& key,
                        const ManifestTensor& tensor, const ManifestPiece& piece) {
  std::string shape;
  for (size_t d = 0; d < tensor.shape.size(); ++d) shape += (d ? "," : "") + std::to_string(tensor.shape[d]);
  std::string label = save_id;
  for (const std::string& part :
       {key, tensor.dtype, shape, std::to_string(tensor.dim), std::to_string(tensor.tp_size),
        std::to_string(piece.tp_rank), std::to_string(piece.begin), std::to_string(piece.end)}) {
    label += '\0';
    label += part;
  }
  return crc32c(label.data(), label.size(), data_crc);
}

Json optimizer_json(const std::optional<CheckpointOptimizer>& optimizer) {
  if (!optimizer) return nullptr;
  Json json = {{"kind", optimizer->kind}, {"step", optimizer->step}};
  if (optimizer->muon_adamw_params) json["muon_adamw_params"] = *optimizer->muon_adamw_params;
  if (optimizer->muon_stacked_matrices) json["muon_stacked_matrices"] = true;
  return json;
}

std::string manifest_text(const Json& manifest) {
  Json m = manifest;
  m["manifest_crc32c"] = "0x00000000";
  std::string text = json_text(m, 1) + "\n";
  ManifestChecker check("(being written)");
  const size_t digits = checksum_position(text, check);
  TORCH_INTERNAL_ASSERT(digits != std::string::npos);
  text.replace(digits - 2, 10, crc_hex(content_checksum(text, digits)));
  return text;
}

Manifest parse_manifest(const std::string& text, const std::string& path) {
  ManifestChecker check(path);
  TORCH_CHECK(static_cast<int64_t>(text.size()) <= kMaxManifestBytes, "checkpoint: manifest '", path, "' has ",
              text.size(), " bytes; more than the ", kMaxManifestBytes, " a manifest may have: not a manifest");
  const size_t digits = checksum_position(text, check);
  if (digits != std::string::npos) {
    const uint32_t stored = static_cast<uint32_t>(std::stoul(text.substr(digits, 8), nullptr, 16));
    const uint32_t actual = content_checksum(text, digits);
    if (stored != actual) {
      check.fail("manifest_crc32c",
                 "is " + crc_hex(stored) + " but the manifest's content has CRC32C " + crc_hex(actual));
    }
  }
  const Json json = parse_json(text, "manifest '" + path + "'");
  Manifest m;
  const std::string& format = check.string(check.member(json, "the manifest", "format"), "format");
  const int64_t version = check.integer(check.member(json, "the manifest", "version"), "version", 0, INT64_MAX);
  TORCH_CHECK(format == kCheckpointFormat && version == kCheckpointVersion, "checkpoint: '", path, "' is format '",
              format, "' version ", version, "; this build reads '", kCheckpointFormat, "' version ",
              kCheckpointVersion, (version < kCheckpointVersion ? " (load it with the build that saved it)" : ""));
  if (digits == std::string::npos) check.fail("the manifest", "has no manifest_crc32c");

  const std::string& id = check.string(check.member(json, "the manifest", "save_id"), "save_id");
  if (id.size() != 16 ||
      !std::all_of(id.begin(), id.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
    check.fail("save_id", "is '" + id + "'; expected 16 hex digits");
  }
  m.save_id = id;
  m.step = check.integer(check.member(json, "the manifest", "step"), "step", 0, INT64_MAX);
  const Json& mesh = check.member(json, "the manifest", "mesh");
  m.world_size = check.integer(check.member(mesh, "mesh", "world_size"), "mesh.world_size", 1, 1 << 24);
  m.dp_size = check.integer(check.member(mesh, "mesh", "dp_size"), "mesh.dp_size", 1, m.world_size);
  m.tp_size = check.integer(check.member(mesh, "mesh", "tp_size"), "mesh.tp_size", 1, m.world_size);
  // Pipeline stages (absent before pipeline checkpoints existed: 1).
  if (mesh.contains("pp_size"))
    m.pp_size = check.integer(check.member(mesh, "mesh", "pp_size"), "mesh.pp_size", 1, m.world_size);
  if (m.dp_size * m.tp_size * m.pp_size != m.world_size) {
    check.fail("mesh", "has dp_size " + std::to_string(m.dp_size) + " x tp_size " + std::to_string(m.tp_size) +
                           (m.pp_size > 1 ? " x pp_size " + std::to_string(m.pp_size) : std::string()) +
                           " != world_size " + std::to_string(m.world_size));
  }
  m.values = parse_values(check.member(json, "the manifest", "values"), check);
  m.optimizer = parse_optimizer(check.member(json, "the manifest", "optimizer"), check);
  // The live run's link (Note [The live run], checkpoint/lineage.h): null or a step directory name.
  if (json.contains("parent") && !json_at(json, "parent", "the manifest").is_null()) {
    const std::string& parent = check.string(json_at(json, "parent", "the manifest"), "parent");
    if (checkpoint_step_of(parent) < 0) check.fail("parent", "is '" + parent + "'; expected null or step-<N>");
  }

  const Json::object_t& files = check.object(check.member(json, "the manifest", "files"), "files");
  for (const auto& [name, entry] : files) {
    const std::string field = "files[" + json_quoted(name) + "]";
    ManifestFile f;
    f.rank = check.integer(check.member(entry, field, "rank"), field + ".rank", 0, m.world_size - 1);
    if (name != checkpoint_file_name(f.rank)) {
      check.fail(field, "is rank " + std::to_string(f.rank) + "'s file, whose name is " + checkpoint_file_name(f.rank));
    }
    f.dp_rank = check.integer(check.member(entry, field, "dp_rank"), field + ".dp_rank", 0, m.dp_size - 1);
    f.tp_rank = check.integer(check.member(entry, field, "tp_rank"), field + ".tp_rank", 0, m.tp_size - 1);
    f.bytes = check.integer(check.member(entry, field, "bytes"), field + ".bytes", 8, kMaxElements);
    f.crc = check.crc(check.member(entry, field, "crc32c"), field + ".crc32c");
    m.files.emplace(name, f);
  }
  if (static_cast<int64_t>(m.files.size()) != m.world_size) {
    check.fail("files", "lists " + std::to_string(m.files.size()) + " files; a checkpoint of world_size " +
                            std::to_string(m.world_size) + " has one per rank");
  }
  for (const auto& [key, entry] : check.object(check.member(json, "the manifest", "tensors"), "tensors")) {
    if (key.empty() || key == "__metadata__") check.fail("tensors[" + json_quoted(key) + "]", "is not a tensor name");
    m.tensors.emplace(key, parse_tensor(entry, "tensors[" + json_quoted(key) + "]", m, check));
  }
  return m;
}

}  // namespace meshddp
