#include "tests/support/rank_threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <exception>
#include <thread>

namespace meshddp::test {

void run_ranks(int world_size, const std::function<void(int rank)>& fn) {
  at::set_num_threads(1);  // ranks are the parallelism; 2 cores on CI
  // c10d's process-global FlightRecorder inserts each group's status into a map before taking its
  // lock (torch 2.11, FlightRecorderDetail.hpp), so several ranks' groups recording their first
  // collectives at once from different threads corrupt it (seen: a segfault in the checkpoint
  // tests). One rank per process never does that; ranks as threads do, so tests turn it off
  // before any group exists.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/1);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world_size; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const c10::Error& e) {
      throw std::runtime_error("rank " + std::to_string(r) + ": " + e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(r) + ": " + e.what());
    }
  }
}

void run_on_mesh(std::vector<int64_t> sizes, std::vector<std::string> names,
                 const std::function<void(DeviceMesh& mesh)>& fn) {
  int64_t world = 1;
  for (int64_t s : sizes) world *= s;
  auto store = c10::make_intrusive<c10d::HashStore>();
  MeshOptions options;
  options.timeout = kTestTimeout;
  run_ranks(static_cast<int>(world), [&](int rank) {
    DeviceMesh mesh = DeviceMesh::from_store(store, rank, world, sizes, names, options);
    fn(mesh);
  });
}

}  // namespace meshddp::test
