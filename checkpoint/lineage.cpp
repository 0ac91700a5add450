#include "checkpoint/lineage.h"

#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sys/stat.h>

namespace meshddp {
namespace {

constexpr const char* kManifest = "manifest.json";

std::string step_name(int64_t step) { return "step-" + std::to_string(step); }

bool is_complete(const std::string& step_dir) { return path_exists(step_dir + "/" + kManifest); }

bool is_directory(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void warn_once(const std::string& path, const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lock(mutex);
  if (!warned.insert(path).second) return;
  std::fprintf(stderr, "meshddp: warning: checkpoint: skipping '%s': %s\n", path.c_str(), text.c_str());
  std::fflush(stderr);
}

std::string real_path(const std::string& dir) {
  char* resolved = ::realpath(dir.c_str(), nullptr);
  if (resolved == nullptr) return dir;
  std::string out = resolved;
  std::free(resolved);
  return out;
}

// The manifest's "parent" (a step directory name, "" for a fresh start); nullopt for a manifest
// written before the record existed.
std::optional<std::string> recorded_parent(const std::string& dir, int64_t step) {
  const std::string path = dir + "/" + step_name(step) + "/" + kManifest;
  const Json manifest = parse_json(read_file(path, kMaxManifestBytes, "manifest"), "'" + path + "'");
  if (!manifest.contains("parent")) return std::nullopt;
  const Json& parent = json_at(manifest, "parent", path);
  if (parent.is_null()) return std::string();
  const std::string& name = json_string(parent, path + ": parent");
  TORCH_CHECK(checkpoint_step_of(name) >= 0, "checkpoint: '", path, "' names parent '", name,
              "', which is not a step directory name: the manifest is damaged");
  return name;
}

// The parent of complete step `step` ("" for none): recorded, or (older manifests) the next lower
// complete step.
std::string parent_of(const std::string& dir, int64_t step, const std::vector<int64_t>& complete) {
  if (auto recorded = recorded_parent(dir, step)) return *recorded;
  auto it = std::lower_bound(complete.begin(), complete.end(), step);
  return it == complete.begin() ? "" : step_name(*std::prev(it));
}

}  // namespace

int64_t checkpoint_step_of(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5 || name.size() > 5 + 19) return -1;
  if (name[5] == '0' && name.size() > 6) return -1;  // leading zeros: not a name a save writes
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    const int digit = name[i] - '0';
    if (step > (INT64_MAX - digit) / 10) return -1;
    step = step * 10 + digit;
  }
  return step;
}

std::string CheckpointListing::describe() const {
  std::string s = " (complete:";
  for (int64_t c : complete) s += " " + step_name(c);
  if (complete.empty()) s += " none";
  s += "; incomplete:";
  for (int64_t c : incomplete) s += " " + step_name(c);
  if (incomplete.empty()) s += " none";
  return s + ")";
}

CheckpointListing list_checkpoints(const std::string& dir) {
  CheckpointListing out;
  for (const std::string& name : list_directory(dir)) {
    if (name.rfind("step-", 0) != 0) continue;
    const std::string path = dir + "/" + name;
    const int64_t step = checkpoint_step_of(name);
    if (step < 0) {
      warn_once(path, "not a checkpoint step directory (a save writes step-<N>, N in [0, 2^63) without leading zeros)");
      continue;
    }
    if (!is_directory(path)) {
      warn_once(path, "not a directory");
      continue;
    }
    (is_complete(path) ? out.complete : out.incomplete).push_back(step);
  }
  std::sort(out.complete.begin(), out.complete.end());
  std::sort(out.incomplete.begin(), out.incomplete.end());
  return out;
}

std::string read_latest_pointer(const std::string& dir) {
  const std::string path = dir + "/latest";
  if (!path_exists(path)) return "";
  std::string text = read_file(path, kMaxLatestBytes, "`latest` pointer");
  if (!text.empty() && text.back() == '\n') text.pop_back();  // a save writes "step-<N>\n"
  if (checkpoint_step_of(text) < 0) {
    std::string shown;  // printable: a NUL, a CR or a path in it shows as what it is
    for (unsigned char c : text.substr(0, 64)) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      shown += (c >= 0x20 && c < 0x7f) ? std::string(1, static_cast<char>(c)) : std::string(hex);
    }
    TORCH_CHECK(false, "checkpoint: '", path, "' holds '", shown, text.size() > 64 ? "...'" : "'",
                ", which is not a step directory name: the file is damaged (a save writes exactly \"step-<N>\" and a ",
                "newline; fix or delete it)");
  }
  return text;
}

