// Resuming means resuming (checkpoint/lineage.h, Note [The live run]): a damaged `latest`
// is a named error, never a fresh start; keep_last counts the live run after a rollback and an
// abandoned timeline is never taken as the newest; stray step-like directories are skipped with a
// warning; a pruning failure after the commit is reported as such. ZeRO-1 MLP ranks as threads.
#include "checkpoint/lineage.h"
#include "checkpoint/store.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

// The optimizer-only checkpoint (DistributedOptimizer::save_checkpoint / load_checkpoint), deprecated
// for users, is still read, written and tested here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}
void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Trains on 2 ranks from `load` (a step of `dir`, or none: from scratch), saving after each step in
// `saves` with `keep_last`.
void train_and_save(const std::string& dir, std::optional<int64_t> load, const std::vector<int>& saves,
                    int64_t keep_last = 0) {
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, ZeroScenario{}, kZeroSeed);
    int at = load ? static_cast<int>(rank.opt->load_checkpoint(dir, *load)) : 0;
    CheckpointSaveOptions options;
    options.keep_last = keep_last;
    for (int step : saves) {
      rank.train(at, step);
      at = step;
      rank.opt->save_checkpoint(dir, options);
    }
  });
}

// Every rank's agreed resolution of `dir` for a resume: the step directory, "none", or the error.
std::vector<std::string> resume_finds(const std::string& dir) {
  std::vector<std::string> found(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, ZeroScenario{}, kZeroSeed);
    try {
      found[mesh.rank()] = agree_on_checkpoint(rank.opt->checkpoint_mesh(), dir, std::nullopt, true).value_or("none");
    } catch (const c10::Error& e) {
      found[mesh.rank()] = e.what_without_backtrace();
    }
  });
  return found;
}

}  // namespace

// Before: a `latest` with a flipped byte, or naming a step that does not exist, made --resume
// start from step 0 with exit 0 beside complete checkpoints. Now both are named errors that list the
// complete steps and say how to pick one; only a directory with no checkpoint is a fresh start.
TEST(CheckpointResume, ADamagedLatestIsANamedErrorNotAFreshStart) {
  const std::string dir = fresh_dir("resume-latest");
  EXPECT_EQ(resume_finds(dir), (std::vector<std::string>{"none", "none"})) << "no directory: a fresh start";
  train_and_save(dir, std::nullopt, {2, 4});
  EXPECT_EQ(resume_finds(dir)[1], dir + "/step-4");
  write_text(dir + "/latest", "stdp-4\n");
  for (const std::string& e : resume_finds(dir)) {
    EXPECT_THAT(
        e, HasSubstr("'" + dir + "/latest' holds 'stdp-4', which is not a step directory name: the file is damaged"));
    EXPECT_THAT(e, HasSubstr("(complete: step-2 step-4; incomplete: none)"));
    EXPECT_THAT(e, HasSubstr("--resume-step N"));
  }
  write_text(dir + "/latest", "step-9\n");
  for (const std::string& e : resume_finds(dir)) {
    EXPECT_THAT(e, HasSubstr("'" + dir + "/latest' names 'step-9', which does not exist"));
  }
  // Only an incomplete save (a crash during the first save) and no `latest`: nothing was committed.
  const std::string first = fresh_dir("resume-first");
  ::mkdir(first.c_str(), 0755);
  ::mkdir((first + "/step-3").c_str(), 0755);
  EXPECT_EQ(resume_finds(first), (std::vector<std::string>{"none", "none"}));
  remove_dir(dir);
  remove_dir(first);
}

