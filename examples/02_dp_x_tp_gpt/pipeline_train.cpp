// The pipeline training loop of example 02 (pipeline_train.h), on meshddp's pipeline controls
// (docs/guide/pipelines.md). One DistributedDataParallel per model chunk this rank holds, configured by
// pipeline_chunk_config (the first stage's chunk 0 bucketed, every other chunk one bucket); the tied
// embedding's two copies (wte.weight on the first stage, lm_head.weight on the last) declared with
// declare_tied_across_stages, so DDP sums their gradients over the embedding group before the DP
// reduction (and before ZeRO-1's reduce-scatter). One step:
//   1. every chunk: zero_grad_buffer(), set_requires_gradient_sync(false) (backward only accumulates);
//   2. the schedule (pipeline_schedule.h) runs M forward and M backward micro-batches per chunk; just
//      before a chunk's last backward its sync is allowed (its buckets launch as they fill) and just
//      after it start_grad_sync() launches the rest, so that chunk's DP sync overlaps the other chunks'
//      backward and the pipeline's cool-down bubble (--grad-sync end: nothing until the schedule ends);
//   3. finalize_model_grads(chunks): every chunk's sync finished, the tied sum, and with --loss
//      per-token the division by the global count of valid tokens; then the optimizer step (torch
//      AdamW/SGD over all chunks, or one ZeRO-1 DistributedOptimizer per chunk, AdamW, SGD or Muon) and
//      check_tied_params_identical() (the two copies bit for bit).
// --dtype bf16 as the plain path (examples/common/precision.h), on every stage: bf16 params and
// activations (the p2p buffers bf16 too), the loss in fp32 on the last stage, fp32 main grads unless
// --grad-reduce-in-bf16 (the tied sum then runs on them as well), fp32 masters per chunk (each chunk's
// ZeRO-1 shard, or for plain DDP an Fp32MasterParams per chunk under one torch optimizer).
#include "examples/02_dp_x_tp_gpt/pipeline_train.h"

#include "examples/02_dp_x_tp_gpt/pipeline_model.h"
#include "examples/02_dp_x_tp_gpt/pipeline_schedule.h"
#include "examples/common/checkpointing.h"
#include "examples/common/flag_agreement.h"
#include "examples/common/precision.h"
#include "examples/common/step_log.h"
#include "examples/common/training.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "mesh/pipeline_groups.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <meshddp/meshddp.h>
#include <string>
#include <vector>

