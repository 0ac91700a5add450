// Checkpoints across data-parallel sharding strategies (docs/guide/sharding.md): the tiny GPT saved under
// each of no_shard / optim / optim_grads, at dp 2 and at dp 4, loads under each strategy at the other DP
// size and at its own. A checkpoint is the same bytes whatever the strategy: loaded and saved again at
// once, every tensor (params and AdamW state) and the optimizer's step come back bit for bit; trained on,
// the run continues the uninterrupted run's loss curve and ends at its params.
#include "checkpoint/whole_checkpoint.h"
#include "tests/support/gpt_training.h"
#include "tests/support/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int kSteps = 6, kSaveStep = 3;
const std::vector<std::string> kStrategies = {"no_shard", "optim", "optim_grads"};

GptScenario scenario(int64_t dp, const std::string& strategy) {
  GptScenario s{.dp = dp, .tp = 1, .steps = kSteps};
  s.sharding_strategy = strategy;
  return s;
}

void expect_same_checkpoint(const WholeCheckpoint& want, const WholeCheckpoint& got, const std::string& what) {
  ASSERT_TRUE(want.meta.optimizer.has_value() && got.meta.optimizer.has_value()) << what;
  EXPECT_EQ(got.meta.optimizer->kind, want.meta.optimizer->kind) << what;
  EXPECT_EQ(got.meta.optimizer->step, want.meta.optimizer->step) << what;
  ASSERT_EQ(got.tensors.size(), want.tensors.size()) << what;
  for (size_t i = 0; i < want.tensors.size(); ++i) {
    const auto& [key, tensor] = want.tensors[i];
    ASSERT_EQ(got.tensors[i].first, key) << what;
    EXPECT_TRUE(torch::equal(got.tensors[i].second, tensor))
        << what << ": '" << key << "' differs, max abs " << (got.tensors[i].second - tensor).abs().max().item<double>();
  }
}

double worst_param_difference(const GptRun& want, const GptRun& got) {
  double worst = 0;
  for (size_t i = 0; i < want.params.size(); ++i) {
    worst = std::max(worst, (got.params[i] - want.params[i]).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

// Tolerances. The loaded-and-saved-again checkpoint: bit for bit (it is data movement only). Continuing
// at the saving run's DP size: bit for bit under every pair of strategies (optim and optim_grads
// reduce-scatter the same buckets, the shard is 0 + the reduced bucket without accumulation, and at dp 2
// no_shard's all-reduce adds the same two numbers; torch's AdamW and meshddp's step alike here). At
// another DP size steps 3..5 take the DP mean over 4 ranks instead of 2 (another fp32 order): losses
// within 5e-7 relative and final params within 1e-6 absolute (measured 5.8e-8 and 1.2e-7: printed).
TEST(ShardingCheckpoint, SavedUnderEachStrategyLoadsUnderEveryOtherAtDpTwoAndFourAndContinuesTheRun) {
  for (int64_t save_dp : {2, 4}) {
    for (const std::string& saved_under : kStrategies) {
      const std::string dir = fresh_dir("sharding-ckpt-" + saved_under + "-dp" + std::to_string(save_dp));
      GptScenario save = scenario(save_dp, saved_under);
      save.save_dir = dir;
      save.save_before_step = kSaveStep;
      const GptRun uninterrupted = train_gpt_on_mesh(save)[0];
      const WholeCheckpoint saved = read_whole_checkpoint(dir, kSaveStep, /*with_optimizer=*/true);
      for (int64_t load_dp : {int64_t{2}, int64_t{4}}) {
        if (save_dp == 4 && load_dp == 4) continue;  // dp 4 -> dp 4 adds nothing to dp 2 -> dp 2
        for (const std::string& loaded_under : kStrategies) {
          const std::string what = saved_under + " at dp " + std::to_string(save_dp) + " -> " + loaded_under +
                                   " at dp " + std::to_string(load_dp);
          const std::string again = fresh_dir("sharding-ckpt-again");
          GptScenario resume = scenario(load_dp, loaded_under);
          resume.load_dir = dir;
          resume.first_step = kSaveStep;
          resume.save_dir = again;  // saved again right after the load, before any training
          resume.save_before_step = kSaveStep;
          const GptRun resumed = train_gpt_on_mesh(resume)[0];
          expect_same_checkpoint(saved, read_whole_checkpoint(again, kSaveStep, /*with_optimizer=*/true), what);
          remove_dir(again);

          ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(kSteps - kSaveStep)) << what;
          const bool exact = save_dp == load_dp;
          double worst_loss = 0;
          for (int k = 0; k < kSteps - kSaveStep; ++k) {
            const double a = uninterrupted.losses[kSaveStep + k], b = resumed.losses[k];
            worst_loss = std::max(worst_loss, std::abs(a - b) / std::abs(a));
            if (exact) {
              EXPECT_EQ(b, a) << what << ", step " << kSaveStep + k;
            } else {
              EXPECT_NEAR(b, a, 5e-7 * std::abs(a)) << what << ", step " << kSaveStep + k;
            }
          }
          const double worst_param = worst_param_difference(uninterrupted, resumed);
          if (exact) {
            EXPECT_EQ(worst_param, 0.0) << what << ": final params";
          } else {
            EXPECT_LE(worst_param, 1e-6) << what << ": final params";
          }
          std::cout << "[ " << what << ": max relative loss diff " << worst_loss << ", max abs param diff "
                    << worst_param << (exact ? " (bit for bit expected)" : "") << " ]" << std::endl;
        }
      }
      remove_dir(dir);
    }
  }
}
