// DistributedDataParallel + DistributedOptimizer under the "optim_grads_params" sharding strategy
// (ZeRO-3; Note [Sharded parameters], grad_buffer/sharded_params.h) on the test MLP, against the
// "optim" strategy's run (ZeRO-1, whole params resident): a step skipped for a non-finite gradient on
// one rank, reading whole params (gather_full_params(), a module outliving its wrapper), Muon on
// whole-param shards. Ranks are threads with Gloo groups.
//
// Tolerance: bit for bit. At dp 2 a reduce-scatter sums two values (a + b == b + a in fp32), and the
// AdamW update is the same elementwise arithmetic on the same shard elements under both strategies,
// so whatever the units do to the bucket boundaries the params are the same bits.
#include "checkpoint/store.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "tests/support/rank_threads.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

constexpr int kCleanSteps = 3, kPoisonedStep = 3, kLastStep = 7;

// Everything a skipped step must leave alone: this rank's optimizer state and masters ("optim/..."),
// its pieces of the params ("model/...") and, under "optim_grads_params", its param shards.
std::vector<at::Tensor> rank_state(ZeroRank& rank) {
  std::vector<at::Tensor> out;
  for (const CheckpointTensor& t : rank.opt->checkpoint_tensors(/*for_save=*/false)) out.push_back(t.data.clone());
  if (ShardedParams* sharded = rank.ddp->grad_buffer().param_buffer()->sharded()) {
    for (size_t b = 0; b < rank.ddp->grad_buffer()->layout().buckets.size(); ++b) {
      out.push_back(sharded->bucket_shard(static_cast<int64_t>(b)).clone());
    }
  }
  return out;
}

struct SkipRun {
  std::vector<torch::Tensor> params;  // after the clean steps that follow the skipped one
  std::string report;                 // the skipped step's
};

// Steps 0..2 clean; step 3 with `value` written into one element of fc2.weight's local gradient on DP
// rank 1 only (a gradient hook, as a bad kernel would: before the bucket's reduce-scatter); steps 4..6
// clean. Checks on every rank that step 3 was skipped and changed nothing.
SkipRun train_with_a_poisoned_step(const std::string& strategy, float value) {
  SkipRun out;
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroScenario s{.world = 2, .strategy = strategy};
    ZeroRank rank(mesh, s, kZeroSeed + 31 * mesh.rank());
    rank.train(0, kCleanSteps);
    const std::vector<at::Tensor> before = rank_state(rank);
    int hook = -1;
    if (mesh.rank() == 1) {
      hook = static_cast<int>(rank.model->fc2->weight.register_hook([value](torch::Tensor g) {
        g = g.clone();
        g[3][4] = value;
        return g;
      }));
    }
    rank.ddp->zero_grad_buffer();
    auto [x, y] = make_batch(kZeroSeed, kPoisonedStep, kZeroBatch, kZeroIn, kZeroOut);
    const auto xr = shard_rows(x, mesh.rank(), 2), yr = shard_rows(y, mesh.rank(), 2);
    torch::mse_loss(rank.ddp->forward(xr), yr).backward();
    const StepResult r = rank.opt->step();
    if (hook >= 0) rank.model->fc2->weight.remove_hook(hook);
    EXPECT_TRUE(r.skipped) << "rank " << mesh.rank();
    EXPECT_EQ(rank.opt->steps_taken(), kCleanSteps) << "rank " << mesh.rank();
    const std::vector<at::Tensor> after = rank_state(rank);
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(at::equal(after[i], before[i]))
          << "rank " << mesh.rank() << ": state tensor " << i << " changed in the skipped step";
    }
    rank.train(kPoisonedStep + 1, kLastStep);
    EXPECT_EQ(rank.opt->steps_taken(), kCleanSteps + (kLastStep - kPoisonedStep - 1)) << "rank " << mesh.rank();
    auto params = rank.params();
    if (mesh.rank() == 0) {
      out.params = std::move(params);
      out.report = r.report;
    }
  });
  return out;
}

}  // namespace

