// Tensor parallelism on DP x TP meshes: the tiny GPT parallelized by its plan matches the golden
// (one process, whole global batch) in gradients, in params after AdamW, and in losses.
//
// Tolerance: TP changes how sums are split (matmul partial sums over TP, the vocab-parallel softmax,
// sequence shards), DP how gradients are summed: a few fp32 ulps per op. The sharp check is the
// step-0 gradient of every local shard against the golden's slice: measured max |diff| <= 3.7e-8,
// asserted within 1e-5 + 1e-4 relative; a wrong group, a missed or doubled TP sum is off by >= 1e-3.
// Params after 6 AdamW steps: Adam divides by sqrt(v), so elements with gradients near 1e-6 turn
// those ulp differences into larger update differences; measured max 1.4e-5 (1x4), asserted 5e-5.
// Losses (mean over the global batch): measured 4.8e-7, asserted 1e-5.
#include "examples/02_dp_x_tp_gpt/gpt_plan.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/gpt_training.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

constexpr double kParamTol = 5e-5;

void expect_matches_golden(const GptScenario& s) {
  const GptRun golden = train_gpt_golden(s);
  const auto runs = train_gpt_on_mesh(s);
  double max_param = 0, max_grad = 0, max_loss = 0;
  for (size_t rank = 0; rank < runs.size(); ++rank) {
    const GptRun& run = runs[rank];
    int64_t owned_grad_elements = 0;
    ASSERT_EQ(run.params.size(), golden.params.size());
    for (size_t i = 0; i < golden.params.size(); ++i) {
      auto expected = local_part(golden.params[i], run.placements[i]);
      ASSERT_EQ(expected.sizes(), run.params[i].sizes()) << "rank " << rank << " param " << i;
      const double d = (expected - run.params[i]).abs().max().item<double>();
      max_param = std::max(max_param, d);
      EXPECT_LE(d, kParamTol) << "rank " << rank << " param " << i << " (" << run.placements[i].str() << ")";
      ASSERT_EQ(run.first_grads.size(), golden.first_grads.size()) << "rank " << rank;
      // ZeRO-1: only the elements this DP rank owns are synced; the others are NaN (see synced_grads).
      auto g = local_part(golden.first_grads[i], run.placements[i]);
      const auto owned = run.first_grads[i].isnan().logical_not();
      owned_grad_elements += owned.sum().item<int64_t>();
      const auto got = torch::where(owned, run.first_grads[i], g);
      max_grad = std::max(max_grad, (g - got).abs().max().item<double>());
      EXPECT_TRUE(torch::allclose(got, g, 1e-4, 1e-5))
          << "rank " << rank << " grad " << i << " (" << run.placements[i].str() << ") max |diff| "
          << (g - got).abs().max().item<double>();
    }
    EXPECT_GT(owned_grad_elements, 0) << "rank " << rank << " checked no gradient element";
    // The tp::Linear layers (every style, the tied LM head) wrote their weight gradients into the
    // buffer (and their biases, but for row-parallel ones, which are added after the TP reduction).
    ASSERT_GT(run.linear_weights, 0);
    for (int64_t written : run.grads_written_in_place) EXPECT_GE(written, run.linear_weights) << "rank " << rank;
    for (int step = 0; step < s.steps; ++step) {
      max_loss = std::max(max_loss, std::abs(run.losses[step] - golden.losses[step]));
      EXPECT_NEAR(run.losses[step], golden.losses[step], 1e-5) << "rank " << rank << " step " << step;
    }
  }
  std::cout << "[ " << s.dp << "x" << s.tp << (s.sequence_parallel ? " SP" : "")
            << (s.distributed_optimizer ? " ZeRO-1" : "") << ": max |param diff| " << max_param << ", |grad diff| "
            << max_grad << ", |loss diff| " << max_loss << " ]" << std::endl;
}

}  // namespace

TEST(TensorParallel, GptOnTwoByTwoMatchesGolden) { expect_matches_golden({.dp = 2, .tp = 2}); }

TEST(TensorParallel, GptOnOneByFourMatchesGolden) { expect_matches_golden({.dp = 1, .tp = 4}); }

TEST(TensorParallel, GptOnFourByOneMatchesGolden) { expect_matches_golden({.dp = 4, .tp = 1}); }

TEST(TensorParallel, GptWithSequenceParallelOnTwoByTwoMatchesGolden) {
  expect_matches_golden({.dp = 2, .tp = 2, .sequence_parallel = true});
}

// TP-partial gradients (sequence-parallel norms and row-parallel biases) accumulate over 4
// micro-batches and are summed over TP once, in the step's sync: a per-micro-batch sum would
// multiply earlier micro-batches by TP.
TEST(TensorParallel, SequenceParallelWithFourMicroBatchesSumsPartialGradsOncePerStep) {
  expect_matches_golden({.dp = 2, .tp = 2, .sequence_parallel = true, .micro_batches = 4});
}

