// Whole-state loads where one rank differs (plugin/training_checkpoint.h): a rank that fails between the
// reader's constructor and read() (here: its optimizer is not the saved one) makes every rank throw
// its error instead of leaving the others waiting in read(); resume_checkpoint starts fresh only
// when no rank finds a checkpoint. A Linear under DDP with torch optimizers; ranks are threads.
#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_checkpoint.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

struct LinearRank {
  LinearRank(DeviceMesh& mesh, bool sgd) {
    {
      static std::mutex mutex;  // the default generator is process-global; ranks are threads
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(3);
      model = torch::nn::Linear(4, 2);
    }
    ddp = std::make_unique<DistributedDataParallel<torch::nn::LinearImpl>>(model.ptr(), mesh, "dp");
    if (sgd) {
      optimizer =
          std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
    } else {
      optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
    }
  }
  void train(int steps) {
    for (int i = 0; i < steps; ++i) {
      ddp->zero_grad_buffer();
      ddp->forward(torch::ones({2, 4}) * (i + 1)).square().sum().backward();
      ddp->finish_grad_sync();
      optimizer->step();
    }
  }
  TrainingState state() { return {model.ptr().get(), ddp.get(), nullptr, optimizer.get()}; }
  torch::nn::Linear model{nullptr};
  std::unique_ptr<DistributedDataParallel<torch::nn::LinearImpl>> ddp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

}  // namespace

// Rank 1 resumes with SGD from an AdamW checkpoint: it fails before read(), where rank 0 waits.
// Before: rank 0 hung in read()'s agreement until the collective timeout.
TEST(CheckpointAgreement, ARankThatFailsBeforeReadMakesEveryRankThrowItsError) {
  const std::string dir = fresh_dir("agree-before-read");
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    LinearRank rank(mesh, /*sgd=*/false);
    rank.train(2);
    save_checkpoint(rank.state(), dir, 2);
  });
  std::vector<std::string> errors(2, "(no error)");
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    LinearRank rank(mesh, /*sgd=*/mesh.rank() == 1);
    try {
      load_checkpoint(rank.state(), dir);
    } catch (const c10::Error& e) {
      errors[mesh.rank()] = e.what_without_backtrace();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_THAT(e, HasSubstr("checkpoint load from '" + dir + "/step-2' failed; nothing was loaded on any rank:"));
    EXPECT_THAT(e, HasSubstr("rank 1: checkpoint '" + dir + "/step-2' holds adamw state but this optimizer is sgd"));
  }
  remove_dir(dir);
}

// resume_checkpoint: nothing in the directory is a fresh start (nullopt, on every rank); a checkpoint
// is loaded (the one asked for, when a step is given).
TEST(CheckpointAgreement, ResumeStartsFreshOnlyWhenNoRankFindsACheckpoint) {
  const std::string dir = fresh_dir("agree-resume");
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    LinearRank rank(mesh, false);
    EXPECT_FALSE(resume_checkpoint(rank.state(), dir).has_value());
    rank.train(1);
    save_checkpoint(rank.state(), dir, 1);
    rank.train(1);
    save_checkpoint(rank.state(), dir, 2);
  });
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    LinearRank rank(mesh, false);
    EXPECT_EQ(resume_checkpoint(rank.state(), dir)->step, 2);
    EXPECT_EQ(resume_checkpoint(rank.state(), dir, 1)->step, 1);
  });
  remove_dir(dir);
}