// One rank's NaN (or Inf) in a step: the step is skipped on every rank, its shards and optimizer state
// are unchanged bit for bit, and the next clean steps train on exactly as the "optim" run with the same
// skip does.
TEST(ShardedParamsTraining, ANonFiniteGradientOnOneRankSkipsTheStepEverywhereAndTrainingGoesOnAsUnderOptim) {
  for (float value : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(std::isnan(value) ? "NaN" : "Inf");
    const SkipRun want = train_with_a_poisoned_step(kShardOptim, value);
    const SkipRun got = train_with_a_poisoned_step(kShardOptimGradsParams, value);
    EXPECT_THAT(got.report, HasSubstr("DP rank 1 produced 1 non-finite value(s) in its local gradient of parameter "
                                      "'fc2.weight'"));
    ASSERT_EQ(got.params.size(), want.params.size());
    for (size_t i = 0; i < want.params.size(); ++i) {
      EXPECT_TRUE(at::equal(got.params[i], want.params[i]))
          << "param " << i << ": max |diff| " << (got.params[i] - want.params[i]).abs().max().item<double>();
    }
    Mlp init = make_mlp(kZeroSeed, kZeroIn, kZeroHidden, kZeroOut);
    EXPECT_GT((init->parameters()[0] - got.params[0]).abs().max().item<double>(), 1e-3) << "training moved params";
  }
}

namespace {

constexpr int kSteps = 5;

// The params, read as they are (fp32 copies): inside gather_full_params() under "optim_grads_params".
std::vector<torch::Tensor> read_params_of(MlpImpl& model) {
  std::vector<torch::Tensor> out;
  for (auto& p : model.parameters()) out.push_back(p.detach().to(torch::kFloat).clone());
  return out;
}
std::vector<torch::Tensor> read_params(ZeroRank& rank) { return read_params_of(*rank.model); }

void expect_equal_params(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], want[i]))
        << what << ": param " << i << ", max |diff| " << (got[i] - want[i]).abs().max().item<double>();
  }
}

}  // namespace

// Inside gather_full_params() every param reads its whole value: the "optim" run's, under every strategy
// (a no-op but for "optim_grads_params"); an evaluation forward inside it keeps the units whole; after
// it the rank holds its shards alone again, and a read is refused naming gather_full_params().
TEST(ShardedParamsTraining, GatherFullParamsReadsTheOptimRunsParamsUnderEveryStrategyAndReleasesAfter) {
  const std::vector<torch::Tensor> want = train_zero({.world = 2, .steps = kSteps});
  for (const char* strategy : {kShardOptim, kShardOptimGrads, kShardOptimGradsParams}) {
    SCOPED_TRACE(strategy);
    run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
      ZeroRank rank(mesh, {.world = 2, .steps = kSteps, .strategy = strategy}, kZeroSeed + 31 * mesh.rank());
      rank.train(0, kSteps);
      rank.opt->finish_param_sync();
      ShardedParams* sharded = rank.ddp->grad_buffer().param_buffer()->sharded();
      {
        auto whole = rank.ddp->gather_full_params();
        expect_equal_params(read_params(rank), want, "inside the scope");
        {
          auto nested = rank.ddp->gather_full_params();
        }
        c10::NoGradGuard no_grad;
        (void)rank.ddp->forward(torch::ones({2, kZeroIn}));
        expect_equal_params(read_params(rank), want, "after a nested scope and an evaluation forward inside it");
      }
      if (sharded == nullptr) return;
      EXPECT_EQ(sharded->resident_bytes(), sharded->shard_bytes()) << "after the scope: the shards alone";
      try {
        (void)rank.model->fc1->weight.sum();
        ADD_FAILURE() << "a read of a released unit after the scope was not refused";
      } catch (const c10::Error& e) {
        EXPECT_THAT(e.what_without_backtrace(),
                    HasSubstr("read params inside DistributedDataParallel::gather_full_params() (called on every "
                              "rank)"));
      }
    });
  }
}

// The module outlives its wrapper: the wrapper's destruction (on every rank) leaves it with plain whole
// params holding the trained values (the "optim" run's), which a forward of the bare module reads.
TEST(ShardedParamsTraining, AModuleOutlivingItsWrapperKeepsItsWholeTrainedParams) {
  const std::vector<torch::Tensor> want = train_zero({.world = 2, .steps = kSteps});
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, {.world = 2, .steps = kSteps, .strategy = kShardOptimGradsParams},
                  kZeroSeed + 31 * mesh.rank());
    rank.train(0, kSteps);
    rank.opt->finish_param_sync();
    rank.opt.reset();
    rank.ddp.reset();
    expect_equal_params(read_params(rank), want, "after the wrapper's destruction");
    EXPECT_NO_THROW((void)rank.model->forward(torch::ones({2, kZeroIn}))) << "the bare module's forward";
  });
}

