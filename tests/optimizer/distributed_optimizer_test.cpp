// DistributedOptimizer (ZeRO-1) against the golden: the same model and optimizer unsharded, in one
// process, on the whole global batch. Ranks are threads with Gloo groups.
//
// Tolerances. fp32: the shard update is the same elementwise arithmetic as torch::optim's, so the
// only difference is the gradient's summation order (per-rank partial sums, then the DP sum): a few
// fp32 ulps per step. Measured max |diff| after 20 steps is printed by each test (<= ~2e-7); we
// allow 2e-6, still far below what a wrong shard, a missed clip or a stale param gives (>= 1e-4).
// bf16 params with fp32 master weights: the golden's gradients are bf16 GEMM results over the whole
// batch, the distributed ones fp32 sums of per-rank bf16 results: they differ by ~2^-8 relative each
// step, and a bf16 copy of a master may then round one ulp (<= 2^-7 |w|) the other way. Beyond that
// ulp: with SGD the difference stays ~lr x the gradient difference: measured 6.8e-5 after 20 steps
// (4 ranks), allowed 2e-4 (3x), while a lost 1/DP moves params by ~1e-2. With AdamW, whose update
// is ~lr whatever the gradient's size, a rounding flip of a near-zero gradient can move an element
// by up to lr (1e-2) the other way: measured 6.9e-3 (2 ranks, clipping), allowed 1e-2 (one step's
// update). So SGD is the sharp bf16 check; the fp32 tests are the sharp check of the arithmetic.
#include "grad_buffer/bucket_layout.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_gather.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

constexpr double kFp32Tol = 2e-6;
constexpr double kBf16AdamExcess = 1e-2;  // beyond one bf16 ulp; see the header
constexpr double kBf16SgdExcess = 2e-4;

void expect_matches_golden(const ZeroScenario& s) {
  auto golden = train_zero_golden(s);
  auto zero = train_zero(s);
  const double diff = max_abs_diff(golden, zero);
  std::cout << "[ max |zero1 - golden| = " << diff << " ]" << std::endl;
  if (s.bf16) {
    // The part of each difference beyond a bf16 rounding flip (2^-7 |w|: one ulp at most).
    double max_excess = 0;
    for (size_t i = 0; i < golden.size(); ++i) {
      const double excess = ((zero[i] - golden[i]).abs() - std::ldexp(1.0, -7) * golden[i].abs()).max().item<double>();
      max_excess = std::max(max_excess, excess);
      EXPECT_LE(excess, s.kind == OptimizerKind::kSgd ? kBf16SgdExcess : kBf16AdamExcess) << "param " << i;
    }
    std::cout << "[ bf16: max |zero1 - golden| beyond 2^-7 |w| = " << max_excess << " ]" << std::endl;
  } else {
    EXPECT_LE(diff, kFp32Tol);
  }
  Mlp init = make_mlp(kZeroSeed, kZeroIn, s.hidden, kZeroOut);
  EXPECT_GT((init->parameters()[0] - golden[0]).abs().max().item<double>(), 1e-2) << "training must move params";
}

}  // namespace

TEST(DistributedOptimizer, AdamWMatchesGoldenOnTwoRanks) { expect_matches_golden({.world = 2}); }

TEST(DistributedOptimizer, AdamWMatchesGoldenOnFourRanks) { expect_matches_golden({.world = 4}); }

TEST(DistributedOptimizer, SgdWithMomentumMatchesGoldenOnTwoAndFourRanks) {
  expect_matches_golden({.world = 2, .kind = OptimizerKind::kSgd});
  expect_matches_golden({.world = 4, .kind = OptimizerKind::kSgd});
}

TEST(DistributedOptimizer, MatchesGoldenWithOverlappedParamGather) {
  expect_matches_golden({.world = 4, .overlap_param_gather = true});
  expect_matches_golden({.world = 2, .kind = OptimizerKind::kSgd, .overlap_param_gather = true});
}

// Each variant also runs with SGD: AdamW's update hardly changes when every gradient is scaled, so
// a lost or doubled 1/DP (or micro-batch scale) would pass with AdamW alone.
TEST(DistributedOptimizer, MatchesGoldenWithFourAccumulatedMicroBatches) {
  expect_matches_golden({.world = 4, .micro_batches = 4});
  expect_matches_golden({.world = 2, .micro_batches = 4, .overlap_param_gather = true});
  expect_matches_golden({.world = 4, .micro_batches = 4, .kind = OptimizerKind::kSgd});
  expect_matches_golden({.world = 2, .micro_batches = 4, .kind = OptimizerKind::kSgd, .overlap_param_gather = true});
}

