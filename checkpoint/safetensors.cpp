#include "checkpoint/safetensors.h"

#include "checkpoint/json.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <mutex>
#include <sys/stat.h>
#include <unistd.h>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; add byte swaps here");

namespace meshddp {
namespace {

constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct CrcTable {
  uint32_t t[8][256];
  CrcTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

uint32_t crc32c_software(const uint8_t* p, size_t n, uint32_t crc) {
  static const CrcTable table;
  while (n >= 8) {  // slicing-by-8
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = table.t[7][w & 0xFF] ^ table.t[6][(w >> 8) & 0xFF] ^ table.t[5][(w >> 16) & 0xFF] ^
          table.t[4][(w >> 24) & 0xFF] ^ table.t[3][(w >> 32) & 0xFF] ^ table.t[2][(w >> 40) & 0xFF] ^
          table.t[1][(w >> 48) & 0xFF] ^ table.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ table.t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = __builtin_ia32_crc32di(c, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

std::string error_text() { return std::strerror(errno); }

// Ignores SIGXFSZ while checkpoint files are written: over a file-size limit (`ulimit -f`) write()
// then fails with EFBIG and the error names the file, instead of the signal killing the process
// without a word. Counted, because ranks run as threads of one process in tests (and the
// disposition is per process): the first writer in saves the previous handler, the last out
// restores it.
class IgnoreFileSizeSignal {
 public:
  IgnoreFileSizeSignal() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (writers_++ > 0) return;
    struct sigaction ignore{};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGXFSZ, &ignore, &previous_);
  }
  ~IgnoreFileSizeSignal() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--writers_ == 0) ::sigaction(SIGXFSZ, &previous_, nullptr);
  }
  IgnoreFileSizeSignal(const IgnoreFileSizeSignal&) = delete;
  IgnoreFileSizeSignal& operator=(const IgnoreFileSizeSignal&) = delete;

 private:
  inline static std::mutex mutex_;
  inline static int writers_ = 0;
  inline static struct sigaction previous_{};
};

void write_all(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "checkpoint: writing '", path, "' failed: ", error_text(),
                errno == EFBIG ? " (over the file-size limit: see ulimit -f)" : " (disk full?)");
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? crc32c_sse42(p, n, crc) : crc32c_software(p, n, crc);
#else
  crc = crc32c_software(p, n, crc);
#endif
  return ~crc;
}

std::string crc_hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", crc);
  return buf;
}

std::string safetensors_dtype(c10::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      TORCH_CHECK(false, "safetensors: no dtype for ", c10::toString(type));
  }
}

c10::ScalarType scalar_type_from_safetensors(const std::string& dtype) {
  static const std::map<std::string, c10::ScalarType> types = {
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"I64", at::kLong},
      {"I32", at::kInt},   {"I16", at::kShort},  {"I8", at::kChar},  {"U8", at::kByte},       {"BOOL", at::kBool}};
  auto it = types.find(dtype);
  TORCH_CHECK(it != types.end(), "safetensors: unsupported dtype '", dtype, "'");
  return it->second;
}

int64_t SafetensorsHeader::data_bytes() const {
  int64_t end = 0;
  for (const auto& [name, t] : tensors) end = std::max(end, t.end);
  return end;
}

SafetensorsHeader parse_safetensors_header(const std::string& head, const std::string& source) {
  TORCH_CHECK(head.size() >= 8, "safetensors: '", source, "' is shorter than 8 bytes: not a safetensors file");
  uint64_t n = 0;
  std::memcpy(&n, head.data(), 8);
  TORCH_CHECK(n <= head.size() - 8 && n < (100u << 20), "safetensors: '", source, "' declares a ", n,
              "-byte header but has ", head.size() - 8, " bytes after the length: truncated or not safetensors");
  const Json json = parse_json(head.substr(8, n), "the header of '" + source + "'");
  SafetensorsHeader h;
  h.data_start = 8 + static_cast<int64_t>(n);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& [name, value] : json_object(json, "the header of '" + source + "'")) {
    const std::string where = "'" + source + "' tensor '" + name + "'";
    if (name == "__metadata__") {
      for (const auto& [k, v] : json_object(value, where)) h.metadata[k] = json_string(v, where + "." + k);
      continue;
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = json_string(json_at(value, "dtype", where), where);
    const int64_t item = static_cast<int64_t>(c10::elementSize(scalar_type_from_safetensors(t.dtype)));
    int64_t bytes = item;  // overflow-safe: every step is checked
    for (const auto& d : json_array(json_at(value, "shape", where), where)) {
      t.shape.push_back(json_int(d, where + " shape"));
      TORCH_CHECK(t.shape.back() >= 0 && !__builtin_mul_overflow(bytes, t.shape.back(), &bytes), "safetensors: ", where,
                  " has a negative or too large shape");
    }
    const auto& offsets = json_array(json_at(value, "data_offsets", where), where);
    TORCH_CHECK(offsets.size() == 2, "safetensors: ", where, " has ", offsets.size(), " data_offsets, not 2");
    t.begin = json_int(offsets[0], where);
    t.end = json_int(offsets[1], where);
    TORCH_CHECK(t.begin >= 0 && t.end >= t.begin && t.end - t.begin == bytes, "safetensors: ", where,
                " has data_offsets [", t.begin, ", ", t.end, ") but ", t.dtype, " of shape ",
                json_text(json_at(value, "shape", where)), " needs ", bytes, " bytes");
    ranges.push_back({t.begin, t.end});
    h.tensors.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    TORCH_CHECK(ranges[i].first >= ranges[i - 1].second, "safetensors: '", source, "' has overlapping tensors");
  }
  return h;
}

