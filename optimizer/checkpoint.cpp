// Sharded checkpoints of the DistributedOptimizer.
//
// Note [Checkpoint format, version 1]
// A checkpoint is a directory:
//   shard-dp<r>.bin   one per DP rank: raw little-endian fp32, state-major: for each state tensor
//                     (master, then exp_avg, exp_avg_sq for AdamW / momentum for SGD), the values of
//                     the rank's segments in shard order. A segment is one param's elements inside
//                     the rank's shard of one bucket; padding is not stored.
//   manifest.txt      written by DP rank 0 last: format version, optimizer, step, DP size, the
//                     parameters (name, dtype, shape), every rank's segments (param, first element,
//                     count) and every shard file's exact size.
// Saving deletes the old manifest first, writes every shard (temp file + rename), waits for all
// ranks, then writes the manifest (temp + rename): a directory with a manifest is complete, one
// without is not. Loading maps the saved segments onto this run's shards by (param, element), so
// the DP size may change; it checks the manifest, the model and every file's size, and reads
// everything, before any state changes, and every rank agrees (one all-reduce) before committing.
#include "mesh/collectives.h"
#include "optimizer/distributed_optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace meshddp {
namespace {

// No std::filesystem here: the torch wheel's libtorch*.so export their own, older std::filesystem
// symbols, which win symbol resolution over libstdc++'s at run time and crash (docs/building.md).
// These few POSIX calls do the job.
bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

int64_t file_size(const std::string& path) {
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint: cannot stat '", path, "': ", std::strerror(errno));
  return static_cast<int64_t>(st.st_size);
}

void make_directories(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    TORCH_CHECK(::mkdir(prefix.c_str(), 0755) == 0 || errno == EEXIST, "checkpoint: cannot create directory '", prefix,
                "': ", std::strerror(errno));
  }
}

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

constexpr const char* kMagic = "meshddp-checkpoint";
constexpr int kVersion = 1;

// An exception's message, without c10's backtrace (it is rethrown with context).
std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// With TP > 1 every TP rank's DP group saves its own shards: names carry the TP coordinate.
std::string tp_prefix(const SyncGroups& g) { return g.tp_size > 1 ? "tp" + std::to_string(g.tp_rank) + "-" : ""; }

std::string dtype_name(c10::ScalarType t) { return c10::toString(t); }

void write_atomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out, "checkpoint: cannot open '", tmp, "' for writing");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    TORCH_CHECK(out, "checkpoint: writing '", tmp, "' failed (disk full?)");
  }
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint: cannot rename '", tmp, "' to '", path, "': ",
              std::strerror(errno));
}

struct SavedSegment {
  int64_t param, param_offset, numel, file_offset;  // file_offset: in elements, within one state block
};

struct Manifest {
  std::string optimizer;
  int64_t step = 0, dp_size = 0, num_states = 0;
  std::vector<std::string> param_lines;                     // "name dtype numel shape"
  std::map<int64_t, std::vector<SavedSegment>> segments;    // by DP rank
  std::map<int64_t, int64_t> file_bytes;                    // by DP rank
};

// "name dtype numel [local shape] placement": for a TP shard the placement says which chunk of which
// dim of the global param this is (global shape = local shape with that dim times tp_size).
std::string param_line(const NamedParam& p, const Placement& placement) {
  std::ostringstream out;
  out << p.name << " " << dtype_name(p.param.scalar_type()) << " " << p.param.numel() << " [";
  for (int64_t d = 0; d < p.param.dim(); ++d) out << (d ? "," : "") << p.param.size(d);
  out << "] " << placement.str();
  if (placement.is_shard()) out << ":" << placement.tp_rank << "/" << placement.tp_size;
  return out.str();
}

Manifest read_manifest(const std::string& dir, const std::string& prefix) {
  const std::string path = join(dir, prefix + "manifest.txt");
  TORCH_CHECK(file_exists(path), "checkpoint: no ", prefix, "manifest.txt in '", dir,
              "': not a complete meshddp checkpoint (a save that did not finish leaves none)");
  std::ifstream in(path);
  Manifest m;
  std::string word;
  int version = 0;
  in >> word >> version;
  TORCH_CHECK(word == kMagic && version == kVersion, "checkpoint: '", path, "' is not a meshddp checkpoint ",
              "manifest of version ", kVersion, " (starts with '", word, " ", version, "')");
  int64_t params = 0;
  while (in >> word) {
    if (word.rfind("#", 0) == 0) {
      std::getline(in, word);  // a comment: the config, for people
    } else if (word == "optimizer") {
      in >> m.optimizer;
    } else if (word == "step") {
      in >> m.step;
    } else if (word == "dp_size") {
      in >> m.dp_size;
    } else if (word == "states") {
      in >> m.num_states;
    } else if (word == "params") {
      in >> params;
      std::getline(in, word);
      for (int64_t i = 0; i < params; ++i) {
        std::string line;
        std::getline(in, line);
        m.param_lines.push_back(line);
      }
    } else if (word == "seg") {
      int64_t rank;
      SavedSegment s{};
      in >> rank >> s.param >> s.param_offset >> s.numel >> s.file_offset;
      m.segments[rank].push_back(s);
    } else if (word == "file") {
      int64_t rank, bytes;
      std::string name;
      in >> rank >> name >> bytes;
      m.file_bytes[rank] = bytes;
    } else if (word == "end") {
      return m;
    } else {
      TORCH_CHECK(false, "checkpoint: '", path, "' has an unknown entry '", word, "'");
    }
  }
  TORCH_CHECK(false, "checkpoint: '", path, "' is truncated (no 'end' line)");
}

}  // namespace

