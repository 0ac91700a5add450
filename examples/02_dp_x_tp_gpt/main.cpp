// Example 02: a tiny GPT trained on a DP x TP mesh of torchrun ranks. The model (gpt.h) is plain
// single-device code; gpt_plan.h parallelizes it over "tp"; DistributedDataParallel syncs gradients
// over "dp" (optionally with the ZeRO-1 distributed optimizer and sequence parallelism).
//
//   torchrun --standalone --nproc-per-node 4 --no-python build/examples/gpt_example --dp 2 --tp 2 --steps 30
//
// stdout (or --log-file): `step <n> loss <loss>` per step, the mean loss over the whole global batch
// with 10 significant digits; stderr: a one-line status per step. The same --seed and
// --global-batch give the same loss curve at any DP x TP (to fp32 tolerance).
#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "examples/common/checkpointing.h"
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "mesh/collectives.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

namespace {

struct Flags {
  int64_t dp = 1, tp = 1;
  bool sequence_parallel = false, distributed_optimizer = false;
  int steps = 30;
  int64_t global_batch = 16;
  uint64_t seed = 0;
  double lr = 1e-2;
  std::string log_file;
  gpt::Config model;
  examples::CheckpointFlags checkpoints;
};

[[noreturn]] void usage(const char* prog, const std::string& error) {
  std::cerr << "error: " << error << "\nusage: " << prog
            << " --dp N --tp N [--sequence-parallel] [--distributed-optimizer] [--steps N] [--global-batch N] "
               "[--seed N] [--lr X] [--log-file PATH] [--layers N] [--dim N] [--heads N] [--seq-len N] [--vocab N]"
            << examples::checkpoint_usage() << "\n";
  std::exit(2);
}

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sequence-parallel") { f.sequence_parallel = true; continue; }
    if (arg == "--distributed-optimizer") { f.distributed_optimizer = true; continue; }
    if (examples::parse_checkpoint_flag(argc, argv, i, f.checkpoints)) continue;
    if (i + 1 >= argc) usage(argv[0], "flag " + arg + " needs a value");
    const std::string v = argv[++i];
    try {
      if (arg == "--dp") f.dp = std::stoll(v);
      else if (arg == "--tp") f.tp = std::stoll(v);
      else if (arg == "--steps") f.steps = std::stoi(v);
      else if (arg == "--global-batch") f.global_batch = std::stoll(v);
      else if (arg == "--seed") f.seed = std::stoull(v);
      else if (arg == "--lr") f.lr = std::stod(v);
      else if (arg == "--log-file") f.log_file = v;
      else if (arg == "--layers") f.model.layers = std::stoll(v);
      else if (arg == "--dim") f.model.dim = std::stoll(v);
      else if (arg == "--heads") f.model.heads = std::stoll(v);
      else if (arg == "--seq-len") f.model.seq_len = std::stoll(v);
      else if (arg == "--vocab") f.model.vocab = std::stoll(v);
      else usage(argv[0], "unknown flag " + arg);
    } catch (const std::logic_error&) {
      usage(argv[0], "flag " + arg + " has a bad value '" + v + "'");
    }
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  try {
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency() /
                                                        std::max(1, local_world ? std::atoi(local_world) : 1))));
    meshddp::DeviceMesh mesh = meshddp::DeviceMesh::from_env({f.dp, f.tp}, {"dp", "tp"});
    TORCH_CHECK(f.global_batch % f.dp == 0, "--global-batch ", f.global_batch, " must divide by --dp ", f.dp);
    TORCH_CHECK(!f.sequence_parallel || f.model.seq_len % f.tp == 0, "--seq-len ", f.model.seq_len,
                " must divide by --tp ", f.tp, " with --sequence-parallel");

    torch::manual_seed(f.seed);  // every rank builds the full model, then keeps its shards
    gpt::Gpt model(f.model);
    meshddp::parallelize(*model, mesh, gpt::tp_plan(f.model), {.sequence_parallel = f.sequence_parallel});
    meshddp::DdpConfig config;
    config.use_distributed_optimizer = f.distributed_optimizer;
    meshddp::DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::unique_ptr<meshddp::DistributedOptimizer> zero1;
    if (f.distributed_optimizer) {
      meshddp::DistributedOptimizerConfig oc;
      oc.lr = f.lr;
      oc.weight_decay = 0.0;
      zero1 = std::make_unique<meshddp::DistributedOptimizer>(ddp.grad_buffer(), oc);
    } else {
      adamw = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0.0));
    }

    FILE* log = stdout;
    if (!f.log_file.empty() && mesh.rank() == 0) {
      log = std::fopen(f.log_file.c_str(), "w");
      TORCH_CHECK(log, "cannot open --log-file '", f.log_file, "' for writing");
    }
    const int64_t dp_rank = mesh.coordinate("dp"), local = f.global_batch / f.dp;
    if (mesh.rank() == 0) {
      int64_t n = 0;
      for (const auto& p : model->parameters()) n += p.numel();
      std::fprintf(stderr, "# gpt: %s%s%s, %lld params on rank 0, global batch %lld x %lld tokens\n", mesh.describe().c_str(),
                   f.sequence_parallel ? ", sequence parallel" : "", f.distributed_optimizer ? ", ZeRO-1" : "",
                   static_cast<long long>(n), static_cast<long long>(f.global_batch), static_cast<long long>(f.model.seq_len));
    }
    examples::ExampleCheckpoints checkpoints(f.checkpoints, {model.ptr().get(), &ddp, zero1.get(), adamw.get()},
                                             mesh.rank(), f.seed, f.global_batch);
    for (int step = checkpoints.resume(); step < f.steps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      auto [ids, targets] = gpt::make_batch(f.model, f.seed, step, f.global_batch);
      ddp.zero_grad_buffer();
      auto logits = ddp.forward(ids.narrow(0, dp_rank * local, local));
      auto loss = meshddp::tp::cross_entropy(logits.view({-1, logits.size(-1)}),
                                             targets.narrow(0, dp_rank * local, local).reshape({-1}), mesh["tp"].get());
      loss.backward();
      if (zero1) {
        zero1->step();
      } else {
        ddp.finish_grad_sync();
        adamw->step();
      }
      auto global = loss.detach().to(torch::kDouble).reshape({1}) / static_cast<double>(f.dp);
      meshddp::all_reduce_sum_now(*mesh["dp"], global, "the example's loss report");
      if (mesh.rank() == 0) {
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(log, "step %d loss %#.10g\n", step, global.item<double>());
        std::fflush(log);
        std::fprintf(stderr, "[dp %lld x tp %lld] step %d/%d  loss %.4f  %.0f ms\n", static_cast<long long>(f.dp),
                     static_cast<long long>(f.tp), step + 1, f.steps, global.item<double>(), ms);
      }
      checkpoints.after_step(step, f.steps);
    }
    if (zero1) zero1->finish_param_sync();
    if (log != stdout) std::fclose(log);
  } catch (const c10::Error& e) {
    std::cerr << "gpt_example: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
