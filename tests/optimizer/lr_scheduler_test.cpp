// LrScheduler: the pure schedule against closed-form values (Megatron's formulas), driving
// torch::optim and DistributedOptimizer param groups, state save/restore, and a ZeRO-1 run under a
// schedule against torch::optim::AdamW under the same schedule, step by step.
#include "optimizer/lr_scheduler.h"

#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

using meshddp::test::error_of;

namespace {

LrScheduleConfig warmup_then(LrDecayStyle style) {
  LrScheduleConfig c;
  c.max_lr = 1.0;
  c.min_lr = 0.1;
  c.init_lr = 0.0;
  c.warmup_steps = 10;
  c.decay_steps = 110;  // counted from step 0: 100 steps of decay after the warm-up
  c.decay_style = style;
  return c;
}

}  // namespace

// Closed forms: warm-up n/10; cosine 0.1 + 0.9 (cos(pi r) + 1) / 2 with r = (n - 10) / 100; linear
// 0.1 + 0.9 (1 - r). Exact up to one rounding of each formula: 1e-15.
TEST(LrSchedule, WarmsUpLinearlyThenDecaysByCosineOrLinearToMinLr) {
  for (auto style : {LrDecayStyle::kCosine, LrDecayStyle::kLinear, LrDecayStyle::kConstant}) {
    const auto c = warmup_then(style);
    EXPECT_EQ(lr_at(c, 0), 0.0);
    EXPECT_NEAR(lr_at(c, 5), 0.5, 1e-15);
    EXPECT_NEAR(lr_at(c, 10), 1.0, 1e-15);
  }
  const auto cosine = warmup_then(LrDecayStyle::kCosine);
  EXPECT_NEAR(lr_at(cosine, 35), 0.1 + 0.9 * 0.5 * (std::cos(M_PI * 0.25) + 1), 1e-15);  // 0.86820...
  EXPECT_NEAR(lr_at(cosine, 60), 0.55, 1e-15);
  EXPECT_NEAR(lr_at(cosine, 110), 0.1, 1e-15);
  EXPECT_EQ(lr_at(cosine, 111), 0.1);
  EXPECT_EQ(lr_at(cosine, 100000), 0.1);
  const auto linear = warmup_then(LrDecayStyle::kLinear);
  EXPECT_NEAR(lr_at(linear, 35), 0.775, 1e-15);
  EXPECT_NEAR(lr_at(linear, 60), 0.55, 1e-15);
  EXPECT_NEAR(lr_at(linear, 110), 0.1, 1e-15);
  const auto constant = warmup_then(LrDecayStyle::kConstant);
  EXPECT_EQ(lr_at(constant, 11), 1.0);
  EXPECT_EQ(lr_at(constant, 100000), 1.0);
  LrScheduleConfig no_warmup = cosine;
  no_warmup.warmup_steps = 0;
  no_warmup.decay_steps = 100;
  EXPECT_EQ(lr_at(no_warmup, 0), 1.0);  // no warm-up: the first step uses max_lr
  EXPECT_NEAR(lr_at(no_warmup, 50), 0.55, 1e-15);
}

// Megatron's increments: linear start + (end - start) n / N; cosine start + (end - start)(cos(pi (1 - n/N)) + 1) / 2.
TEST(LrSchedule, WeightDecayIncrementsLinearlyOrByCosine) {
  LrScheduleConfig c;
  c.start_wd = 0.0;
  c.end_wd = 0.1;
  c.wd_incr_steps = 100;
  c.wd_incr_style = WdIncrStyle::kLinear;
  EXPECT_EQ(weight_decay_at(c, 0), 0.0);
  EXPECT_NEAR(weight_decay_at(c, 25), 0.025, 1e-16);
  EXPECT_NEAR(weight_decay_at(c, 100), 0.1, 1e-16);
  EXPECT_EQ(weight_decay_at(c, 101), 0.1);
  c.wd_incr_style = WdIncrStyle::kCosine;
  EXPECT_NEAR(weight_decay_at(c, 25), 0.1 * 0.5 * (std::cos(M_PI * 0.75) + 1), 1e-16);  // 0.014645...
  EXPECT_NEAR(weight_decay_at(c, 50), 0.05, 1e-16);
}

TEST(LrScheduleConfig, RejectsBadValuesNamingTheField) {
  auto bad = [](auto edit) {
    auto c = warmup_then(LrDecayStyle::kCosine);
    edit(c);
    return error_of([&] { LrScheduler s(c); });
  };
  EXPECT_THAT(bad([](auto& c) { c.max_lr = 0; }), HasSubstr("max_lr must be > 0"));
  EXPECT_THAT(bad([](auto& c) { c.min_lr = 2; }), HasSubstr("min_lr must be in [0, max_lr = 1], got 2"));
  EXPECT_THAT(bad([](auto& c) { c.decay_steps = 10; }), HasSubstr("decay_steps (10) must be > warmup_steps (10)"));
  EXPECT_THAT(bad([](auto& c) { c.start_wd = 0.1; }), HasSubstr("set both start_wd and end_wd"));
}