void DistributedOptimizer::save_checkpoint(const std::string& dir_name) {
  const std::string& dir = dir_name;
  c10d::ProcessGroup& group = buffer_.dp_group();
  const int64_t dp = buffer_.dp_size(), rank = buffer_.dp_rank();
  finish_param_sync();
  const int64_t states = 1 + num_state_tensors();
  const std::string prefix = tp_prefix(buffer_.groups());
  auto shard_file_name = [&](int64_t r) { return prefix + "shard-dp" + std::to_string(r) + ".bin"; };
  auto barrier = [&](const std::string& what, bool ok) {
    at::Tensor failures = at::full({1}, ok ? 0.0 : 1.0, at::kFloat);
    all_reduce_sum_now(group, failures, "checkpoint save: " + what);
    return failures.item<float>() == 0;
  };
  std::string error;
  try {
    if (rank == 0) {
      make_directories(dir);
      std::remove(join(dir, prefix + "manifest.txt").c_str());  // from here until the new one is renamed in, the checkpoint is incomplete
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  TORCH_CHECK(barrier("prepare", error.empty()), "checkpoint save to '", dir, "' failed on DP rank ", rank,
              ": ", error.empty() ? "see DP rank 0's error" : error);
  try {
    // This rank's shard: state-major, segments in shard order.
    std::string bytes;
    for (int64_t k = 0; k < states; ++k) {
      const std::vector<at::Tensor>& source = k == 0 ? master_ : (k == 1 ? state1_ : state2_);
      for (size_t b = 0; b < shards_.size(); ++b) {
        for (const ShardSegment& seg : shards_[b].segments) {
          at::Tensor values = source[b].narrow(0, seg.shard_offset, seg.numel).to(at::kCPU).contiguous();
          bytes.append(reinterpret_cast<const char*>(values.data_ptr<float>()), values.nbytes());
        }
      }
    }
    write_atomically(join(dir, shard_file_name(rank)), bytes);
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  TORCH_CHECK(barrier("shards", error.empty()), "checkpoint save to '", dir, "': writing a shard failed",
              error.empty() ? " on another DP rank (see its error)" : ": " + error);
  if (rank == 0) {
    try {
      std::ostringstream m;
      m << kMagic << " " << kVersion << "\n";
      m << "optimizer " << (config_.kind == OptimizerKind::kAdamW ? "adamw" : "sgd") << "\n";
      m << "step " << step_ << "\ndp_size " << dp << "\nstates " << states - 1 << "\n";
      m << "# config lr " << config_.lr << " weight_decay " << config_.weight_decay << " beta1 " << config_.beta1
        << " beta2 " << config_.beta2 << " eps " << config_.eps << " momentum " << config_.momentum << "\n";
      const auto& params = buffer_.params();
      m << "params " << params.size() << "\n";
      for (size_t i = 0; i < params.size(); ++i) m << param_line(params[i], buffer_.placement(static_cast<int64_t>(i))) << "\n";
      for (int64_t r = 0; r < dp; ++r) {
        int64_t pos = 0;
        for (const BucketShard& shard : shard_buckets(buffer_.layout(), r, dp)) {
          for (const ShardSegment& seg : shard.segments) {
            m << "seg " << r << " " << seg.param << " " << seg.param_offset << " " << seg.numel << " " << pos << "\n";
            pos += seg.numel;
          }
        }
        m << "file " << r << " " << shard_file_name(r) << " " << pos * states * 4 << "\n";
      }
      m << "end\n";
      write_atomically(join(dir, prefix + "manifest.txt"), m.str());
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  TORCH_CHECK(barrier("manifest", error.empty()), "checkpoint save to '", dir, "': writing the manifest failed",
              error.empty() ? " on DP rank 0 (see its error)" : ": " + error);
}

void DistributedOptimizer::load_checkpoint(const std::string& dir_name) {
  const std::string& dir = dir_name;
  c10d::ProcessGroup& group = buffer_.dp_group();
  const int64_t states = 1 + num_state_tensors();
  const std::string prefix = tp_prefix(buffer_.groups());
  auto shard_file_name = [&](int64_t r) { return prefix + "shard-dp" + std::to_string(r) + ".bin"; };
  finish_param_sync();
  // Everything is read into `loaded` first; state changes only after every rank succeeded.
  std::vector<std::vector<at::Tensor>> loaded(states);
  int64_t loaded_step = 0;
  std::string error;
  try {
    const Manifest m = read_manifest(dir, prefix);
    const std::string kind = config_.kind == OptimizerKind::kAdamW ? "adamw" : "sgd";
    TORCH_CHECK(m.optimizer == kind && m.num_states == states - 1, "checkpoint '", dir, "' holds ", m.optimizer,
                " state (", m.num_states, " tensors per element) but this optimizer is ", kind, " (", states - 1, ")");
    const auto& params = buffer_.params();
    for (size_t i = 0; i < std::max(params.size(), m.param_lines.size()); ++i) {
      const std::string here =
          i < params.size() ? param_line(params[i], buffer_.placement(static_cast<int64_t>(i))) : "(nothing)";
      const std::string there = i < m.param_lines.size() ? m.param_lines[i] : "(nothing)";
      TORCH_CHECK(here == there, "checkpoint '", dir, "' was saved from a different model: parameter #", i,
                  " is '", there, "' in the checkpoint but '", here, "' here");
    }
    // Where each param's saved elements are: (param) -> list of (rank, segment).
    std::map<int64_t, std::vector<std::pair<int64_t, SavedSegment>>> by_param;
    for (const auto& [rank, segs] : m.segments) {
      for (const auto& s : segs) by_param[s.param].push_back({rank, s});
    }
    std::map<int64_t, std::ifstream> files;
    std::map<int64_t, int64_t> per_state_numel;
    for (int64_t r = 0; r < m.dp_size; ++r) {
      const std::string path = join(dir, shard_file_name(r));
      TORCH_CHECK(file_exists(path), "checkpoint '", dir, "': shard file '", path, "' of DP rank ", r,
                  " (of ", m.dp_size, ") is missing");
      const auto expected = m.file_bytes.count(r) ? m.file_bytes.at(r) : -1;
      const auto actual = file_size(path);
      TORCH_CHECK(actual == expected, "checkpoint '", dir, "': shard file '", path, "' has ", actual,
                  " bytes but the manifest says ", expected, " (truncated, or from another save)");
      files[r].open(path, std::ios::binary);
      per_state_numel[r] = expected / (4 * states);
    }
    for (int64_t k = 0; k < states; ++k) {
      for (size_t b = 0; b < shards_.size(); ++b) {
        at::Tensor dest = at::zeros({shards_[b].numel}, at::kFloat);
        for (const ShardSegment& seg : shards_[b].segments) {
          int64_t covered = 0;
          for (const auto& [r, s] : by_param[seg.param]) {
            const int64_t lo = std::max(s.param_offset, seg.param_offset);
            const int64_t hi = std::min(s.param_offset + s.numel, seg.param_offset + seg.numel);
            if (lo >= hi) continue;
            std::ifstream& in = files[r];
            in.seekg((k * per_state_numel[r] + s.file_offset + (lo - s.param_offset)) * 4);
            in.read(reinterpret_cast<char*>(dest.data_ptr<float>() + seg.shard_offset + (lo - seg.param_offset)),
                    (hi - lo) * 4);
            TORCH_CHECK(in, "checkpoint '", dir, "': reading shard file of DP rank ", r, " failed");
            covered += hi - lo;
          }
          TORCH_CHECK(covered == seg.numel, "checkpoint '", dir, "': elements [", seg.param_offset, ", ",
                      seg.param_offset + seg.numel, ") of parameter '", params[seg.param].name,
                      "' are not in any shard file (", covered, " of ", seg.numel, " found)");
        }
        loaded[k].push_back(dest);
      }
    }
    loaded_step = m.step;
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  at::Tensor failures = at::full({1}, error.empty() ? 0.0 : 1.0, at::kFloat);
  all_reduce_sum_now(group, failures, "checkpoint load: agreement");
  TORCH_CHECK(error.empty(), error, " (nothing was loaded)");
  TORCH_CHECK(failures.item<float>() == 0, "checkpoint load from '", dir,
              "' failed on another DP rank (see its error); nothing was loaded");

  c10::NoGradGuard no_grad;
  for (size_t b = 0; b < shards_.size(); ++b) {
    master_[b].copy_(loaded[0][b]);
    if (states >= 2) state1_[b].copy_(loaded[1][b]);
    if (states >= 3) state2_[b].copy_(loaded[2][b]);
  }
  step_ = loaded_step;
  // Params = the loaded master weights (cast), everywhere.
  write_masters_into_param_buffer();
  buffer_.param_gather()->start(/*async=*/false);
}

}  // namespace meshddp
