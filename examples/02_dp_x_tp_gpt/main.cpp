// Example 02: a tiny GPT trained on a DP x TP mesh of torchrun ranks. The model (gpt.h) is plain
// single-device code; gpt_plan.h parallelizes it over "tp"; DistributedDataParallel syncs gradients
// over "dp" (optionally with the ZeRO-1 distributed optimizer and sequence parallelism). --cp N adds a
// context-parallel dim ("dp" x "cp" x "tp"): each CP rank holds a slice of every sequence and
// gradients are averaged over DP x CP (docs/context_parallel.md). --experts E makes each block's MLP a
// dropless mixture of E experts (top --top-k); --ep N spreads them over expert-parallel groups of N
// ranks carved out of DP (x CP), tokens moving by all-to-all (docs/expert_parallel.md).
// --distributed-optimizer --optimizer-instances K shards the optimizer within K instances of DP(xCP)/K
// ranks and all-reduces the shards across them (hierarchical ZeRO-1, docs/optimizer.md).
// --dtype bf16 trains in bf16 with fp32 main grads and fp32 masters (--grad-reduce-in-bf16: bf16 main
// grads), as Megatron does (examples/common/precision.h); --micro-batches K accumulates K micro-batches
// per DP rank and syncs once.
//
//   torchrun --standalone --nproc-per-node 4 --no-python build/examples/gpt_example --dp 2 --tp 2 --steps 30
//
// stdout (or --log-file): `step <n> loss <loss>` per step, the mean loss over the whole global batch
// with 10 significant digits; stderr (rank 0): the step log (examples/common/step_log.h) and a
// summary. The same --seed and --global-batch give the same loss curve at any DP x TP (to fp32
// tolerance). Flags: docs/examples.md.
#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "examples/common/checkpointing.h"
#include "examples/common/flag_agreement.h"
#include "examples/common/precision.h"
#include "examples/common/run_flags.h"
#include "examples/common/step_log.h"
#include "examples/common/training.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <meshddp/meshddp.h>
#include <string>
#include <thread>

