// ZeRO-1 checkpoints (DistributedOptimizer::save_checkpoint / load_checkpoint): round trip at the
// same DP size (bit-exact), resharding 4 -> 2, 2 -> 4, 4 -> 1 (continued training matches the run
// that never stopped), the crash-safe layout (a crash between files, keep-last-K, incomplete step
// directories), and damaged files: each a named error on every rank that changes no rank's state.
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <optional>
#include <cstdlib>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

std::string scratch_dir(const std::string& name) { return test::fresh_dir("ckpt-" + name); }
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
std::vector<torch::Tensor> train_and_save(const ZeroScenario& s, int save_dp, const std::string& dir,
                                          const CheckpointSaveOptions& options = {}) {
  ZeroScenario at_save = s;
  at_save.world = save_dp;
  std::vector<torch::Tensor> result;
  run_on_mesh({save_dp}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, at_save, kZeroSeed);
    rank.train(0, kSaveAt);
    rank.opt->save_checkpoint(dir, options);
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

// Loads `dir` at `dp` ranks into a fresh model; returns every rank's error message ("(no error)" if
// it loaded) and, where it failed, checks that the rank's params and step did not change.
std::vector<std::string> load_errors(const ZeroScenario& s, int dp, const std::string& dir,
                                     std::optional<int64_t> step = std::nullopt) {
  std::vector<std::string> messages(dp, "(no error)");
  ZeroScenario at = s;
  at.world = dp;
  run_on_mesh({dp}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, at, kZeroSeed + 5);
    auto before = rank.params();
    try {
      rank.opt->load_checkpoint(dir, step);
      return;  // loaded
    } catch (const c10::Error& e) {
      messages[mesh.rank()] = e.what_without_backtrace();
    }
    auto after = rank.params();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "rank " << mesh.rank() << " param " << i;
    EXPECT_EQ(rank.opt->steps_taken(), 0) << "nothing is half-loaded";
  });
  return messages;
}

// Every rank's message contains `text`.
void expect_every_rank_says(const std::vector<std::string>& messages, const std::string& text) {
  for (size_t r = 0; r < messages.size(); ++r) EXPECT_THAT(messages[r], HasSubstr(text)) << "rank " << r;
}

}  // namespace

TEST(Checkpoint, RoundTripAtTheSameDpSizeContinuesBitExactly) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    ZeroScenario s{.kind = kind};
    auto dir = scratch_dir("same");
    auto uninterrupted = train_and_save(s, 4, dir);
    EXPECT_TRUE(exists(dir + "/step-6/manifest.json"));
    EXPECT_TRUE(exists(dir + "/step-6/rank00003.safetensors"));
    std::ifstream latest(dir + "/latest");
    std::string name;
    latest >> name;
    EXPECT_EQ(name, "step-6");
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
    auto dir = scratch_dir("reshard");
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
  auto dir = scratch_dir("bf16");
  auto uninterrupted = train_and_save(s, 2, dir);
  auto resumed = load_and_continue(s, 4, dir);
  EXPECT_LE(max_abs_diff(uninterrupted, resumed), 8e-3);
  remove_dir(dir);
}

// Each damage gives its named error on every rank (not only on the rank that verified the file),
// and no rank's params or step change (checked inside load_errors).
TEST(Checkpoint, DamagedFilesGiveNamedErrorsOnEveryRankAndLoadNothing) {
  ZeroScenario s;
  auto dir = scratch_dir("damage");
  train_and_save(s, 2, dir);
  const std::string file = dir + "/step-6/rank00001.safetensors", backup = dir + "/backup";
  std::system(("cp '" + file + "' '" + backup + "'").c_str());
  auto restore = [&] { std::system(("cp '" + backup + "' '" + file + "'").c_str()); };

  // A flipped byte in the data.
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(size_of(file) - 10);
    char c;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(size_of(file) - 10);
    f.write(&c, 1);
  }
  auto messages = load_errors(s, 2, dir);
  expect_every_rank_says(messages, "file '" + file + "' (written by rank 1) has CRC32C 0x");
  expect_every_rank_says(messages, "but the manifest says 0x");
  expect_every_rank_says(messages, "nothing was loaded on any rank");
  restore();

  // Truncated.
  ASSERT_EQ(::truncate(file.c_str(), size_of(file) - 4), 0);
  expect_every_rank_says(load_errors(s, 4, dir), "(written by rank 1) has " + std::to_string(size_of(backup) - 4) +
                                                     " bytes but the manifest says " + std::to_string(size_of(backup)));
  restore();

  // Missing.
  std::remove(file.c_str());
  expect_every_rank_says(load_errors(s, 2, dir), "file '" + file + "' (written by rank 1) is missing");
  restore();

  // From another save of the same step: same size, another save id.
  auto other = scratch_dir("damage-other");
  train_and_save(s, 2, other);
  std::system(("cp '" + other + "/step-6/rank00001.safetensors' '" + file + "'").c_str());
  expect_every_rank_says(load_errors(s, 2, dir), "(written by rank 1) is from another save (save id ");
  restore();
  remove_dir(other);

  // Intact again: loads.
  expect_every_rank_says(load_errors(s, 2, dir), "(no error)");
  remove_dir(dir);
}

