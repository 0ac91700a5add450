// Expert parallel: expert (MoE) params reduced over the expert-data-parallel group, dense
// params over DP, against the golden: the same model trained in one process, all experts local, on
// the whole global batch.
//
// The toy MoE: a dense MLP on each token plus, per token, one expert (token i goes to expert i % E)
// fed the token directly, the two squared errors summed. On dp 4 with EP 2, EP rank k (= DP rank % 2)
// holds experts {2k, 2k+1}. The all-to-all of a real MoE is stood in for by the data: every rank can
// build the global batch, so each rank's local experts take the tokens of its EP group's batches routed
// to them, weighted 1/b as the tokens' own ranks would (b = B / DP, the local batch): exactly what an
// expert receives through the all-to-all. Golden gradients come out only if dense buckets are averaged
// over DP and expert buckets summed over the expert-DP group and divided by DP (Note [Expert gradient
// scale], bucket_reduction.cpp); an expert reduced over DP mixes different experts (O(1) errors).
//
// Tolerance: fp32 sums split differently across ranks (a few ulps per step): 5e-7 absolute +
// relative. Measured max |diff| over 3 steps: gradients 7.5e-8, params 2.4e-7 (SGD and AdamW, also
// after a checkpoint load and resume), grad norm 6.4e-9. An expert reduced over DP is off by O(0.1).
#include "common/grad_norm.h"
#include "grad_buffer/bucket_layout.h"
#include "grad_buffer/bucket_reduction.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/sharded_params.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_checkpoint.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tp/parallelize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <map>
#include <tuple>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 6, kHidden = 10, kOut = 4, kBatch = 32, kExperts = 4, kDp = 4;
constexpr uint64_t kSeed = 23;
constexpr double kAtol = 5e-7, kRtol = 5e-7;
constexpr int kSteps = 3;
constexpr double kLr = 0.05;

struct ExpertImpl : torch::nn::Module {
  ExpertImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(kIn, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kOut));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Expert);

// Dense MLP + the experts `held` (global indices), registered as "experts.<global index>".
struct MoeToyImpl : torch::nn::Module {
  explicit MoeToyImpl(std::vector<int64_t> held) : held(std::move(held)) {
    dense1 = register_module("dense1", torch::nn::Linear(kIn, kHidden));
    dense2 = register_module("dense2", torch::nn::Linear(kHidden, kOut));
    experts = register_module("experts", std::make_shared<torch::nn::Module>());
    for (int64_t e : this->held) by_index[e] = experts->register_module(std::to_string(e), Expert());
  }
  // The loss of one rank: its own tokens (x, y) through the dense MLP, and the tokens (xe, ye) its
  // experts receive (global token indices first_token, first_token + 1, ...; token i goes to expert
  // i % kExperts), all weighted 1 / (b * kOut), b = the rank's own batch size.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& xe,
                        const torch::Tensor& ye, int64_t first_token) {
    const double scale = 1.0 / static_cast<double>(x.size(0) * kOut);
    torch::Tensor loss = (dense2(torch::tanh(dense1(x))) - y).square().sum() * scale;
    for (int64_t e : held) {
      std::vector<int64_t> rows;
      for (int64_t j = 0; j < xe.size(0); ++j) {
        if ((first_token + j) % kExperts == e) rows.push_back(j);
      }
      const torch::Tensor index = torch::tensor(rows, torch::kLong);
      loss =
          loss + (by_index[e]->forward(xe.index_select(0, index)) - ye.index_select(0, index)).square().sum() * scale;
    }
    return loss;
  }
  std::vector<int64_t> held;
  torch::nn::Linear dense1{nullptr}, dense2{nullptr};
  std::shared_ptr<torch::nn::Module> experts;
  std::map<int64_t, Expert> by_index;
};
TORCH_MODULE(MoeToy);

// Deterministic values from a per-tensor generator (ranks are threads: no global RNG). `offset`
// perturbs them: ranks other than their group's rank 0 start from other values, which DDP's
// broadcast must replace.
MoeToy make_model(const std::vector<int64_t>& held, uint64_t dense_offset, uint64_t expert_offset) {
  MoeToy model(held);
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    const bool expert = item.key().rfind("experts.", 0) == 0;
    // Seeded by name, so one expert has the same values whichever rank (or the golden) builds it.
    const uint64_t seed = std::hash<std::string>{}(item.key()) + kSeed + (expert ? expert_offset : dense_offset);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    item.value().copy_(torch::randn(item.value().sizes(), gen) * 0.4);
  }
  return model;
}