bool holds_no_checkpoint(const std::string& dir) {
  if (!path_exists(dir)) return true;
  return list_checkpoints(dir).complete.empty() && !path_exists(dir + "/latest");
}

std::string resolve_checkpoint(const std::string& dir, std::optional<int64_t> step) {
  TORCH_CHECK(path_exists(dir), "checkpoint: directory '", dir, "' does not exist");
  const CheckpointListing listing = list_checkpoints(dir);
  const std::string choose =
      "; load one of the complete steps explicitly (load_checkpoint(..., step); the examples: "
      "--resume-step N)";
  std::string name;
  if (step) {
    name = step_name(*step);
    TORCH_CHECK(path_exists(dir + "/" + name), "checkpoint: '", dir, "' has no ", name, listing.describe());
  } else {
    try {
      name = read_latest_pointer(dir);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, e.what_without_backtrace(), listing.describe(), choose);
    }
    if (!name.empty()) {
      TORCH_CHECK(path_exists(dir + "/" + name), "checkpoint: '", dir, "/latest' names '", name,
                  "', which does not exist", listing.describe(), choose);
    } else {
      TORCH_CHECK(!listing.complete.empty() || !path_exists(dir + "/.metadata"), "checkpoint: '", dir,
                  "' is a torch.distributed.checkpoint (DCP) directory (it has .metadata), not meshddp's format ",
                  "(save_checkpoint); load it with torch.distributed.checkpoint (dcp.load of meshddp's state dicts), ",
                  "or make one file of it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save('", dir,
                  "', 'full.pt') (the optimizer's state as flattened params)");
      TORCH_CHECK(!listing.complete.empty(), "checkpoint: '", dir, "' holds no complete checkpoint",
                  listing.describe());
      // No `latest` (a crash between a manifest and the pointer): the live run's head, the one
      // complete step no other names as its parent (Note [The live run]).
      std::set<std::string> parents;
      for (int64_t s : listing.complete) parents.insert(parent_of(dir, s, listing.complete));
      std::vector<std::string> heads;
      for (int64_t s : listing.complete) {
        if (parents.count(step_name(s)) == 0) heads.push_back(step_name(s));
      }
      std::string list;
      for (const auto& h : heads) list += " " + h;
      TORCH_CHECK(heads.size() == 1, "checkpoint: '", dir, "' has no `latest` and ", heads.size(),
                  " runs end in it:", list, " (a rollback's newest checkpoint and the abandoned timeline's); ",
                  "which is the live one is not recorded", listing.describe(), choose);
      name = heads[0];
    }
  }
  TORCH_CHECK(is_complete(dir + "/" + name), "checkpoint: '", dir, "/", name, "' is incomplete (no ", kManifest,
              ": a save that did not finish); it is never loaded", listing.describe(), step ? "" : choose);
  return dir + "/" + name;
}

namespace {
std::mutex live_mutex;
std::map<std::string, std::string>& live_runs() {
  static std::map<std::string, std::string> runs;
  return runs;
}
}  // namespace

void note_live_checkpoint(const std::string& dir, const std::string& name) {
  const std::string key = real_path(dir);
  std::lock_guard<std::mutex> lock(live_mutex);
  live_runs()[key] = name;
}

std::string live_checkpoint(const std::string& dir) {
  const std::string key = real_path(dir);
  std::lock_guard<std::mutex> lock(live_mutex);
  auto it = live_runs().find(key);
  return it == live_runs().end() ? "" : it->second;
}

void prune_checkpoints(const std::string& dir, const std::string& head, int64_t keep_last) {
  const CheckpointListing listing = list_checkpoints(dir);
  std::set<std::string> keep;
  std::string name = head;
  while (!name.empty() && static_cast<int64_t>(keep.size()) < keep_last && keep.insert(name).second) {
    const int64_t step = checkpoint_step_of(name);
    if (!std::binary_search(listing.complete.begin(), listing.complete.end(), step)) break;  // pruned before
    name = parent_of(dir, step, listing.complete);
  }
  for (const auto* steps : {&listing.complete, &listing.incomplete}) {
    for (int64_t s : *steps) {
      if (keep.count(step_name(s)) == 0) remove_tree(dir + "/" + step_name(s));
    }
  }
}

}  // namespace meshddp
