// Asynchronous checkpoint saves (plugin/checkpoint_saver.h, checkpoint/async_save.h): an async save
// writes the same bytes as a sync save of the same step, even while training changes the state
// during the write, and both resume to the same params bit for bit; a write that fails on one rank is
// reported on every rank at the next step boundary, naming the rank and its file, and `latest` stays;
// a save started while the previous one is still being written waits for it or is refused by name (the
// ranks' if_busy agreed first); a failed save is reported even when the next save fails to start.
// (Kills at random points of async saves: tests/examples/check_async_save_kills.py.)
#include "checkpoint/json.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "plugin/checkpoint_saver.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tests/support/zero_training.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <future>
#include <sstream>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

std::string scratch_dir(const std::string& name) { return test::fresh_dir("async-ckpt-" + name); }

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TrainingState state_of(ZeroRank& rank) { return {rank.model.ptr().get(), rank.ddp.get(), rank.opt.get(), nullptr}; }

// What a save wrote, without what differs between two saves of the same state (the save id, and
// the checksums that cover it): each rank file's data bytes and its header's tensors, and the
// manifest's tensors (shape, placement, piece ranges) and files (sizes).
std::string content_of(const std::string& step_dir, int world) {
  std::ostringstream out;
  for (int r = 0; r < world; ++r) {
    const std::string path = step_dir + "/" + checkpoint_file_name(r);
    const std::string bytes = read_text(path);
    const SafetensorsHeader h = read_safetensors_header(path, static_cast<int64_t>(bytes.size()));
    out << path.substr(path.rfind('/')) << " " << bytes.size() << " bytes, data CRC32C "
        << crc_hex(crc32c(bytes.data() + h.data_start, bytes.size() - h.data_start)) << "\n";
    for (const auto& [name, t] : h.tensors) out << "  " << name << " " << t.dtype << " " << t.begin << "\n";
  }
  Json m = parse_json(read_text(step_dir + "/manifest.json"), "manifest");
  m.erase("save_id");
  m.erase("manifest_crc32c");
  for (auto& [name, f] : m["files"].items()) f.erase("crc32c");
  for (auto& [key, t] : m["tensors"].items()) {
    for (Json& p : t["pieces"]) p.erase("crc32c");
  }
  out << json_text(m, 1);
  return out.str();
}

// Blocks a writer thread until released (one per rank: ranks are threads here).
struct Latch {
  std::promise<void> promise;
  std::shared_future<void> future = promise.get_future().share();
  void release() { promise.set_value(); }
};

constexpr int kSaveAt = 4, kEnd = 8;

}  // namespace

// The async save's writer is held until this rank has trained one more step, so a snapshot that were
// not a copy would write the next step's state.
TEST(AsyncCheckpoint, WritesTheSameBytesAsASyncSaveOfTheSameStepAndResumesBitForBit) {
  const std::string sync_dir = scratch_dir("sync"), async_dir = scratch_dir("async");
  const ZeroScenario s{.world = 2, .steps = kEnd};
  std::vector<torch::Tensor> uninterrupted;
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    CheckpointSaver saver(state_of(rank));
    rank.train(0, kSaveAt);
    saver.save(sync_dir, kSaveAt, {{"next_step", int64_t{kSaveAt}}});
    Latch trained;
    CheckpointSaveOptions options;
    options.async_save = true;
    options.before_file_written = [&](const std::string&) { trained.future.wait(); };
    const AsyncSaveStart started = saver.save(async_dir, kSaveAt, {{"next_step", int64_t{kSaveAt}}}, options);
    EXPECT_EQ(started.path, async_dir + "/step-4");
    EXPECT_GT(saver.snapshot_bytes(), 0);
    rank.train(kSaveAt, kSaveAt + 1);  // changes params and moments while the writer waits
    trained.release();
    AsyncSaveReport r = saver.step_boundary();
    while (r.kind == AsyncSaveReport::Kind::kPending) r = saver.step_boundary();
    EXPECT_EQ(r.kind, AsyncSaveReport::Kind::kCommitted) << r.message;
    EXPECT_EQ(r.path, async_dir + "/step-4");
    rank.train(kSaveAt + 1, kEnd);
    auto p = rank.params();
    if (mesh.rank() == 0) uninterrupted = p;
  });
  EXPECT_EQ(read_text(async_dir + "/latest"), "step-4\n");
  const std::string sync_content = content_of(sync_dir + "/step-4", 2);
  EXPECT_TRUE(sync_content == content_of(async_dir + "/step-4", 2))
      << "the async save's files or manifest differ from the sync save's beyond the save id; the sync save's "
      << sync_content.substr(0, sync_content.find('{'));

  for (const std::string& dir : {sync_dir, async_dir}) {
    std::vector<torch::Tensor> resumed;
    run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
      ZeroRank rank(mesh, s, kZeroSeed + 1);  // other initial params: the load must replace them all
      const LoadedCheckpoint loaded = load_checkpoint(state_of(rank), dir);
      EXPECT_EQ(loaded.step, kSaveAt);
      rank.train(kSaveAt, kEnd);
      auto p = rank.params();
      if (mesh.rank() == 0) resumed = p;
    });
    EXPECT_EQ(max_abs_diff(resumed, uninterrupted), 0.0) << dir;  // same mesh: bit for bit
  }
  remove_dir(sync_dir);
  remove_dir(async_dir);
}