TEST(DistributedOptimizer, MatchesGoldenWithOneBucketPerParamAndWithOneBucket) {
  expect_matches_golden({.world = 4, .bucket_bytes = 0});
  expect_matches_golden({.world = 4, .bucket_bytes = size_t{1} << 30});
  expect_matches_golden({.world = 4, .kind = OptimizerKind::kSgd, .bucket_bytes = 0});
  expect_matches_golden({.world = 4, .kind = OptimizerKind::kSgd, .bucket_bytes = size_t{1} << 30});
}

TEST(DistributedOptimizer, ClipsByTheGlobalNormLikeClipGradNorm) {
  // max_norm chosen between the run's smallest and largest gradient norms: clipping is active on
  // some steps only.
  ZeroScenario s{.world = 4, .clip = 0.35};
  std::vector<double> golden_norms;
  auto golden = train_zero_golden(s, &golden_norms);
  std::vector<std::vector<StepResult>> results;
  auto zero = train_zero(s, &results);
  int clipped = 0;
  for (int step = 0; step < s.steps; ++step) {
    EXPECT_NEAR(results[0][step].grad_norm, golden_norms[step], 1e-5 * golden_norms[step]) << "step " << step;
    EXPECT_EQ(results[0][step].clipped, golden_norms[step] > s.clip) << "step " << step;
    clipped += results[0][step].clipped;
    EXPECT_EQ(results[3][step].grad_norm, results[0][step].grad_norm) << "every rank reports the same norm";
  }
  EXPECT_GT(clipped, 0);
  EXPECT_LT(clipped, s.steps);
  const double diff = max_abs_diff(golden, zero);
  std::cout << "[ clipped " << clipped << "/" << s.steps << " steps; max |zero1 - golden| = " << diff << " ]"
            << std::endl;
  EXPECT_LE(diff, kFp32Tol);
}

TEST(DistributedOptimizer, Bf16ParamsWithFp32MasterWeightsMatchGolden) {
  expect_matches_golden({.world = 4, .bf16 = true});
  expect_matches_golden({.world = 2, .overlap_param_gather = true, .clip = 0.35, .bf16 = true});
  expect_matches_golden({.world = 4, .kind = OptimizerKind::kSgd, .bf16 = true});
  expect_matches_golden(
      {.world = 2, .kind = OptimizerKind::kSgd, .overlap_param_gather = true, .clip = 0.35, .bf16 = true});
}

// The fused kernels (FusedStep::kAlways: the CUDA default, forced on CPU here) inside step(): the
// same goldens and tolerances as the foreach path (their master differs from it by <= 2 ulps of an
// update per step, far inside kFp32Tol), with clipping, groups, bf16 params and both optimizers.
TEST(DistributedOptimizer, FusedStepKernelsMatchGolden) {
  expect_matches_golden({.world = 4, .clip = 0.35, .fused_step = FusedStep::kAlways});
  expect_matches_golden(
      {.world = 2, .kind = OptimizerKind::kSgd, .overlap_param_gather = true, .fused_step = FusedStep::kAlways});
  expect_matches_golden({.world = 2, .clip = 0.35, .bf16 = true, .fused_step = FusedStep::kAlways});
  expect_matches_golden({.world = 4, .kind = OptimizerKind::kSgd, .bf16 = true, .fused_step = FusedStep::kAlways});
}

TEST(DistributedOptimizer, FusedStepReportsTheSameNormAndSkipsLikeTheForeachPath) {
  ZeroScenario s{.world = 4, .clip = 0.35};
  std::vector<std::vector<StepResult>> foreach_results, fused_results;
  train_zero(s, &foreach_results);
  s.fused_step = FusedStep::kAlways;
  train_zero(s, &fused_results);
  int clipped = 0;
  for (int step = 0; step < s.steps; ++step) {
    // fp64 sums in another order than linalg_vector_norm's fp32 one: relative 1e-6 (measured ~1e-7).
    EXPECT_NEAR(fused_results[0][step].grad_norm, foreach_results[0][step].grad_norm,
                1e-6 * foreach_results[0][step].grad_norm)
        << "step " << step;
    EXPECT_EQ(fused_results[0][step].clipped, foreach_results[0][step].clipped) << "step " << step;
    clipped += fused_results[0][step].clipped;
  }
  EXPECT_GT(clipped, 0);
}