SafetensorsHeader read_safetensors_header(const std::string& path, int64_t bytes) {
  TORCH_CHECK(bytes >= 8, "safetensors: '", path, "' has ", bytes, " bytes: truncated, not a safetensors file");
  uint64_t n = 0;
  read_file_range(path, 0, 8, &n);
  TORCH_CHECK(n <= static_cast<uint64_t>(bytes - 8) && n < (100u << 20), "safetensors: '", path, "' declares a ", n,
              "-byte header but the file has ", bytes, " bytes: truncated or not safetensors");
  std::string head(8 + n, '\0');
  read_file_range(path, 0, static_cast<int64_t>(8 + n), head.data());
  SafetensorsHeader h = parse_safetensors_header(head, path);
  TORCH_CHECK(h.data_bytes() <= bytes - h.data_start, "safetensors: '", path, "' has ", bytes, " bytes but its header ",
              "needs ", h.data_bytes(), " bytes of data after its ", h.data_start, " bytes of header: truncated");
  return h;
}

WrittenFile write_safetensors_file(const std::string& path,
                                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  std::vector<at::Tensor> host;
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(!header.contains(name), "safetensors: tensor name '", name, "' appears twice in '", path, "'");
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    header[name] = {{"dtype", safetensors_dtype(t.scalar_type())},
                    {"shape", std::vector<int64_t>(t.sizes().begin(), t.sizes().end())},
                    {"data_offsets", {offset, offset + static_cast<int64_t>(t.nbytes())}}};
    offset += static_cast<int64_t>(t.nbytes());
    host.push_back(t);
  }
  std::string json = json_text(header);
  json.append((8 - (8 + json.size()) % 8) % 8, ' ');  // the data starts 8-aligned
  const uint64_t n = json.size();
  std::string head(8, '\0');
  std::memcpy(head.data(), &n, 8);
  head += json;

  const IgnoreFileSizeSignal ignore_sigxfsz;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot create '", path, "': ", error_text());
  WrittenFile expected;
  try {
    write_all(fd, head.data(), head.size(), path);
    expected.crc = crc32c(head.data(), head.size());
    for (const at::Tensor& t : host) {
      const auto* bytes = static_cast<const char*>(t.data_ptr());
      write_all(fd, bytes, t.nbytes(), path);
      expected.crc = crc32c(bytes, t.nbytes(), expected.crc);
      expected.tensor_crcs.push_back(crc32c(bytes, t.nbytes()));
    }
    TORCH_CHECK(::fsync(fd) == 0, "checkpoint: fsync of '", path, "' failed: ", error_text());
  } catch (...) {
    ::close(fd);
    throw;
  }
  TORCH_CHECK(::close(fd) == 0, "checkpoint: closing '", path, "' failed: ", error_text());
  expected.bytes = static_cast<int64_t>(head.size()) + offset;
  const WrittenFile actual = checksum_file(path);
  TORCH_CHECK(actual.bytes == expected.bytes && actual.crc == expected.crc, "checkpoint: '", path, "' reads back as ",
              actual.bytes, " bytes with CRC32C ", crc_hex(actual.crc), " but ", expected.bytes, " bytes with CRC32C ",
              crc_hex(expected.crc), " were written: the storage is failing");
  return expected;
}

bool path_exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

void check_regular(const struct stat& st, const std::string& path) {
  TORCH_CHECK(S_ISREG(st.st_mode), "checkpoint: '", path, "' is ", file_kind(st.st_mode),
              ", not a regular file: a checkpoint's files are plain files; remove it or pick another checkpoint");
}