// A target that cannot be written: as an unprivileged user rank 1 makes the step directory read-only
// just before its write; as root (whom permissions do not stop) it puts a directory where its file
// goes. Either way the write fails on the writer thread.
TEST(AsyncCheckpoint, AFailedBackgroundWriteIsNamedOnEveryRankAtTheNextStepBoundaryAndLatestStays) {
  const std::string dir = scratch_dir("fail");
  const ZeroScenario s{.world = 2, .steps = 8};
  std::vector<std::string> reports(2), thrown(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    for (CheckpointSaver::OnFailure on_failure :
         {CheckpointSaver::OnFailure::kWarn, CheckpointSaver::OnFailure::kThrow}) {
      const bool warn = on_failure == CheckpointSaver::OnFailure::kWarn;
      CheckpointSaver saver(state_of(rank), on_failure);
      CheckpointSaveOptions options;
      options.async_save = true;
      const int first = warn ? 0 : 4;
      rank.train(first, first + 1);
      saver.save(dir, first + 1, {}, options);
      EXPECT_EQ(saver.wait().kind, AsyncSaveReport::Kind::kCommitted);
      options.before_file_written = [&](const std::string& path) {
        if (mesh.rank() != 1) return;
        if (::geteuid() == 0) {
          ::mkdir(path.c_str(), 0755);
        } else {
          ::chmod(path.substr(0, path.rfind('/')).c_str(), 0555);
        }
      };
      rank.train(first + 1, first + 2);
      saver.save(dir, first + 2, {}, options);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // this rank's writer has failed by now
      rank.train(first + 2, first + 3);
      if (warn) {
        const AsyncSaveReport r = saver.step_boundary();  // the next step boundary
        EXPECT_EQ(r.kind, AsyncSaveReport::Kind::kFailed);
        reports[mesh.rank()] = r.message;
      } else {
        thrown[mesh.rank()] = error_of([&] { saver.step_boundary(); });
      }
      EXPECT_FALSE(saver.pending());
      EXPECT_EQ(read_text(dir + "/latest"), "step-" + std::to_string(first + 1) + "\n");
      ::chmod((dir + "/step-" + std::to_string(first + 2)).c_str(), 0755);
      // Training goes on; the next save commits.
      options.before_file_written = nullptr;
      saver.save(dir, first + 3, {}, options);
      EXPECT_EQ(saver.wait().kind, AsyncSaveReport::Kind::kCommitted);
    }
  });
  for (const std::vector<std::string>* messages : {&reports, &thrown}) {
    EXPECT_EQ((*messages)[0], (*messages)[1]) << "every rank reports the same failure";
    EXPECT_THAT((*messages)[0], HasSubstr("rank 1: "));
    EXPECT_THAT((*messages)[0], HasSubstr("/step-"));
    EXPECT_THAT((*messages)[0], HasSubstr("rank00001.safetensors"));
    EXPECT_THAT((*messages)[0], HasSubstr("nothing was committed and `latest` still names the previous checkpoint"));
  }
  EXPECT_THAT(reports[0], HasSubstr("/step-2' failed (writing the files)"));
  EXPECT_THAT(thrown[0], HasSubstr("/step-6' failed (writing the files)"));
  EXPECT_EQ(read_text(dir + "/latest"), "step-7\n");
  std::cout << "[ rank 0 reported: " << reports[0] << " ]" << std::endl;
  remove_dir(dir);
}

