// meshddp benchmark: the candidates side by side in one run, on the same model, data and
// ranks, interleaved per repetition (the order rotates every repetition, a barrier before each
// step), warm-up then N repetitions; medians of the step time (per step, the max over ranks) and of
// each phase (per step, the mean over ranks).
//
//   local           the model trained in this rank alone, no DDP (the floor)
//   meshddp         meshddp DDP, bucketed all-reduce overlapped with backward; its layers write their
//                   gradients into the flat buffer (meshddp::linear_with_grad_in_buffer; no zeroing pass)
//   meshddp_autograd the same with torch's Linear and gradient_accumulation_fusion off: gradients added
//                   into the buffer by autograd after a zeroing pass (meshddp before in-place gradient writes)
//   meshddp_no_overlap  the same with overlap_grad_reduce=false (every bucket launched in finish_grad_sync)
//   meshddp_zero1   meshddp DDP + ZeRO-1 DistributedOptimizer (reduce-scatter, sharded optimizer, all-gather)
//   reducer_view    c10d::Reducer from the same LibTorch, set up as torch's DDP does, gradient_as_bucket_view=true
//   reducer_copy    the same, gradient_as_bucket_view=false (grads copied into buckets and back)
//   naive           backward, then one blocking all-reduce per parameter, then the step
//   meshddp_bf16    meshddp with the bf16_compress communication hook (grad_buffer/comm_hook.h)
//   reducer_bf16    reducer_view with PyTorch's bf16_compress_hook (Bf16CompressCommHook below)
//   meshddp_fp32_grads  meshddp with grad_reduce_in_fp32 (Megatron's default for bf16): with --dtype bf16,
//                   fp32 main grads and fp32 master weights (Fp32Masters below); for fp32 params = meshddp
//   meshddp_zero1_fp32_grads  meshddp_zero1 with grad_reduce_in_fp32
//   meshddp_zero1_instances  meshddp_zero1 in --optimizer-instances K (default 2) instances: hierarchical
//                   ZeRO-1 (reduce-scatter within D/K ranks, all-reduce of the shard across the K)
//
// Every candidate steps the same torch::optim optimizer (--optimizer sgd: momentum 0.9, the default;
// or adamw) except meshddp_zero1*, whose DistributedOptimizer runs the same arithmetic on its shard
// (with fp32 masters for bf16 params), and meshddp_fp32_grads, which steps fp32 masters. With
// --dtype bf16 the others keep bf16 params, grads and optimizer state: the same arithmetic as local.
//
// Models (bench/bench_models.h; --model): mlp, a deep MLP stack (the default), or gpt,
// a GPT-style decoder (--layers --hidden --heads --seq --vocab; --batch sequences per rank).
// --preset gpt1b is the ~1B-parameter bf16 transformer (set_preset in bench/bench_flags.cpp).
//
// --mode main   the candidates, plus per-parameter gradient-ready times, standalone collective times
//               (every bucket size, and a size sweep for the cost model's alpha/beta) and memory
// --mode sweep  meshddp (all-reduce) at several bucket sizes, interleaved, with local as the floor
//
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/ddp_bench --json out.json
//
// Files: bench_flags (the command line), bench_models (the models), candidate (Phases, Memory, the
// Candidate record), candidates (each candidate's step), bench_run (the interleaved timing loop and
// standalone collectives), bench_report (stdout table and JSON); this file wires them together.
#include "bench/bench.h"
#include "bench/bench_report.h"
#include "examples/common/flags.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using bench::Candidate;
using bench::Flags;
using bench::ReadyTimeline;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// --threads, else the cores shared by the ranks on this machine (LOCAL_WORLD_SIZE).
int threads_per_rank(const Flags& flags) {
  if (flags.threads > 0) return flags.threads;
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  const int ranks_here = local_world ? std::max(1, std::atoi(local_world)) : 1;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency() / ranks_here));
}

// WORLD_SIZE x 1 ("dp", "tp") from torchrun's environment; --device cuda: NCCL on cuda:LOCAL_RANK,
// and the clock waits for the GPU.
meshddp::DeviceMesh make_mesh(const Flags& flags) {
  const int64_t world = std::getenv("WORLD_SIZE") ? std::atoll(std::getenv("WORLD_SIZE")) : 1;
  meshddp::MeshOptions mesh_options;
  if (flags.device == "cuda") {
    mesh_options.device_type = c10::DeviceType::CUDA;
    bench::set_sync_cuda(true);
  }
  return meshddp::DeviceMesh::from_env({world, 1}, {"dp", "tp"}, mesh_options);
}