// Opens `path` for reading without blocking (a FIFO planted in its place would block open() and
// read() forever) and refuses anything but a regular file. Returns the descriptor; its size in *bytes.
int open_regular_file(const std::string& path, int64_t* bytes = nullptr) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open '", path, "': ", error_text());
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string err = error_text();
    ::close(fd);
    TORCH_CHECK(st.st_mode != 0, "checkpoint: cannot stat '", path, "': ", err);
    check_regular(st, path);
  }
  if (bytes) *bytes = static_cast<int64_t>(st.st_size);
  return fd;
}

}  // namespace

int64_t file_bytes(const std::string& path) {
  struct stat st{};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint: cannot stat '", path, "': ", error_text());
  check_regular(st, path);
  return static_cast<int64_t>(st.st_size);
}

void make_directories(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    TORCH_CHECK(::mkdir(prefix.c_str(), 0755) == 0 || errno == EEXIST, "checkpoint: cannot create directory '", prefix,
                "': ", error_text());
  }
}

std::vector<std::string> list_directory(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  TORCH_CHECK(d, "checkpoint: cannot list '", dir, "': ", error_text());
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

void remove_tree(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const std::string& name : list_directory(path)) remove_tree(path + "/" + name);
    TORCH_CHECK(::rmdir(path.c_str()) == 0, "checkpoint: cannot remove directory '", path, "': ", error_text());
  } else {
    TORCH_CHECK(::unlink(path.c_str()) == 0, "checkpoint: cannot remove '", path, "': ", error_text());
  }
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' to fsync it: ", error_text());
  const int rc = ::fsync(fd);
  const std::string err = rc == 0 ? "" : error_text();
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed: ", err);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const IgnoreFileSizeSignal ignore_sigxfsz;
  // A leftover temp file (a crash mid-write) or anything planted there (a symlink to a file outside
  // the directory) is removed, never written through: the new one is created exclusively.
  TORCH_CHECK(::unlink(tmp.c_str()) == 0 || errno == ENOENT, "checkpoint: cannot remove the stale '", tmp,
              "': ", error_text());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot create '", tmp, "': ", error_text());
  try {
    write_all(fd, bytes.data(), bytes.size(), tmp);
    TORCH_CHECK(::fsync(fd) == 0, "checkpoint: fsync of '", tmp, "' failed: ", error_text());
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint: cannot rename '", tmp, "' to '", path,
              "': ", error_text());
  const size_t slash = path.rfind('/');
  fsync_path(slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash));
}

std::string read_file(const std::string& path, int64_t max_bytes, const char* what) {
  int64_t n = 0;
  const int fd = open_regular_file(path, &n);
  ::close(fd);
  TORCH_CHECK(n <= max_bytes, "checkpoint: ", what, " '", path, "' has ", n, " bytes; more than the ", max_bytes,
              " it may have: not a ", what, "; remove it or pick another checkpoint");
  std::string out(static_cast<size_t>(n), '\0');
  read_file_range(path, 0, n, out.data());
  return out;
}

void read_file_range(const std::string& path, int64_t offset, int64_t n, void* out) {
  const int fd = open_regular_file(path);
  auto* p = static_cast<char*>(out);
  int64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, static_cast<size_t>(n - done), offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string err = r < 0 ? error_text() : "end of file";
      ::close(fd);
      TORCH_CHECK(false, "checkpoint: reading bytes [", offset, ", ", offset + n, ") of '", path, "' failed at byte ",
                  offset + done, ": ", err, " (truncated?)");
    }
    done += r;
  }
  ::close(fd);
}

WrittenFile checksum_file(const std::string& path, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    TORCH_INTERNAL_ASSERT(ranges[i].first <= ranges[i].second && (i == 0 || ranges[i - 1].second <= ranges[i].first));
  }
  const int fd = open_regular_file(path);
  std::vector<char> buf(8 << 20);
  WrittenFile f;
  f.tensor_crcs.assign(ranges.size(), 0);
  size_t first = 0;  // the first range not yet complete
  while (true) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string err = error_text();
      ::close(fd);
      TORCH_CHECK(false, "checkpoint: reading '", path, "' failed: ", err);
    }
    if (r == 0) break;
    f.crc = crc32c(buf.data(), static_cast<size_t>(r), f.crc);
    const int64_t chunk_end = f.bytes + r;
    for (size_t i = first; i < ranges.size() && ranges[i].first < chunk_end; ++i) {
      const int64_t b = std::max(ranges[i].first, f.bytes), e = std::min(ranges[i].second, chunk_end);
      if (b < e) f.tensor_crcs[i] = crc32c(buf.data() + (b - f.bytes), static_cast<size_t>(e - b), f.tensor_crcs[i]);
      if (ranges[i].second <= chunk_end && i == first) ++first;
    }
    f.bytes = chunk_end;
  }
  ::close(fd);
  return f;
}

}  // namespace meshddp