// The save waited for failed in its background write, and the next one fails to start (phase 1: its
// directory lies under a regular file, which stops root too): one error on every rank names both, in
// the order they were made, each with its step directory.
TEST(AsyncCheckpoint, AFailedSaveIsStillReportedWhenTheNextSaveFailsToStart) {
  const std::string dir = scratch_dir("twice"), blocked = scratch_dir("twice-blocked");
  {
    std::ofstream(blocked) << "a file, not a directory";
  }
  const ZeroScenario s{.world = 2, .steps = 4};
  std::vector<std::string> thrown(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    CheckpointSaver saver(state_of(rank));
    CheckpointSaveOptions options;
    options.async_save = true;
    options.before_file_written = [&](const std::string& path) {
      if (mesh.rank() != 1) return;
      if (::geteuid() == 0) {
        ::mkdir(path.c_str(), 0755);
      } else {
        ::chmod(path.substr(0, path.rfind('/')).c_str(), 0555);
      }
    };
    rank.train(0, 1);
    saver.save(dir, 1, {}, options);
    rank.train(1, 2);
    options.before_file_written = nullptr;
    thrown[mesh.rank()] = error_of([&] { saver.save(blocked + "/sub", 2, {}, options); });
    EXPECT_FALSE(saver.pending());
  });
  EXPECT_EQ(thrown[0], thrown[1]) << "every rank reports the same failures";
  const std::string& m = thrown[0];
  const size_t first = m.find("checkpoint save of step 1 to '" + dir + "/step-1' failed (writing the files)");
  const size_t second =
      m.find("checkpoint save of step 2 to '" + blocked + "/sub/step-2' failed (preparing the directory)");
  EXPECT_NE(first, std::string::npos) << m;
  EXPECT_NE(second, std::string::npos) << m;
  EXPECT_LT(first, second) << "reported in the order the saves were made: " << m;
  EXPECT_THAT(m, HasSubstr("rank00001.safetensors"));
  std::cout << "[ rank 0 reported: " << m << " ]" << std::endl;
  ::chmod((dir + "/step-1").c_str(), 0755);
  remove_dir(dir);
  remove_dir(blocked);
}

// if_busy decides which collectives a rank runs next while a save is pending (wait for it, or look
// once and refuse): ranks that disagree are refused alike, naming each rank's value, and the pending
// save is committed as usual afterwards.
TEST(AsyncCheckpoint, RanksThatDisagreeOnIfBusyAreRefusedByNameAndThePendingSaveStillCommits) {
  const std::string dir = scratch_dir("if-busy");
  const ZeroScenario s{.world = 2, .steps = 4};
  std::vector<std::string> refusals(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    CheckpointSaver saver(state_of(rank));
    CheckpointSaveOptions held;
    held.async_save = true;
    auto latch = std::make_shared<Latch>();
    held.before_file_written = [latch](const std::string&) { latch->future.wait(); };
    rank.train(0, 1);
    saver.save(dir, 1, {}, held);
    rank.train(1, 2);
    CheckpointSaveOptions next;
    next.async_save = true;
    next.if_busy = mesh.rank() == 0 ? CheckpointSaveOptions::IfBusy::kWait : CheckpointSaveOptions::IfBusy::kRefuse;
    // Released from another thread, so that ranks that went separate ways (no agreement) do not wait
    // for each other forever.
    std::thread release([latch] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      latch->release();
    });
    refusals[mesh.rank()] = error_of([&] { saver.save(dir, 2, {}, next); });
    release.join();
    EXPECT_EQ(saver.wait().kind, AsyncSaveReport::Kind::kCommitted);
  });
  EXPECT_EQ(refusals[0], refusals[1]);
  EXPECT_THAT(refusals[0], HasSubstr("checkpoint save of step 2 to '" + dir +
                                     "/step-2' refused on every rank: the "
                                     "ranks disagree on if_busy"));
  EXPECT_THAT(refusals[0], HasSubstr("rank 0 wait, rank 1 refuse"));
  EXPECT_EQ(read_text(dir + "/latest"), "step-1\n");
  remove_dir(dir);
}

