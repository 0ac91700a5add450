#include "mesh/launch_round.h"

#include "mesh/reduction_groups.h"  // describe_ranks

#include <c10/util/Exception.h>

#include <cstdlib>
#include <random>
#include <set>
#include <string_view>
#include <thread>
#include <unistd.h>
#include <vector>

namespace meshddp {
namespace {

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }
std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

// A value no other process writes: this host, this pid, 64 random bits.
std::string make_nonce() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::random_device device;
  const uint64_t random = (static_cast<uint64_t>(device()) << 32) ^ device();
  return std::string(host) + ":" + std::to_string(getpid()) + ":" + std::to_string(random);
}

int64_t answer_every_rank(c10d::Store& store, const std::string& prefix, int64_t world_size,
                          std::chrono::milliseconds timeout) {
  const int64_t round = store.add(prefix + "/rounds", 1);
  const std::string acks = prefix + "/" + std::to_string(round) + "/ack/";
  std::set<int64_t> pending;
  for (int64_t r = 1; r < world_size; ++r) pending.insert(r);
  std::set<std::string> answered;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pending.empty()) {
    for (auto it = pending.begin(); it != pending.end();) {
      if (store.check({acks + std::to_string(*it)})) {
        it = pending.erase(it);
        continue;
      }
      const std::string ask = prefix + "/ask/" + std::to_string(*it);
      if (store.check({ask})) {
        const std::string nonce = text_of(store.get(ask));
        if (answered.insert(nonce).second) store.set(prefix + "/answer/" + nonce, bytes_of(std::to_string(round)));
      }
      ++it;
    }
    if (pending.empty()) break;
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "DeviceMesh: rank 0 waited ", timeout.count(),
                " ms for ranks ", describe_ranks(std::vector<int64_t>(pending.begin(), pending.end())), " of ",
                world_size, " to join launch round ", round,
                " (Note [Launch rounds], mesh/launch_round.h); they did not start, or started with another WORLD_SIZE "
                "or MASTER_ADDR/MASTER_PORT");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return round;
}

}  // namespace

int64_t agree_on_launch_round(c10d::Store& store, const std::string& prefix, int64_t rank, int64_t world_size,
                              std::chrono::milliseconds timeout) {
  if (rank == 0) return answer_every_rank(store, prefix, world_size, timeout);
  const std::string nonce = make_nonce();
  store.set(prefix + "/ask/" + std::to_string(rank), bytes_of(nonce));
  const std::string answer = prefix + "/answer/" + nonce;
  try {
    store.wait({answer}, timeout);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "DeviceMesh: rank ", rank, " of ", world_size, " waited ", timeout.count(),
                " ms for rank 0 to give it the launch round (Note [Launch rounds], mesh/launch_round.h): ",
                e.what_without_backtrace(), ". Check that rank 0 started, with the same MASTER_ADDR/MASTER_PORT");
  }
  const std::string round = text_of(store.get(answer));
  store.set(prefix + "/" + round + "/ack/" + std::to_string(rank), bytes_of("1"));
  return std::stoll(round);
}

bool store_outlives_launch() {
  const char* value = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return value != nullptr && std::string_view(value) == "True";
}

}  // namespace meshddp
