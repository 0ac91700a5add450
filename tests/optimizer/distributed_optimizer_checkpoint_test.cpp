// ZeRO-1 checkpoints (DistributedOptimizer::save_checkpoint / load_checkpoint): round trip at the
// same DP size (bit-exact), resharding 4 -> 2, 2 -> 4, 4 -> 1 (continued training matches the run
// that never stopped), the crash-safe layout (a crash between files, keep-last-K, incomplete step
// directories), and damaged files and hostile manifests: each a named error on every rank that
// changes no rank's state.
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <sys/stat.h>
#include <unistd.h>

// The optimizer-only checkpoint (DistributedOptimizer::save_checkpoint / load_checkpoint), deprecated
// for users, is still read, written and tested here.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

std::string scratch_dir(const std::string& name) { return test::fresh_dir("ckpt-" + name); }
bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}
int64_t size_of(const std::string& path) {
  struct stat st{};
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
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(torch::equal(before[i], after[i])) << "rank " << mesh.rank() << " param " << i;
    EXPECT_EQ(rank.opt->steps_taken(), 0) << "nothing is half-loaded";
  });
  return messages;
}

// Every rank's message contains `text`.
void expect_every_rank_says(const std::vector<std::string>& messages, const std::string& text) {
  for (size_t r = 0; r < messages.size(); ++r) EXPECT_THAT(messages[r], HasSubstr(text)) << "rank " << r;
}

// What the tests of damaged and hostile files start from: the default scenario trained at 2 ranks and
// saved at kSaveAt into a fresh scratch directory, removed when the test ends (failed ones too).
struct SavedRun {
  explicit SavedRun(const std::string& name) : dir(scratch_dir(name)) { train_and_save(s, 2, dir); }
  ~SavedRun() { remove_dir(dir); }
  SavedRun(const SavedRun&) = delete;
  SavedRun& operator=(const SavedRun&) = delete;

  const ZeroScenario s;
  const std::string dir;
  const std::string step_dir = dir + "/step-" + std::to_string(kSaveAt);
  const std::string manifest = step_dir + "/manifest.json";
};

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
    for (size_t i = 0; i < uninterrupted.size(); ++i)
      EXPECT_TRUE(torch::equal(uninterrupted[i], resumed[i])) << "param " << i;
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
  SavedRun run("damage");
  const ZeroScenario& s = run.s;
  const std::string& dir = run.dir;
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
}

