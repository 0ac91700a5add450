// Example 02: a tiny GPT trained on a DP x TP mesh of torchrun ranks. The model (gpt.h) is plain
// single-device code; gpt_plan.h parallelizes it over "tp"; DistributedDataParallel syncs gradients
// over "dp" (optionally with the ZeRO-1 distributed optimizer and sequence parallelism). --cp N adds a
// context-parallel dim ("dp" x "cp" x "tp"): each CP rank holds a slice of every sequence and
// gradients are averaged over DP x CP (docs/guide/parallelism.md). --experts E makes each block's MLP a
// dropless mixture of E experts (top --top-k); --ep N spreads them over expert-parallel groups of N
// ranks carved out of DP (x CP), tokens moving by all-to-all (docs/guide/parallelism.md).
// --distributed-optimizer --optimizer-instances K shards the optimizer within K instances of DP(xCP)/K
// ranks and all-reduces the shards across them (hierarchical ZeRO-1, docs/reference/optimizer.md).
// --dtype bf16 trains in bf16 with fp32 main grads and fp32 masters (--grad-reduce-in-bf16: bf16 main
// grads), as Megatron does (examples/common/precision.h); --micro-batches K accumulates K micro-batches
// per DP rank and syncs once. --pp N [--vpp V] runs it on a pipeline (pipeline_train.h: 1F1B or
// interleaved, on meshddp's pipeline controls; docs/guide/pipelines.md); --loss per-token normalises by the
// global count of valid tokens.
//
//   torchrun --standalone --nproc-per-node 4 --no-python build/examples/gpt_example --dp 2 --tp 2 --steps 30
//
// stdout (or --log-file): `step <n> loss <loss>` per step, the mean loss over the whole global batch
// with 10 significant digits; stderr (rank 0): the step log (examples/common/step_log.h) and a
// summary. The same --seed and --global-batch give the same loss curve at any DP x TP (to fp32
// tolerance). Flags: docs/reference/examples.md.
#include "examples/02_dp_x_tp_gpt/gpt.h"
#include "examples/02_dp_x_tp_gpt/gpt_flags.h"
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "examples/02_dp_x_tp_gpt/pipeline_train.h"
#include "examples/common/checkpointing.h"
#include "examples/common/flag_agreement.h"
#include "examples/common/precision.h"
#include "examples/common/step_log.h"
#include "examples/common/training.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "mesh/reduction_groups.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <meshddp/meshddp.h>
#include <string>
#include <sys/resource.h>
#include <thread>