TEST(DistributedOptimizer, NanOnOneRankSkipsTheStepEverywhereAndNamesParamAndRank) {
  for (FusedStep fused : {FusedStep::kNever, FusedStep::kAlways}) {
    SCOPED_TRACE(fused == FusedStep::kAlways ? "fused step kernels" : "foreach path");
    run_on_mesh({2}, {"dp"}, [fused](DeviceMesh& mesh) {
      ZeroScenario s{.world = 2, .fused_step = fused};
      ZeroRank rank(mesh, s, kZeroSeed);
      rank.train(0, 3);
      auto before = rank.params();
      // Step 3: on DP rank 1 a gradient hook poisons one element of fc2.weight's gradient, as a bad
      // kernel would: it reaches the buffer before the bucket's reduce-scatter.
      if (mesh.rank() == 1) {
        rank.model->fc2->weight.register_hook([](torch::Tensor g) {
          g = g.clone();
          g[3][4] = std::numeric_limits<float>::quiet_NaN();
          return g;
        });
      }
      rank.ddp->zero_grad_buffer();
      auto x = torch::randn({16, kZeroIn});
      rank.ddp->forward(x).sum().backward();
      StepResult r = rank.opt->step();
      EXPECT_TRUE(r.skipped);
      EXPECT_THAT(r.report, HasSubstr("DP rank 1 produced 1 non-finite value(s) in its local gradient of parameter "
                                      "'fc2.weight'"));
      EXPECT_THAT(r.report, Not(HasSubstr("'fc1.weight'")));  // clean params are not named
      EXPECT_THAT(r.report, HasSubstr("parameter 'fc2.weight' has a non-finite reduced gradient"));
      EXPECT_EQ(rank.opt->steps_taken(), 3);
      auto after = rank.params();
      for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "param " << i;
      std::cout << r.report;
    });
  }
}

// After training with overlapped gathers, rank 0 overwrites every part of its param buffer that it
// does not own with garbage, launches the all-gathers and runs a forward at once; rank 1 joins the
// gathers only 300 ms later. So the gathers are in flight when rank 0's forward starts, and the
// forward is exact only if each op waits for its bucket instead of reading what is in the buffer.
TEST(DistributedOptimizer, ParamAllGatherOverlapsTheNextForwardAndItsResultIsExact) {
  ZeroScenario s{.world = 2, .steps = 4, .overlap_param_gather = true, .bucket_bytes = 2048, .hidden = 64};
  Mlp golden_model = trained_zero_golden_model(s);
  auto probe = torch::randn({8, kZeroIn});
  auto expected = golden_model->forward(probe).detach();
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    rank.train(0, s.steps);
    rank.opt->finish_param_sync();
    ParamGather* gather = start_gathers_over_a_poisoned_param_buffer(rank);
    auto out = rank.ddp->forward(probe).detach();
    if (mesh.rank() == 0) {
      EXPECT_GT(gather->pending_at_last_forward_start(), 0) << "gathers were in flight when forward began";
      EXPECT_GT(gather->waited_in_last_forward(), 0) << "forward waited for buckets";
    }
    EXPECT_EQ(gather->pending(), 0) << "forward touched every bucket";
    const double diff = (out - expected).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5) << "rank " << mesh.rank() << ": forward on gathered params must equal the golden forward";
  });
}

TEST(DistributedOptimizer, ReportsShardedMemoryPerComponent) {
  for (int dp : {1, 2, 4}) {
    for (bool bf16 : {false, true}) {
      run_on_mesh({dp}, {"dp"}, [&](DeviceMesh& mesh) {
        ZeroScenario s{.world = dp, .bf16 = bf16, .bucket_bytes = size_t{1} << 20, .hidden = 128};
        ZeroRank rank(mesh, s, kZeroSeed);
        int64_t n = 0;
        for (const auto& p : rank.model->parameters()) n += p.numel();
        const MemoryReport m = rank.opt->memory();
        const int64_t pad = 2 * dp * kAlignmentElems * 4;  // < one bucket's end padding + per-param alignment slack
        EXPECT_NEAR(m.optimizer_state_bytes, 8 * n / dp, 8 * pad / dp + 8 * 6 * kAlignmentElems) << "dp " << dp;
        EXPECT_EQ(m.master_weight_bytes, bf16 ? m.optimizer_state_bytes / 2 : 0);
        EXPECT_GE(m.grad_buffer_bytes, 4 * n);
        EXPECT_GE(m.param_buffer_bytes, (bf16 ? 2 : 4) * n);
        if (mesh.rank() == 0) {
          std::cout << "[ dp " << dp << (bf16 ? " bf16" : " fp32") << ": " << n << " params; param buffer "
                    << m.param_buffer_bytes << " B, grad buffer " << m.grad_buffer_bytes << " B, master "
                    << m.master_weight_bytes << " B, state " << m.optimizer_state_bytes << " B per rank ]" << std::endl;
        }
      });
    }
  }
}