TEST(Checkpoint, AChangedModelIsNamed) {
  SavedRun run("model");
  const ZeroScenario& s = run.s;
  const std::string& dir = run.dir;
  ZeroScenario wider = s;
  wider.hidden = kZeroHidden + 8;
  expect_every_rank_says(load_errors(wider, 2, dir),
                         "'model/fc1.weight' has global shape [24,12] in the checkpoint but [32,12] here");
  ZeroScenario sgd = s;
  sgd.kind = OptimizerKind::kSgd;
  expect_every_rank_says(load_errors(sgd, 2, dir), "holds adamw state but this optimizer is sgd");
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
  EXPECT_FALSE(exists(dir + "/step-12")) << "a save that fails removes its step directory";
  // A real crash (the process killed after writing its file) leaves the directory without a manifest.
  ASSERT_EQ(
      std::system(("mkdir -p '" + dir + "/step-12' && touch '" + dir + "/step-12/rank00000.safetensors'").c_str()), 0);
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

// --- The files are untrusted input: the manifest is checked field by field, pieces
// are tied to their place by checksums, headers are compared with the manifest.
namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The manifest of `dir`/step-6 after `edit`: re-signed (a deliberate, consistent edit: a matching
// manifest_crc32c) or not (damage, or an edit by hand).
std::string edited_manifest(const std::string& dir, const std::function<void(Json&)>& edit, bool resign) {
  Json m = parse_json(read_text(dir + "/step-6/manifest.json"), "test");
  edit(m);
  if (!resign) return m.dump(1) + "\n";
  m.erase("manifest_crc32c");
  return manifest_text(m);
}

// The first tensor saved in two pieces (its key), for the piece edits.
std::string two_piece_tensor(const Json& m) {
  for (const auto& [key, t] : json_object(json_at(m, "tensors", "m"), "t")) {
    if (json_array(json_at(t, "pieces", key), key).size() == 2 && key.rfind("model/", 0) == 0) return key;
  }
  ADD_FAILURE() << "no tensor in two pieces";
  return "";
}
Json& piece(Json& m, const std::string& key, size_t i) {
  return m["tensors"][key]["pieces"].get_ref<Json::array_t&>()[i];
}

}  // namespace

TEST(CheckpointManifest, RefusesPieceFilesThatAreNotThisCheckpointsOwn) {
  SavedRun run("names");
  const std::string& dir = run.dir;
  const std::string& path = run.manifest;
  const std::string key = two_piece_tensor(parse_json(read_text(path), "m"));
  for (const std::string bad : {"../../other/step-6/rank00000.safetensors", "/etc/passwd", "sub/rank00000.safetensors",
                                "rank00009.safetensors", ""}) {
    const std::string text = edited_manifest(dir, [&](Json& m) { piece(m, key, 0)["file"] = Json(bad); }, true);
    EXPECT_THAT(error_of([&] { parse_manifest(text, path); }),
                HasSubstr(".pieces[0].file is " + Json(bad).dump() + ", which is not one of the checkpoint's files"))
        << bad;
  }
  // A file entry renamed to reach outside the directory.
  const std::string text = edited_manifest(
      dir,
      [&](Json& m) {
        auto& files = m["files"];
        files["../rank00000.safetensors"] = files["rank00000.safetensors"];
        files.erase("rank00000.safetensors");
      },
      true);
  EXPECT_THAT(error_of([&] { parse_manifest(text, path); }),
              HasSubstr("files[\"../rank00000.safetensors\"] is rank 0's file, whose name is rank00000.safetensors"));
}

TEST(CheckpointManifest, RefusesPiecesThatOverlapLeaveAGapOrLeaveTheTensor) {
  SavedRun run("cover");
  const std::string& dir = run.dir;
  const std::string& path = run.manifest;
  const std::string key = two_piece_tensor(parse_json(read_text(path), "m"));
  auto error_after = [&](const std::function<void(Json&)>& edit) {
    const std::string text = edited_manifest(dir, edit, true);
    return error_of([&] { parse_manifest(text, path); });
  };
  // Today's attack: a second copy of piece 0 in the other file, the first moved to a negative begin
  // (the sizes still sum to the tensor's).
  EXPECT_THAT(error_after([&](Json& m) {
                const int64_t n = json_int(piece(m, key, 0)["end"], "e") - json_int(piece(m, key, 0)["begin"], "b");
                piece(m, key, 0)["begin"] = Json(-n);
                piece(m, key, 0)["end"] = Json(int64_t{0});
              }),
              HasSubstr(".pieces[0].begin is -"));
  EXPECT_THAT(error_after([&](Json& m) { piece(m, key, 0)["end"] = Json(json_int(piece(m, key, 0)["end"], "e") - 1); }),
              HasSubstr(".pieces leave a gap in TP chunk 0"));
  EXPECT_THAT(error_after([&](Json& m) { piece(m, key, 0)["end"] = Json(json_int(piece(m, key, 0)["end"], "e") + 1); }),
              HasSubstr(".pieces overlap in TP chunk 0"));
  EXPECT_THAT(error_after([&](Json& m) { piece(m, key, 1)["end"] = Json(int64_t{1} << 40); }),
              HasSubstr(".pieces[1].end is 1099511627776; expected an integer in ["));
  EXPECT_THAT(error_after([&](Json& m) {
                auto& pieces = m["tensors"][key]["pieces"].get_ref<Json::array_t&>();
                pieces.push_back(pieces[0]);
              }),
              HasSubstr("for a second piece of this tensor"));
  EXPECT_THAT(error_after([&](Json& m) { m["tensors"][key]["pieces"].get_ref<Json::array_t&>().pop_back(); }),
              HasSubstr(".pieces cover "));
  EXPECT_THAT(error_after([&](Json& m) { piece(m, key, 0)["begin"] = Json(1.5); }),
              HasSubstr(".pieces[0].begin is number 1.5; expected an integer"));
}

TEST(CheckpointManifest, RefusesAnyEditThatDoesNotCarryAMatchingChecksum) {
  SavedRun run("crc");
  const ZeroScenario& s = run.s;
  const std::string& dir = run.dir;
  const std::string& path = run.manifest;
  const std::string original = read_text(path);
  EXPECT_NO_THROW(parse_manifest(original, path));
  write_text(path, edited_manifest(dir, [](Json& m) { m["step"] = Json(int64_t{5}); }, false));
  expect_every_rank_says(load_errors(s, 2, dir), "manifest_crc32c is 0x");
  expect_every_rank_says(load_errors(s, 2, dir), "but the manifest's content has CRC32C 0x");
  write_text(path, edited_manifest(dir, [](Json& m) { m["values"]["data_position"] = Json(int64_t{99}); }, false));
  expect_every_rank_says(load_errors(s, 2, dir), "manifest_crc32c is 0x");
  write_text(path, edited_manifest(dir, [](Json& m) { m.erase("manifest_crc32c"); }, false));
  expect_every_rank_says(load_errors(s, 2, dir), "has no manifest_crc32c");
  write_text(path, original);
  expect_every_rank_says(load_errors(s, 2, dir), "(no error)");
}

// Consistent (re-signed) manifests that move bytes to another place: the piece checksums refuse them.
TEST(Checkpoint, PiecesSwappedBetweenRanksRelabelledOrGivenAnotherDtypeAreRefused) {
  SavedRun run("swap");
  const ZeroScenario& s = run.s;
  const std::string& dir = run.dir;
  const std::string& path = run.manifest;
  const std::string original = read_text(path);
  const std::string key = two_piece_tensor(parse_json(original, "m"));
  auto swap_fields = [&](std::vector<const char*> fields) {
    return [=](Json& m) {
      for (const char* f : fields) std::swap(piece(m, key, 0)[f], piece(m, key, 1)[f]);
    };
  };
  // The two ranks' pieces swapped (files), relabelled (ranges), and the two AdamW moments swapped.
  for (const auto& edit : {swap_fields({"file"}), swap_fields({"begin", "end"}), swap_fields({"file", "crc32c"})}) {
    write_text(path, original);
    write_text(path, edited_manifest(dir, edit, true));
    expect_every_rank_says(load_errors(s, 2, dir), "(written by rank ");
  }
  const std::string param = key.substr(std::string("model/").size());
  write_text(path, original);
  write_text(path, edited_manifest(
                       dir,
                       [&](Json& m) {
                         auto& t = m["tensors"];
                         std::swap(t["optim/exp_avg/" + param], t["optim/exp_avg_sq/" + param]);
                       },
                       true));
  expect_every_rank_says(load_errors(s, 2, dir), "do not have the checksum the manifest gives");
  write_text(path, original);
  write_text(path, edited_manifest(
                       dir, [&](Json& m) { m["tensors"]["optim/exp_avg/" + param]["dtype"] = Json("I32"); }, true));
  expect_every_rank_says(load_errors(s, 2, dir), "holds 'optim/exp_avg/" + param + "' as F32 [");
  // The tensor's shape edited (same element count, so the pieces still tile it): the piece checksum
  // covers it. Before: the file checks passed and the model check spoke of a reshaped tensor.
  write_text(path, original);
  write_text(path, edited_manifest(
                       dir,
                       [&](Json& m) {
                         auto& shape = m["tensors"][key]["shape"].get_ref<Json::array_t&>();
                         std::reverse(shape.begin(), shape.end());
                       },
                       true));
  expect_every_rank_says(load_errors(s, 2, dir), "do not have the checksum the manifest gives");
  write_text(path, original);
  expect_every_rank_says(load_errors(s, 2, dir), "(no error)");
}

// The piece checksum ties the bytes to the tensor's dtype, global shape, sharded dim and TP size
// too (an outside attack: `dim` 0 -> 1 re-signed read row chunks as column chunks, silently).
TEST(CheckpointManifest, APieceChecksumCoversItsTensorsDtypeShapeDimAndTpSize) {
  ManifestTensor t;
  t.dtype = "F32";
  t.shape = {32, 32};
  t.dim = 0;
  t.tp_size = 2;
  ManifestPiece p;
  p.tp_rank = 1;
  p.begin = 0;
  p.end = 512;
  const std::string id = "0123456789abcdef";
  const uint32_t base = piece_checksum(0x1234, id, "model/k.weight", t, p);
  std::vector<std::pair<std::string, std::function<void(ManifestTensor&)>>> edits = {
      {"dim", [](ManifestTensor& e) { e.dim = 1; }},
      {"tp_size", [](ManifestTensor& e) { e.tp_size = 4; }},
      {"shape", [](ManifestTensor& e) { e.shape = {16, 64}; }},
      {"flattened shape", [](ManifestTensor& e) { e.shape = {1024}; }},
      {"dtype", [](ManifestTensor& e) { e.dtype = "I32"; }}};
  for (const auto& [what, edit] : edits) {
    ManifestTensor e = t;
    edit(e);
    EXPECT_NE(piece_checksum(0x1234, id, "model/k.weight", e, p), base) << what;
  }
  EXPECT_EQ(piece_checksum(0x1234, id, "model/k.weight", t, p), base);
}

// Files that are not what a save writes, in the step directory: named on every rank, in seconds.
// Before: a FIFO as manifest.json or a rank file blocked every rank in open() forever; bytes
// appended to a rank file (its size and CRC re-signed) loaded, and a sparse 16 TiB tail would have
// been CRC-checked for hours; a step directory renamed (step-6 as step-7) loaded step 6 as 7.
TEST(Checkpoint, AFifoAnAppendedTailOrARenamedStepDirectoryIsRefusedByName) {
  SavedRun run("hostile-files");
  const ZeroScenario& s = run.s;
  const std::string& dir = run.dir;
  const std::string& step_dir = run.step_dir;
  const std::string& manifest = run.manifest;
  const std::string original = read_text(manifest);
  const std::string rank1 = step_dir + "/rank00001.safetensors";
  const std::string rank1_bytes = read_text(rank1);

  std::remove(manifest.c_str());
  ASSERT_EQ(::mkfifo(manifest.c_str(), 0644), 0);
  expect_every_rank_says(load_errors(s, 2, dir), "'" + manifest + "' is a FIFO, not a regular file");
  std::remove(manifest.c_str());
  write_text(manifest, original);

  std::remove(rank1.c_str());
  ASSERT_EQ(::mkfifo(rank1.c_str(), 0644), 0);
  expect_every_rank_says(load_errors(s, 2, dir), "'" + rank1 + "' is a FIFO, not a regular file");
  std::remove(rank1.c_str());

  write_text(rank1, rank1_bytes + std::string(8, '\0'));  // appended, and the manifest re-signed to match
  const WrittenFile appended = checksum_file(rank1);
  write_text(manifest, edited_manifest(
                           dir,
                           [&](Json& m) {
                             auto& f = m["files"]["rank00001.safetensors"];
                             f["bytes"] = Json(appended.bytes);
                             f["crc32c"] = Json(crc_hex(appended.crc));
                           },
                           true));
  expect_every_rank_says(load_errors(s, 2, dir), "but its header ends its data at byte " +
                                                     std::to_string(rank1_bytes.size()) + " (bytes appended");
  write_text(rank1, rank1_bytes);
  write_text(manifest, original);

  ASSERT_EQ(std::rename(step_dir.c_str(), (dir + "/step-7").c_str()), 0);
  write_text(dir + "/latest", "step-7\n");
  expect_every_rank_says(load_errors(s, 2, dir), "holds step 6 but its directory is named 'step-7'");
  ASSERT_EQ(std::rename((dir + "/step-7").c_str(), step_dir.c_str()), 0);
  write_text(dir + "/latest", "step-6\n");
  expect_every_rank_says(load_errors(s, 2, dir), "(no error)");
}
