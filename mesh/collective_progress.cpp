#include "mesh/collective_progress.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <iomanip>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

namespace meshddp {
namespace {

using Clock = std::chrono::steady_clock;

struct Launch {
  const c10d::Work* work = nullptr;
  uint64_t number = 0;
  std::string label;
  Clock::time_point launched_at{};
};

struct GroupProgress {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;
  std::string name;  // the group's name, the same on every rank
  std::vector<int64_t> global_ranks;
  int rank = 0;
  int64_t global_rank() const { return global_ranks[rank]; }
  std::chrono::milliseconds report_after{0};
  std::chrono::milliseconds publish_interval{1000};
  std::chrono::milliseconds timeout{0};
  std::atomic<uint64_t> launches{0};
  // Publisher thread only.
  Clock::time_point last_publish{};
  // The last launches' Work (by address), number and label, newest at next - 1.
  std::mutex ring_mutex;
  std::array<Launch, 64> ring{};
  size_t next = 0;

  GroupProgress(c10::weak_intrusive_ptr<c10d::ProcessGroup> g) : group(std::move(g)) {}
};

std::vector<uint8_t> to_bytes(const std::string& text) { return {text.begin(), text.end()}; }

int64_t epoch_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A published count: "<count> <unix time in ms>".
void publish_count(GroupProgress& r) {
  r.store->set(std::to_string(r.rank),
               to_bytes(std::to_string(r.launches.load(std::memory_order_relaxed)) + " " + std::to_string(epoch_ms())));
}

// The process-wide registry and its publisher thread (joined at exit).
class Board {
 public:
  static Board& get() {
    static Board board;
    return board;
  }

  void add(const c10d::ProcessGroup* key, std::shared_ptr<GroupProgress> record) {
    std::lock_guard<std::mutex> lock(mutex_);
    records_[key] = std::move(record);
    ++added_;  // a new record may need a shorter interval than the one the thread sleeps for
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    wake_.notify_all();
  }

  std::shared_ptr<GroupProgress> find(const c10d::ProcessGroup& group) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = records_.find(&group);
    if (it == records_.end()) return nullptr;
    // A record of a destroyed group whose address was reused is not this group's.
    auto alive = it->second->group.lock();
    return alive.get() == &group ? it->second : nullptr;
  }

  // Live records of the groups global rank `global_rank` belongs to (ranks may be threads of one
  // process, each with its own groups).
  std::vector<std::shared_ptr<GroupProgress>> records_of(int64_t global_rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<GroupProgress>> out;
    for (const auto& [key, r] : records_) {
      auto alive = r->group.lock();
      if (alive.get() == key && r->global_rank() == global_rank) out.push_back(r);
    }
    return out;
  }

  ~Board() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      const uint64_t seen = added_;
      auto interval = std::chrono::milliseconds(5000);
      std::vector<std::shared_ptr<GroupProgress>> due;
      const auto now = Clock::now();
      for (auto it = records_.begin(); it != records_.end();) {
        if (it->second->group.expired()) {
          it = records_.erase(it);
          continue;
        }
        GroupProgress& r = *it->second;
        interval = std::min(interval, r.publish_interval);
        if (now - r.last_publish >= r.publish_interval) due.push_back(it->second);  // changed or not: its age
        ++it;
      }
      lock.unlock();
      for (auto& r : due) {
        try {
          publish_count(*r);
        } catch (const std::exception&) {
          // The store is gone (e.g. rank 0 exited): nothing to publish to; the next wait reports it.
        }
        r->last_publish = Clock::now();
      }
      lock.lock();
      // Not a plain notify: one sent while this thread was publishing (lock released) would be lost.
      wake_.wait_for(lock, interval, [this, seen] { return stop_ || added_ != seen; });
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  uint64_t added_ = 0;
  std::unordered_map<const c10d::ProcessGroup*, std::shared_ptr<GroupProgress>> records_;
  std::thread thread_;
};

// The ring's entry for `work` (number 0 when it is no longer there).
Launch find_launch(GroupProgress& r, const c10d::Work* work) {
  std::lock_guard<std::mutex> lock(r.ring_mutex);
  for (size_t i = 0; i < r.ring.size(); ++i) {
    const Launch& entry = r.ring[(r.next + r.ring.size() - 1 - i) % r.ring.size()];
    if (entry.work == work) return entry;
  }
  return {};
}

// The label of launch `number` ("" when it is no longer in the ring).
std::string label_of(GroupProgress& r, uint64_t number) {
  std::lock_guard<std::mutex> lock(r.ring_mutex);
  for (const Launch& entry : r.ring) {
    if (entry.number == number) return entry.label;
  }
  return "";
}

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << static_cast<double>(ms.count()) / 1000.0 << " s";
  return out.str();
}

}  // namespace