TEST(DistributedOptimizerConfig, RejectsBadValuesNamingTheField) {
  DistributedOptimizerConfig c;
  c.beta2 = 1.0;
  try {
    c.validate();
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("beta2 must be in [0, 1), got 1"));
  }
  c = {};
  c.groups = {{"*.bias", -1.0, std::nullopt}};
  EXPECT_THROW(c.validate(), c10::Error);
}

// Ranks whose optimizer settings differ would update the same replica differently (or, for
// overlap_param_gather, pair different collectives): construction compares every field of
// kOptimizerConfigFields over the mesh and names the first that differs with each rank's value.
TEST(DistributedOptimizer, RejectsSettingsThatDifferAcrossRanksNamingTheSettingAndEachRanksValue) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizerConfig oc;
    oc.lr = mesh.rank() == 0 ? 0.1 : 0.2;
    EXPECT_THAT(error_of([&] { DistributedOptimizer opt(ddp.grad_buffer(), oc); }),
                HasSubstr("DistributedOptimizer: the DistributedOptimizerConfig settings differ across the ranks of "));
    EXPECT_THAT(error_of([&] { DistributedOptimizer opt(ddp.grad_buffer(), oc); }),
                HasSubstr("'lr' is rank 0: 0.1, rank 1: 0.2"));
    oc.lr = 0.1;
    oc.groups = {{"*.bias", std::nullopt, mesh.rank() == 0 ? 0.0 : 0.5}};
    EXPECT_THAT(error_of([&] { DistributedOptimizer opt(ddp.grad_buffer(), oc); }),
                HasSubstr("'groups' is rank 0: [*.bias: lr=default weight_decay=0], rank 1: [*.bias: lr=default "
                          "weight_decay=0.5]"));
  });
}

TEST(DistributedOptimizer, RefusesAGradBufferWithoutDistributedOptimizerMode) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DistributedDataParallel ddp(model.ptr(), mesh);
    try {
      DistributedOptimizer opt(ddp.grad_buffer(), {});
      ADD_FAILURE();
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("built without use_distributed_optimizer"));
    }
  });
}

// Loading weights into a wrapped model: bf16 params have fp32 masters that the next step writes
// back into the params. DDP's load_state_dict makes the optimizer refresh them, so the loaded
// weights survive a step that changes nothing (zero gradient, plain SGD); stale masters would put
// the trained weights back.
TEST(DistributedOptimizer, LoadStateDictWithBf16ParamsRefreshesTheMasterWeights) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kZeroSeed, kZeroIn, kZeroHidden, kZeroOut);
    model->to(torch::kBFloat16);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    config.grad_reduce_in_fp32 = true;
    config.bucket_bytes = 512;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizerConfig sgd;
    sgd.kind = OptimizerKind::kSgd;
    sgd.lr = 0.1;
    DistributedOptimizer opt(ddp.grad_buffer(), sgd);
    for (int step = 0; step < 2; ++step) {  // the masters move away from the initial weights
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(kZeroSeed, step, 8, kZeroIn, kZeroOut);
      torch::mse_loss(ddp.forward(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
      opt.step();
    }
    opt.finish_param_sync();
    Mlp loaded = make_mlp(kZeroSeed + 1, kZeroIn, kZeroHidden, kZeroOut);
    loaded->to(torch::kBFloat16);
    ddp.load_state_dict(loaded->named_parameters());
    ddp.zero_grad_buffer();
    opt.step();  // zero gradient, plain SGD: params = bf16(master), which must be the loaded weights
    opt.finish_param_sync();
    for (const auto& item : loaded->named_parameters()) {
      EXPECT_TRUE(torch::equal(model->named_parameters()[item.key()], item.value())) << item.key();
    }
  });
}

TEST(DistributedOptimizer, AGroupRuleThatMatchesNoParamIsAnErrorNamingIt) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizerConfig oc;
    oc.groups = {{"*.bias", std::nullopt, 0.0}, {"*.baises", std::nullopt, 0.0}};
    try {
      DistributedOptimizer opt(ddp.grad_buffer(), oc);
      ADD_FAILURE() << "a rule matching nothing was accepted";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("group rule #1 with pattern '*.baises' matches no trainable parameter"));
    }
  });
}

// A model whose params are all frozen has nothing to shard: the optimizer steps as a no-op.
TEST(DistributedOptimizer, StepsAModelWithNoTrainableParams) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(1, 4, 8, 2);
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    DistributedOptimizer opt(ddp.grad_buffer(), {});
    const auto before = model->parameters()[0].clone();
    ddp.zero_grad_buffer();
    (void)ddp.forward(torch::ones({2, 4}));
    StepResult result = opt.step();
    EXPECT_FALSE(result.skipped);
    EXPECT_EQ(result.grad_norm, 0.0);
    EXPECT_TRUE(torch::equal(model->parameters()[0], before));
  });
}