std::pair<torch::Tensor, torch::Tensor> batch_of(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed * 1000003 + step);
  auto x = torch::randn({kBatch, kIn}, gen);
  auto y = torch::randn({kBatch, kOut}, gen);
  return {x, y};
}

std::vector<int64_t> all_experts() {
  std::vector<int64_t> e(kExperts);
  for (int64_t i = 0; i < kExperts; ++i) e[i] = i;
  return e;
}

// The experts EP rank `ep_rank` of `ep` holds: a contiguous block.
std::vector<int64_t> experts_of(int64_t ep_rank, int64_t ep) {
  std::vector<int64_t> held;
  for (int64_t e = ep_rank * kExperts / ep; e < (ep_rank + 1) * kExperts / ep; ++e) held.push_back(e);
  return held;
}

using Named = std::map<std::string, torch::Tensor>;

enum class Optim { kSgd, kAdamW };

struct GoldenRun {
  std::vector<Named> grads;   // per step, before the update
  std::vector<Named> params;  // per step, after the update
  std::vector<double> norms;  // per step
};

// One process, all experts, the whole batch (the loss is then the global mean).
GoldenRun golden(Optim optim, int steps) {
  MoeToy model = make_model(all_experts(), 0, 0);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optim == Optim::kSgd) {
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(kLr));
  } else {
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.0));
  }
  GoldenRun run;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    auto [x, y] = batch_of(step);
    model->forward(x, y, x, y, 0).backward();
    Named grads, params;
    double sq = 0;
    for (auto& item : model->named_parameters()) {
      grads[item.key()] = item.value().grad().clone();
      sq += item.value().grad().to(torch::kDouble).square().sum().item<double>();
    }
    opt->step();
    for (auto& item : model->named_parameters()) params[item.key()] = item.value().detach().clone();
    run.grads.push_back(grads);
    run.params.push_back(params);
    run.norms.push_back(std::sqrt(sq));
  }
  return run;
}

// Every entry of `got` against `want` (the golden holds every expert; a rank only some).
void expect_close(const Named& got, const Named& want, const std::string& what, int64_t rank, int step) {
  for (const auto& [name, t] : got) {
    ASSERT_TRUE(want.count(name)) << name;
    EXPECT_TRUE(torch::allclose(t, want.at(name), kRtol, kAtol))
        << what << " '" << name << "' on rank " << rank << " at step " << step << ": max |diff| "
        << (t - want.at(name)).abs().max().item<double>();
  }
}

// One rank of dp 4 with EP `ep`: its model, DDP and optimizer.
struct Rank {
  MoeToy model{nullptr};
  std::unique_ptr<DistributedDataParallel<MoeToyImpl>> ddp;
  std::unique_ptr<DistributedOptimizer> zero;
  std::unique_ptr<torch::optim::Optimizer> plain;
  int64_t ep = 1;
};

// `strategy`: DdpConfig::data_parallel_sharding_strategy ("" = from `zero1`).
Rank make_rank(DeviceMesh& mesh, int64_t ep, Optim optim, bool zero1, uint64_t perturb = 0, int64_t instances = 1,
               const char* strategy = "") {
  Rank r;
  r.ep = ep;
  const int64_t d = mesh.coordinate("dp");
  const bool expert_dp_rank0 = d / ep == 0;  // DP ranks d and d + ep hold the same experts
  r.model = make_model(experts_of(d % ep, ep), d == 0 ? 0 : 17 * d + perturb, expert_dp_rank0 ? 0 : 31 * d + perturb);
  for (auto& item : r.model->experts->named_parameters()) declare_expert_param(item.value());
  DdpConfig config;
  config.bucket_bytes = 256;  // several buckets per group
  config.use_distributed_optimizer = zero1;
  config.expert_parallel_size = ep;
  config.num_distributed_optimizer_instances = instances;
  config.data_parallel_sharding_strategy = strategy;
  r.ddp = std::make_unique<DistributedDataParallel<MoeToyImpl>>(r.model.ptr(), mesh, std::vector<std::string>{"dp"},
                                                                config);
  if (zero1) {
    DistributedOptimizerConfig oc;
    oc.kind = optim == Optim::kSgd ? OptimizerKind::kSgd : OptimizerKind::kAdamW;
    oc.lr = kLr;
    r.zero = std::make_unique<DistributedOptimizer>(r.ddp->grad_buffer(), oc);
  } else if (optim == Optim::kSgd) {
    r.plain = std::make_unique<torch::optim::SGD>(r.ddp->parameters(), torch::optim::SGDOptions(kLr));
  } else {
    r.plain =
        std::make_unique<torch::optim::AdamW>(r.ddp->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(0.0));
  }
  return r;
}