void register_collective_progress(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                  c10::intrusive_ptr<c10d::Store> store, std::vector<int64_t> global_ranks,
                                  std::chrono::milliseconds report_after, std::chrono::milliseconds timeout) {
  TORCH_CHECK(group && store, "register_collective_progress: null group or store");
  TORCH_CHECK(static_cast<int64_t>(global_ranks.size()) == group->getSize(),
              "register_collective_progress: ", global_ranks.size(), " global ranks for a group of ", group->getSize());
  auto record = std::make_shared<GroupProgress>(c10::weak_intrusive_ptr<c10d::ProcessGroup>(group));
  record->store = std::move(store);
  record->name = group->getGroupName();
  record->global_ranks = std::move(global_ranks);
  record->rank = group->getRank();
  record->report_after = report_after;
  record->timeout = timeout;
  // Fresh enough for the first report (or, with reports off, for the timeout's error).
  const auto horizon = report_after.count() > 0 ? report_after : timeout;
  record->publish_interval = std::clamp(horizon / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(5000));
  publish_count(*record);
  record->last_publish = Clock::now();
  Board::get().add(group.get(), std::move(record));
}

void note_collective_launch(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work,
                            const std::string& label) {
  auto record = Board::get().find(group);
  if (!record) return;
  const uint64_t n = record->launches.fetch_add(1, std::memory_order_relaxed) + 1;
  std::lock_guard<std::mutex> lock(record->ring_mutex);
  Launch& entry = record->ring[record->next];
  entry.work = work.get();
  entry.number = n;
  entry.label.assign(label);  // reuses the entry's buffer: no allocation once warm
  entry.launched_at = Clock::now();
  record->next = (record->next + 1) % record->ring.size();
}

std::vector<std::string> recent_collective_labels(const c10d::ProcessGroup& group) {
  auto record = Board::get().find(group);
  std::vector<std::string> out;
  if (!record) return out;
  std::lock_guard<std::mutex> lock(record->ring_mutex);
  for (size_t i = 0; i < record->ring.size(); ++i) {
    const Launch& entry = record->ring[(record->next + i) % record->ring.size()];
    if (entry.number > 0) out.push_back("#" + std::to_string(entry.number) + " " + entry.label);
  }
  return out;
}

std::optional<std::chrono::steady_clock::time_point> collective_launch_time(
    const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work) {
  auto record = Board::get().find(group);
  if (!record) return std::nullopt;
  const Launch launch = find_launch(*record, work.get());
  if (launch.number == 0) return std::nullopt;
  return launch.launched_at;
}

void publish_collective_progress_now(const c10d::ProcessGroup& group) {
  auto record = Board::get().find(group);
  if (!record) return;
  for (const auto& r : Board::get().records_of(record->global_rank())) {
    try {
      publish_count(*r);
    } catch (const std::exception&) {
      // The store is gone: the report says what it can.
    }
  }
}

std::optional<std::chrono::milliseconds> collective_report_after(const c10d::ProcessGroup& group) {
  auto record = Board::get().find(group);
  if (!record || record->report_after.count() <= 0) return std::nullopt;
  return record->report_after;
}