// The wrapper destroyed inside a gather_full_params() scope: its destruction leaves the params whole (the
// trained values), and the scope's end, after it, touches nothing of the wrapper (it is gone).
TEST(ShardedParamsTraining, AWrapperDestroyedInsideGatherFullParamsLeavesItsParamsWhole) {
  const std::vector<torch::Tensor> want = train_zero({.world = 2, .steps = kSteps});
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, {.world = 2, .steps = kSteps, .strategy = kShardOptimGradsParams},
                  kZeroSeed + 31 * mesh.rank());
    rank.train(0, kSteps);
    rank.opt->finish_param_sync();
    {
      auto whole = rank.ddp->gather_full_params();
      rank.opt.reset();
      rank.ddp.reset();
    }
    expect_equal_params(read_params(rank), want, "after the wrapper's destruction inside the scope");
  });
}

// A wrapper destroyed while an exception unwinds leaves its units released (no collective then: Note [A module
// outliving its ZeRO-3 wrapper]): wrapping the module again is refused naming a param without bytes, on every
// rank, before any collective (it read no memory: a segfault in the initial broadcast).
TEST(ShardedParamsTraining, WrappingAgainAModuleLeftWithoutBytesIsRefusedNamingTheParam) {
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    Mlp model = make_mlp(kZeroSeed, kZeroIn, kZeroHidden, kZeroOut);
    DdpConfig config;
    config.data_parallel_sharding_strategy = kShardOptimGradsParams;
    try {
      DistributedDataParallel<MlpImpl> ddp(model.ptr(), mesh, "dp", config);
      throw std::runtime_error("the training loop failed");
    } catch (const std::runtime_error&) {
    }
    try {
      DistributedDataParallel<MlpImpl> again(model.ptr(), mesh, "dp", config);
      ADD_FAILURE() << "a module whose params hold no bytes was wrapped";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("parameter 'fc1.weight' holds no bytes"));
    }
  });
}

namespace {

constexpr int kMuonSteps = 8;

// The test MLP trained by Muon (AdamW on the biases) with shard_policy "whole_param" under `strategy`,
// on 2 ranks; checks the ranks end with the same params and returns rank 0's.
std::vector<torch::Tensor> train_muon_with_whole_param_shards(const char* strategy) {
  std::vector<std::vector<torch::Tensor>> per_rank(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    Mlp model = make_mlp(kZeroSeed + 31 * mesh.rank(), kZeroIn, kZeroHidden, kZeroOut);
    DdpConfig config;
    config.data_parallel_sharding_strategy = strategy;
    config.shard_policy = kWholeParamShards;
    config.bucket_bytes = 512;
    DistributedDataParallel<MlpImpl> ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizer opt(ddp.grad_buffer(), zero_optimizer_config({.kind = OptimizerKind::kMuon}));
    EXPECT_EQ(opt.muon_params(), (std::vector<std::string>{"fc1.weight", "fc2.weight", "fc3.weight"}));
    for (int step = 0; step < kMuonSteps; ++step) {
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(kZeroSeed, step, kZeroBatch, kZeroIn, kZeroOut);
      torch::mse_loss(ddp.forward(shard_rows(x, mesh.rank(), 2)), shard_rows(y, mesh.rank(), 2)).backward();
      EXPECT_FALSE(opt.step().skipped);
    }
    opt.finish_param_sync();
    auto whole = ddp.gather_full_params();
    per_rank[mesh.rank()] = read_params_of(*model);
  });
  expect_equal_params(per_rank[1], per_rank[0], "rank 1 vs rank 0");
  return per_rank[0];
}

}  // namespace

// Muon under "optim_grads_params" with shard_policy "whole_param": each rank's shard of a bucket holds
// whole matrices (bin-packed as under "optim"), the units are gathered from those shards, and Muon steps
// the matrices its rank owns with no gather. The params equal the "optim" run's with whole_param bit for
// bit: the same layout within each bucket (a unit boundary closes a bucket no earlier than 512 bytes
// does here: one matrix a bucket), the same shard arithmetic, and dp-2 sums are order-free.
TEST(ShardedParamsTraining, MuonOnWholeParamShardsMatchesTheOptimRunBitForBit) {
  const std::vector<torch::Tensor> want = train_muon_with_whole_param_shards(kShardOptim);
  const std::vector<torch::Tensor> got = train_muon_with_whole_param_shards(kShardOptimGradsParams);
  expect_equal_params(got, want, "Muon, optim_grads_params vs optim");
  Mlp init = make_mlp(kZeroSeed, kZeroIn, kZeroHidden, kZeroOut);
  EXPECT_GT((init->fc2->weight - got[2]).abs().max().item<double>(), 1e-3) << "Muon moved fc2.weight";
}
