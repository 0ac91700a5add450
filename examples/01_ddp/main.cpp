// Example 01: data-parallel training of an MLP on synthetic data with meshddp's
// DistributedDataParallel over the "dp" dim of a (dp, tp=1) DeviceMesh built from torchrun's
// environment. Rank 0 prints `step <n> loss <loss>`, the mean loss over the whole global batch;
// the same --seed and --global-batch give the same losses at any rank count that divides the batch.
// stderr (rank 0): the step log and a summary (examples/common/step_log.h). Flags: docs/reference/examples.md.
// --dtype bf16: bf16 params and activations, fp32 main grads (--grad-reduce-in-bf16: bf16) and fp32
// master weights (examples/common/precision.h).
//
//   torchrun --standalone --nproc-per-node 4 --no-python build/examples/ddp_example --steps 30
#include "examples/common/checkpointing.h"
#include "examples/common/flag_agreement.h"
#include "examples/common/precision.h"
#include "examples/common/run_flags.h"
#include "examples/common/step_log.h"
#include "examples/common/training.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <meshddp/meshddp.h>
#include <string>
#include <thread>

namespace {

struct Flags {
  int64_t global_batch = 64;
  uint64_t seed = 0;
  examples::RunFlags run;  // --steps, --lr and schedule, logging, --inject-nan, timeouts
  int64_t hidden = 256;
  int64_t layers = 4;
  double bucket_mb = 40;
  bool distributed_optimizer = false;  // ZeRO-1: sharded AdamW state, reduce-scatter + param all-gather
  examples::PrecisionFlags precision;  // --dtype, --grad-reduce-in-bf16
  examples::CheckpointFlags checkpoints;
};

std::string usage_line() {
  return std::string(
             "[--global-batch N] [--seed N] [--hidden N] [--layers N] [--bucket-mb X] "
             "[--distributed-optimizer] ") +
         examples::precision_usage() + " " + examples::run_flags_usage() + examples::checkpoint_usage();
}

[[noreturn]] void usage_and_exit(const char* prog, const std::string& bad) {
  examples::exit_with_usage(prog, bad, usage_line());
}

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") examples::exit_with_help(argv[0], usage_line());
    if (arg == "--distributed-optimizer") {
      f.distributed_optimizer = true;
      continue;
    }
    if (examples::parse_precision_switch(arg, f.precision)) continue;
    if (examples::parse_checkpoint_flag(argc, argv, i, f.checkpoints)) continue;
    if (i + 1 >= argc) usage_and_exit(argv[0], "flag " + arg + " needs a value");
    const std::string value = argv[++i];
    using examples::parse_int_flag;
    try {
      if (arg == "--global-batch")
        f.global_batch = parse_int_flag(arg, value, 1);
      else if (arg == "--seed")
        f.seed = static_cast<uint64_t>(parse_int_flag(arg, value, 0));
      else if (arg == "--hidden")
        f.hidden = parse_int_flag(arg, value, 1);
      else if (arg == "--layers")
        f.layers = parse_int_flag(arg, value, 1);
      else if (arg == "--bucket-mb")
        f.bucket_mb = examples::parse_float_flag(arg, value, 0.0, true);
      else if (examples::parse_precision_flag(arg, value, f.precision))
        continue;
      else if (!examples::parse_run_flag(arg, value, f.run))
        usage_and_exit(argv[0], "unknown flag " + arg);
    } catch (const examples::FlagError& e) {
      usage_and_exit(argv[0], e.what());
    }
  }
  try {
    examples::validate_run_flags(f.run);
    examples::validate_precision_flags(f.precision, f.distributed_optimizer, f.checkpoints.any());
  } catch (const examples::FlagError& e) {
    usage_and_exit(argv[0], e.what());
  }
  return f;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out, int64_t layers) {
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t fan_in = l == 0 ? in : hidden;
      const int64_t fan_out = l == layers - 1 ? out : hidden;
      blocks->push_back(torch::nn::Linear(fan_in, fan_out));
    }
    register_module("blocks", blocks);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t l = 0; l < blocks->size(); ++l) {
      x = blocks[l]->as<torch::nn::Linear>()->forward(x);
      if (l + 1 < blocks->size()) x = torch::gelu(x);
    }
    return x;
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(Mlp);

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = parse(argc, argv);
  try {
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    const int ranks_here = local_world ? std::max(1, std::atoi(local_world)) : 1;
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency() / ranks_here)));

    const int64_t world = std::getenv("WORLD_SIZE") ? std::atoll(std::getenv("WORLD_SIZE")) : 1;
    meshddp::DeviceMesh mesh =
        meshddp::DeviceMesh::from_env({world, 1}, {"dp", "tp"}, examples::mesh_options(flags.run));
    examples::verify_same_flags_across_ranks(mesh, argc, argv, "ddp_example");  // before the flags shape anything
    const int64_t dp = mesh.size("dp"), dp_rank = mesh.coordinate("dp");
    TORCH_CHECK(flags.global_batch % dp == 0, "--global-batch ", flags.global_batch, " must divide by the DP size ",
                dp);
    const int64_t local_batch = flags.global_batch / dp;
    constexpr int64_t kIn = 64, kOut = 16;

    torch::manual_seed(flags.seed);
    Mlp model(kIn, flags.hidden, kOut, flags.layers);
    model->to(flags.precision.param_dtype());
    meshddp::DdpConfig config;
    config.bucket_bytes = static_cast<size_t>(flags.bucket_mb * (1 << 20));
    config.use_distributed_optimizer = flags.distributed_optimizer;
    config.check_for_nan_in_grad = !flags.distributed_optimizer;  // ZeRO-1 skips such steps instead
    config.grad_reduce_in_fp32 = flags.precision.grad_reduce_in_fp32();
    meshddp::DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    // The same AdamW either way (LibTorch's default weight decay 1e-2): unsharded, or ZeRO-1.
    std::unique_ptr<torch::optim::AdamW> optimizer;
    std::unique_ptr<meshddp::DistributedOptimizer> zero1;
    std::unique_ptr<examples::Fp32MasterParams> masters;  // plain DDP in bf16: AdamW steps fp32 copies
    meshddp::LrScheduler schedule(examples::lr_schedule(flags.run));
    if (flags.distributed_optimizer) {
      meshddp::DistributedOptimizerConfig opt_config;
      opt_config.lr = flags.run.lr;
      opt_config.weight_decay = 1e-2;
      zero1 = std::make_unique<meshddp::DistributedOptimizer>(ddp.grad_buffer(), opt_config);
      schedule.attach(*zero1);
    } else {
      if (flags.precision.bf16) masters = std::make_unique<examples::Fp32MasterParams>(ddp);
      optimizer = std::make_unique<torch::optim::AdamW>(masters ? masters->masters() : ddp.parameters(),
                                                        torch::optim::AdamWOptions(flags.run.lr));
      schedule.attach(*optimizer);
    }

    // A fixed random "teacher" makes the targets learnable, so the loss goes down.
    auto teacher_gen = at::make_generator<at::CPUGeneratorImpl>(flags.seed + 1);
    auto teacher = torch::randn({kIn, kOut}, teacher_gen) / std::sqrt(static_cast<double>(kIn));
    if (mesh.rank() == 0) {
      int64_t numel = 0;
      for (const auto& p : model->parameters()) numel += p.numel();
      std::fprintf(stderr,
                   "# meshddp example 01_ddp: %s, %lld params in %zu bucket(s), global batch %lld (%lld per rank)\n",
                   mesh.describe().c_str(), static_cast<long long>(numel), ddp.grad_buffer()->layout().buckets.size(),
                   static_cast<long long>(flags.global_batch), static_cast<long long>(local_batch));
      std::fprintf(stderr, "%s\n", examples::precision_header(ddp, zero1.get(), masters.get()).c_str());
    }
    examples::ExampleCheckpoints checkpoints(
        flags.checkpoints, meshddp::TrainingState{model.ptr().get(), &ddp, zero1.get(), optimizer.get()}, mesh.rank(),
        flags.seed, flags.global_batch);
    checkpoints.track(schedule);
    const int64_t first_step = checkpoints.resume();
    FILE* log = stdout;
    if (!flags.run.log_file.empty() && mesh.rank() == 0) {
      log = std::fopen(flags.run.log_file.c_str(), "w");
      TORCH_CHECK(log, "cannot open --log-file '", flags.run.log_file, "' for writing");
    }
    examples::StepLogger logger(flags.run.steps, flags.run.log_interval, flags.global_batch, /*tokens_per_sample=*/0,
                                mesh.device(), mesh.rank() == 0);
    examples::SkippedSteps skipped(flags.run.max_skipped_steps);
    const auto named = model->named_parameters();
    const auto first_param = named.begin();
    examples::NanInjector inject(flags.run.inject_nan, first_step, flags.run.steps, world, first_param->value(),
                                 first_param->key());
    for (int64_t step = first_step; step < flags.run.steps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      auto gen = at::make_generator<at::CPUGeneratorImpl>(flags.seed * 1000003 + step + 7);
      auto x = torch::randn({flags.global_batch, kIn}, gen);
      auto y = torch::sin(x.matmul(teacher));
      auto xs = x.narrow(0, dp_rank * local_batch, local_batch);
      auto ys = y.narrow(0, dp_rank * local_batch, local_batch);

      ddp.zero_grad_buffer();
      const double lr = schedule.lr();
      // Inputs in the params' dtype; the loss in fp32.
      auto loss = torch::mse_loss(ddp.forward(xs.to(flags.precision.param_dtype())).to(torch::kFloat), ys);
      inject.before_backward(step, mesh.rank());
      loss.backward();
      inject.after_backward();
      meshddp::StepResult result;
      if (zero1) {
        result = zero1->step();  // finishes the grad sync itself
        skipped.on_step(step, result, mesh.rank() == 0);
      } else {
        ddp.finish_grad_sync();  // with check_for_nan_in_grad: throws on every rank, naming param, rank, step
        result.grad_norm = meshddp::grad_norm(ddp.grad_buffer());
        if (masters) masters->take_grads(ddp);
        optimizer->step();
        if (masters) masters->write_params();
      }
      if (!result.skipped) schedule.step();

      // Mean over the global batch = DP mean of the local means (equal shards).
      auto global_loss = loss.detach().reshape({1}) / static_cast<double>(dp);
      meshddp::all_reduce_sum_now(*mesh["dp"], global_loss, "the example's loss report");
      if (mesh.rank() == 0) {
        std::fprintf(log, "step %lld loss %#.10g\n", static_cast<long long>(step), global_loss.item<double>());
        std::fflush(log);
      }
      logger.record({step, global_loss.item<double>(), lr, result.grad_norm,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), result.skipped});
      checkpoints.after_step(static_cast<int>(step), static_cast<int>(flags.run.steps));
    }
    logger.summary();
    if (log != stdout) std::fclose(log);
  } catch (const c10::Error& e) {
    examples::report_error("ddp_example", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {  // anything else (std::bad_alloc, ...): named, never a terminate
    examples::report_error("ddp_example", e.what());
    return 1;
  }
  return 0;
}