std::optional<std::chrono::milliseconds> collective_timeout(const c10d::ProcessGroup& group) {
  auto record = Board::get().find(group);
  if (!record) return std::nullopt;
  return record->timeout;
}

std::string describe_collective_progress(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work) {
  auto record = Board::get().find(group);
  if (!record) return "";
  const Launch launch = find_launch(*record, work.get());
  const uint64_t n = launch.number;
  // When this rank launched it, on the peers' clock (unix ms): a peer's count published before then
  // says nothing of whether the peer has launched it since.
  const int64_t launched_at_ms =
      epoch_ms() - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - launch.launched_at).count();
  std::ostringstream out;
  if (n == 0) {
    out << "its launch number is no longer known (over 64 launches since); ranks' launch counts on this group:";
  } else {
    out << "it is launch #" << n << " on this group; ";
  }
  std::vector<std::string> missing, unknown;
  std::ostringstream counts;
  int64_t listed = 0;
  for (int r = 0; r < static_cast<int>(record->global_ranks.size()); ++r) {
    if (r == record->rank) continue;
    const std::string key = std::to_string(r);
    std::string value;
    try {
      if (!record->store->check({key})) {
        unknown.push_back(std::to_string(record->global_ranks[r]) + " (no progress record: never started?)");
        continue;
      }
      const auto bytes = record->store->get(key);
      value.assign(bytes.begin(), bytes.end());
    } catch (const std::exception& e) {
      unknown.push_back(std::to_string(record->global_ranks[r]) + " (store unreadable: " + e.what() + ")");
      continue;
    }
    char* rest = nullptr;
    const uint64_t count = std::strtoull(value.c_str(), &rest, 10);
    const int64_t published_at = std::strtoll(rest, nullptr, 10);
    std::ostringstream age;
    age << std::fixed << std::setprecision(1) << static_cast<double>(epoch_ms() - published_at) / 1000.0 << " s ago";
    if (n == 0) {
      if (listed++ < 16) counts << " " << record->global_ranks[r] << ":" << count << " (" << age.str() << ")";
    } else if (count < n && published_at < launched_at_ms) {
      // A count older than this launch (e.g. this collective failed at once because a peer died,
      // before the live peers republished): the peer may well have launched it since.
      unknown.push_back(std::to_string(record->global_ranks[r]) + " (no count published since this rank launched it; " +
                        "the last, " + age.str() + ", was launch #" + std::to_string(count) + ")");
    } else if (count < n) {
      missing.push_back(std::to_string(record->global_ranks[r]) + " (at launch #" + std::to_string(count) + ", as of " +
                        age.str() + ")");
    }
  }
  if (n == 0) {
    out << counts.str();
    return out.str();
  }
  if (missing.empty() && unknown.empty()) {
    out << "every rank of the group has launched it (as of their last published counts); the collective itself "
           "is slow or stuck in the transport";
    return out.str();
  }
  const auto list = [&out](const std::vector<std::string>& items) {
    for (size_t i = 0; i < items.size() && i < 16; ++i) out << (i ? ", " : " ") << items[i];
    if (items.size() > 16) out << " and " << (items.size() - 16) << " more";
  };
  if (!missing.empty()) {
    out << "rank(s) that have not reached it (global ranks):";
    list(missing);
  }
  if (!unknown.empty()) {
    out << (missing.empty() ? "" : "; ") << "rank(s) whose progress is unknown (global ranks):";
    list(unknown);
  }
  out << " (each count as of the time given; counts are republished every " << seconds(record->publish_interval)
      << ": one much older is a stopped or dead process)";
  return out.str();
}

// ---- Divergent collectives (Note [Divergent collectives]) ----