// Forward and backward of step `step` on this rank: its own b = B / DP tokens, and for its experts the
// tokens of its EP group's batches (what the all-to-all would bring).
void forward_backward(Rank& r, const DeviceMesh& mesh, int64_t step) {
  auto [x, y] = batch_of(step);
  const int64_t d = mesh.coordinate("dp"), b = kBatch / kDp;
  const int64_t group_first = (d / r.ep) * r.ep * b;  // the EP group's first token
  r.ddp
      ->forward(x.narrow(0, d * b, b), y.narrow(0, d * b, b), x.narrow(0, group_first, r.ep * b),
                y.narrow(0, group_first, r.ep * b), group_first)
      .backward();
}

// Steps `r` once; returns the grad norm (plain: meshddp::grad_norm; ZeRO-1: the step's).
double train_step(Rank& r, const DeviceMesh& mesh, int64_t step, Named* grads) {
  r.ddp->zero_grad_buffer();  // param.grad() is its slot: no optimizer zero_grad()
  forward_backward(r, mesh, step);
  double norm = 0;
  if (r.zero) {
    const StepResult result = r.zero->step();
    EXPECT_FALSE(result.skipped) << result.report;
    norm = result.grad_norm;
    r.zero->finish_param_sync();
  } else {
    r.ddp->finish_grad_sync();
    norm = grad_norm(r.ddp->grad_buffer());
    if (grads) {
      for (const auto& p : r.ddp->named_parameters()) (*grads)[p.name] = r.ddp->main_grad(p.name).clone();
    }
    r.plain->step();
  }
  return norm;
}

Named params_of(const Rank& r) {
  // optim_grads_params: every unit gathered (a collective: every rank reads at once), then released.
  const ParamBuffer* param_buffer = r.ddp->grad_buffer()->param_buffer();
  ShardedParams* sharded = param_buffer ? param_buffer->sharded() : nullptr;
  if (sharded) sharded->gather_all();
  Named out;
  for (auto& item : r.model->named_parameters()) out[item.key()] = item.value().detach().clone();
  if (sharded) sharded->release_all();
  return out;
}

// Returns each rank's params after the last step.
std::vector<Named> expect_matches_golden(Optim optim, bool zero1, int64_t ep = 2, int64_t instances = 1,
                                         const char* strategy = "") {
  const GoldenRun want = golden(optim, kSteps);
  std::vector<Named> final_params(kDp);
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    Rank r = make_rank(mesh, ep, optim, zero1, /*perturb=*/0, instances, strategy);
    EXPECT_EQ(r.ddp->grad_buffer()->groups().expert_dp->getSize(), kDp / ep);
    for (int step = 0; step < kSteps; ++step) {
      Named grads;
      const double norm = train_step(r, mesh, step, &grads);
      if (!zero1) expect_close(grads, want.grads[step], "gradient", mesh.rank(), step);
      EXPECT_NEAR(norm, want.norms[step], kAtol + kRtol * want.norms[step]) << "grad norm at step " << step;
      final_params[mesh.rank()] = params_of(r);
      expect_close(final_params[mesh.rank()], want.params[step], "param", mesh.rank(), step);
    }
  });
  return final_params;
}

}  // namespace

TEST(ExpertParallel, DenseAndExpertGradientsAndNormMatchOneProcessAtDp4WithEp2) {
  expect_matches_golden(Optim::kSgd, /*zero1=*/false);
}

TEST(ExpertParallel, DistributedOptimizerSgdShardsExpertBucketsOverExpertDpAndMatchesOneProcess) {
  expect_matches_golden(Optim::kSgd, /*zero1=*/true);
}

