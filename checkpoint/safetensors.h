// The safetensors file format (https://github.com/huggingface/safetensors), written and read here
// without the library: 8 bytes little-endian u64 N, N bytes of JSON header (space-padded so the data
// starts 8-aligned), then the raw little-endian tensor bytes. The header maps each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to the data start) and may hold
// "__metadata__" (string -> string). Also CRC32C (the Castagnoli CRC of iSCSI, ext4 and GCS) and the
// few POSIX file calls checkpoints need (no std::filesystem: docs/reference/building.md). Host code only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace meshddp {

// CRC32C of `n` bytes, continuing from `crc` (0 to start). Hardware (SSE4.2) when the CPU has it.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// "0x1a2b3c4d".
std::string crc_hex(uint32_t crc);

// "F32", "BF16", "F16", "F64", "I64", "I32", "U8", "BOOL"... and back; throw naming the type.
std::string safetensors_dtype(c10::ScalarType type);
c10::ScalarType scalar_type_from_safetensors(const std::string& dtype);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range, relative to the data start
};

struct SafetensorsHeader {
  int64_t data_start = 0;  // 8 + N
  std::map<std::string, std::string> metadata;
  std::map<std::string, SafetensorsTensor> tensors;
  int64_t data_bytes() const;  // the largest `end` (the data section's length)
};

// Parses the header from a file's first bytes (`head` holds at least 8 + N bytes; N < 100 MiB).
// Throws naming `source` on anything malformed (offsets overlapping, out of order, or not matching
// dtype x shape; negative or overflowing sizes).
SafetensorsHeader parse_safetensors_header(const std::string& head, const std::string& source);
// Reads and parses the header of the file at `path`; `file_bytes` is its size.
SafetensorsHeader read_safetensors_header(const std::string& path, int64_t file_bytes);

struct WrittenFile {
  int64_t bytes = 0;
  uint32_t crc = 0;                   // CRC32C of the whole file
  std::vector<uint32_t> tensor_crcs;  // CRC32C of each tensor's bytes (write), or of each range (checksum_file)
};

// Writes `tensors` (name -> tensor, any device and layout; stored contiguous, little-endian, shape
// kept) with `metadata` to `path` (created or truncated), fsyncs it, then reads it back and checks
// its size and CRC32C against what was meant to be written. Throws naming the path on any failure.
WrittenFile write_safetensors_file(const std::string& path,
                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                   const std::map<std::string, std::string>& metadata);

// POSIX helpers. All throw naming the path and strerror. The readers (file_bytes, read_file,
// read_file_range, checksum_file) refuse anything but a regular file, without blocking on a FIFO.
bool path_exists(const std::string& path);
int64_t file_bytes(const std::string& path);
void make_directories(const std::string& dir);
void remove_tree(const std::string& path);                        // rm -r; absent is fine
std::vector<std::string> list_directory(const std::string& dir);  // names, without "." and ".."
void fsync_path(const std::string& path);                         // a file or a directory
// Writes `bytes` to `path` via `path.tmp`, fsync, rename, fsync of the directory: after a crash
// `path` holds either its old content or the new one, never a mix. An existing `path.tmp` (a
// symlink included) is unlinked first and the temp file created exclusively, never followed.
void write_file_atomically(const std::string& path, const std::string& bytes);
// The whole file; refuses one of more than `max_bytes` bytes, naming it as `what` ("manifest").
std::string read_file(const std::string& path, int64_t max_bytes, const char* what);
// Reads [offset, offset + n) of `path` into `out`; throws if the file is shorter.
void read_file_range(const std::string& path, int64_t offset, int64_t n, void* out);
// CRC32C and size of a whole file, read in chunks, and the CRC32C of each of `ranges` (sorted,
// non-overlapping [begin, end) byte ranges; a range past the end gets the CRC of what exists) in
// the same pass.
WrittenFile checksum_file(const std::string& path, const std::vector<std::pair<int64_t, int64_t>>& ranges = {});

}  // namespace meshddp