namespace {

std::atomic<uint64_t> next_wait_id{1};

// What a waiting rank publishes: "<id>\n<group>\n<launch>\n<label>\n" then "<count> <group>\n" per group.
struct WaitRecord {
  uint64_t id = 0;
  std::string group;
  uint64_t launch = 0;
  std::string label;
  std::map<std::string, uint64_t> counts;  // this rank's launch count on each of its groups, by name
};

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

std::string encode(const WaitRecord& w) {
  std::ostringstream out;
  out << w.id << "\n" << one_line(w.group) << "\n" << w.launch << "\n" << one_line(w.label) << "\n";
  for (const auto& [name, count] : w.counts) out << count << " " << one_line(name) << "\n";
  return out.str();
}

std::optional<WaitRecord> decode(const std::string& text) {
  std::istringstream in(text);
  WaitRecord w;
  std::string id, launch, line;
  if (!std::getline(in, id) || !std::getline(in, w.group) || !std::getline(in, launch) || !std::getline(in, w.label)) {
    return std::nullopt;
  }
  w.id = std::strtoull(id.c_str(), nullptr, 10);
  w.launch = std::strtoull(launch.c_str(), nullptr, 10);
  while (std::getline(in, line)) {
    const size_t space = line.find(' ');
    if (space != std::string::npos) w.counts[line.substr(space + 1)] = std::strtoull(line.c_str(), nullptr, 10);
  }
  if (w.id == 0 || w.launch == 0) return std::nullopt;
  return w;
}

// A label as compared across ranks: device indices dropped ("... elements on cuda:1" is the same
// bucket as "... on cuda:0" on the next rank).
std::string comparable(const std::string& label) {
  std::string out;
  for (size_t i = 0; i < label.size(); ++i) {
    out += label[i];
    if (label[i] == ':' && i > 0 && std::isalpha(static_cast<unsigned char>(label[i - 1]))) {
      while (i + 1 < label.size() && std::isdigit(static_cast<unsigned char>(label[i + 1]))) ++i;
    }
  }
  return out;
}

std::string wait_key(const GroupProgress& r) { return std::to_string(r.rank) + "/wait"; }
constexpr const char* kDivergenceKey = "divergence";

std::string divergence_error(const std::string& what) {
  return "meshddp: ranks are in different collectives, so none of them can finish (a divergence, not a slow rank: "
         "failing now instead of at the timeout): " +
         what +
         ". Every rank must issue the same collectives in the same order: look for a rank-dependent branch (a "
         "checkpoint saved on some ranks only, different step counts or save intervals, a directory present on "
         "one node only)";
}

}  // namespace

struct DivergenceWatch::State {
  std::shared_ptr<GroupProgress> record;
  WaitRecord mine;
  std::vector<std::shared_ptr<GroupProgress>> my_groups;  // filled at the first check
  std::string suspected;                                  // a cycle seen at the previous check
};

std::string published_divergence(const c10d::ProcessGroup& group) {
  auto record = Board::get().find(group);
  if (!record) return "";
  try {
    if (!record->store->check({kDivergenceKey})) return "";
    const auto bytes = record->store->get(kDivergenceKey);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception&) {
    return "";  // the store is gone with the rank that hosted it
  }
}

DivergenceWatch::DivergenceWatch(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work)
    : state_(std::make_unique<State>()) {
  state_->record = Board::get().find(group);
  if (!state_->record) return;
  const Launch launch = find_launch(*state_->record, work.get());
  state_->mine.id = next_wait_id.fetch_add(1);
  state_->mine.group = state_->record->name;
  state_->mine.launch = launch.number;
  state_->mine.label = launch.label;
}

DivergenceWatch::~DivergenceWatch() {
  for (const auto& g : state_->my_groups) {
    try {
      g->store->deleteKey(wait_key(*g));
    } catch (const std::exception&) {
      // The store is gone; so are the peers that would read it.
    }
  }
}

std::optional<std::chrono::milliseconds> DivergenceWatch::check_every() const {
  if (!state_->record) return std::nullopt;
  const GroupProgress& r = *state_->record;
  const auto horizon = r.report_after.count() > 0 ? r.report_after : r.timeout;
  return std::clamp(horizon / 8, std::chrono::milliseconds(50), std::chrono::milliseconds(2000));
}