TEST(ExpertParallel, DistributedOptimizerAdamWMatchesOneProcessAtDp4WithEp2) {
  expect_matches_golden(Optim::kAdamW, /*zero1=*/true);
}

// optim_grads_params (ZeRO-3) with experts: each expert is an FSDP unit of its own ("experts.<e>", the
// default units), whose buckets are sharded and gathered over the expert-DP group (2 ranks), the dense
// units' over DP (4). The params after each step match one process (kAtol) and, after the last, the
// optim strategy's bit for bit (dp 4 SGD without accumulation: the same reduce-scatters, the same param
// values in every op). Gathering an expert bucket over DP would mix the two EP ranks' experts.
TEST(ExpertParallel, ShardedParamsGatherExpertUnitsOverExpertDpAndMatchOneProcessAndOptim) {
  const std::vector<Named> optim = expect_matches_golden(Optim::kSgd, /*zero1=*/true, /*ep=*/2, 1, kShardOptim);
  const std::vector<Named> zero3 =
      expect_matches_golden(Optim::kSgd, /*zero1=*/true, /*ep=*/2, 1, kShardOptimGradsParams);
  for (int64_t rank = 0; rank < kDp; ++rank) {
    ASSERT_EQ(zero3[rank].size(), optim[rank].size());
    for (const auto& [name, want] : optim[rank]) {
      EXPECT_TRUE(torch::equal(zero3[rank].at(name), want))
          << name << " on rank " << rank << ": max |diff| to optim " << (zero3[rank].at(name) - want).abs().max();
    }
  }
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    Rank r = make_rank(mesh, /*ep=*/2, Optim::kSgd, /*zero1=*/true, 0, 1, kShardOptimGradsParams);
    const ShardedParams* sharded = r.ddp->grad_buffer()->param_buffer()->sharded();
    const GradBuffer& buffer = *r.ddp->grad_buffer();
    for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
      const bool expert = buffer.bucket_reduction(b).expert;
      const std::string& unit = sharded->unit_name(sharded->unit_of_bucket(b));
      EXPECT_EQ(unit.rfind("experts.", 0) == 0, expert) << "bucket " << b << " of unit " << unit;
      EXPECT_EQ(sharded->bucket_shard(b).numel(), buffer.layout().buckets[b].numel() / (expert ? 2 : kDp))
          << "bucket " << b << " of unit " << unit;
    }
  });
}

TEST(ExpertParallel, ExpertParamsLiveInBuffersAndBucketsOfTheirOwn) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    Rank r = make_rank(mesh, /*ep=*/2, Optim::kSgd, /*zero1=*/true);
    const GradBuffer& buffer = *r.ddp->grad_buffer();
    const BucketLayout& layout = buffer.layout();
    int64_t expert_buckets = 0;
    for (int64_t b = 0; b < static_cast<int64_t>(layout.buckets.size()); ++b) {
      const BucketSpan& span = layout.buckets[b];
      const bool expert = layout.buffers[span.buffer].key.expert;
      const BucketReduction& reduction = buffer.bucket_reduction(b);
      EXPECT_EQ(reduction.expert, expert);
      EXPECT_EQ(reduction.divisor, kDp);  // Note [Expert gradient scale]
      EXPECT_EQ(reduction.shard_size, expert ? 2 : kDp);
      EXPECT_EQ(span.numel() % (reduction.shard_size * kAlignmentElems), 0);
      for (int64_t p : span.params) {
        EXPECT_EQ(buffer.is_expert(p), expert) << buffer.params()[p].name;  // a bucket never mixes groups
        EXPECT_EQ(buffer.params()[p].name.rfind("experts.", 0) == 0, expert) << buffer.params()[p].name;
      }
      expert_buckets += expert ? 1 : 0;
    }
    EXPECT_GE(expert_buckets, 2);
  });
}

TEST(ExpertParallel, PlanStyleExpertParallelDeclaresEveryParamOfTheMatchedModules) {
  run_on_mesh({2, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model(experts_of(mesh.rank(), 2), 0, 0);
    parallelize(*model, mesh, {{"experts", ExpertParallel{}}});
    for (auto& item : model->named_parameters()) {
      EXPECT_EQ(is_expert_param(item.value()), item.key().rfind("experts.", 0) == 0) << item.key();
    }
    EXPECT_THAT(error_of([&] { parallelize(*model, mesh, {{"moe.experts", ExpertParallel{}}}); }),
                testing::HasSubstr("parallelize: plan entry 'moe.experts' (ExpertParallel) matches no module"));
  });
}