// Clipping by the global norm across DP shards and TP shards, each element counted once (a
// replicated param is not counted TP times).
TEST(TensorParallel, DistributedOptimizerWithClippingOnTwoByTwoMatchesGolden) {
  GptScenario s{.dp = 2, .tp = 2, .sequence_parallel = true, .distributed_optimizer = true, .clip = 1.0};
  const GptRun golden = train_gpt_golden(s);
  const auto runs = train_gpt_on_mesh(s);
  for (int step = 0; step < s.steps; ++step) {
    EXPECT_NEAR(runs[0].grad_norms[step], golden.grad_norms[step], 1e-5 * golden.grad_norms[step]) << "step " << step;
    EXPECT_EQ(runs[3].grad_norms[step], runs[0].grad_norms[step]);
  }
  int clipped = 0;
  for (double n : golden.grad_norms) clipped += n > s.clip;
  EXPECT_GT(clipped, 0) << "make the test clip on some steps";
  expect_matches_golden(s);
}

// Plain DDP with meshddp::clip_grad_norm_ (common/grad_norm.h) on 2x2 against torch's clip_grad_norm_ on
// the whole model in one process: TP shards' squares summed over TP, replicated and TP-partial params
// (sequence-parallel norms) counted once, the tied LM head once. Norms: the TP/DP summation order
// moves the params by a few 1e-6 over the steps (see kParamTol), and the norms with them: measured
// relative diff <= 7.4e-7 (step 0: 1.9e-8), asserted 5e-6; replicated params counted TP times make it
// 0.10 at step 0.
TEST(TensorParallel, ClipGradNormWithPlainDdpOnTwoByTwoMatchesTorchOnTheWholeModel) {
  for (const GptScenario& s : {GptScenario{.dp = 2, .tp = 2, .sequence_parallel = true, .clip = 1.0},
                               GptScenario{.dp = 2, .tp = 2, .clip = 1.0, .model = {.lm_head_module = true}}}) {
    const GptRun golden = train_gpt_golden(s);
    const auto runs = train_gpt_on_mesh(s);
    double max_rel = 0;
    for (int step = 0; step < s.steps; ++step) {
      for (const GptRun& run : runs) {
        ASSERT_EQ(run.grad_norms.size(), golden.grad_norms.size());
        EXPECT_EQ(run.grad_norms[step], runs[0].grad_norms[step]) << "every rank gets the same norm";
      }
      const double rel = std::abs(runs[0].grad_norms[step] - golden.grad_norms[step]) / golden.grad_norms[step];
      max_rel = std::max(max_rel, rel);
      EXPECT_LE(rel, 5e-6) << "step " << step << ": " << runs[0].grad_norms[step] << " vs torch "
                           << golden.grad_norms[step];
    }
    int clipped = 0;
    for (double n : golden.grad_norms) clipped += n > s.clip;
    EXPECT_GT(clipped, 0) << "make the test clip on some steps";
    EXPECT_LT(clipped, s.steps) << "make the test leave some steps unclipped";
    std::cout << "[ clipped " << clipped << "/" << s.steps << " steps; relative norm diff at step 0 "
              << std::abs(runs[0].grad_norms[0] - golden.grad_norms[0]) / golden.grad_norms[0] << ", max " << max_rel
              << " ]" << std::endl;
    expect_matches_golden(s);
  }
}

// Tied weights: the LM head is a module of its own whose weight is the token embedding's tensor,
// registered twice ("wte.weight", "lm_head.weight"). One tensor must be one parameter: one slot,
// one reduction, one master and one norm term. Doubled, its gradient and update would be off by 2x.
TEST(TensorParallel, TiedLmHeadRegisteredTwiceIsOneParamWithPlainDdp) {
  expect_matches_golden({.dp = 2, .tp = 1, .model = {.lm_head_module = true}});
}

TEST(TensorParallel, TiedLmHeadRegisteredTwiceIsOneParamWithZeroOneAndClipping) {
  GptScenario s{.dp = 2, .tp = 1, .distributed_optimizer = true, .clip = 1.0, .model = {.lm_head_module = true}};
  const GptRun golden = train_gpt_golden(s);
  const auto runs = train_gpt_on_mesh(s);
  for (int step = 0; step < s.steps; ++step) {
    EXPECT_NEAR(runs[0].grad_norms[step], golden.grad_norms[step], 1e-5 * golden.grad_norms[step]) << "step " << step;
  }
  expect_matches_golden(s);
}

TEST(TensorParallel, TiedLmHeadRegisteredTwiceIsOneParamOnTwoByTwo) {
  expect_matches_golden({.dp = 2, .tp = 2, .model = {.lm_head_module = true}});
  expect_matches_golden(
      {.dp = 2, .tp = 2, .sequence_parallel = true, .distributed_optimizer = true, .model = {.lm_head_module = true}});
}

// The TP dim need not be called "tp": with dims ("data", "model"), partial gradients are summed
// over "model", the clipping norm counts replicated params once, and ZeRO-1 matches the golden.
TEST(TensorParallel, AnyDimNamesWorkForDpAndTp) {
  GptScenario s{.dp = 2,
                .tp = 2,
                .sequence_parallel = true,
                .distributed_optimizer = true,
                .clip = 1.0,
                .dims = {"data", "model"}};
  const GptRun golden = train_gpt_golden(s);
  const auto runs = train_gpt_on_mesh(s);
  for (int step = 0; step < s.steps; ++step) {
    EXPECT_NEAR(runs[0].grad_norms[step], golden.grad_norms[step], 1e-5 * golden.grad_norms[step]) << "step " << step;
  }
  expect_matches_golden(s);
  expect_matches_golden({.dp = 2, .tp = 2, .sequence_parallel = true, .dims = {"data", "model"}});
}

