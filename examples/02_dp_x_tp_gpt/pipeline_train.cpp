// The pipeline training loop of example 02 (pipeline_train.h). One step:
//   1. every chunk's DDP: zero_grad_buffer(), sync held (set_is_last_microbatch(false));
//   2. the schedule runs M forward and M backward micro-batches on each chunk; just before a chunk's
//      last backward its sync is allowed, so its buckets launch as their gradients become final, and
//      after it the rest is started: that chunk's DP sync overlaps the other chunks' backward and the
//      pipeline's cool-down bubble (--grad-sync end holds it all until the schedule ends instead);
//   3. finalize: every chunk's sync finished, the tied embedding's two copies summed over the
//      embedding group; then the optimizer step (torch AdamW/SGD over all chunks, or one ZeRO-1
//      DistributedOptimizer per chunk) and a check that the two copies are still bit-identical.
#include "examples/02_dp_x_tp_gpt/pipeline_train.h"

#include "examples/02_dp_x_tp_gpt/pipeline_model.h"
#include "examples/02_dp_x_tp_gpt/pipeline_schedule.h"
#include "examples/common/checkpointing.h"
#include "examples/common/flag_agreement.h"
#include "examples/common/step_log.h"
#include "examples/common/training.h"

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

// This rank's pipeline stage as a DP (x CP) x TP mesh: the full mesh's groups for those dims, and as its
// world the stage's ranks (what TP-partial gradients are summed over and DDP agrees over). DDP syncs
// over a (DP dims) x TP mesh; the pipeline dim is the schedule's. Collective over the whole mesh.
meshddp::DeviceMesh stage_mesh(const meshddp::DeviceMesh& mesh) {
  std::vector<int64_t> sizes;
  std::vector<std::string> names;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  int64_t rank = 0;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    const std::string& name = mesh.names()[d];
    if (name == "pp") continue;
    sizes.push_back(mesh.sizes()[d]);
    names.push_back(name);
    groups.push_back(mesh[name]);
    rank = rank * mesh.sizes()[d] + mesh.coordinates()[d];  // row-major within the stage
  }
  auto world = mesh.flattened(names);
  return meshddp::DeviceMesh::from_groups(sizes, names, rank, groups, mesh.device().type(), world);
}

// For each (dp, cp, tp) position: its first and last pipeline ranks, which hold the two copies of the
// tied embedding; the middle stages' ranks each alone. A partition of the mesh, as group_of() wants.
meshddp::RankGroups embedding_groups(const meshddp::DeviceMesh& mesh) {
  const int64_t pp = mesh.size("pp"), stage = mesh.world_size() / pp;
  meshddp::RankGroups groups;
  for (int64_t s = 0; s < stage; ++s) {
    groups.push_back(pp > 1 ? std::vector<int64_t>{s, (pp - 1) * stage + s} : std::vector<int64_t>{s});
    for (int64_t p = 1; p + 1 < pp; ++p) groups.push_back({p * stage + s});
  }
  return groups;
}

struct Chunk {
  GptChunk module{nullptr};
  std::unique_ptr<Ddp> ddp;
  std::unique_ptr<meshddp::DistributedOptimizer> zero1;
};

// The tied embedding's two copies on this rank (wte.weight on the model's first chunk, lm_head.weight
// on its last): {chunk index, name} of each this rank holds, for the tied sum and the check.
std::vector<std::pair<size_t, std::string>> tied_copies(const std::vector<Chunk>& chunks, int64_t pp) {
  std::vector<std::pair<size_t, std::string>> out;
  if (pp == 1) return out;  // one chunk holds both names on one tensor
  for (size_t v = 0; v < chunks.size(); ++v) {
    if (chunks[v].module->is_first) out.emplace_back(v, "wte.weight");
    if (chunks[v].module->is_last) out.emplace_back(v, "lm_head.weight");
  }
  return out;
}

at::Tensor param_named(const GptChunkImpl& module, const std::string& name) {
  return module.named_parameters().find(name)->detach();
}

// Throws unless the tied embedding's copies are bit-identical across the embedding group: the bit
// patterns' elementwise max and min over the group agree.
void check_tied_copies(const std::vector<Chunk>& chunks, int64_t pp, c10d::ProcessGroup& group, int64_t step) {
  for (const auto& [v, name] : tied_copies(chunks, pp)) {
    const auto bits = param_named(*chunks[v].module, name).contiguous().view(torch::kInt32);
    at::Tensor high = bits.clone();
    at::Tensor low = -bits.to(torch::kInt64);  // the min as -max(-x), exact in int64
    meshddp::all_reduce_max_now(group, high, "the tied-embedding check");
    meshddp::all_reduce_max_now(group, low, "the tied-embedding check");
    const int64_t differ = (high.to(torch::kInt64) != -low).sum().item<int64_t>();
    TORCH_CHECK(differ == 0, "after step ", step, " the tied embedding's copies (wte.weight on the first pipeline ",
                "stage, lm_head.weight on the last) differ in ", differ, " of ", bits.numel(), " elements");
  }
}

}  // namespace