// Each torch::optim group keeps its ratio to the defaults' LR (and weight decay): here 1 and 1/2.
TEST(LrScheduler, DrivesTorchOptimParamGroupsKeepingTheirRatios) {
  auto a = torch::zeros({2}, torch::requires_grad()), b = torch::zeros({2}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a},
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1.0).weight_decay(0.1)));
  groups.emplace_back(std::vector<torch::Tensor>{b},
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.5).weight_decay(0.0)));
  torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(1.0).weight_decay(0.1));
  auto c = warmup_then(LrDecayStyle::kCosine);
  c.start_wd = 0.0;
  c.end_wd = 0.2;
  c.wd_incr_steps = 100;
  c.wd_incr_style = WdIncrStyle::kLinear;
  LrScheduler sched(c);
  sched.attach(opt);
  auto lr = [&](size_t g) { return opt.param_groups()[g].options().get_lr(); };
  auto wd = [&](size_t g) {
    return static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[g].options()).weight_decay();
  };
  EXPECT_EQ(lr(0), 0.0);  // attach applies step 0: the warm-up's init_lr
  sched.step(60);
  EXPECT_NEAR(lr(0), 0.55, 1e-15);
  EXPECT_NEAR(lr(1), 0.275, 1e-15);
  EXPECT_NEAR(wd(0), 0.12, 1e-15);
  EXPECT_EQ(wd(1), 0.0);
}

TEST(LrScheduler, StateRestoresTheStepAndRefusesAnotherSchedule) {
  LrScheduler first(warmup_then(LrDecayStyle::kCosine));
  first.step(37);
  const SchedulerState saved = first.state();
  EXPECT_EQ(saved.at("lr_scheduler.steps"), "37");

  LrScheduler resumed(warmup_then(LrDecayStyle::kCosine));
  resumed.load_state(saved);
  EXPECT_EQ(resumed.steps(), 37);
  EXPECT_EQ(resumed.lr(), first.lr());

  LrScheduler other(warmup_then(LrDecayStyle::kLinear));
  EXPECT_THAT(error_of([&] { other.load_state(saved); }),
              HasSubstr("'lr_scheduler.decay_style' is cosine in the checkpoint but linear in this run"));
  other.load_state(saved, /*use_checkpoint_config=*/true);
  EXPECT_EQ(other.config().decay_style, LrDecayStyle::kCosine);
  EXPECT_EQ(other.lr(), first.lr());
  SchedulerState truncated = saved;
  truncated.erase("lr_scheduler.max_lr");
  EXPECT_THAT(error_of([&] { resumed.load_state(truncated); }), HasSubstr("has no 'lr_scheduler.max_lr'"));
}

// ZeRO-1 on 2 ranks and the single-process torch::optim::AdamW, both driven by the same scheduler
// (warm-up 3 steps, cosine to 1e-3 by step 12, weight decay rising linearly 0.05 -> 0.2 over 10
// steps), compared after every step with the fp32 tolerance of the unscheduled tests (2e-6: only
// the gradient summation order differs). A schedule applied to only one side, a lost group ratio,
// or weight decay applied to the biases moves params by >= 1e-4 within a step or two.
TEST(LrScheduler, ZeroOneUnderAScheduleMatchesTorchAdamWStepByStep) {
  ZeroScenario s{.world = 2, .steps = 14};
  LrScheduleConfig c;
  c.max_lr = zero_optimizer_config(s).lr;
  c.min_lr = 1e-3;
  c.warmup_steps = 3;
  c.decay_steps = 12;
  c.decay_style = LrDecayStyle::kCosine;
  c.start_wd = 0.05;
  c.end_wd = 0.2;
  c.wd_incr_steps = 10;
  c.wd_incr_style = WdIncrStyle::kLinear;
  s.schedule = c;
  std::vector<std::vector<torch::Tensor>> golden;
  train_zero_golden(s, nullptr, &golden);
  ASSERT_EQ(golden.size(), static_cast<size_t>(s.steps));

  std::vector<std::vector<torch::Tensor>> zero(s.steps);
  std::vector<double> lrs;
  run_on_mesh({s.world}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed + 31 * mesh.rank());
    for (int step = 0; step < s.steps; ++step) {
      if (mesh.rank() == 0) lrs.push_back(rank.opt->lr());
      rank.train(step, step + 1);
      auto params = rank.params();
      if (mesh.rank() == 0) zero[step] = params;
    }
  });
  double worst = 0;
  for (int step = 0; step < s.steps; ++step) {
    EXPECT_EQ(lrs[step], lr_at(c, step)) << "step " << step;
    const double diff = max_abs_diff(golden[step], zero[step]);
    worst = std::max(worst, diff);
    EXPECT_LE(diff, 2e-6) << "step " << step << " (lr " << lrs[step] << ")";
  }
  std::cout << "[ max |zero1 - golden| over " << s.steps << " scheduled steps = " << worst << " ]" << std::endl;
  EXPECT_EQ(lrs[0], 0.0);
  EXPECT_EQ(lrs[3], c.max_lr);
}
