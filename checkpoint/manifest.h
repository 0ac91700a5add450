// The checkpoint manifest (step-<N>/manifest.json) read as untrusted input: parse_manifest() checks
// every field (type, range, names, exact coverage of every tensor by its pieces) and the manifest's
// own checksum, and returns typed data the reader can use without further checks. Also the two
// checksums the format adds to the files' CRC32Cs: the manifest's, and each piece's. Pure host
// logic over text: no files, no tensors, no communication. The format: docs/reference/checkpoints.md.
//
// Note [Manifest and piece checksums]
// manifest_crc32c: CRC32C of the manifest's bytes with the 8 hex digits of its own value written as
// "00000000". Any damaged or edited byte (a step, a data position, a piece's range) is refused.
// A piece's crc32c: CRC32C of its bytes in the tensor file, continued over the text
// "<save_id>\0<key>\0<dtype>\0<shape>\0<dim>\0<tp_size>\0<tp_rank>\0<begin>\0<end>" (<shape>: the
// global shape's sizes joined by ",", "" for a scalar): the bytes are tied to the place they fill, so
// a piece relabelled to another range or TP rank, moved to another tensor, or whose tensor's dtype,
// shape, sharded dim or TP size was edited, is refused even when the manifest was rewritten with a
// matching manifest_crc32c. Both are checksums against damage and
// mistakes, not signatures: whoever can write the directory can forge a consistent checkpoint.
#pragma once

#include "checkpoint_values.h"
#include "json.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace meshddp {

constexpr const char* kCheckpointFormat = "meshddp-checkpoint";
constexpr int64_t kCheckpointVersion = 3;         // 3: adds manifest_crc32c and per-piece crc32c
constexpr int64_t kMaxManifestBytes = 1ll << 30;  // a 110M-param model's is 161 KB

// "rank00003.safetensors": the only file names a manifest may use.
std::string checkpoint_file_name(int64_t rank);

struct ManifestPiece {
  std::string file;            // a name in Manifest::files
  int64_t tp_rank = 0;         // which TP chunk of the tensor
  int64_t begin = 0, end = 0;  // flat element range of that chunk
  uint32_t crc = 0;            // piece_checksum() of its bytes
};

struct ManifestTensor {
  std::string dtype;                  // safetensors dtype ("F32", ...)
  std::vector<int64_t> shape;         // global shape
  int64_t dim = -1, tp_size = 1;      // sharded on `dim` into tp_size chunks; dim -1: not sharded (tp_size 1)
  std::vector<ManifestPiece> pieces;  // tile every chunk exactly: sorted by (tp_rank, begin)
};

struct ManifestFile {
  int64_t rank = 0, dp_rank = 0, tp_rank = 0;
  int64_t bytes = 0;
  uint32_t crc = 0;  // CRC32C of the whole file
};

struct Manifest {
  std::string save_id;  // 16 hex digits; also in every file's __metadata__
  int64_t step = 0;
  int64_t world_size = 1, dp_size = 1, tp_size = 1, pp_size = 1;  // pp_size: pipeline stages (1 if absent)
  CheckpointValues values;
  std::optional<CheckpointOptimizer> optimizer;  // JSON: null, or {"kind": "adamw" | "sgd" | "muon", "step": >= 0}
  std::map<std::string, ManifestFile> files;     // exactly checkpoint_file_name(0 .. world_size - 1)
  std::map<std::string, ManifestTensor> tensors;
};

// Parses and checks the text of the manifest at `path`. Throws naming `path`, the field (e.g.
// tensors."model/fc1.weight".pieces[2].begin) and expected vs actual, on anything wrong.
Manifest parse_manifest(const std::string& text, const std::string& path);

// The manifest's "optimizer" field: null without an optimizer, else {"kind": ..., "step": ...}.
Json optimizer_json(const std::optional<CheckpointOptimizer>& optimizer);

// `manifest` (a JSON object without manifest_crc32c) as the text to write, with its checksum.
std::string manifest_text(const Json& manifest);

// The checksum of a piece whose bytes have CRC32C `data_crc` (Note [Manifest and piece checksums]).
// `tensor`'s dtype, shape, dim and tp_size and `piece`'s tp_rank, begin and end are covered.
uint32_t piece_checksum(uint32_t data_crc, const std::string& save_id, const std::string& key,
                        const ManifestTensor& tensor, const ManifestPiece& piece);

}  // namespace meshddp