// A model parallelized over TP cannot be synced by a DDP built from a DP process group alone: it
// has no TP group to sum partial gradients over, so it refuses, naming the param.
TEST(TensorParallel, DdpFromADpGroupRefusesTpPartialParams) {
  run_on_mesh({2, 2}, {"data", "model"}, [](DeviceMesh& mesh) {
    gpt::Config c;
    gpt::Gpt model(c);
    parallelize(*model, mesh, gpt::tp_plan(c), {.sequence_parallel = true, .tp_dim = "model"});
    std::string msg = "(no error)";
    try {
      DistributedDataParallel ddp(model.ptr(), mesh["data"]);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    EXPECT_THAT(
        msg, HasSubstr("GradBuffer: parameter 'ln_f.weight' has a gradient that is partial over TP (PartialGrad over "
                       "group 'meshddp/model/ranks="));
    EXPECT_THAT(msg, HasSubstr("build DistributedDataParallel from the DeviceMesh the model was parallelized over"));
  });
}

// A 2x2 ZeRO-1 checkpoint (per-TP-rank files recording each shard's placement) reloaded at 2x2
// continues bit-exactly, and at 1x2 (DP resharded, TP kept) within the DP-reordering tolerance.
TEST(TensorParallel, CheckpointOnTwoByTwoReloadsAtTwoByTwoAndOneByTwo) {
  const std::string dir = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/meshddp-tp-ckpt-" +
                          std::to_string(::getpid());
  std::system(("rm -rf '" + dir + "'").c_str());
  GptScenario s{.dp = 2, .tp = 2, .sequence_parallel = true, .distributed_optimizer = true, .steps = 6};
  GptScenario save = s;
  save.save_dir = dir;
  save.save_before_step = 3;
  const auto uninterrupted = train_gpt_on_mesh(save);
  GptScenario same = s;
  same.load_dir = dir;
  same.first_step = 3;
  const auto resumed = train_gpt_on_mesh(same);
  for (size_t r = 0; r < resumed.size(); ++r) {
    for (size_t i = 0; i < resumed[r].params.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed[r].params[i], uninterrupted[r].params[i])) << "rank " << r << " param " << i;
    }
  }
  GptScenario resharded = same;
  resharded.dp = 1;
  const auto one_by_two = train_gpt_on_mesh(resharded);
  double max_diff = 0;
  for (size_t t = 0; t < 2; ++t) {  // global rank t of the 1x2 mesh = TP rank t = global rank t of 2x2
    for (size_t i = 0; i < one_by_two[t].params.size(); ++i) {
      max_diff = std::max(max_diff, (one_by_two[t].params[i] - uninterrupted[t].params[i]).abs().max().item<double>());
    }
  }
  std::cout << "[ 2x2 -> 1x2: max |diff| " << max_diff << " ]" << std::endl;
  EXPECT_LE(max_diff, kParamTol);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(TensorParallel, PlanErrorsNameTheModuleStyleAndSizes) {
  run_on_mesh({1, 4}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    gpt::Config six_heads{.dim = 48, .heads = 6};  // 6 heads of 8 do not split over TP 4
    gpt::Gpt a(six_heads);
    EXPECT_THAT(error_of([&] { parallelize(*a, mesh, gpt::tp_plan(six_heads)); }),
                HasSubstr("'blocks.0.attn.q' (ColwiseParallel) has 6 heads, not divisible by the TP size 4"));
    gpt::Config odd_vocab{.vocab = 66};
    gpt::Gpt b(odd_vocab);
    EXPECT_THAT(error_of([&] { parallelize(*b, mesh, gpt::tp_plan(odd_vocab)); }),
                HasSubstr("'wte' (VocabParallel) has 66 vocabulary entries, not divisible by the TP size 4"));
    gpt::Config c;
    gpt::Gpt d(c);
    EXPECT_THAT(error_of([&] { parallelize(*d, mesh, {{"blocks.*.attn.qq", RowwiseParallel{}}}); }),
                HasSubstr("plan entry 'blocks.*.attn.qq' (RowwiseParallel) matches no module"));
    EXPECT_THAT(
        error_of([&] { parallelize(*d, mesh, {{"ln_f", ColwiseParallel{}}}); }),
        HasSubstr("'ln_f' is a meshddp::tp::LayerNormImpl, but ColwiseParallel applies to a meshddp::tp::Linear"));
    auto no_norms = gpt::tp_plan(c);
    no_norms.pop_back();  // drop ln_f
    EXPECT_THAT(
        error_of([&] { parallelize(*d, mesh, no_norms, {.sequence_parallel = true}); }),
        HasSubstr(
            "under sequence parallelism every LayerNorm runs on a sequence shard, so 'ln_f' must be in the plan"));
  });
}