int main(int argc, char** argv) {
  const gpt::Flags f = gpt::parse(argc, argv);
  try {
    const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
    at::set_num_threads(static_cast<int>(
        std::max(1u, std::thread::hardware_concurrency() / std::max(1, local_world ? std::atoi(local_world) : 1))));
    if (f.pipeline) return gpt::train_pipeline(f, argc, argv);  // --pp / --vpp
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
    config.data_parallel_sharding_strategy = f.sharding_strategy;  // "" = from use_distributed_optimizer
    if (f.bucket_bytes >= 0) config.bucket_bytes = static_cast<size_t>(f.bucket_bytes);
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
      zero1 = std::make_unique<meshddp::DistributedOptimizer>(ddp.grad_buffer(), gpt::zero1_config(f));
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
    examples::ExampleCheckpoints checkpoints(f.checkpoints,
                                             meshddp::TrainingState{model.ptr().get(), &ddp, zero1.get(), adamw.get()},
                                             mesh.rank(), f.seed, f.global_batch);
    checkpoints.track(schedule);
    checkpoints.explain_load_failures(resume_hint(f));
    const int64_t first_step = checkpoints.resume();
    examples::StepLogger logger(f.run.steps, f.run.log_interval, f.global_batch, f.model.seq_len, mesh.device(),
                                mesh.rank() == 0);
    examples::SkippedSteps skipped(f.run.max_skipped_steps);
    const auto named = model->named_parameters();
    const auto first_param = named.begin();
    examples::NanInjector inject(f.run.inject_nan, first_step, f.run.steps, mesh.world()->getSize(),
                                 first_param->value(), first_param->key());
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
      // --loss per-token: the valid tokens of the whole global batch (every rank knows the count).
      const auto valid = f.per_token_loss ? gpt::valid_mask(f.model, f.seed, step, f.global_batch) : torch::Tensor();
      const double valid_total = f.per_token_loss ? valid.sum().item<double>() : 0.0;
      torch::Tensor loss = torch::zeros({}, torch::kDouble);
      inject.before_backward(step, mesh.rank());
      for (int64_t m = 0; m < f.micro_batches; ++m) {
        ddp.set_is_last_microbatch(m == f.micro_batches - 1);
        auto logits = ddp.forward(mine(ids).narrow(0, m * micro, micro));
        // The loss in fp32 (bf16 logits widened, as Megatron's cross entropy does); the mean over
        // this rank's tokens: slices are equal, so the DP x CP gradient mean is the gradient of the
        // whole batch's mean. --loss per-token: this rank's sum over its valid tokens over the global
        // batch's count, times DP x CP (which DDP's mean divides by again).
        const auto flat_logits = logits.to(torch::kFloat).view({-1, logits.size(-1)});
        const auto micro_targets = mine(targets).narrow(0, m * micro, micro).reshape({-1});
        torch::Tensor micro_loss;
        if (f.per_token_loss) {
          micro_loss = gpt::loss_sum(flat_logits, micro_targets, mine(valid).narrow(0, m * micro, micro).reshape({-1}),
                                     mesh["tp"].get()) *
                       (static_cast<double>(f.dp * f.cp) / valid_total);
        } else {
          micro_loss = meshddp::tp::cross_entropy(flat_logits, micro_targets, mesh["tp"].get()) /
                       static_cast<double>(f.micro_batches);
        }
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
        // --clip-grad: torch's clip_grad_norm_ over the whole mesh (the norm before clipping is logged).
        result.grad_norm = f.clip_grad > 0 ? meshddp::clip_grad_norm_(ddp.grad_buffer(), f.clip_grad)
                                           : meshddp::grad_norm(ddp.grad_buffer());
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
    {  // every rank: the shards and the pool under optim_grads, the whole flat buffer otherwise; peak RSS
      rusage usage{};
      getrusage(RUSAGE_SELF, &usage);
      std::fprintf(stderr, "# gradient storage on rank %lld: %lld bytes (%s), peak RSS %ld KiB\n",
                   static_cast<long long>(mesh.rank()), static_cast<long long>(ddp.grad_buffer()->grad_buffer_bytes()),
                   ddp.config().sharding_strategy().c_str(), usage.ru_maxrss);
      if (zero1) {  // what the memory model counts per rank (docs/guide/sharding.md), after the last step
        const meshddp::MemoryReport m = zero1->memory();
        std::fprintf(stderr,
                     "# memory on rank %lld: params %lld, grads %lld, optimizer state %lld, fp32 masters %lld, "
                     "total %lld bytes\n",
                     static_cast<long long>(mesh.rank()), static_cast<long long>(m.param_buffer_bytes),
                     static_cast<long long>(m.grad_buffer_bytes), static_cast<long long>(m.optimizer_state_bytes),
                     static_cast<long long>(m.master_weight_bytes), static_cast<long long>(m.total()));
      }
      // optim_grads_params: the shards and the units in use; the most held at once since construction.
      const meshddp::ParamBuffer* params = ddp.grad_buffer()->param_buffer();
      if (const meshddp::ShardedParams* sharded = params ? params->sharded() : nullptr) {
        std::fprintf(stderr,
                     "# param storage on rank %lld: %lld bytes after the run, peak %lld (whole params %lld, largest "
                     "unit %lld)\n",
                     static_cast<long long>(mesh.rank()), static_cast<long long>(sharded->resident_bytes()),
                     static_cast<long long>(sharded->peak_resident_bytes()),
                     static_cast<long long>(sharded->whole_bytes()),
                     static_cast<long long>(sharded->largest_unit_bytes()));
      }
    }
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