// One --candidates name; unknown names exit 2 with the usage.
std::unique_ptr<Candidate> make_candidate(bench::Bench& bench, const std::string& name, ReadyTimeline* local_timeline,
                                          ReadyTimeline* meshddp_timeline, const char* prog) {
  const double mb = bench.flags.bucket_mb;
  const std::string bf16 = meshddp::kBf16CompressHook;
  if (name == "local") return bench.make_local(local_timeline);
  if (name == "meshddp") return bench.make_meshddp(name, mb, {}, meshddp_timeline);
  if (name == "meshddp_no_overlap") return bench.make_meshddp(name, mb, {.overlap = false}, nullptr);
  if (name == "meshddp_zero1") return bench.make_meshddp(name, mb, {.zero1 = true}, nullptr);
  if (name == "meshddp_zero1_instances") {
    return bench.make_meshddp(name, mb, {.zero1 = true, .instances = bench.flags.optimizer_instances}, nullptr);
  }
  // before in-place gradient writes: torch's Linear, gradients added by autograd, zeroing pass
  if (name == "meshddp_autograd") return bench.make_meshddp(name, mb, {.grads_in_buffer = false}, nullptr);
  if (name == "meshddp_fp32_grads") return bench.make_meshddp(name, mb, {.fp32_grads = true}, nullptr);
  if (name == "meshddp_zero1_fp32_grads")
    return bench.make_meshddp(name, mb, {.zero1 = true, .fp32_grads = true}, nullptr);
  if (name == "reducer_view") return bench.make_reducer(true);
  if (name == "reducer_copy") return bench.make_reducer(false);
  if (name == "naive") return bench.make_naive();
  if (name == "meshddp_bf16") return bench.make_meshddp(name, mb, {.comm_hook = bf16}, nullptr);
  if (name == "meshddp_zero1_bf16") return bench.make_meshddp(name, mb, {.zero1 = true, .comm_hook = bf16}, nullptr);
  if (name == "reducer_bf16") return bench.make_reducer(true, /*bf16=*/true);
  bench::usage_and_exit(prog, "unknown candidate " + name);
}

// --mode main: the --candidates; --mode sweep: local (the cost model's input), then meshddp at each
// --sweep-mb bucket size.
std::vector<std::unique_ptr<Candidate>> make_candidates(bench::Bench& bench, ReadyTimeline* local_timeline,
                                                        ReadyTimeline* meshddp_timeline, const char* prog) {
  std::vector<std::unique_ptr<Candidate>> cands;
  if (bench.flags.mode == "main") {
    for (const auto& name : split(bench.flags.candidates)) {
      cands.push_back(make_candidate(bench, name, local_timeline, meshddp_timeline, prog));
    }
    return cands;
  }
  cands.push_back(bench.make_local(local_timeline));
  for (const auto& mb : split(bench.flags.sweep_mb)) {
    double bucket_mb = 0;
    try {
      bucket_mb = examples::parse_float_flag("--sweep-mb", mb, 0.0, true);
    } catch (const examples::FlagError& e) {
      bench::usage_and_exit(prog, e.what());
    }
    cands.push_back(bench.make_meshddp("meshddp_" + mb + "MiB", bucket_mb, {}, nullptr));
  }
  return cands;
}

// After the timed runs: memory (buffers and optimizer state exist), standalone collectives, losses.
bench::RunReport measure(bench::Bench& bench, std::vector<std::unique_ptr<Candidate>>& cands, int threads,
                         std::string loadavg_start) {
  bench::RunReport r;
  r.threads = threads;
  r.loadavg_start = std::move(loadavg_start);
  r.results = bench.run(cands);
  for (auto& c : cands) r.memory.push_back(c->memory());
  r.collectives = bench::measure_collectives(bench, cands);
  r.loadavg_end = bench::loadavg();
  for (auto& c : cands) r.losses.push_back(c->last_loss.item<double>());  // every candidate ran >= 1 step
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = bench::parse_flags(argc, argv);
  try {
    const std::string loadavg_start = bench::loadavg();
    const int threads = threads_per_rank(flags);
    at::set_num_threads(threads);
    bench::Bench bench(flags, make_mesh(flags));
    const bool root = bench.rank == 0;
    ReadyTimeline local_timeline, meshddp_timeline;
    auto cands = make_candidates(bench, &local_timeline, &meshddp_timeline, argv[0]);
    if (root) bench::print_header(bench, threads, loadavg_start);
    const bench::RunReport report = measure(bench, cands, threads, loadavg_start);
    if (root) {
      bench::print_table(bench, cands, report);
      if (!flags.json.empty()) bench::write_json(bench, cands, report, local_timeline, meshddp_timeline);
    }
  } catch (const c10::Error& e) {
    std::cerr << "ddp_bench: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