namespace {

struct Flags {
  int64_t dp = 1, cp = 1, tp = 1;
  int64_t ep = 1;  // expert-parallel size (--ep); the number of experts and top-k are in `model`
  bool sequence_parallel = false, distributed_optimizer = false;
  // --optimizer-instances K: hierarchical ZeRO-1 (num_distributed_optimizer_instances)
  int64_t optimizer_instances = 1;
  int64_t global_batch = 16;
  int64_t micro_batches = 1;  // per DP rank and step: backward accumulates, the last one syncs
  uint64_t seed = 0;
  examples::PrecisionFlags precision;  // --dtype, --grad-reduce-in-bf16
  std::string optimizer = "adamw";     // --optimizer adamw|sgd|muon (SGD: a wrong gradient scale shows; AdamW hides it;
                                    // muon: Muon on the block matrices, AdamW on the rest, whole-param ZeRO-1 shards)
  examples::RunFlags run;  // --steps, --lr and schedule, logging, --inject-nan, timeouts
  gpt::Config model;
  examples::CheckpointFlags checkpoints;
};

std::string usage_line() {
  return std::string(
             "--dp N [--cp N] --tp N [--sequence-parallel] [--distributed-optimizer [--optimizer-instances K]] "
             "[--optimizer adamw|sgd|muon] "
             "[--global-batch N] [--micro-batches K] "
             "[--seed N] [--layers N] [--dim N] [--heads N] [--seq-len N] [--vocab N] [--experts N [--top-k K] [--ep "
             "N]] ") +
         examples::precision_usage() + " " + examples::run_flags_usage() + examples::checkpoint_usage();
}

[[noreturn]] void usage(const char* prog, const std::string& error) {
  examples::exit_with_usage(prog, error, usage_line());
}

// Model and mesh flags that would otherwise fail deep inside (--heads 0 divides by zero on every rank).
void validate(const Flags& f) {
  using examples::FlagError;
  const auto& m = f.model;
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (m.dim % m.heads != 0) throw FlagError("--dim " + n(m.dim) + " must divide by --heads " + n(m.heads));
  if (m.heads % f.tp != 0)
    throw FlagError("--heads " + n(m.heads) + " must divide by --tp " + n(f.tp) + " (heads are split over TP)");
  if (m.vocab % f.tp != 0)
    throw FlagError("--vocab " + n(m.vocab) + " must divide by --tp " + n(f.tp) + " (the vocab is split over TP)");
  if (f.global_batch % (f.dp * f.micro_batches) != 0) {
    throw FlagError("--global-batch " + n(f.global_batch) + " must divide by --dp " + n(f.dp) +
                    (f.micro_batches > 1 ? " x --micro-batches " + n(f.micro_batches) : std::string()));
  }
  if (m.seq_len % f.cp != 0) {
    throw FlagError("--seq-len " + n(m.seq_len) + " must divide by --cp " + n(f.cp) +
                    " (each CP rank holds a slice of every sequence)");
  }
  if (f.sequence_parallel && m.seq_len % (f.cp * f.tp) != 0) {
    throw FlagError("--seq-len " + n(m.seq_len) + " must divide by --tp " + n(f.tp) +
                    (f.cp > 1 ? " x --cp " + n(f.cp) : std::string()) + " with --sequence-parallel");
  }
  if (m.experts == 0 && f.ep > 1)
    throw FlagError("--ep " + n(f.ep) + " needs --experts (a mixture of experts to spread)");
  if (m.experts > 0) {
    if (m.top_k > m.experts) throw FlagError("--top-k " + n(m.top_k) + " must be at most --experts " + n(m.experts));
    if (m.experts % f.ep != 0)
      throw FlagError("--experts " + n(m.experts) + " must divide by --ep " + n(f.ep) + " (each EP rank holds E / ep)");
    if ((f.dp * f.cp) % f.ep != 0) {
      throw FlagError("--ep " + n(f.ep) + " must divide --dp " + n(f.dp) + (f.cp > 1 ? " x --cp " + n(f.cp) : "") +
                      " (expert-parallel groups are carved out of the data-parallel ranks)");
    }
    if (f.sequence_parallel && f.tp > 1) {
      throw FlagError(
          "--sequence-parallel with --experts is not supported: the MoE layer routes whole tokens, which "
          "sequence parallelism splits over TP; drop one of them (--experts works with --tp without it)");
    }
  }
  if (f.optimizer == "muon" && !f.distributed_optimizer) {
    throw FlagError("--optimizer muon needs --distributed-optimizer (Muon runs on whole-param ZeRO-1 shards)");
  }
  examples::validate_run_flags(f.run);
  examples::validate_precision_flags(f.precision, f.distributed_optimizer, f.checkpoints.any());
}

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") examples::exit_with_help(argv[0], usage_line());
    if (arg == "--sequence-parallel") {
      f.sequence_parallel = true;
      continue;
    }
    if (arg == "--distributed-optimizer") {
      f.distributed_optimizer = true;
      continue;
    }
    if (examples::parse_precision_switch(arg, f.precision)) continue;
    if (examples::parse_checkpoint_flag(argc, argv, i, f.checkpoints)) continue;
    if (i + 1 >= argc) usage(argv[0], "flag " + arg + " needs a value");
    const std::string v = argv[++i];
    using examples::parse_int_flag;
    try {
      if (arg == "--dp")
        f.dp = parse_int_flag(arg, v, 1);
      else if (arg == "--tp")
        f.tp = parse_int_flag(arg, v, 1);
      else if (arg == "--cp")
        f.cp = parse_int_flag(arg, v, 1);
      else if (arg == "--optimizer-instances")
        f.optimizer_instances = parse_int_flag(arg, v, 1);
      else if (arg == "--ep")
        f.ep = parse_int_flag(arg, v, 1);
      else if (arg == "--experts")
        f.model.experts = parse_int_flag(arg, v, 0);
      else if (arg == "--top-k")
        f.model.top_k = parse_int_flag(arg, v, 1);
      else if (arg == "--global-batch")
        f.global_batch = parse_int_flag(arg, v, 1);
      else if (arg == "--micro-batches")
        f.micro_batches = parse_int_flag(arg, v, 1);
      else if (examples::parse_precision_flag(arg, v, f.precision))
        continue;
      else if (arg == "--seed")
        f.seed = static_cast<uint64_t>(parse_int_flag(arg, v, 0));
      else if (arg == "--optimizer") {
        if (v != "adamw" && v != "sgd" && v != "muon")
          throw examples::FlagError("--optimizer must be adamw, sgd or muon, got '" + v + "'");
        f.optimizer = v;
      } else if (arg == "--layers")
        f.model.layers = parse_int_flag(arg, v, 1);
      else if (arg == "--dim")
        f.model.dim = parse_int_flag(arg, v, 1);
      else if (arg == "--heads")
        f.model.heads = parse_int_flag(arg, v, 1);
      else if (arg == "--seq-len")
        f.model.seq_len = parse_int_flag(arg, v, 1);
      else if (arg == "--vocab")
        f.model.vocab = parse_int_flag(arg, v, 1);
      else if (!examples::parse_run_flag(arg, v, f.run))
        usage(argv[0], "unknown flag " + arg);
    } catch (const examples::FlagError& e) {
      usage(argv[0], e.what());
    }
  }
  try {
    validate(f);
  } catch (const examples::FlagError& e) {
    usage(argv[0], e.what());
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  try {
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    at::set_num_threads(static_cast<int>(
        std::max(1u, std::thread::hardware_concurrency() / std::max(1, local_world ? std::atoi(local_world) : 1))));
    // A "cp" dim only with --cp > 1, so that DP x TP runs keep their 2-D mesh.
    meshddp::DeviceMesh mesh =
        f.cp > 1 ? meshddp::DeviceMesh::from_env({f.dp, f.cp, f.tp}, {"dp", "cp", "tp"}, examples::mesh_options(f.run))
                 : meshddp::DeviceMesh::from_env({f.dp, f.tp}, {"dp", "tp"}, examples::mesh_options(f.run));
    examples::verify_same_flags_across_ranks(mesh, argc, argv, "gpt_example");  // before the flags shape anything

    torch::manual_seed(f.seed);  // every rank builds the full model (all experts), then keeps its shards
    gpt::Gpt model(f.model);
    model->to(f.precision.param_dtype());  // before parallelize: every layout holds the same bf16 values
    // Every param is replicated over DP and CP: its gradient is averaged over the flattened DP x CP group.
    const std::vector<std::string> dp_dims =
        f.cp > 1 ? std::vector<std::string>{"dp", "cp"} : std::vector<std::string>{"dp"};
    // Expert parallel: blocks of --ep consecutive DP (x CP) ranks, TP fixed (mesh/reduction_groups.h).
    c10::intrusive_ptr<c10d::ProcessGroup> ep_group;
    if (f.ep > 1) {
      const std::vector<int64_t> sizes =
          f.cp > 1 ? std::vector<int64_t>{f.dp, f.cp, f.tp} : std::vector<int64_t>{f.dp, f.tp};
      const std::vector<std::string> names =
          f.cp > 1 ? std::vector<std::string>{"dp", "cp", "tp"} : std::vector<std::string>{"dp", "tp"};
      ep_group = mesh.group_of("ep", meshddp::expert_parallel_groups(sizes, names, dp_dims, f.ep));
      model->set_expert_parallel(ep_group.get());
    }
    meshddp::parallelize(*model, mesh, gpt::tp_plan(f.model), {.sequence_parallel = f.sequence_parallel});
    if (f.cp > 1) model->set_context_parallel(mesh["cp"].get());
    meshddp::DdpConfig config;
    config.use_distributed_optimizer = f.distributed_optimizer;
    if (f.optimizer == "muon") config.shard_policy = meshddp::kWholeParamShards;  // Muon needs whole matrices
    config.num_distributed_optimizer_instances = f.optimizer_instances;           // checked by DdpConfig and DDP
    config.check_for_nan_in_grad = !f.distributed_optimizer;                      // ZeRO-1 skips such steps instead
    config.grad_reduce_in_fp32 = f.precision.grad_reduce_in_fp32();
    config.expert_parallel_size = f.ep;  // expert grads over the expert-DP group (dense ones over DP (x CP))
    meshddp::DistributedDataParallel ddp(model.ptr(), mesh, dp_dims, config);
    std::unique_ptr<torch::optim::Optimizer> adamw;  // AdamW, or SGD with --optimizer sgd
    std::unique_ptr<meshddp::DistributedOptimizer> zero1;
    std::unique_ptr<examples::Fp32MasterParams> masters;  // plain DDP in bf16: the optimizer steps fp32 copies
    meshddp::LrScheduler schedule(examples::lr_schedule(f.run));
    const bool sgd = f.optimizer == "sgd";
    if (f.distributed_optimizer) {
      meshddp::DistributedOptimizerConfig oc;
      oc.kind = sgd ? meshddp::OptimizerKind::kSgd : meshddp::OptimizerKind::kAdamW;
      if (f.optimizer == "muon") {
        oc.kind = meshddp::OptimizerKind::kMuon;
        oc.muon_adamw_params = "*wte*,*wpe*,*lm_head*";  // the embeddings (and the head tied to wte) stay on AdamW
      }
      oc.lr = f.run.lr;
      oc.weight_decay = 0.0;
      zero1 = std::make_unique<meshddp::DistributedOptimizer>(ddp.grad_buffer(), oc);
      schedule.attach(*zero1);
    } else {
      if (f.precision.bf16) masters = std::make_unique<examples::Fp32MasterParams>(ddp);
      const std::vector<torch::Tensor> stepped = masters ? masters->masters() : ddp.parameters();
      if (sgd) {
        adamw = std::make_unique<torch::optim::SGD>(stepped, torch::optim::SGDOptions(f.run.lr));
      } else {
        adamw = std::make_unique<torch::optim::AdamW>(stepped, torch::optim::AdamWOptions(f.run.lr).weight_decay(0.0));
      }
      schedule.attach(*adamw);
    }

    FILE* log = stdout;
    if (!f.run.log_file.empty() && mesh.rank() == 0) {
      log = std::fopen(f.run.log_file.c_str(), "w");
      TORCH_CHECK(log, "cannot open --log-file '", f.run.log_file, "' for writing");
    }
    const int64_t dp_rank = mesh.coordinate("dp"), local = f.global_batch / f.dp;
    const int64_t cp_rank = f.cp > 1 ? mesh.coordinate("cp") : 0, slice = f.model.seq_len / f.cp;
    if (mesh.rank() == 0) {
      int64_t n = 0;
      for (const auto& p : model->parameters()) n += p.numel();
      const std::string moe = f.model.experts > 0
                                  ? ", " + std::to_string(f.model.experts) + " experts (top-" +
                                        std::to_string(f.model.top_k) + ", ep " + std::to_string(f.ep) + ")"
                                  : std::string();
      std::fprintf(stderr, "# gpt: %s%s%s%s, %lld params on rank 0, global batch %lld x %lld tokens\n",
                   mesh.describe().c_str(), moe.c_str(), f.sequence_parallel ? ", sequence parallel" : "",
                   f.distributed_optimizer ? ", ZeRO-1" : "", static_cast<long long>(n),
                   static_cast<long long>(f.global_batch), static_cast<long long>(f.model.seq_len));
      std::fprintf(stderr, "%s\n", examples::precision_header(ddp, zero1.get(), masters.get()).c_str());
    }
    examples::ExampleCheckpoints checkpoints(f.checkpoints, {model.ptr().get(), &ddp, zero1.get(), adamw.get()},
                                             mesh.rank(), f.seed, f.global_batch);
    checkpoints.track(schedule);
    const int64_t first_step = checkpoints.resume();
    examples::StepLogger logger(f.run.steps, f.run.log_interval, f.global_batch, f.model.seq_len, mesh.device(),
                                mesh.rank() == 0);
    examples::SkippedSteps skipped(f.run.max_skipped_steps);
    const auto named = model->named_parameters();
    const auto first_param = named.begin();
    examples::NanInjector inject(f.run.inject_nan, first_param->value(), first_param->key());
    for (int64_t step = first_step; step < f.run.steps; ++step) {
      const auto start = std::chrono::steady_clock::now();
      auto [ids, targets] = gpt::make_batch(f.model, f.seed, step, f.global_batch);
      ddp.zero_grad_buffer();
      const double lr = schedule.lr();
      // This DP rank's sequences, this CP rank's slice of each: tokens [cp_rank * slice, (cp_rank + 1) * slice).
      const auto mine = [&](const torch::Tensor& t) {
        return t.narrow(0, dp_rank * local, local).narrow(1, cp_rank * slice, slice);
      };
      // --micro-batches K: K slices of this rank's sequences; backward accumulates, the last one syncs.
      const int64_t micro = local / f.micro_batches;
      torch::Tensor loss = torch::zeros({}, torch::kDouble);
      inject.before_backward(step, mesh.rank());
      for (int64_t m = 0; m < f.micro_batches; ++m) {
        ddp.set_is_last_microbatch(m == f.micro_batches - 1);
        auto logits = ddp.forward(mine(ids).narrow(0, m * micro, micro));
        // The loss in fp32 (bf16 logits widened, as Megatron's cross entropy does); the mean over
        // this rank's tokens: slices are equal, so the DP x CP gradient mean is the gradient of the
        // whole batch's mean.
        auto micro_loss =
            meshddp::tp::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}),
                                       mine(targets).narrow(0, m * micro, micro).reshape({-1}), mesh["tp"].get()) /
            static_cast<double>(f.micro_batches);
        micro_loss.backward();
        loss = loss + micro_loss.detach().to(torch::kDouble);
      }
      inject.after_backward();
      meshddp::StepResult result;
      if (zero1) {
        result = zero1->step();
        skipped.on_step(step, result, mesh.rank() == 0);
      } else {
        ddp.finish_grad_sync();  // with check_for_nan_in_grad: throws on every rank, naming param, rank, step
        result.grad_norm = meshddp::grad_norm(ddp.grad_buffer());
        if (masters) masters->take_grads(ddp);
        adamw->step();
        if (masters) masters->write_params();
      }
      if (!result.skipped) schedule.step();
      auto global = loss.reshape({1}) / static_cast<double>(f.dp * f.cp);
      meshddp::all_reduce_sum_now(ddp.dp_group(), global, "the example's loss report");
      if (mesh.rank() == 0) {
        std::fprintf(log, "step %lld loss %#.10g\n", static_cast<long long>(step), global.item<double>());
        std::fflush(log);
      }
      logger.record({step, global.item<double>(), lr, result.grad_norm,
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), result.skipped});
      checkpoints.after_step(static_cast<int>(step), static_cast<int>(f.run.steps));
    }
    if (zero1) zero1->finish_param_sync();
    logger.summary();
    if (log != stdout) std::fclose(log);
  } catch (const c10::Error& e) {
    examples::report_error("gpt_example", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {  // anything else (std::bad_alloc, ...): named, never a terminate
    examples::report_error("gpt_example", e.what());
    return 1;
  }
  return 0;
}