TEST(ExpertParallel, RefusesAnExpertParallelSizeThatDoesNotDivideTheDpSizeNamingTheField) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model(experts_of(0, 1), 0, 0);
    for (auto& p : model->experts->parameters()) declare_expert_param(p);
    DdpConfig config;
    config.expert_parallel_size = 3;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                testing::HasSubstr("DdpConfig::expert_parallel_size = 3 does not divide the data-parallel size 4"));
    config.expert_parallel_size = 0;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                testing::HasSubstr("expert_parallel_size"));
  });
}

TEST(ExpertParallel, RefusesExpertParallelOverAProcessGroupWithoutAMesh) {
  run_on_mesh({2, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model(experts_of(0, 1), 0, 0);
    for (auto& p : model->experts->parameters()) declare_expert_param(p);
    DdpConfig config;
    config.expert_parallel_size = 2;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh["dp"], config); }),
                testing::HasSubstr("DDP was given a data-parallel process group, not a DeviceMesh"));
  });
}

TEST(ExpertParallel, RefusesExpertsNamedLocallyOnEveryEpRank) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model({0, 1}, 0, 0);  // every EP rank calls its experts 0 and 1
    for (auto& p : model->experts->parameters()) declare_expert_param(p);
    DdpConfig config;
    config.expert_parallel_size = 2;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                testing::HasSubstr("is held by 4 of the 4 data-parallel ranks, but an expert lives on the 2 ranks of "
                                   "one expert-data-parallel group"));
  });
}

// Saves after two ZeRO-1 AdamW steps at dp 4 with EP 2 (every expert element written once, or the
// manifest's exact-coverage check refuses the save), then loads into fresh ranks at EP 2 and at EP 4
// (each rank one expert: the pieces are found by the expert's global name) and takes the third step:
// the params must be those of the uninterrupted run.
TEST(ExpertParallel, CheckpointRoundTripWithExpertsResumesAtTheSameAndAnotherEpSize) {
  const std::string dir = fresh_dir("expert-ckpt");
  const GoldenRun want = golden(Optim::kAdamW, 3);
  for (bool zero1 : {true, false}) {
    remove_dir(dir);
    run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      Rank r = make_rank(mesh, /*ep=*/2, Optim::kAdamW, zero1);
      for (int step = 0; step < 2; ++step) train_step(r, mesh, step, nullptr);
      save_checkpoint(TrainingState{&*r.model, r.ddp.get(), r.zero.get(), r.plain.get()}, dir, 2);
    });
    for (int64_t ep : {2, 4}) {
      run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
        Rank r = make_rank(mesh, ep, Optim::kAdamW, zero1, /*perturb=*/5);
        const LoadedCheckpoint loaded =
            load_checkpoint(TrainingState{&*r.model, r.ddp.get(), r.zero.get(), r.plain.get()}, dir);
        EXPECT_EQ(loaded.step, 2);
        expect_close(params_of(r), want.params[1], "loaded param (ep " + std::to_string(ep) + ")", mesh.rank(), 1);
        train_step(r, mesh, 2, nullptr);
        expect_close(params_of(r), want.params[2], "param after resuming (ep " + std::to_string(ep) + ")", mesh.rank(),
                     2);
      });
    }
  }
  remove_dir(dir);
}

