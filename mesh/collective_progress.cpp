#include "mesh/collective_progress.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

namespace meshddp {
namespace {

using Clock = std::chrono::steady_clock;

struct GroupProgress {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;
  std::vector<int64_t> global_ranks;
  int rank = 0;
  std::chrono::milliseconds report_after{0};
  std::chrono::milliseconds publish_interval{1000};
  std::chrono::milliseconds timeout{0};
  std::atomic<uint64_t> launches{0};
  // Publisher thread only.
  uint64_t published = 0;
  Clock::time_point last_publish{};
  // The last launches' Work (by address) and number, newest at next - 1.
  std::mutex ring_mutex;
  std::array<std::pair<const c10d::Work*, uint64_t>, 64> ring{};
  size_t next = 0;

  GroupProgress(c10::weak_intrusive_ptr<c10d::ProcessGroup> g) : group(std::move(g)) {}
};

std::vector<uint8_t> to_bytes(uint64_t v) {
  const std::string text = std::to_string(v);
  return {text.begin(), text.end()};
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
        if (r.launches.load(std::memory_order_relaxed) != r.published && now - r.last_publish >= r.publish_interval) {
          due.push_back(it->second);
        }
        ++it;
      }
      lock.unlock();
      for (auto& r : due) {
        const uint64_t count = r->launches.load(std::memory_order_relaxed);
        try {
          r->store->set(std::to_string(r->rank), to_bytes(count));
          r->published = count;
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

uint64_t launch_number(GroupProgress& r, const c10d::Work* work) {
  std::lock_guard<std::mutex> lock(r.ring_mutex);
  for (size_t i = 0; i < r.ring.size(); ++i) {
    const auto& entry = r.ring[(r.next + r.ring.size() - 1 - i) % r.ring.size()];
    if (entry.first == work) return entry.second;
  }
  return 0;
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
  TORCH_CHECK(static_cast<int64_t>(global_ranks.size()) == group->getSize(), "register_collective_progress: ",
              global_ranks.size(), " global ranks for a group of ", group->getSize());
  auto record = std::make_shared<GroupProgress>(c10::weak_intrusive_ptr<c10d::ProcessGroup>(group));
  record->store = std::move(store);
  record->global_ranks = std::move(global_ranks);
  record->rank = group->getRank();
  record->report_after = report_after;
  record->timeout = timeout;
  // Fresh enough for the first report (or, with reports off, for the timeout's error).
  const auto horizon = report_after.count() > 0 ? report_after : timeout;
  record->publish_interval = std::clamp(horizon / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(5000));
  record->store->set(std::to_string(record->rank), to_bytes(0));
  Board::get().add(group.get(), std::move(record));
}

void note_collective_launch(const c10d::ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work) {
  auto record = Board::get().find(group);
  if (!record) return;
  const uint64_t n = record->launches.fetch_add(1, std::memory_order_relaxed) + 1;
  std::lock_guard<std::mutex> lock(record->ring_mutex);
  record->ring[record->next] = {work.get(), n};
  record->next = (record->next + 1) % record->ring.size();
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
  const uint64_t n = launch_number(*record, work.get());
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
    const uint64_t count = std::strtoull(value.c_str(), nullptr, 10);
    if (n == 0) {
      if (listed++ < 16) counts << " " << record->global_ranks[r] << ":" << count;
    } else if (count < n) {
      missing.push_back(std::to_string(record->global_ranks[r]) + " (at launch #" + std::to_string(count) + ")");
    }
  }
  if (n == 0) {
    out << counts.str();
  } else if (missing.empty() && unknown.empty()) {
    out << "every rank of the group has launched it (as of their last published counts); the collective itself "
           "is slow or stuck in the transport";
  } else {
    out << "rank(s) that have not reached it (global ranks):";
    size_t shown = 0;
    for (const auto* list : {&missing, &unknown}) {
      for (const auto& m : *list) {
        if (shown++ < 16) out << " " << m << (shown < missing.size() + unknown.size() ? "," : "");
      }
    }
    if (shown > 16) out << " and " << (shown - 16) << " more";
    out << " (counts are published every " << seconds(record->publish_interval) << ")";
  }
  return out.str();
}

}  // namespace meshddp