TEST(AsyncCheckpoint, ASaveStartedWhileThePreviousIsBeingWrittenIsRefusedByNameOrWaitsForIt) {
  const std::string dir = scratch_dir("busy");
  const ZeroScenario s{.world = 2, .steps = 8};
  std::vector<std::string> refusals(2);
  std::vector<double> waited(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    CheckpointSaver saver(state_of(rank));
    CheckpointSaveOptions held;
    held.async_save = true;
    auto latch = std::make_shared<Latch>();
    held.before_file_written = [latch](const std::string&) { latch->future.wait(); };
    rank.train(0, 1);
    saver.save(dir, 1, {}, held);
    rank.train(1, 2);
    CheckpointSaveOptions refuse;
    refuse.async_save = true;
    refuse.if_busy = CheckpointSaveOptions::IfBusy::kRefuse;
    refusals[mesh.rank()] = error_of([&] { saver.save(dir, 2, {}, refuse); });
    EXPECT_TRUE(saver.pending());
    latch->release();
    EXPECT_EQ(saver.wait().kind, AsyncSaveReport::Kind::kCommitted);

    // kWait (the default): the save of step 3 waits for step 2's writer, released 200 ms later.
    latch = std::make_shared<Latch>();
    held.before_file_written = [latch](const std::string&) { latch->future.wait(); };
    saver.save(dir, 2, {}, held);
    std::thread release([latch] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      latch->release();
    });
    rank.train(2, 3);
    CheckpointSaveOptions wait;
    wait.async_save = true;
    const AsyncSaveStart started = saver.save(dir, 3, {}, wait);
    release.join();
    EXPECT_EQ(started.previous.kind, AsyncSaveReport::Kind::kCommitted);
    EXPECT_EQ(started.previous.step, 2);
    waited[mesh.rank()] = started.wait_ms;
    EXPECT_EQ(saver.wait().kind, AsyncSaveReport::Kind::kCommitted);
  });
  EXPECT_EQ(refusals[0], refusals[1]);
  EXPECT_THAT(refusals[0],
              HasSubstr("checkpoint save of step 2 to '" + dir + "/step-2' refused: the save of step 1 to '" + dir +
                        "/step-1' is still being written"));
  EXPECT_THAT(refusals[0], HasSubstr("IfBusy::kWait"));
  EXPECT_GT(waited[0], 100.0);
  EXPECT_EQ(read_text(dir + "/latest"), "step-3\n");
  remove_dir(dir);
}

// The end of a run that leaves on an error: the saver cannot agree with the other ranks any more, so
// it does not commit; it waits for its writer and says, on every rank, that the save was abandoned.
TEST(AsyncCheckpoint, ASaverDestroyedWithASavePendingSaysOnEveryRankThatItWasAbandoned) {
  const std::string dir = scratch_dir("abandoned");
  const ZeroScenario s{.world = 2, .steps = 4};
  ::testing::internal::CaptureStderr();
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    rank.train(0, 1);
    auto latch = std::make_shared<Latch>();
    std::thread release;
    {
      CheckpointSaver saver(state_of(rank));
      saver.save(dir, 1);
      CheckpointSaveOptions held;
      held.async_save = true;
      held.before_file_written = [latch](const std::string&) { latch->future.wait(); };
      rank.train(1, 2);
      saver.save(dir, 2, {}, held);
      release = std::thread([latch] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        latch->release();
      });
    }  // destroyed with step 2 pending
    release.join();
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(err, HasSubstr("rank " + std::to_string(r) + ": the checkpoint save of step 2 to '" + dir +
                               "/step-2' was abandoned before its commit"));
  }
  EXPECT_EQ(read_text(dir + "/latest"), "step-1\n");
  struct stat st{};
  EXPECT_NE(::stat((dir + "/step-2/manifest.json").c_str(), &st), 0) << "an abandoned save is never complete";
  remove_dir(dir);
}