int train_pipeline(const Flags& f, int argc, char** argv) {
  meshddp::DeviceMesh mesh = meshddp::DeviceMesh::from_env(mesh_sizes(f), mesh_names(f), examples::mesh_options(f.run));
  examples::verify_same_flags_across_ranks(mesh, argc, argv, "gpt_example");  // before the flags shape anything
  TORCH_CHECK(f.vpp == 1 || f.pp > 1, "--vpp ", f.vpp, " needs --pp > 1 (interleaving chunks of one rank)");
  meshddp::DeviceMesh stage = stage_mesh(mesh);
  const auto embedding = mesh.group_of("embedding", embedding_groups(mesh));
  const int64_t pp_rank = mesh.coordinate("pp"), chunks_total = f.pp * f.vpp;

  // The one-process model, cut: every rank builds it whole from the seed and keeps its chunks.
  torch::manual_seed(f.seed);
  Gpt whole(f.model);
  const std::vector<std::string> dp_dims =
      f.cp > 1 ? std::vector<std::string>{"dp", "cp"} : std::vector<std::string>{"dp"};
  std::vector<Chunk> chunks(f.vpp);
  std::vector<at::Tensor> all_params;
  for (int64_t v = 0; v < f.vpp; ++v) {
    Chunk& chunk = chunks[v];
    chunk.module = GptChunk(*whole, f.model, v * f.pp + pp_rank, chunks_total);
    meshddp::parallelize(*chunk.module, stage, chunk_plan(f.model, *chunk.module),
                         {.sequence_parallel = f.sequence_parallel});
    if (f.cp > 1) chunk.module->set_context_parallel(stage["cp"].get());
    meshddp::DdpConfig config;
    config.use_distributed_optimizer = f.distributed_optimizer;
    config.check_for_nan_in_grad = !f.distributed_optimizer;
    // Megatron's bucket policy: on the first stage's first chunk the sync is on the critical path (its
    // backward ends last), so it is bucketed to overlap that backward; elsewhere one bucket per chunk.
    if (v * f.pp + pp_rank != 0) config.bucket_bytes = size_t{1} << 40;
    chunk.ddp = std::make_unique<Ddp>(chunk.module.ptr(), stage, dp_dims, config);
    for (const auto& p : chunk.ddp->parameters()) all_params.push_back(p);
  }

  std::unique_ptr<torch::optim::Optimizer> torch_optimizer;
  meshddp::LrScheduler schedule(examples::lr_schedule(f.run));
  const bool sgd = f.optimizer == "sgd";
  if (f.distributed_optimizer) {
    for (Chunk& chunk : chunks) {
      meshddp::DistributedOptimizerConfig oc;
      oc.kind = sgd ? meshddp::OptimizerKind::kSgd : meshddp::OptimizerKind::kAdamW;
      oc.lr = f.run.lr;
      oc.weight_decay = 0.0;
      chunk.zero1 = std::make_unique<meshddp::DistributedOptimizer>(chunk.ddp->grad_buffer(), oc);
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
  const int64_t dp_rank = mesh.coordinate("dp"), local = f.global_batch / f.dp, micro = local / f.microbatches;
  const int64_t cp_rank = f.cp > 1 ? mesh.coordinate("cp") : 0, slice = f.model.seq_len / f.cp;
  const int64_t shard = slice / (f.sequence_parallel ? f.tp : 1);  // sequence positions a hidden state holds
  PipelineSchedule pipeline(mesh["pp"], f.vpp, f.microbatches, {micro, shard, f.model.dim});
  if (mesh.rank() == 0) {
    std::fprintf(stderr, "# gpt pipeline: %s, %lld chunks (vpp %lld, %s), %lld micro-batches of %lld%s%s, loss %s\n",
                 mesh.describe().c_str(), static_cast<long long>(chunks_total), static_cast<long long>(f.vpp),
                 f.vpp > 1 ? "interleaved" : "1F1B", static_cast<long long>(f.microbatches),
                 static_cast<long long>(micro), f.sequence_parallel ? ", sequence parallel" : "",
                 f.distributed_optimizer ? ", ZeRO-1" : "", f.per_token_loss ? "per-token" : "mean");
    std::fprintf(stderr, "# pipeline rank 0 runs: %s\n", describe_actions(pipeline.actions()).c_str());
  }
  meshddp::PipelineTrainingState state{{}, mesh.world()};
  for (Chunk& chunk : chunks) {
    state.chunks.push_back({chunk.module.ptr().get(), chunk.ddp.get(), chunk.zero1.get(), torch_optimizer.get()});
  }
  examples::ExampleCheckpoints checkpoints(f.checkpoints, state, mesh.rank(), f.seed, f.global_batch);
  checkpoints.track(schedule);
  const int64_t first_step = checkpoints.resume();
  const bool reports_loss = chunks.back().module->is_last && (f.tp == 1 || mesh.coordinate("tp") == 0);
  const auto tied = tied_copies(chunks, f.pp);
  examples::StepLogger logger(f.run.steps, f.run.log_interval, f.global_batch, f.model.seq_len, mesh.device(),
                              mesh.rank() == 0);
  examples::SkippedSteps skipped(f.run.max_skipped_steps);
  double exposed_total = 0, schedule_total = 0;  // after the first step (which warms up)
  for (int64_t step = first_step; step < f.run.steps; ++step) {
    const auto start = Clock::now();
    auto [ids, targets] = make_batch(f.model, f.seed, step, f.global_batch);
    const auto valid = valid_mask(f.model, f.seed, step, f.global_batch);
    const double valid_total = valid.sum().item<double>();
    // This DP rank's micro-batch m, this CP rank's slice of each sequence.
    const auto mine = [&](const torch::Tensor& t, int64_t m) {
      return t.narrow(0, dp_rank * local + m * micro, micro).narrow(1, cp_rank * slice, slice);
    };
    for (Chunk& chunk : chunks) {
      chunk.ddp->zero_grad_buffer();
      chunk.ddp->set_is_last_microbatch(false);  // sync held until the chunk's last backward
    }
    const double lr = schedule.lr();
    auto loss_report = torch::zeros({1}, torch::kDouble);
    StageWork work;
    work.forward = [&](int64_t v, int64_t m, const at::Tensor& input) -> at::Tensor {
      Chunk& chunk = chunks[v];
      auto out = chunk.ddp->forward(chunk.module->is_first ? mine(ids, m) : input);
      if (!chunk.module->is_last) return out;
      const auto logits = out.view({-1, out.size(-1)});
      const auto y = mine(targets, m).reshape({-1});
      torch::Tensor loss, reported;
      if (f.per_token_loss) {
        // Sum over valid tokens / the global batch's count, times DP x CP (which DDP's mean divides by).
        reported = loss_sum(logits, y, mine(valid, m).reshape({-1}), mesh["tp"].get()) / valid_total;
        loss = reported * static_cast<double>(f.dp * f.cp);
      } else {
        // Each micro-batch's mean over M: micro-batches are equal, so this is the mean over this rank.
        loss = meshddp::tp::cross_entropy(logits, y, mesh["tp"].get()) / static_cast<double>(f.microbatches);
        reported = loss / static_cast<double>(f.dp * f.cp);
      }
      loss_report += reported.detach().to(torch::kDouble);
      return loss;
    };
    work.before_last_backward = [&](int64_t v) {
      if (!f.sync_at_end) chunks[v].ddp->set_is_last_microbatch(true);
    };
    work.after_last_backward = [&](int64_t) {};
    pipeline.run(work);
    const auto schedule_end = Clock::now();
    for (Chunk& chunk : chunks) {
      chunk.ddp->set_is_last_microbatch(true);
      chunk.ddp->finish_grad_sync();
    }
    for (const auto& [v, name] : tied) {
      meshddp::all_reduce_sum_now(*embedding, chunks[v].ddp->main_grad(name), "the tied embedding's gradient sum");
    }
    // The exposed sync: from the last rank's schedule end until every rank's gradients are final (the
    // ranks share one host's monotonic clock in the benchmark; across hosts this mixes clocks).
    auto times = torch::tensor({since_epoch(schedule_end), since_epoch(Clock::now())}, torch::kDouble);
    meshddp::all_reduce_max_now(*mesh.world(), times, "the example's sync timing");
    if (step > first_step) {
      exposed_total += times[1].item<double>() - times[0].item<double>();
      schedule_total += std::chrono::duration<double>(schedule_end - start).count();
    }
    meshddp::StepResult result;
    if (f.distributed_optimizer) {
      double squares = 0;
      for (Chunk& chunk : chunks) {
        const meshddp::StepResult r = chunk.zero1->step();
        squares += r.grad_norm * r.grad_norm;
        result.skipped = result.skipped || r.skipped;
      }
      result.grad_norm = std::sqrt(squares);
      skipped.on_step(step, result, mesh.rank() == 0);
    } else {
      double squares = 0;
      for (Chunk& chunk : chunks) squares += std::pow(meshddp::grad_norm(chunk.ddp->grad_buffer()), 2);
      result.grad_norm = std::sqrt(squares);  // this stage's chunks (the log's value)
      torch_optimizer->step();
    }
    if (!result.skipped) schedule.step();
    if (f.distributed_optimizer) {
      for (Chunk& chunk : chunks) chunk.zero1->finish_param_sync();
    }
    check_tied_copies(chunks, f.pp, *embedding, step);
    if (!reports_loss) loss_report.zero_();
    meshddp::all_reduce_sum_now(*mesh.world(), loss_report, "the example's loss report");
    if (mesh.rank() == 0) {
      std::fprintf(log, "step %lld loss %#.10g\n", static_cast<long long>(step), loss_report.item<double>());
      std::fflush(log);
    }
    logger.record({step, loss_report.item<double>(), lr, result.grad_norm, seconds_since(start), result.skipped});
    checkpoints.after_step(static_cast<int>(step), static_cast<int>(f.run.steps));
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
