// Asynchronous checkpoint saves of CUDA tensors (checkpoint/async_save.h): the snapshot is a copy into
// host buffers (pinned for CUDA pieces) taken at the step boundary, so the file holds the values of
// that moment although the tensors change on the GPU while the writer thread is held; a second save
// of the same pieces reuses the buffers (the host memory held stays the same) and writes the new
// values. Two ranks as threads share the one GPU over Gloo; each piece is read back through the
// checkpoint reader and compared bit for bit with a CPU copy taken at the save.
#include "checkpoint/async_save.h"
#include "mesh/device_mesh.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <future>

using namespace meshddp;
using namespace meshddp::test;

#define SKIP_WITHOUT_GPU()                                                   \
  if (!torch::cuda::is_available())                                          \
  GTEST_SKIP() << "no CUDA device on this machine: the GPU path is checked " \
                  "by scripts/gpu_check.sh on a GPU machine"

namespace {

// This rank's pieces: an fp32 and a bf16 CUDA tensor, each whole on this rank (keys per rank).
std::vector<CheckpointTensor> pieces_of(int64_t rank, const torch::Tensor& w, const torch::Tensor& h) {
  std::vector<CheckpointTensor> out;
  for (const auto& [name, t] : {std::pair{"w", w}, std::pair{"h", h}}) {
    CheckpointTensor c;
    c.key = "model/rank" + std::to_string(rank) + "." + name;
    c.data = t.reshape({-1});
    c.global_shape = t.sizes().vec();
    c.begin = 0;
    c.end = t.numel();
    out.push_back(c);
  }
  return out;
}

// Reads this rank's pieces back into CPU tensors and compares them with `expected` bit for bit.
void expect_saved(const CheckpointMesh& cm, const std::string& dir, int64_t step, int64_t rank,
                  const std::vector<torch::Tensor>& expected) {
  CheckpointReader reader(cm, dir, step);
  std::vector<CheckpointTensor> wanted = pieces_of(rank, expected[0], expected[1]);
  std::set<std::string> keys;
  for (int64_t r = 0; r < cm.world->getSize(); ++r) {
    keys.insert("model/rank" + std::to_string(r) + ".w");
    keys.insert("model/rank" + std::to_string(r) + ".h");
  }
  const std::vector<torch::Tensor> got = reader.read(wanted, keys);
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(torch::equal(got[i].reshape(expected[i].sizes()), expected[i]))
        << wanted[i].key << " of step " << step << " is not the value at the save's step boundary";
  }
}

}  // namespace

TEST(GpuAsyncSave, SnapshotsCudaTensorsAtTheStepBoundaryIntoReusedHostBuffers) {
  SKIP_WITHOUT_GPU();
  const std::string dir = fresh_dir("gpu-async-save");
  std::promise<void> released;
  std::shared_future<void> release = released.get_future().share();
  std::atomic<int> held{0};
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    const int64_t rank = mesh.rank();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(17 + rank);
    torch::Tensor w = torch::randn({1000, 33}, gen).cuda();
    torch::Tensor h = torch::randn({257}, gen).to(torch::kBFloat16).cuda();
    const CheckpointMesh cm{mesh.world(), rank, 2, 0, 1};
    AsyncCheckpointSave saver(cm);
    CheckpointSaveOptions options;
    options.async_save = true;
    options.before_file_written = [&](const std::string&) {
      ++held;
      release.wait();
    };
    const std::vector<torch::Tensor> at_step1{w.cpu().clone(), h.cpu().clone()};
    saver.start(dir, CheckpointMeta{1, {}, std::nullopt}, pieces_of(rank, w, h), options);
    const int64_t held_bytes = saver.snapshot_bytes();
    EXPECT_EQ(held_bytes, w.numel() * 4 + h.numel() * 2);
    w.mul_(-3).add_(1);  // the GPU changes the state while the writer waits
    h.add_(2);
    torch::cuda::synchronize();
    if (rank == 0) {
      while (held.load() < 2) std::this_thread::yield();
      released.set_value();
    }
    AsyncSaveReport r = saver.wait();
    ASSERT_EQ(r.kind, AsyncSaveReport::Kind::kCommitted) << r.message;
    expect_saved(cm, dir, 1, rank, at_step1);

    options.before_file_written = nullptr;
    const std::vector<torch::Tensor> at_step2{w.cpu().clone(), h.cpu().clone()};
    saver.start(dir, CheckpointMeta{2, {}, std::nullopt}, pieces_of(rank, w, h), options);
    EXPECT_EQ(saver.snapshot_bytes(), held_bytes) << "the second save of the same pieces must reuse the host buffers";
    r = saver.wait();
    ASSERT_EQ(r.kind, AsyncSaveReport::Kind::kCommitted) << r.message;
    expect_saved(cm, dir, 2, rank, at_step2);
  });
}