namespace gpt {
namespace {

using Ddp = meshddp::DistributedDataParallel<GptChunkImpl>;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double since_epoch(Clock::time_point t) { return std::chrono::duration<double>(t.time_since_epoch()).count(); }

// Megatron's order of dims (tp-cp-dp-pp, innermost first): pp outermost, so that a pipeline stage is a
// block of consecutive ranks and TP peers stay adjacent. A "cp" dim only with --cp > 1.
std::vector<std::string> mesh_names(const Flags& f) {
  if (f.cp > 1) return {"pp", "dp", "cp", "tp"};
  return {"pp", "dp", "tp"};
}
std::vector<int64_t> mesh_sizes(const Flags& f) {
  if (f.cp > 1) return {f.pp, f.dp, f.cp, f.tp};
  return {f.pp, f.dp, f.tp};
}

struct Chunk {
  GptChunk module{nullptr};
  std::unique_ptr<Ddp> ddp;
  std::unique_ptr<meshddp::DistributedOptimizer> zero1;
  std::unique_ptr<examples::Fp32MasterParams> masters;  // plain DDP in bf16: the fp32 copies the optimizer steps
};

}  // namespace

int train_pipeline(const Flags& f, int argc, char** argv) {
  meshddp::DeviceMesh mesh = meshddp::DeviceMesh::from_env(mesh_sizes(f), mesh_names(f), examples::mesh_options(f.run));
  examples::verify_same_flags_across_ranks(mesh, argc, argv, "gpt_example");  // before the flags shape anything
  const int64_t pp_rank = mesh.coordinate("pp"), chunks_total = f.pp * f.vpp;

  // The one-process model, cut: every rank builds it whole from the seed and keeps its chunks.
  torch::manual_seed(f.seed);
  Gpt whole(f.model);
  whole->to(f.precision.param_dtype());  // before cutting: the last stage's LM head copies the bf16 embedding
  const std::vector<std::string> dp_dims =
      f.cp > 1 ? std::vector<std::string>{"dp", "cp"} : std::vector<std::string>{"dp"};
  std::vector<Chunk> chunks(f.vpp);
  std::vector<at::Tensor> all_params;
  std::vector<meshddp::DdpEngine*> engines;  // in chunk order, for finalize_model_grads
  for (int64_t v = 0; v < f.vpp; ++v) {
    Chunk& chunk = chunks[v];
    chunk.module = GptChunk(*whole, f.model, v * f.pp + pp_rank, chunks_total);
    // Only the "tp" dim of the mesh is used by parallelize; DDP syncs each stage within itself (the
    // "pp" dim is neither DP nor TP).
    meshddp::parallelize(*chunk.module, mesh, chunk_plan(f.model, *chunk.module),
                         {.sequence_parallel = f.sequence_parallel});
    if (f.cp > 1) chunk.module->set_context_parallel(mesh["cp"].get());
    // The tie across stages: the embedding on the first stage, the LM head on the last (declared after
    // parallelize, which may replace the tensors by their TP shards). With one stage it is one tensor.
    if (f.pp > 1) {
      const auto params = chunk.module->named_parameters();
      if (chunk.module->is_first) meshddp::declare_tied_across_stages(params["wte.weight"]);
      if (chunk.module->is_last) meshddp::declare_tied_across_stages(params["lm_head.weight"]);
    }
    meshddp::DdpConfig config;
    config.use_distributed_optimizer = f.distributed_optimizer;
    config.data_parallel_sharding_strategy = f.sharding_strategy;  // "" = from use_distributed_optimizer
    if (f.bucket_bytes >= 0) config.bucket_bytes = static_cast<size_t>(f.bucket_bytes);
    config.check_for_nan_in_grad = !f.distributed_optimizer;
    config.grad_reduce_in_fp32 = f.precision.grad_reduce_in_fp32();
    if (f.optimizer == "muon") config.shard_policy = meshddp::kWholeParamShards;  // Muon needs whole matrices
    chunk.ddp = std::make_unique<Ddp>(chunk.module.ptr(), mesh, dp_dims,
                                      meshddp::pipeline_chunk_config(config, pp_rank, v, f.vpp));
    engines.push_back(chunk.ddp.get());
    if (f.precision.bf16 && !f.distributed_optimizer) {
      chunk.masters = std::make_unique<examples::Fp32MasterParams>(*chunk.ddp);
      for (const auto& p : chunk.masters->masters()) all_params.push_back(p);
    } else {
      for (const auto& p : chunk.ddp->parameters()) all_params.push_back(p);
    }
  }

  std::unique_ptr<torch::optim::Optimizer> torch_optimizer;
  meshddp::LrScheduler schedule(examples::lr_schedule(f.run));
  const bool sgd = f.optimizer == "sgd";
  if (f.distributed_optimizer) {
    for (Chunk& chunk : chunks) {
      chunk.zero1 = std::make_unique<meshddp::DistributedOptimizer>(chunk.ddp->grad_buffer(), gpt::zero1_config(f));
      schedule.attach(*chunk.zero1);
    }
  } else {
    if (sgd) {
      torch_optimizer = std::make_unique<torch::optim::SGD>(all_params, torch::optim::SGDOptions(f.run.lr));
    } else {
      torch_optimizer =
          std::make_unique<torch::optim::AdamW>(all_params, torch::optim::AdamWOptions(f.run.lr).weight_decay(0.0));
    }
    schedule.attach(*torch_optimizer);
  }

  FILE* log = stdout;
  if (!f.run.log_file.empty() && mesh.rank() == 0) {
    log = std::fopen(f.run.log_file.c_str(), "w");
    TORCH_CHECK(log, "cannot open --log-file '", f.run.log_file, "' for writing");
  }
  const int64_t dp_rank = mesh.coordinate("dp"), local = f.global_batch / f.dp, micro = local / f.micro_batches;
  const int64_t cp_rank = f.cp > 1 ? mesh.coordinate("cp") : 0, slice = f.model.seq_len / f.cp;
  const int64_t shard = slice / (f.sequence_parallel ? f.tp : 1);  // sequence positions a hidden state holds
  PipelineSchedule pipeline(mesh["pp"], f.vpp, f.micro_batches, {micro, shard, f.model.dim}, f.precision.param_dtype());
  if (mesh.rank() == 0) {
    std::fprintf(stderr, "# gpt pipeline: %s, %lld chunks (vpp %lld, %s), %lld micro-batches of %lld%s%s, loss %s\n",
                 mesh.describe().c_str(), static_cast<long long>(chunks_total), static_cast<long long>(f.vpp),
                 f.vpp > 1 ? "interleaved" : "1F1B", static_cast<long long>(f.micro_batches),
                 static_cast<long long>(micro), f.sequence_parallel ? ", sequence parallel" : "",
                 f.distributed_optimizer ? ", ZeRO-1" : "", f.per_token_loss ? "per-token" : "mean");
    std::fprintf(stderr, "# pipeline rank 0 runs: %s\n", describe_actions(pipeline.actions()).c_str());
    // Read from rank 0's first chunk's buffers and from the schedule's p2p buffers.
    const Chunk& first = chunks.front();
    std::fprintf(stderr, "%s, p2p %s\n",
                 examples::precision_header(*first.ddp, first.zero1.get(), first.masters.get()).c_str(),
                 examples::dtype_name(pipeline.dtype()));
  }
  meshddp::PipelineTrainingState state{{}, mesh.world()};
  for (Chunk& chunk : chunks) {
    state.chunks.push_back({chunk.module.ptr().get(), chunk.ddp.get(), chunk.zero1.get(), torch_optimizer.get()});
  }
  examples::ExampleCheckpoints checkpoints(f.checkpoints, state, mesh.rank(), f.seed, f.global_batch);
  checkpoints.track(schedule);
  checkpoints.explain_load_failures(resume_hint(f));
  const int64_t first_step = checkpoints.resume();
  const bool last_stage = chunks.back().module->is_last;
  const bool reports_loss = last_stage && (f.tp == 1 || mesh.coordinate("tp") == 0);
  examples::StepLogger logger(f.run.steps, f.run.log_interval, f.global_batch, f.model.seq_len, mesh.device(),
                              mesh.rank() == 0);
  examples::SkippedSteps skipped(f.run.max_skipped_steps);
  // --inject-nan STEP:RANK: the first param of the rank's first chunk (whichever stage it is).
  const auto first_named = chunks.front().module->named_parameters();
  examples::NanInjector inject(f.run.inject_nan, first_step, f.run.steps, mesh.world()->getSize(),
                               first_named.begin()->value(), first_named.begin()->key());
  double exposed_total = 0, schedule_total = 0;  // after the first step (which warms up)
  for (int64_t step = first_step; step < f.run.steps; ++step) {
    const auto start = Clock::now();
    auto [ids, targets] = make_batch(f.model, f.seed, step, f.global_batch);
    const auto valid = valid_mask(f.model, f.seed, step, f.global_batch);
    const double valid_total = valid.sum().item<double>();  // for the loss report only
    // This DP rank's micro-batch m, this CP rank's slice of each sequence.
    const auto mine = [&](const torch::Tensor& t, int64_t m) {
      return t.narrow(0, dp_rank * local + m * micro, micro).narrow(1, cp_rank * slice, slice);
    };
    for (Chunk& chunk : chunks) {
      chunk.ddp->zero_grad_buffer();
      chunk.ddp->set_requires_gradient_sync(false);  // backward only accumulates until the chunk's last one
    }
    const double lr = schedule.lr();
    auto loss_report = torch::zeros({1}, torch::kDouble);
    int64_t num_tokens = 0;  // this rank's valid tokens (last stage), for finalize_model_grads
    StageWork work;
    work.forward = [&](int64_t v, int64_t m, const at::Tensor& input) -> at::Tensor {
      Chunk& chunk = chunks[v];
      auto out = chunk.ddp->forward(chunk.module->is_first ? mine(ids, m) : input);
      if (!chunk.module->is_last) return out;
      // The loss in fp32 (bf16 logits widened, as Megatron's cross entropy does).
      const auto logits = out.to(torch::kFloat).view({-1, out.size(-1)});
      const auto y = mine(targets, m).reshape({-1});
      torch::Tensor loss, reported;
      if (f.per_token_loss) {
        // The SUM over this micro-batch's valid tokens; finalize_model_grads divides the gradients by
        // the global count (summed over DP x CP), so no rank needs it before the backward.
        const auto mask = mine(valid, m).reshape({-1});
        loss = loss_sum(logits, y, mask, mesh["tp"].get());
        num_tokens += mask.sum().item<int64_t>();
        reported = loss / valid_total;
      } else {
        // Each micro-batch's mean over M: micro-batches are equal, so this is the mean over this rank
        // (DDP's DP x CP mean makes it the global batch's).
        loss = meshddp::tp::cross_entropy(logits, y, mesh["tp"].get()) / static_cast<double>(f.micro_batches);
        reported = loss / static_cast<double>(f.dp * f.cp);
      }
      loss_report += reported.detach().to(torch::kDouble);
      return loss;
    };
    // --grad-sync bubble: the chunk's buckets launch during its last backward (as each fills) and
    // start_grad_sync() launches the rest right after it; --grad-sync end: finalize launches all.
    work.before_last_backward = [&](int64_t v) {
      if (!f.sync_at_end) chunks[v].ddp->set_requires_gradient_sync(true);
    };
    work.after_last_backward = [&](int64_t v) {
      if (!f.sync_at_end) chunks[v].ddp->start_grad_sync();
    };
    inject.before_backward(step, mesh.rank());
    pipeline.run(work);
    inject.after_backward();
    const auto schedule_end = Clock::now();
    meshddp::FinalizeOptions finalize;
    if (f.per_token_loss) {
      finalize.num_tokens = last_stage ? num_tokens : 0;  // only the last stage counts: taken over the pp group
      finalize.pp_group = mesh["pp"];
    }
    meshddp::finalize_model_grads(engines, finalize);
    // The exposed sync: from the last rank's schedule end until every rank's gradients are final (the
    // ranks share one host's monotonic clock in the benchmark; across hosts this mixes clocks).
    auto times = torch::tensor({since_epoch(schedule_end), since_epoch(Clock::now())}, torch::kDouble);
    meshddp::all_reduce_max_now(*mesh.world(), times, "the example's sync timing");
    if (step > first_step) {
      exposed_total += times[1].item<double>() - times[0].item<double>();
      schedule_total += std::chrono::duration<double>(schedule_end - start).count();
    }
    // One norm, one clipping coefficient and one skip decision for the whole pipeline: every chunk of
    // every stage (the tied embedding once), as one process.
    meshddp::StepResult result;
    if (f.distributed_optimizer) {
      std::vector<meshddp::DistributedOptimizer*> optimizers;
      for (Chunk& chunk : chunks) optimizers.push_back(chunk.zero1.get());
      result = meshddp::DistributedOptimizer::step_together(optimizers);
      skipped.on_step(step, result, mesh.rank() == 0);
    } else {
      std::vector<meshddp::GradBufferHandle> buffers;
      for (Chunk& chunk : chunks) buffers.push_back(chunk.ddp->grad_buffer());
      result.grad_norm = f.clip_grad > 0 ? meshddp::clip_grad_norm_(buffers, f.clip_grad) : meshddp::grad_norm(buffers);
      for (Chunk& chunk : chunks) {
        if (chunk.masters) chunk.masters->take_grads(*chunk.ddp);
      }
      torch_optimizer->step();
      for (Chunk& chunk : chunks) {
        if (chunk.masters) chunk.masters->write_params();
      }
    }
    if (!result.skipped) schedule.step();
    // The two copies of the tied embedding, bit for bit (the first stage's chunk 0 and the last
    // stage's chunk V-1 compare; every other chunk returns at once). Waits for ZeRO-1's param gather.
    for (Chunk& chunk : chunks) chunk.ddp->check_tied_params_identical();
    if (!reports_loss) loss_report.zero_();
    meshddp::all_reduce_sum_now(*mesh.world(), loss_report, "the example's loss report");
    if (mesh.rank() == 0) {
      std::fprintf(log, "step %lld loss %#.10g\n", static_cast<long long>(step), loss_report.item<double>());
      std::fflush(log);
    }
    logger.record({step, loss_report.item<double>(), lr, result.grad_norm, seconds_since(start), result.skipped});
    checkpoints.after_step(static_cast<int>(step), static_cast<int>(f.run.steps));
  }
  if (f.distributed_optimizer) {
    for (Chunk& chunk : chunks) chunk.zero1->finish_param_sync();
  }
  if (mesh.rank() == 0 && f.run.steps > first_step + 1) {
    const double n = static_cast<double>(f.run.steps - first_step - 1);
    std::fprintf(stderr, "# gradient sync exposed after the schedule (%s): %.3f ms/step; schedule %.3f ms/step\n",
                 f.sync_at_end ? "all at the end" : "started in the bubble", 1e3 * exposed_total / n,
                 1e3 * schedule_total / n);
  }
  logger.summary();
  if (log != stdout) std::fclose(log);
  return 0;
}

}  // namespace gpt
