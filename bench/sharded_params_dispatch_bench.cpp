// The per-op cost of the gather-on-use dispatch mode under the "optim_grads_params" sharding strategy
// (ZeRO-3; Note [Sharded parameters], grad_buffer/sharded_params.h): while a ShardedParams lives, every
// op on a thread with the mode on passes through the mode's fallback, which looks up each tensor
// argument's storage among the sharded buckets. Times tiny ops (at::add of two 16-float tensors, no
// grad) so that the dispatch overhead is most of what is measured:
//   off         the mode off on this thread (what any op costs without ZeRO-3)
//   activation  the mode on, ZeRO-3 alive, arguments that are no param (most ops of a forward)
//   param       the mode on, one argument a view of a param of the unit in use (a layer's matmul)
//   lookup      ShardedParams::on_use() alone on a tensor that is no param (the storage lookup every
//               argument of every op makes; the rest of `activation - off` is the boxed fallback itself)
//   lookup_threads  `lookup` on --threads threads at once, CPU ns per call of the slower thread
//   threads     `activation` on --threads threads at once (each with the mode on; rank threads in
//               tests, or autograd's device threads), CPU ns per op of the slower thread
// One process, a group of one (no collective runs): what is timed is the lookup and the fallback, not
// a gather. Times are each thread's CPU time (not the wall clock: the machine may be shared), and the
// scenarios are interleaved rep by rep; prints the best and the median CPU ns per op over --reps.
//   build/bench/sharded_params_dispatch_bench [--ops 200000] [--reps 7] [--threads 2] [--params 64]
#include "examples/common/flags.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/sharded_params.h"
#include "mesh/device_mesh.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kNumel = 16;

double thread_cpu_ns() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e9 * static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec);
}

// CPU ns per op of `ops` calls of `op` on this thread: this thread's CPU time, not the wall clock, so that
// other processes on the same cores (a shared machine) lengthen no op.
double ns_per_op(int64_t ops, const std::function<void()>& op) {
  const double t0 = thread_cpu_ns();
  for (int64_t i = 0; i < ops; ++i) op();
  return (thread_cpu_ns() - t0) / static_cast<double>(ops);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t ops = 200000, reps = 7, threads = 2, num_params = 64;
  const std::string usage = "[--ops N] [--reps N] [--threads N] [--params N]";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") examples::exit_with_help(argv[0], usage);
    if (i + 1 >= argc) examples::exit_with_usage(argv[0], "flag " + arg + " needs a value", usage);
    const std::string v = argv[++i];
    try {
      if (arg == "--ops")
        ops = examples::parse_int_flag(arg, v, 1);
      else if (arg == "--reps")
        reps = examples::parse_int_flag(arg, v, 1);
      else if (arg == "--threads")
        threads = examples::parse_int_flag(arg, v, 1, 64);
      else if (arg == "--params")
        num_params = examples::parse_int_flag(arg, v, 1, 100000);
      else
        examples::exit_with_usage(argv[0], "unknown flag " + arg, usage);
    } catch (const examples::FlagError& e) {
      examples::exit_with_usage(argv[0], e.what(), usage);
    }
  }
  at::set_num_threads(1);
  // One param a unit (unit "layer<k>"), one bucket each: --params buckets to look up among.
  std::vector<meshddp::NamedParam> params;
  for (int64_t k = 0; k < num_params; ++k) {
    params.push_back({"layer" + std::to_string(k) + ".weight", at::randn({kNumel}).requires_grad_(true)});
  }
  auto store = c10::make_intrusive<c10d::HashStore>();
  meshddp::DeviceMesh mesh = meshddp::DeviceMesh::from_store(store, 0, 1, {1}, {"dp"});
  meshddp::GradBufferConfig config;
  config.data_parallel_sharding_strategy = meshddp::kShardOptimGradsParams;
  config.bucket_bytes = kNumel * 4;
  meshddp::GradBuffer buffer(params, mesh["dp"], config);
  meshddp::ShardedParams* sharded = buffer.param_buffer()->sharded();
  TORCH_CHECK(sharded != nullptr, "sharded_params_dispatch_bench: no ShardedParams under optim_grads_params");

  c10::NoGradGuard no_grad;
  const at::Tensor x = at::randn({kNumel}), y = at::randn({kNumel});
  std::map<std::string, std::vector<double>> results;
  const c10::DispatchKey mode = c10::DispatchKey::TESTING_ONLY_GenericMode;
  for (int64_t rep = 0; rep < reps; ++rep) {
    {
      const c10::impl::ExcludeDispatchKeyGuard off(mode);
      results["off"].push_back(ns_per_op(ops, [&] { (void)at::add(x, y); }));
    }
    meshddp::ShardedParams::UseScope scope(sharded);  // the mode on in this thread
    results["activation"].push_back(ns_per_op(ops, [&] { (void)at::add(x, y); }));
    const at::Tensor w = params[0].param.detach();  // gathers unit layer0: the unit in use
    results["param"].push_back(ns_per_op(ops, [&] { (void)at::add(w, y); }));
    results["lookup"].push_back(ns_per_op(ops, [&] { (void)meshddp::ShardedParams::on_use(x, "bench"); }));
    // Each thread's CPU ns per op of `op` run on --threads threads at once; the slower thread's.
    const auto on_threads = [&](const std::function<void(const at::Tensor&, const at::Tensor&)>& op) {
      std::vector<double> per_thread(static_cast<size_t>(threads));
      std::vector<std::thread> pool;
      for (int64_t t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          c10::NoGradGuard no_grad_here;
          meshddp::ShardedParams::UseScope here(sharded);
          const at::Tensor a = at::randn({kNumel}), b = at::randn({kNumel});
          per_thread[static_cast<size_t>(t)] = ns_per_op(ops, [&] { op(a, b); });
        });
      }
      for (std::thread& t : pool) t.join();
      return *std::max_element(per_thread.begin(), per_thread.end());
    };
    results["lookup_threads"].push_back(
        on_threads([](const at::Tensor& a, const at::Tensor&) { (void)meshddp::ShardedParams::on_use(a, "bench"); }));
    results["threads"].push_back(on_threads([](const at::Tensor& a, const at::Tensor& b) { (void)at::add(a, b); }));
  }
  std::printf(
      "# sharded_params_dispatch_bench: at::add of two %lld-float tensors, %lld ops x %lld reps, %lld "
      "sharded buckets, %lld threads in the *threads scenarios (%u hardware threads)\n",
      static_cast<long long>(kNumel), static_cast<long long>(ops), static_cast<long long>(reps),
      static_cast<long long>(num_params), static_cast<long long>(threads), std::thread::hardware_concurrency());
  std::printf("scenario,best_ns_per_op,median_ns_per_op,median_minus_off_ns\n");
  const double off = median(results["off"]);
  for (const char* name : {"off", "activation", "param", "threads", "lookup", "lookup_threads"}) {
    const std::vector<double>& r = results[name];
    const bool op = std::string(name).rfind("lookup", 0) != 0;  // a lookup alone is no op: nothing to subtract
    std::printf("%s,%.1f,%.1f,%s\n", name, *std::min_element(r.begin(), r.end()), median(r),
                op ? std::to_string(median(r) - off).c_str() : "-");
  }
  return 0;
}