std::string DivergenceWatch::check() {
  State& s = *state_;
  if (!s.record || s.mine.launch == 0) return "";
  GroupProgress& r = *s.record;
  try {
    if (r.store->check({kDivergenceKey})) {  // another rank found it
      const auto bytes = r.store->get(kDivergenceKey);
      return std::string(bytes.begin(), bytes.end());
    }
  } catch (const std::exception&) {
    return "";  // the store is gone: the collective's own error will say so
  }
  // Publish this wait (and fresh counts) on every group of this rank.
  if (s.my_groups.empty()) s.my_groups = Board::get().records_of(r.global_rank());
  s.mine.counts.clear();
  for (const auto& g : s.my_groups) s.mine.counts[g->name] = g->launches.load(std::memory_order_relaxed);
  for (const auto& g : s.my_groups) {
    try {
      g->store->set(wait_key(*g), to_bytes(encode(s.mine)));
      publish_count(*g);
    } catch (const std::exception&) {
    }
  }
  // Read the peers' waits.
  const int64_t me = r.global_rank();
  const std::string ours = "the collective for " + s.mine.label + " (launch #" + std::to_string(s.mine.launch) +
                           " on group '" + r.name + "')";
  std::string found, cycle;
  for (int q = 0; q < static_cast<int>(r.global_ranks.size()) && found.empty(); ++q) {
    if (q == r.rank) continue;
    std::string text;
    try {
      const std::string key = std::to_string(q) + "/wait";
      if (!r.store->check({key})) continue;
      const auto bytes = r.store->get(key);
      text.assign(bytes.begin(), bytes.end());
    } catch (const std::exception&) {
      continue;
    }
    const std::optional<WaitRecord> w = decode(text);
    if (!w) continue;
    const int64_t peer = r.global_ranks[q];
    const std::string theirs =
        "the collective for " + w->label + " (launch #" + std::to_string(w->launch) + " on group '" + w->group + "')";
    if (w->group == r.name) {  // (a)
      if (w->launch == s.mine.launch && comparable(w->label) != comparable(s.mine.label)) {
        found = "rank " + std::to_string(me) + " waits in " + ours + " while rank " + std::to_string(peer) +
                " waits in " + theirs + ": the same launch on the same group is a different collective on each";
      } else if (w->launch < s.mine.launch) {
        const std::string mine_then = label_of(r, w->launch);
        if (!mine_then.empty() && comparable(mine_then) != comparable(w->label)) {
          found = "rank " + std::to_string(peer) + " waits in " + theirs + ", but rank " + std::to_string(me) +
                  " launched #" + std::to_string(w->launch) + " on that group as the collective for " + mine_then +
                  " (and now waits in " + ours + ")";
        }
      }
      continue;
    }
    // (b) The peer waits elsewhere. Has it not reached ours, while waiting in one we have not reached?
    const auto reached = w->counts.find(r.name);
    if (reached == w->counts.end() || reached->second >= s.mine.launch) continue;
    for (const auto& g : s.my_groups) {
      const uint64_t my_count = g->launches.load(std::memory_order_relaxed);
      if (g->name != w->group || my_count >= w->launch) continue;
      cycle = "rank " + std::to_string(me) + " waits in " + ours + ", which rank " + std::to_string(peer) +
              " has not reached (it has launched " + std::to_string(reached->second) + " there); rank " +
              std::to_string(peer) + " waits in " + theirs + ", which rank " + std::to_string(me) +
              " has not reached (it has launched " + std::to_string(my_count) + " there): each waits for the other";
    }
  }
  if (found.empty() && !cycle.empty()) {
    if (cycle == s.suspected) found = cycle;  // seen at two checks in a row
    s.suspected = cycle;
  } else if (cycle.empty()) {
    s.suspected.clear();
  }
  if (found.empty()) return "";
  const std::string error = divergence_error(found);
  for (const auto& g : s.my_groups) {
    try {
      g->store->set(kDivergenceKey, to_bytes(error));
    } catch (const std::exception&) {
    }
  }
  return error;
}

}  // namespace meshddp
