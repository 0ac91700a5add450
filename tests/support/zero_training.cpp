#include "tests/support/zero_training.h"

#include "common/grad_norm.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/param_gather.h"
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace meshddp::test {

DistributedOptimizerConfig zero_optimizer_config(const ZeroScenario& s) {
  DistributedOptimizerConfig c;
  c.kind = s.kind;
  c.lr = 1e-2;
  c.weight_decay = s.kind == OptimizerKind::kAdamW ? 0.1 : 0.01;
  c.momentum = 0.9;
  c.groups = {{"*.bias", std::nullopt, 0.0}};
  c.clip_grad_norm = s.clip;
  c.overlap_param_gather = s.overlap_param_gather;
  c.fused_step = s.fused_step;
  return c;
}

namespace {

std::unique_ptr<torch::optim::Optimizer> golden_optimizer(const ZeroScenario& s,
                                                          const std::vector<torch::Tensor>& weights,
                                                          const std::vector<torch::Tensor>& biases) {
  const auto c = zero_optimizer_config(s);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (s.kind == OptimizerKind::kAdamW) {
    auto opts = [&](double wd) {
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(c.lr).betas({c.beta1, c.beta2}).eps(c.eps).weight_decay(wd));
    };
    groups.emplace_back(weights, opts(c.weight_decay));
    groups.emplace_back(biases, opts(0.0));
    return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
  }
  auto opts = [&](double wd) {
    return std::make_unique<torch::optim::SGDOptions>(
        torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(wd));
  };
  groups.emplace_back(weights, opts(c.weight_decay));
  groups.emplace_back(biases, opts(0.0));
  return std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(c.lr).weight_decay(c.weight_decay));
}

bool is_bias(const std::string& name) { return name.size() >= 5 && name.substr(name.size() - 5) == ".bias"; }

}  // namespace

std::vector<torch::Tensor> train_zero_golden(const ZeroScenario& s, std::vector<double>* norms,
                                             std::vector<std::vector<torch::Tensor>>* per_step) {
  Mlp model = make_mlp(kZeroSeed, kZeroIn, s.hidden, kZeroOut);
  // The optimizer runs on fp32 masters; with bf16 the model holds bf16 copies of them.
  std::vector<torch::Tensor> masters, weights, biases;
  for (const auto& item : model->named_parameters()) {
    auto master = item.value().detach().clone().to(torch::kFloat).requires_grad_(true);
    masters.push_back(master);
    (is_bias(item.key()) ? biases : weights).push_back(master);
  }
  if (s.bf16) model->to(torch::kBFloat16);
  auto opt = golden_optimizer(s, weights, biases);
  std::unique_ptr<LrScheduler> scheduler;
  if (s.schedule) {
    scheduler = std::make_unique<LrScheduler>(*s.schedule);
    scheduler->attach(*opt);
  }
  auto params = model->parameters();
  for (int step = 0; step < s.steps; ++step) {
    for (auto& p : params) p.mutable_grad().reset();
    auto [x, y] = make_batch(kZeroSeed, step, kZeroBatch, kZeroIn, kZeroOut);
    for (int m = 0; m < s.micro_batches; ++m) {
      auto xm = shard_rows(x, m, s.micro_batches), ym = shard_rows(y, m, s.micro_batches);
      if (s.bf16) xm = xm.to(torch::kBFloat16);
      auto loss = torch::mse_loss(model->forward(xm).to(torch::kFloat), ym) / s.micro_batches;
      loss.backward();
    }
    for (size_t i = 0; i < params.size(); ++i) masters[i].mutable_grad() = params[i].grad().to(torch::kFloat);
    if (s.clip > 0) {
      const double norm = torch::nn::utils::clip_grad_norm_(masters, s.clip);
      if (norms) norms->push_back(norm);
    }
    opt->step();
    if (scheduler) scheduler->step();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
    if (per_step) {
      per_step->emplace_back();
      for (auto& p : params) per_step->back().push_back(p.detach().to(torch::kFloat).clone());
    }
  }
  std::vector<torch::Tensor> out;
  for (auto& p : params) out.push_back(p.detach().to(torch::kFloat).clone());
  return out;
}

