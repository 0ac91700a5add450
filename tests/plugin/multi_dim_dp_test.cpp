// DistributedDataParallel over several DP dims (context parallel: {"dp", "cp"}) against the golden:
// the same MLP trained in one process on the whole global batch. On a dp 2 x cp 2 x tp 1 mesh of
// rank threads, each (DP, CP) rank takes its own quarter of the batch (a stand-in for a CP slice:
// equal slices, so the DP x CP mean is the whole batch's mean). Gradients must be the golden's mean,
// which they are only if they are averaged over the flattened DP x CP group with the 1/(dp*cp) scale.
//
// Tolerance: as ddp_training_test.cpp (fp32 sums split differently: a few ulps per step; 1e-6
// absolute + relative). Averaging over DP only leaves O(0.1) differences in the gradients.
#include "grad_buffer/grad_buffer.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/tp_dim.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 12, kHidden = 24, kOut = 6, kBatch = 32;
constexpr uint64_t kSeed = 99;
constexpr double kFp32Atol = 1e-6, kFp32Rtol = 1e-6;
constexpr int kSteps = 3;
constexpr double kLr = 0.1;

// One-process SGD on the whole batch; returns the params after kSteps and the first step's grads.
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> golden() {
  Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
  std::vector<torch::Tensor> first_grads;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
    torch::mse_loss(model->forward(x), y).backward();
    if (step == 0) {
      for (auto& p : model->parameters()) first_grads.push_back(p.grad().clone());
    }
    opt.step();
  }
  std::vector<torch::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  return {params, first_grads};
}

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                  const std::string& what, int64_t rank) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got[i], want[i], kFp32Rtol, kFp32Atol))
        << what << " " << i << " on rank " << rank << ": max |diff| " << (got[i] - want[i]).abs().max().item<double>();
  }
}

// Trains on a dp 2 x cp 2 x tp 1 mesh with DDP over {"dp", "cp"} (ZeRO-1 SGD or torch's SGD) and
// checks every rank's first-step gradients and final params against the golden.
void expect_dp_x_cp_matches_golden(bool zero1) {
  const auto [want_params, want_grads] = golden();
  run_on_mesh({2, 2, 1}, {"dp", "cp", "tp"}, [&](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed + mesh.rank() * 17, kIn, kHidden, kOut);  // DDP broadcasts rank 0's
    DdpConfig config;
    config.bucket_bytes = 1024;
    config.use_distributed_optimizer = zero1;
    DistributedDataParallel ddp(model.ptr(), mesh, {"dp", "cp"}, config);
    EXPECT_EQ(ddp.dp_group().getSize(), 4);
    std::unique_ptr<DistributedOptimizer> distributed;
    std::unique_ptr<torch::optim::SGD> plain;
    if (zero1) {
      DistributedOptimizerConfig oc;
      oc.kind = OptimizerKind::kSgd;
      oc.lr = kLr;
      distributed = std::make_unique<DistributedOptimizer>(ddp.grad_buffer(), oc);
    } else {
      plain = std::make_unique<torch::optim::SGD>(ddp.parameters(), torch::optim::SGDOptions(kLr));
    }
    // Rank (d, c) of the flattened DP x CP group takes quarter d * 2 + c of the batch.
    const int64_t slice = mesh.coordinate("dp") * 2 + mesh.coordinate("cp");
    for (int step = 0; step < kSteps; ++step) {
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      torch::mse_loss(ddp.forward(shard_rows(x, slice, 4)), shard_rows(y, slice, 4)).backward();
      if (zero1) {
        distributed->step();
      } else {
        ddp.finish_grad_sync();
        if (step == 0) {
          std::vector<torch::Tensor> grads;
          for (const auto& p : ddp.named_parameters()) grads.push_back(ddp.main_grad(p.name).clone());
          expect_close(grads, want_grads, "gradient", mesh.rank());
        }
        plain->step();
      }
    }
    if (zero1) distributed->finish_param_sync();
    std::vector<torch::Tensor> params;
    for (auto& p : model->parameters()) params.push_back(p.detach().clone());
    expect_close(params, want_params, "param", mesh.rank());
  });
}

}  // namespace

TEST(DistributedDataParallelOverDpAndCp, AveragesGradientsOverTheFlattenedDpXCpGroupLikeOneProcess) {
  expect_dp_x_cp_matches_golden(/*zero1=*/false);
}

TEST(DistributedDataParallelOverDpAndCp, DistributedOptimizerShardsOverDpXCpAndMatchesOneProcessSgd) {
  expect_dp_x_cp_matches_golden(/*zero1=*/true);
}

TEST(DistributedDataParallelOverDpAndCp, TpIsTheOneDimOutsideEveryDpDim) {
  EXPECT_EQ(tp_dim_of({"dp", "cp", "tp"}, {2, 2, 2}, std::vector<std::string>{"dp", "cp"}), "tp");
  EXPECT_EQ(tp_dim_of({"dp", "cp", "tp"}, {2, 2, 1}, std::vector<std::string>{"dp", "cp"}), "");
  const std::vector<std::string> dp_cp{"dp", "cp"};
  EXPECT_THAT(error_of([&] { tp_dim_of({"dp", "cp", "tp", "pp"}, {2, 2, 2, 2}, dp_cp); }),
              testing::HasSubstr("the mesh (dp=2, cp=2, tp=2, pp=2) has 2 dims besides the DP dims 'dp', 'cp' with "
                                 "more than one rank"));
  EXPECT_THAT(error_of([] { tp_dim_of({"dp", "cp", "tp"}, {2, 2, 2}, std::vector<std::string>{"dp", "cq"}); }),
              testing::HasSubstr("the mesh (dp=2, cp=2, tp=2) has no dim named 'cq' (one of the DP dims 'dp', 'cq')"));
}

TEST(DistributedDataParallelOverDpAndCp, RefusesAnUnknownDpDimNamingItBeforeAnyCollective) {
  run_on_mesh({2, 2, 1}, {"dp", "cp", "tp"}, [&](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    EXPECT_THAT(error_of([&] { DistributedDataParallel ddp(model.ptr(), mesh, {"dp", "cq"}); }),
                testing::HasSubstr("DistributedDataParallel: the mesh (dp=2, cp=2, tp=1) has no dim named 'cq' "
                                   "(one of the DP dims 'dp', 'cq')"));
  });
}