// Hierarchical ZeRO-1 with experts (Megatron-core's layout): an expert bucket is sharded over the
// expert-DP ranks within the instance (expert-DP / K of them) and its shard all-reduced across the K
// instances, as a dense one. At EP 2 (expert-DP 2, K 2) each rank holds whole expert buckets, summed
// across the instances; at EP 1 (expert-DP 4) half of each. Skipping the cross-instance step for
// expert buckets leaves each instance with its own half of the batch (O(0.01) off).
TEST(ExpertParallel, TwoOptimizerInstancesShardExpertBucketsWithinTheInstanceAndMatchOneProcess) {
  for (int64_t ep : {2, 1}) {
    expect_matches_golden(Optim::kAdamW, /*zero1=*/true, ep, /*instances=*/2);
    run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      Rank r = make_rank(mesh, ep, Optim::kAdamW, /*zero1=*/true, /*perturb=*/0, /*instances=*/2);
      const GradBuffer& buffer = *r.ddp->grad_buffer();
      int64_t expert_buckets = 0;
      for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
        const BucketReduction& red = buffer.bucket_reduction(b);
        if (!red.expert) continue;
        ++expert_buckets;
        const int64_t intra = kDp / ep / 2;
        EXPECT_EQ(red.shard_size, intra) << "expert bucket " << b << " at ep " << ep;
        EXPECT_TRUE(red.cross_group && red.cross_group->getSize() == 2) << "expert bucket " << b << " at ep " << ep;
        EXPECT_EQ(buffer.bucket_shard(b).numel(), buffer.layout().buckets[b].numel() / intra) << "bucket " << b;
      }
      EXPECT_GT(expert_buckets, 0);
    });
  }
}

// optim_grads_params in two optimizer instances: each instance holds the params sharded over its own
// ranks (dense buckets over its D/K = 2, expert ones over its expert-DP / K), gathered within it; the
// gradient shards are all-reduced across the instances as under optim. At EP 2 and EP 1 (expert units
// sharded as dense ones) the params match one process and the optim strategy's run bit for bit.
TEST(ExpertParallel, ShardedParamsInTwoOptimizerInstancesMatchOneProcessAndOptim) {
  for (int64_t ep : {2, 1}) {
    const std::vector<Named> optim = expect_matches_golden(Optim::kAdamW, /*zero1=*/true, ep, 2, kShardOptim);
    const std::vector<Named> zero3 =
        expect_matches_golden(Optim::kAdamW, /*zero1=*/true, ep, 2, kShardOptimGradsParams);
    for (int64_t rank = 0; rank < kDp; ++rank) {
      for (const auto& [name, want] : optim[rank]) {
        EXPECT_TRUE(torch::equal(zero3[rank].at(name), want))
            << name << " on rank " << rank << " at ep " << ep << ": max |diff| to optim "
            << (zero3[rank].at(name) - want).abs().max();
      }
    }
    run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      Rank r = make_rank(mesh, ep, Optim::kAdamW, /*zero1=*/true, 0, /*instances=*/2, kShardOptimGradsParams);
      const ShardedParams* sharded = r.ddp->grad_buffer()->param_buffer()->sharded();
      const GradBuffer& buffer = *r.ddp->grad_buffer();
      for (int64_t b = 0; b < static_cast<int64_t>(buffer.layout().buckets.size()); ++b) {
        const int64_t within = buffer.bucket_reduction(b).expert ? kDp / ep / 2 : kDp / 2;
        EXPECT_EQ(sharded->bucket_shard(b).numel(), buffer.layout().buckets[b].numel() / within)
            << "bucket " << b << " at ep " << ep;
      }
    });
  }
}

TEST(ExpertParallel, CheckpointWithExpertsInTwoInstancesResumesAtAnotherLayout) {
  // Saved at EP 2 in 2 instances (instance 0 writes every shard, expert ones too), under optim and under
  // optim_grads_params, loaded flat at EP 2 and EP 4, and at EP 1 in 2 instances, each under the other
  // strategy too: each continues as the golden does.
  const std::string dir = fresh_dir("expert-instances-ckpt");
  const GoldenRun want = golden(Optim::kAdamW, 3);
  for (const char* saved_under : {kShardOptim, kShardOptimGradsParams}) {
    const char* other = std::string(saved_under) == kShardOptim ? kShardOptimGradsParams : kShardOptim;
    remove_dir(dir);
    run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      Rank r = make_rank(mesh, /*ep=*/2, Optim::kAdamW, /*zero1=*/true, /*perturb=*/0, /*instances=*/2, saved_under);
      for (int step = 0; step < 2; ++step) train_step(r, mesh, step, nullptr);
      save_checkpoint(TrainingState{&*r.model, r.ddp.get(), r.zero.get(), nullptr}, dir, 2);
    });
    for (const auto& [ep, instances, strategy] :
         std::vector<std::tuple<int64_t, int64_t, const char*>>{{2, 1, saved_under}, {4, 1, other}, {1, 2, other}}) {
      const std::string at = " (saved under " + std::string(saved_under) + "; ep " + std::to_string(ep) + ", " +
                             std::to_string(instances) + " instance(s), " + strategy + ")";
      run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
        Rank r = make_rank(mesh, ep, Optim::kAdamW, /*zero1=*/true, /*perturb=*/5, instances, strategy);
        const LoadedCheckpoint loaded =
            load_checkpoint(TrainingState{&*r.model, r.ddp.get(), r.zero.get(), nullptr}, dir);
        EXPECT_EQ(loaded.step, 2);
        expect_close(params_of(r), want.params[1], "loaded param" + at, mesh.rank(), 1);
        train_step(r, mesh, 2, nullptr);
        expect_close(params_of(r), want.params[2], "param after resuming" + at, mesh.rank(), 2);
      });
    }
  }
  remove_dir(dir);
}