ZeroRank::ZeroRank(DeviceMesh& mesh_, const ZeroScenario& s, uint64_t init_seed) : scenario(s), mesh(mesh_) {
  model = make_mlp(init_seed, kZeroIn, s.hidden, kZeroOut);
  if (s.bf16) model->to(torch::kBFloat16);
  DdpConfig config;
  config.use_distributed_optimizer = true;
  config.bucket_bytes = s.bucket_bytes;
  config.grad_reduce_in_fp32 = s.bf16;
  config.num_distributed_optimizer_instances = s.instances;
  config.data_parallel_sharding_strategy = s.strategy;
  ddp = std::make_unique<DistributedDataParallel<MlpImpl>>(model.ptr(), mesh, "dp", config);
  opt = std::make_unique<DistributedOptimizer>(ddp->grad_buffer(), zero_optimizer_config(s));
  if (s.schedule) {
    scheduler = std::make_unique<LrScheduler>(*s.schedule);
    scheduler->attach(*opt);
  }
}

std::vector<StepResult> ZeroRank::train(int first_step, int last_step) {
  std::vector<StepResult> results;
  const int64_t r = mesh.coordinate("dp"), dp = mesh.size("dp");
  const int k = scenario.micro_batches;
  for (int step = first_step; step < last_step; ++step) {
    ddp->zero_grad_buffer();
    auto [x, y] = make_batch(kZeroSeed, step, kZeroBatch, kZeroIn, kZeroOut);
    for (int m = 0; m < k; ++m) {
      ddp->set_is_last_microbatch(m == k - 1);
      auto xm = shard_rows(shard_rows(x, m, k), r, dp), ym = shard_rows(shard_rows(y, m, k), r, dp);
      if (scenario.bf16) xm = xm.to(torch::kBFloat16);
      auto loss = torch::mse_loss(ddp->forward(xm).to(torch::kFloat), ym) / k;
      loss.backward();
    }
    results.push_back(opt->step());
    if (scheduler && !results.back().skipped) scheduler->step();
  }
  return results;
}

std::vector<torch::Tensor> ZeroRank::params() {
  opt->finish_param_sync();
  auto whole = ddp->gather_full_params();
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().to(torch::kFloat).clone());
  return out;
}

std::vector<torch::Tensor> train_zero(const ZeroScenario& s, std::vector<std::vector<StepResult>>* results) {
  std::vector<std::vector<torch::Tensor>> per_rank(s.world);
  if (results) results->assign(s.world, {});
  run_on_mesh({s.world}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed + 31 * mesh.rank());  // DDP broadcasts DP rank 0's init
    auto r = rank.train(0, s.steps);
    if (results) (*results)[mesh.rank()] = r;
    per_rank[mesh.rank()] = rank.params();
  });
  for (int r = 1; r < s.world; ++r) {
    for (size_t i = 0; i < per_rank[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(per_rank[0][i], per_rank[r][i])) << "rank " << r << " param " << i << " differs";
    }
  }
  return per_rank[0];
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
}

Mlp trained_zero_golden_model(const ZeroScenario& s) {
  auto golden = train_zero_golden(s);
  Mlp model = make_mlp(kZeroSeed, kZeroIn, s.hidden, kZeroOut);
  torch::NoGradGuard no_grad;
  auto ps = model->parameters();
  for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(golden[i]);
  return model;
}

ParamGather* start_gathers_over_a_poisoned_param_buffer(ZeroRank& rank) {
  const GradBuffer& buffer = rank.ddp->grad_buffer();
  ParamGather* gather = rank.ddp->param_gather();
  if (rank.mesh.rank() == 0) {
    torch::NoGradGuard no_grad;
    for (const BucketShard& shard : rank.opt->shards()) {
      at::Tensor full = buffer.param_buffer()->bucket_data(shard.bucket);
      const int64_t mine = shard.begin - buffer.layout().buckets[shard.bucket].begin;
      full.narrow(0, 0, mine).fill_(1e6);
      full.narrow(0, mine + shard.numel, full.numel() - mine - shard.numel).fill_(1e6);
    }
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  gather->start(/*async=*/true);
  return gather;
}

}  // namespace meshddp::test