// An adversary's `latest`: every one is refused naming the file on every rank,
// in seconds. Before: a FIFO blocked every rank in open() forever; a 1 TiB sparse file was read
// whole (std::bad_alloc, SIGABRT); "" was ignored (a run picked by the lineage instead); a
// directory, "../x/step-2", a NUL or a CRLF got a less exact message or none.
TEST(CheckpointResume, ALatestThatIsNotExactlyAStepNameIsRefusedNamingTheFile) {
  const std::string dir = fresh_dir("resume-hostile-latest");
  train_and_save(dir, std::nullopt, {2, 4});
  const std::string latest = dir + "/latest";
  auto expect_refused = [&](const std::string& what, const std::string& message) {
    for (const std::string& e : resume_finds(dir)) {
      EXPECT_THAT(e, HasSubstr("'" + latest + "'")) << what;
      EXPECT_THAT(e, HasSubstr(message)) << what;
      EXPECT_THAT(e, HasSubstr("(complete: step-2 step-4; incomplete: none); load one of the complete steps")) << what;
    }
  };
  for (const auto& [text, shown] :
       std::vector<std::pair<std::string, std::string>>{{"", "holds ''"},
                                                        {"\n", "holds ''"},
                                                        {"../x/step-2\n", "holds '../x/step-2'"},
                                                        {std::string("step-2\0", 7), "holds 'step-2\\x00'"},
                                                        {"step-2\r\n", "holds 'step-2\\x0d'"},
                                                        {"step-2\n\n", "holds 'step-2\\x0a'"},
                                                        {" step-2\n", "holds ' step-2'"}}) {
    std::remove(latest.c_str());
    write_text(latest, text);
    expect_refused(shown, shown +
                              ", which is not a step directory name: the file is damaged (a save writes exactly "
                              "\"step-<N>\" and a newline; fix or delete it)");
  }
  std::remove(latest.c_str());
  ASSERT_EQ(::mkfifo(latest.c_str(), 0644), 0);
  expect_refused("a FIFO", "is a FIFO, not a regular file");
  std::remove(latest.c_str());
  ASSERT_EQ(::mkdir(latest.c_str(), 0755), 0);
  expect_refused("a directory", "is a directory, not a regular file");
  ::rmdir(latest.c_str());
  write_text(latest, "step-4\n");
  ASSERT_EQ(::truncate(latest.c_str(), int64_t{1} << 40), 0);  // sparse: no disk used
  expect_refused("1 TiB", "has 1099511627776 bytes; more than the 4096 it may have");
  write_text(latest, "step-4");  // no newline: fine
  EXPECT_EQ(resume_finds(dir)[0], dir + "/step-4");
  // The recovery the message suggests: load a step explicitly; the next save replaces the damaged
  // `latest` (a save does not refuse it).
  write_text(latest, "../x/step-2\n");
  train_and_save(dir, 4, {6});
  EXPECT_EQ(read_latest_pointer(dir), "step-6");
  remove_dir(dir);
}

// A symlink planted where a save writes its temp file (<dir>/latest.tmp) pointing outside the
// directory: the save replaces the link, never writes through it. Before: the outside file was
// overwritten with "step-4\n".
TEST(CheckpointResume, ASaveNeverWritesThroughALinkPlantedAtItsTempFile) {
  const std::string dir = fresh_dir("resume-tmp-link");
  const std::string outside = fresh_dir("resume-tmp-link-victim");
  train_and_save(dir, std::nullopt, {2});
  write_text(outside, "precious\n");
  ASSERT_EQ(::symlink(outside.c_str(), (dir + "/latest.tmp").c_str()), 0);
  train_and_save(dir, 2, {4});
  std::ifstream victim(outside);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(victim), {}), "precious\n");
  EXPECT_EQ(read_latest_pointer(dir), "step-4");
  struct stat st{};
  EXPECT_NE(::lstat((dir + "/latest.tmp").c_str(), &st), 0) << "the link is gone";
  std::remove(outside.c_str());
  remove_dir(dir);
}

// The usual loss-spike recovery: saves at 2, 4, 6, 8; roll back to 4; continue saving at 5 and 7
// with keep_last 2. The resume point's chain (7 <- 5 <- 4) is the live run: 7 and 5 stay, the
// abandoned 6 and 8 go. Before: keep_last kept the highest step numbers (8 and 7) and deleted the
// resume point and step 5.
TEST(CheckpointResume, KeepLastCountsTheLiveRunAfterARollback) {
  const std::string dir = fresh_dir("resume-rollback");
  train_and_save(dir, std::nullopt, {2, 4, 6, 8});
  train_and_save(dir, 4, {5, 7}, /*keep_last=*/2);
  for (int s : {5, 7}) EXPECT_TRUE(exists(dir + "/step-" + std::to_string(s) + "/manifest.json")) << "step " << s;
  for (int s : {2, 4, 6, 8}) EXPECT_FALSE(exists(dir + "/step-" + std::to_string(s))) << "step " << s;
  // keep_last 3 from the same rollback keeps the resume point itself.
  const std::string dir3 = fresh_dir("resume-rollback3");
  train_and_save(dir3, std::nullopt, {2, 4, 6, 8});
  train_and_save(dir3, 4, {5, 7}, /*keep_last=*/3);
  for (int s : {4, 5, 7}) EXPECT_TRUE(exists(dir3 + "/step-" + std::to_string(s) + "/manifest.json")) << "step " << s;
  for (int s : {2, 6, 8}) EXPECT_FALSE(exists(dir3 + "/step-" + std::to_string(s))) << "step " << s;
  remove_dir(dir);
  remove_dir(dir3);
}

// After a rollback without keep_last, the abandoned step 8 is never taken as the newest: with
// `latest` the load takes 5; without it (a crash between a manifest and the pointer) two runs end
// in the directory and the load refuses, naming both, rather than guess. Before: step 8 was loaded.
TEST(CheckpointResume, AnAbandonedTimelineIsNeverTakenAsTheNewest) {
  const std::string dir = fresh_dir("resume-abandoned");
  train_and_save(dir, std::nullopt, {2, 4, 6, 8});
  train_and_save(dir, 4, {5});
  EXPECT_EQ(resume_finds(dir)[0], dir + "/step-5");
  std::remove((dir + "/latest").c_str());
  for (const std::string& e : resume_finds(dir)) {
    EXPECT_THAT(e, HasSubstr("has no `latest` and 2 runs end in it: step-5 step-8"));
    EXPECT_THAT(e, HasSubstr("--resume-step N"));
  }
  EXPECT_EQ(resolve_checkpoint(dir, 5), dir + "/step-5") << "an explicit step still loads";
  // A linear run without `latest` resolves to its newest, as before.
  const std::string linear = fresh_dir("resume-linear");
  train_and_save(linear, std::nullopt, {2, 4});
  std::remove((linear + "/latest").c_str());
  EXPECT_EQ(resume_finds(linear)[1], linear + "/step-4");
  remove_dir(dir);
  remove_dir(linear);
}