TEST(ExpertParallel, RefusesInstancesThatDoNotDivideTheExpertDpSizeOnEveryRank) {
  // dp 4, EP 2: expert-DP 2; K = 4 divides the DP size but not the expert-DP size.
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    EXPECT_THAT(
        error_of([&] { make_rank(mesh, /*ep=*/2, Optim::kAdamW, true, 0, /*instances=*/4); }),
        testing::HasSubstr("num_distributed_optimizer_instances = 4 does not divide the expert-data-parallel size 2"));
  });
}

// Rank 0 declares its experts, the others forget to: the others would broadcast and reduce the
// experts over DP while rank 0 waits in the expert-DP group. Every rank must fail, naming the setting.
TEST(ExpertParallel, RanksThatDisagreeOnWhichParamsAreExpertsFailOnEveryRank) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model(experts_of(mesh.rank() % 2, 2), 0, 0);
    if (mesh.rank() == 0) {
      for (auto& p : model->experts->parameters()) declare_expert_param(p);
    }
    DdpConfig config;
    config.expert_parallel_size = 2;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                testing::HasSubstr("expert params"))
        << "rank " << mesh.rank();
  });
}

// Rank 0 asks for EP 3 (not dividing dp 4), the others for EP 2: rank 0's own check must not leave
// the others waiting in the settings agreement. Every rank fails at once, naming the field.
TEST(ExpertParallel, RanksThatDisagreeOnTheExpertParallelSizeFailOnEveryRankAtOnce) {
  const auto start = std::chrono::steady_clock::now();
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model(experts_of(mesh.rank() % 2, 2), 0, 0);
    for (auto& p : model->experts->parameters()) declare_expert_param(p);
    DdpConfig config;
    config.expert_parallel_size = mesh.rank() == 0 ? 3 : 2;
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, "dp", config); }),
                testing::HasSubstr("expert_parallel_size"))
        << "rank " << mesh.rank();
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0)
      << "the ranks waited on each other instead of failing at once";
}

// A NaN in one expert's gradient on one rank, with check_for_nan_in_grad: every rank throws (the check
// spans the mesh, not just that expert's expert-DP group), naming the expert param and the rank.
TEST(ExpertParallel, NanInOneExpertGradientIsNamedWithItsRankOnEveryRank) {
  run_on_mesh({kDp, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    MoeToy model = make_model(experts_of(mesh.rank() % 2, 2), 0, 0);
    for (auto& p : model->experts->parameters()) declare_expert_param(p);
    DdpConfig config;
    config.expert_parallel_size = 2;
    config.check_for_nan_in_grad = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    torch::Tensor loss = torch::zeros({});
    for (auto& p : model->parameters()) loss = loss + p.square().sum();
    if (mesh.rank() == 3) loss = loss + model->by_index.at(2)->parameters().front().sum() * NAN;
    const std::string error = error_of([&] {
      loss.backward();
      ddp.finish_grad_sync();
    });
    EXPECT_THAT(error, testing::HasSubstr("rank 3 (DP rank 3): parameter 'experts.2.")) << "rank " << mesh.rank();
    EXPECT_THAT(error, testing::HasSubstr("non-finite on every rank that holds them")) << "rank " << mesh.rank();
    if (mesh.rank() == 0) std::cout << "[ " << error.substr(0, 700) << " ]" << std::endl;
  });
}
