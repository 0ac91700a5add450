#include "tests/support/gpt_training.h"

#include "common/grad_norm.h"
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_checkpoint.h"
#include "tests/support/rank_threads.h"
#include "tp/tp_layers.h"

#include <cmath>
#include <mutex>
#include <set>
#include <unordered_set>

namespace meshddp::test {
namespace {

gpt::Gpt build_model(const gpt::Config& c) {
  static std::mutex mutex;  // the default generator is process-global; ranks are threads
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(kGptSeed);
  return gpt::Gpt(c);
}

constexpr double kLr = 1e-2;

// Each trainable param's synced gradient after finish_grad_sync(), in ddp.parameters() order. With
// ZeRO-1 only this DP rank's shard of each bucket holds the DP mean: the elements it owns are
// filled in and the rest are NaN (so a comparison cannot pass on stale values).
std::vector<torch::Tensor> synced_grads(DdpEngine& ddp, const DistributedOptimizer* zero) {
  const GradBuffer& buffer = ddp.grad_buffer();
  std::vector<torch::Tensor> by_buffer_index;
  for (size_t i = 0; i < buffer.params().size(); ++i) {
    const auto& g = buffer.main_grad(static_cast<int64_t>(i));
    by_buffer_index.push_back(zero ? torch::full_like(g, std::nan("")) : g.clone());
  }
  if (zero) {
    for (const BucketShard& shard : zero->shards()) {
      const at::Tensor data = buffer.bucket_shard(shard.bucket);
      for (const ShardSegment& seg : shard.segments) {
        by_buffer_index[seg.param]
            .view({-1})
            .narrow(0, seg.param_offset, seg.numel)
            .copy_(data.narrow(0, seg.shard_offset, seg.numel));
      }
    }
  }
  // ddp.parameters() lists frozen params too (none in the GPT); map by tensor identity.
  std::vector<torch::Tensor> out;
  for (const auto& p : ddp.parameters()) {
    for (size_t i = 0; i < buffer.params().size(); ++i) {
      if (buffer.params()[i].param.is_same(p)) out.push_back(by_buffer_index[i]);
    }
  }
  return out;
}

}  // namespace

std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

torch::Tensor local_part(const torch::Tensor& golden, const Placement& p) {
  if (!p.is_shard()) return golden;
  return golden.chunk(p.tp_size, p.dim)[p.tp_rank];
}

GptRun train_gpt_golden(const GptScenario& s) {
  GptRun run;
  gpt::Gpt model = build_model(s.model);
  const auto params = unique_parameters(*model);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(kLr).weight_decay(0.0));
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
      for (auto& p : params) run.first_grads.push_back(p.grad().clone());
    }
    if (s.clip > 0) run.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(params, s.clip));
    opt.step();
  }
  for (auto& p : params) run.params.push_back(p.detach().clone());
  return run;
}

std::vector<GptRun> train_gpt_on_mesh(const GptScenario& s) {
  std::vector<GptRun> runs(s.dp * s.tp);
  const std::string& dp_dim = s.dims[0];
  const std::string& tp_dim = s.dims[1];
  run_on_mesh({s.dp, s.tp}, s.dims, [&](DeviceMesh& mesh) {
    GptRun& run = runs[mesh.rank()];
    gpt::Gpt model = build_model(s.model);
    parallelize(*model, mesh, gpt::tp_plan(s.model), {.sequence_parallel = s.sequence_parallel, .tp_dim = tp_dim});
    DdpConfig config;
    config.bucket_bytes = s.bucket_bytes;
    config.use_distributed_optimizer = s.distributed_optimizer;
    config.data_parallel_sharding_strategy = s.sharding_strategy;
    DistributedDataParallel ddp(model.ptr(), mesh, dp_dim, config);
    std::unique_ptr<torch::optim::AdamW> opt;
    std::unique_ptr<DistributedOptimizer> zero;
    if (ddp.config().use_distributed_optimizer) {
      DistributedOptimizerConfig oc;
      oc.lr = kLr;
      oc.weight_decay = 0.0;
      oc.clip_grad_norm = s.clip;
      zero = std::make_unique<DistributedOptimizer>(ddp.grad_buffer(), oc);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(ddp.parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.0));
    }
    const TrainingState state{model.ptr().get(), &ddp, zero.get(), opt.get()};
    if (!s.load_dir.empty()) {
      const LoadedCheckpoint loaded = load_checkpoint(state, s.load_dir);
      TORCH_CHECK(loaded.step == s.first_step, "the checkpoint in '", s.load_dir, "' is of step ", loaded.step,
                  ", not of first_step ", s.first_step);
    }
    const int64_t dp_rank = mesh.coordinate(dp_dim);
    tp::Group* tp_group = mesh[tp_dim].get();
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
        loss.backward(/*gradient=*/{}, /*retain_graph=*/std::nullopt, /*create_graph=*/s.create_graph);
        loss_sum += loss.item<double>();
      }
      at::Tensor global_loss = at::full({1}, loss_sum / s.dp, at::kDouble);
      all_reduce_sum_now(*mesh[dp_dim], global_loss, "test loss");
      run.losses.push_back(global_loss.item<double>());
      ddp.finish_grad_sync();
      run.grads_written_in_place.push_back(ddp.grad_buffer()->stats().grads_written_in_place);
      if (step == 0 && !ddp.config().shards_grads()) run.first_grads = synced_grads(ddp, zero.get());
      if (zero) {
        auto result = zero->step();
        run.grad_norms.push_back(result.grad_norm);
      } else {
        if (s.clip > 0) run.grad_norms.push_back(clip_grad_norm_(ddp.grad_buffer(), s.clip));
        opt->step();
      }
    }
    if (zero) zero->finish_param_sync();
    std::unordered_set<const c10::TensorImpl*> linear_weights;
    for (const auto& m : model->modules()) {
      if (const auto* linear = m->as<tp::LinearImpl>()) linear_weights.insert(linear->weight.unsafeGetTensorImpl());
    }
    run.linear_weights = static_cast<int64_t>(linear_weights.size());
    for (auto& p : ddp.parameters()) {
      run.params.push_back(p.detach().clone());
      run.placements.push_back(get_placement(p));
    }
  });
  return runs;
}

}  // namespace meshddp::test
