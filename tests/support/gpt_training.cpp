#include "tests/support/gpt_training.h"

#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "mesh/collectives.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/checkpoint.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/tp_layers.h"
#include "tests/support/rank_threads.h"

#include <mutex>

namespace meshddp::test {
namespace {

gpt::Gpt build_model(const gpt::Config& c) {
  static std::mutex mutex;  // the default generator is process-global; ranks are threads
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(kGptSeed);
  return gpt::Gpt(c);
}

constexpr double kLr = 1e-2;

}  // namespace

torch::Tensor local_part(const torch::Tensor& golden, const Placement& p) {
  if (!p.is_shard()) return golden;
  return golden.chunk(p.tp_size, p.dim)[p.tp_rank];
}

GptRun train_gpt_golden(const GptScenario& s) {
  GptRun run;
  gpt::Gpt model = build_model(s.model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.0));
  for (int step = 0; step < s.steps; ++step) {
    opt.zero_grad();
    auto [ids, targets] = gpt::make_batch(s.model, kGptSeed, step, s.global_batch);
    double loss_sum = 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      auto rows = [&](const torch::Tensor& t) { return t.chunk(s.micro_batches, 0)[m]; };
      auto logits = model->forward(rows(ids));
      auto loss = tp::cross_entropy(logits.view({-1, logits.size(-1)}), rows(targets).reshape({-1})) / s.micro_batches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    run.losses.push_back(loss_sum);
    if (step == 0) {
      for (auto& p : model->parameters()) run.first_grads.push_back(p.grad().clone());
    }
    if (s.clip > 0) run.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), s.clip));
    opt.step();
  }
  for (auto& p : model->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

std::vector<GptRun> train_gpt_on_mesh(const GptScenario& s) {
  std::vector<GptRun> runs(s.dp * s.tp);
  run_on_mesh({s.dp, s.tp}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    GptRun& run = runs[mesh.rank()];
    gpt::Gpt model = build_model(s.model);
    parallelize(*model, mesh, gpt::tp_plan(s.model), {.sequence_parallel = s.sequence_parallel});
    DdpConfig config;
    config.bucket_bytes = s.bucket_bytes;
    config.use_distributed_optimizer = s.distributed_optimizer;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    std::unique_ptr<torch::optim::AdamW> opt;
    std::unique_ptr<DistributedOptimizer> zero;
    if (s.distributed_optimizer) {
      DistributedOptimizerConfig oc;
      oc.lr = kLr;
      oc.weight_decay = 0.0;
      oc.clip_grad_norm = s.clip;
      zero = std::make_unique<DistributedOptimizer>(ddp.grad_buffer(), oc);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.0));
    }
    const TrainingState state{model.ptr().get(), &ddp, zero.get(), opt.get()};
    if (!s.load_dir.empty()) {
      const LoadedCheckpoint loaded = load_checkpoint(state, s.load_dir);
      TORCH_CHECK(loaded.step == s.first_step, "the checkpoint in '", s.load_dir, "' is of step ", loaded.step,
                  ", not of first_step ", s.first_step);
    }
    const int64_t dp_rank = mesh.coordinate("dp"), local = s.global_batch / s.dp;
    tp::Group* tp_group = mesh["tp"].get();
    for (int step = s.first_step; step < s.steps; ++step) {
      if (step == s.save_before_step) save_checkpoint(state, s.save_dir, step, {{"next_step", int64_t{step}}});
      ddp.zero_grad_buffer();
      auto [ids, targets] = gpt::make_batch(s.model, kGptSeed, step, s.global_batch);
      double loss_sum = 0;
      for (int m = 0; m < s.micro_batches; ++m) {
        ddp.set_is_last_microbatch(m == s.micro_batches - 1);
        // Micro-batch m of the global batch, then this DP rank's rows of it.
        auto rows = [&](const torch::Tensor& t) { return t.chunk(s.micro_batches, 0)[m].chunk(s.dp, 0)[dp_rank]; };
        auto logits = ddp.forward(rows(ids));
        auto loss = tp::cross_entropy(logits.view({-1, logits.size(-1)}), rows(targets).reshape({-1}), tp_group) /
                    s.micro_batches;
        loss.backward();
        loss_sum += loss.item<double>();
      }
      at::Tensor global_loss = at::full({1}, loss_sum / s.dp, at::kDouble);
      all_reduce_sum_now(*mesh["dp"], global_loss, "test loss");
      run.losses.push_back(global_loss.item<double>());
      if (zero) {
        auto result = zero->step();
        run.grad_norms.push_back(result.grad_norm);
        if (step == 0) {
          // With ZeRO-1 only this rank's shard of each grad bucket is reduced; skip the grad check.
        }
      } else {
        ddp.finish_grad_sync();
        if (step == 0) {
          for (auto& p : model->parameters()) run.first_grads.push_back(p.grad().clone());
        }
        opt->step();
      }
    }
    if (zero) zero->finish_param_sync();
    for (auto& p : model->parameters()) {
      run.params.push_back(p.detach().clone());
      run.placements.push_back(get_placement(p));
    }
    (void)local;
  });
  return runs;
}

}  // namespace meshddp::test