// A stray step-<20 digits> directory (out of int64 range) made every save with keep_last fail after
// `latest` had moved, reported as "nothing was committed", and every later load fail with stoll's
// out_of_range. Now it (and step-007, a file named step-9) is skipped with a warning.
TEST(CheckpointResume, StrayStepDirectoriesAreSkippedWithAWarning) {
  const std::string dir = fresh_dir("resume-stray");
  train_and_save(dir, std::nullopt, {2});
  ::mkdir((dir + "/step-99999999999999999999").c_str(), 0755);
  ::mkdir((dir + "/step-007").c_str(), 0755);
  write_text(dir + "/step-9", "not a directory");
  testing::internal::CaptureStderr();
  train_and_save(dir, 2, {4, 6}, /*keep_last=*/2);
  const std::vector<std::string> found = resume_finds(dir);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(found[0], dir + "/step-6");
  EXPECT_THAT(err, HasSubstr("meshddp: warning: checkpoint: skipping '" + dir +
                             "/step-99999999999999999999': not a "
                             "checkpoint step directory"));
  EXPECT_THAT(err, HasSubstr("skipping '" + dir + "/step-007'"));
  EXPECT_THAT(err, HasSubstr("skipping '" + dir + "/step-9': not a directory"));
  EXPECT_TRUE(exists(dir + "/step-99999999999999999999")) << "not ours: left alone";
  EXPECT_FALSE(exists(dir + "/step-2"));
  remove_dir(dir);
}

// Pruning after the commit fails (here: a damaged manifest in the chain it walks). The save itself
// succeeded and says so; before, a failure there was reported as "nothing was committed".
TEST(CheckpointResume, APruningFailureAfterTheCommitIsReportedAsSuch) {
  const std::string dir = fresh_dir("resume-prune-fails");
  train_and_save(dir, std::nullopt, {2, 4});
  write_text(dir + "/step-2/manifest.json", "{damaged");
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(train_and_save(dir, 4, {6}, /*keep_last=*/4));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("meshddp: warning: checkpoint '" + dir +
                             "/step-6' is saved and committed (`latest` names "
                             "it), but pruning the older checkpoints (keep_last 4) failed: "));
  EXPECT_THAT(err, HasSubstr(dir + "/step-2/manifest.json"));
  EXPECT_THAT(err, Not(HasSubstr("nothing was committed")));
  EXPECT_EQ(resume_finds(dir)[0], dir + "/step-6");
  remove_dir(dir);
}

// Ranks that see different directories (a node-local disk, a typo on one node) agree to refuse,
// naming what each rank found. Before: each rank resolved alone (rank 0 loaded, rank 1 started
// fresh) and they hung in different collectives until the timeout.
TEST(CheckpointResume, RanksThatFindDifferentCheckpointsRefuseNamingEach) {
  const std::string dir = fresh_dir("resume-split");
  train_and_save(dir, std::nullopt, {2});
  std::vector<std::string> errors(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, ZeroScenario{}, kZeroSeed);
    const std::string mine = mesh.rank() == 0 ? dir : dir + "-elsewhere";
    try {
      agree_on_checkpoint(rank.opt->checkpoint_mesh(), mine, std::nullopt, true);
    } catch (const c10::Error& e) {
      errors[mesh.rank()] = e.what_without_backtrace();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("the ranks found different checkpoints; nothing was loaded on any rank"));
    EXPECT_THAT(e, HasSubstr("rank 0: " + dir + "/step-2"));
    EXPECT_THAT(e, HasSubstr("rank 1: no checkpoint (" + dir + "-elsewhere is missing"));
  }
  remove_dir(dir);
}

// Rolled back to step 4, the run reaches step 8 again and saves it while `latest` still names the
// abandoned step-8: `latest` moves back to step 4 first, then the new step-8 (parent step-4)
// replaces the old. Before: refused ("a save never overwrites" latest).
TEST(CheckpointResume, ARollbackSavesOverTheAbandonedLatest) {
  const std::string dir = fresh_dir("resume-overwrite");
  train_and_save(dir, std::nullopt, {2, 4, 6, 8});
  EXPECT_NO_THROW(train_and_save(dir, 4, {8}));
  std::ifstream manifest(dir + "/step-8/manifest.json");
  const std::string text((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"parent\": \"step-4\""));
  EXPECT_EQ(resume_finds(dir)[0], dir + "/step-8");
  remove_dir(dir);
}