TEST(Checkpoint, AChangedModelIsNamed) {
  ZeroScenario s;
  auto dir = scratch_dir("model");
  train_and_save(s, 2, dir);
  ZeroScenario wider = s;
  wider.hidden = kZeroHidden + 8;
  expect_every_rank_says(load_errors(wider, 2, dir),
                         "'model/fc1.weight' has global shape [24,12] in the checkpoint but [32,12] here");
  ZeroScenario sgd = s;
  sgd.kind = OptimizerKind::kSgd;
  expect_every_rank_says(load_errors(sgd, 2, dir), "holds adamw state but this optimizer is sgd");
  remove_dir(dir);
}

// A save that dies between files (rank 1 fails after writing its file, before the manifest) leaves
// the previous checkpoint complete, `latest` naming it, and the new step never taken.
TEST(Checkpoint, ACrashBetweenFilesLeavesThePreviousCheckpointLatestAndLoadable) {
  ZeroScenario s;
  auto dir = scratch_dir("crash");
  std::vector<std::string> errors(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    rank.train(0, kSaveAt);
    rank.opt->save_checkpoint(dir);
    rank.train(kSaveAt, kEnd);
    CheckpointSaveOptions crash;
    crash.after_file_written = [&](const std::string& path) {
      if (mesh.rank() == 1) throw std::runtime_error("injected crash after writing " + path);
    };
    try {
      rank.opt->save_checkpoint(dir, crash);
    } catch (const c10::Error& e) {
      errors[mesh.rank()] = e.what_without_backtrace();
    }
  });
  expect_every_rank_says(errors, "checkpoint save of step 12 to '" + dir + "/step-12' failed (writing the files)");
  expect_every_rank_says(errors, "`latest` still names the previous checkpoint");
  expect_every_rank_says(errors, "rank 1: injected crash after writing");
  std::ifstream latest(dir + "/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-6");
  EXPECT_TRUE(exists(dir + "/step-12/rank00000.safetensors")) << "the crash came after the files";
  EXPECT_FALSE(exists(dir + "/step-12/manifest.json"));
  // Loads step 6 (load_and_continue checks steps_taken() == 6); step 12 is refused by name.
  load_and_continue(s, 2, dir);
  expect_every_rank_says(load_errors(s, 2, dir, 12), "step-12' is incomplete (no manifest.json");
  // Without `latest` (a crash between the manifest and the pointer), the newest complete step wins.
  std::remove((dir + "/latest").c_str());
  load_and_continue(s, 2, dir);
  remove_dir(dir);
}

TEST(Checkpoint, KeepLastKeepsTheNewestStepsAndNeverOverwritesLatest) {
  ZeroScenario s;
  auto dir = scratch_dir("keep");
  std::string overwrite_error;
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    CheckpointSaveOptions keep2;
    keep2.keep_last = 2;
    for (int k = 1; k <= 4; ++k) {
      rank.train(2 * (k - 1), 2 * k);
      rank.opt->save_checkpoint(dir, keep2);
    }
    try {
      rank.opt->save_checkpoint(dir, keep2);  // step 8 again
    } catch (const c10::Error& e) {
      if (mesh.rank() == 0) overwrite_error = e.what_without_backtrace();
    }
  });
  EXPECT_FALSE(exists(dir + "/step-2"));
  EXPECT_FALSE(exists(dir + "/step-4"));
  EXPECT_TRUE(exists(dir + "/step-6/manifest.json"));
  EXPECT_TRUE(exists(dir + "/step-8/manifest.json"));
  EXPECT_THAT(overwrite_error, HasSubstr("step-8' is the latest complete checkpoint; a save never overwrites it"));
  remove_dir(dir);
}
