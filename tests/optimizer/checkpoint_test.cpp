// Sharded checkpoints: round trip at the same DP size (bit-exact), resharding 4 -> 2 and 2 -> 4
// (continued training matches the run that never stopped), and clear errors that load nothing.
#include "tests/support/rank_threads.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

// POSIX, not std::filesystem: the torch wheel exports an older std::filesystem that crashes when it
// shadows libstdc++'s (docs/building.md).
std::string fresh_dir(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp ? tmp : "/tmp") + "/meshddp-ckpt-" + name + "-" + std::to_string(::getpid());
  std::system(("rm -rf '" + dir + "'").c_str());
  return dir;
}
void remove_dir(const std::string& dir) { std::system(("rm -rf '" + dir + "'").c_str()); }
bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}
int64_t size_of(const std::string& path) {
  struct stat st {};
  ::stat(path.c_str(), &st);
  return st.st_size;
}

constexpr int kSaveAt = 6, kEnd = 12;

// Trains kSaveAt steps at `save_dp`, saves, trains on to kEnd: returns the final params.
std::vector<torch::Tensor> train_and_save(const ZeroScenario& s, int save_dp, const std::string& dir) {
  ZeroScenario at_save = s;
  at_save.world = save_dp;
  std::vector<torch::Tensor> result;
  run_on_mesh({save_dp}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, at_save, kZeroSeed);
    rank.train(0, kSaveAt);
    rank.opt->save_checkpoint(dir);
    rank.train(kSaveAt, kEnd);
    auto p = rank.params();
    if (mesh.rank() == 0) result = p;
  });
  return result;
}

// Loads at `load_dp` into a model initialised differently, trains kSaveAt..kEnd.
std::vector<torch::Tensor> load_and_continue(const ZeroScenario& s, int load_dp, const std::string& dir) {
  ZeroScenario at_load = s;
  at_load.world = load_dp;
  std::vector<torch::Tensor> result;
  run_on_mesh({load_dp}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, at_load, kZeroSeed + 1000);
    rank.opt->load_checkpoint(dir);
    EXPECT_EQ(rank.opt->steps_taken(), kSaveAt);
    rank.train(kSaveAt, kEnd);
    auto p = rank.params();
    if (mesh.rank() == 0) result = p;
  });
  return result;
}

std::string load_error(const ZeroScenario& s, int dp, const std::string& dir, std::vector<torch::Tensor>* before = nullptr,
                       std::vector<torch::Tensor>* after = nullptr) {
  std::string message = "(no error)";
  ZeroScenario at = s;
  at.world = dp;
  run_on_mesh({dp}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, at, kZeroSeed + 5);
    auto b = rank.params();
    try {
      rank.opt->load_checkpoint(dir);
    } catch (const c10::Error& e) {
      if (mesh.rank() == 0) message = e.what_without_backtrace();
    }
    auto a = rank.params();
    if (mesh.rank() == 0 && before) *before = b;
    if (mesh.rank() == 0 && after) *after = a;
    EXPECT_EQ(rank.opt->steps_taken(), 0) << "nothing is half-loaded";
  });
  return message;
}

}  // namespace

TEST(Checkpoint, RoundTripAtTheSameDpSizeContinuesBitExactly) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    ZeroScenario s{.kind = kind};
    auto dir = fresh_dir("same");
    auto uninterrupted = train_and_save(s, 4, dir);
    EXPECT_TRUE(exists(dir + "/manifest.txt"));
    auto resumed = load_and_continue(s, 4, dir);
    for (size_t i = 0; i < uninterrupted.size(); ++i) EXPECT_TRUE(torch::equal(uninterrupted[i], resumed[i])) << "param " << i;
    remove_dir(dir);
  }
}

// Tolerance: after the load, the two runs differ only in DP size, i.e. in gradient summation
// order: as in the golden tests (2e-6).
TEST(Checkpoint, ReshardsFromFourRanksToTwoAndFromTwoToFour) {
  for (auto [save_dp, load_dp] : {std::pair{4, 2}, std::pair{2, 4}, std::pair{4, 1}}) {
    ZeroScenario s{.bf16 = false};
    auto dir = fresh_dir("reshard");
    auto uninterrupted = train_and_save(s, save_dp, dir);
    auto resumed = load_and_continue(s, load_dp, dir);
    const double diff = max_abs_diff(uninterrupted, resumed);
    std::cout << "[ " << save_dp << " -> " << load_dp << ": max |diff| = " << diff << " ]" << std::endl;
    EXPECT_LE(diff, 2e-6) << save_dp << " -> " << load_dp;
    remove_dir(dir);
  }
}

TEST(Checkpoint, Bf16MasterWeightsSurviveResharding) {
  ZeroScenario s{.bf16 = true};
  auto dir = fresh_dir("bf16");
  auto uninterrupted = train_and_save(s, 2, dir);
  auto resumed = load_and_continue(s, 4, dir);
  EXPECT_LE(max_abs_diff(uninterrupted, resumed), 8e-3);
  remove_dir(dir);
}

TEST(Checkpoint, ErrorsNameTheFileAndLoadNothing) {
  ZeroScenario s;
  auto dir = fresh_dir("errors");
  train_and_save(s, 2, dir);

  // Truncated shard.
  const std::string shard1 = dir + "/shard-dp1.bin", backup = dir + "/backup.bin";
  std::system(("cp '" + shard1 + "' '" + backup + "'").c_str());
  ASSERT_EQ(::truncate(shard1.c_str(), size_of(shard1) - 4), 0);
  std::vector<torch::Tensor> before, after;
  auto msg = load_error(s, 2, dir, &before, &after);
  EXPECT_THAT(msg, HasSubstr("shard-dp1.bin' has"));
  EXPECT_THAT(msg, HasSubstr("truncated"));
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "params untouched";

  // Missing shard.
  std::remove(shard1.c_str());
  EXPECT_THAT(load_error(s, 4, dir), HasSubstr("shard file '" + shard1 + "' of DP rank 1 (of 2) is missing"));
  std::rename(backup.c_str(), shard1.c_str());

  // A different model.
  ZeroScenario wider = s;
  wider.hidden = kZeroHidden + 8;
  msg = load_error(wider, 2, dir);
  EXPECT_THAT(msg, HasSubstr("was saved from a different model: parameter #0 is 'fc1.weight Float 288 [24,12] Replicate' in the checkpoint but 'fc1.weight Float 384 [32,12] Replicate' here"));

  // No manifest: an unfinished save.
  std::remove((dir + "/manifest.txt").c_str());
  EXPECT_THAT(load_error(s, 2, dir), HasSubstr("no manifest.txt"));
  remove_dir(dir);
}
