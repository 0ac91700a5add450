// ZeRO-2 (the "optim_grads" sharding strategy, Note [Sharded gradients] in grad_buffer/grad_shards.cpp)
// on CUDA tensors: the pooled whole-bucket blocks, the shard buffers and the DistributedOptimizer's
// fused AdamW on the shards all live on the GPU. Without a CUDA device every test skips, saying so.
//   - World size 1 on NCCL with every collective forced: each bucket's reduce-scatter copies its block
//     into the separate shard buffer on NCCL's stream, and the block goes back to the pool and is
//     zeroed for the next bucket on the current stream, so a missing stream wait shows in the data.
//     One and two micro-batches (the second flushes each micro-batch's buckets from a callback queued
//     on the autograd engine). At DP 1 the shards are "optim"'s bit for bit (0 + g, then + g').
//   - 4 ranks as threads sharing the one GPU over Gloo with CUDA tensors (the reduction really sums):
//     bit for bit "optim"'s without accumulation (the same reduce-scatter of the same bucket).
//   - Nothing allocated from the device per step once warm: the pool's blocks are reused.
//   - ZeRO-3 ("optim_grads_params") the same ways: at world size 1 bit for bit "optim"'s; on 4 Gloo
//     ranks within the golden's tolerance (its units move bucket edges, so sums may be reordered).
// Golden: torch::optim::AdamW on the whole batch on the same GPU; tolerance 1e-5 as tests/gpu/gpu_test.cpp
// (GEMMs over different batch shapes sum in different orders; the fused kernel is a few ulps from ATen).
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/param_buffer.h"
#include "grad_buffer/sharded_params.h"
#include "mesh/switches.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <cstdlib>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 32, kHidden = 64, kOut = 8, kBatch = 64;
constexpr int kSteps = 6;
constexpr double kLr = 1e-2, kWeightDecay = 0.01;

#define SKIP_WITHOUT_GPU()                                                   \
  if (!torch::cuda::is_available())                                          \
  GTEST_SKIP() << "no CUDA device on this machine: the GPU path is checked " \
                  "by scripts/gpu_check.sh on a GPU machine"

const bool kForceCollectives = (override_switch_for_testing(Switch::kForceCollectives, true), true);

struct Trained {
  std::vector<torch::Tensor> params;  // on CPU
  bool shards_on_cuda = false;
  int64_t device_allocs_after_warmup = -1;  // cudaMalloc calls in steps 2..kSteps-1
};

// `micro_batches` micro-batches per step of this rank's rows, each a slice of them; the loss of each is
// divided by their count, so the step's gradient is the mean over the rank's rows as in the golden.
Trained train(DeviceMesh& mesh, const char* strategy, int micro_batches) {
  Mlp model = make_mlp(3, kIn, kHidden, kOut);
  model->to(torch::kCUDA);
  DdpConfig config;
  config.bucket_bytes = 4096;
  config.data_parallel_sharding_strategy = strategy;
  DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
  DistributedOptimizerConfig oc;
  oc.kind = OptimizerKind::kAdamW;
  oc.lr = kLr;
  oc.weight_decay = kWeightDecay;  // fused_step kAuto: the fused kernel on CUDA shards
  DistributedOptimizer optimizer(ddp.grad_buffer(), oc);
  const int64_t dp = mesh.size("dp"), r = mesh.coordinate("dp");
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    if (step == 2) {
      torch::cuda::synchronize();
      out.device_allocs_after_warmup = -c10::cuda::CUDACachingAllocator::getDeviceStats(0).num_device_alloc;
    }
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(3, step, kBatch, kIn, kOut);
    x = shard_rows(x, r, dp).cuda();
    y = shard_rows(y, r, dp).cuda();
    for (int m = 0; m < micro_batches; ++m) {
      ddp.set_is_last_microbatch(m == micro_batches - 1);
      const torch::Tensor loss =
          torch::mse_loss(ddp.forward(shard_rows(x, m, micro_batches)), shard_rows(y, m, micro_batches));
      (loss / micro_batches).backward();
    }
    EXPECT_FALSE(optimizer.step().skipped) << strategy << ", step " << step;
  }
  optimizer.finish_param_sync();
  torch::cuda::synchronize();
  out.device_allocs_after_warmup += c10::cuda::CUDACachingAllocator::getDeviceStats(0).num_device_alloc;
  out.shards_on_cuda = ddp.grad_buffer()->bucket_shard(0).is_cuda();
  // "optim_grads_params" released every unit at the step: gathered on every rank before they are read.
  const ParamBuffer* param_buffer = ddp.grad_buffer()->param_buffer();
  if (ShardedParams* sharded = param_buffer ? param_buffer->sharded() : nullptr) sharded->gather_all();
  for (auto& p : model->parameters()) out.params.push_back(p.detach().cpu());
  return out;
}

std::vector<torch::Tensor> golden_on_gpu() {
  Mlp model = make_mlp(3, kIn, kHidden, kOut);
  model->to(torch::kCUDA);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
  for (int step = 0; step < kSteps; ++step) {
    optimizer.zero_grad();
    auto [x, y] = make_batch(3, step, kBatch, kIn, kOut);
    torch::mse_loss(model->forward(x.cuda()), y.cuda()).backward();
    optimizer.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().cpu());
  return out;
}

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& golden,
                  const std::string& what) {
  double max_diff = 0;
  for (size_t i = 0; i < got.size(); ++i)
    max_diff = std::max(max_diff, (got[i] - golden[i]).abs().max().item<double>());
  std::cout << "[ " << what << ": max |gpu run - golden| = " << max_diff << " ]" << std::endl;
  EXPECT_LE(max_diff, 1e-5) << what;
}

void expect_identical(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i], want[i]))
        << what << ": param " << i << " differs from \"optim\"'s by " << (got[i] - want[i]).abs().max().item<double>();
  }
}

// A 1-D mesh of one rank on GPU 0 with NCCL groups.
DeviceMesh world_one_nccl_mesh() {
  EXPECT_TRUE(kForceCollectives);
  setenv("LOCAL_RANK", "0", 1);
  MeshOptions options;
  options.device_type = c10::DeviceType::CUDA;
  options.timeout = kTestTimeout;
  return DeviceMesh::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, {1}, {"dp"}, options);
}

Trained train_world_one_nccl(const char* strategy, int micro_batches) {
  DeviceMesh mesh = world_one_nccl_mesh();
  return train(mesh, strategy, micro_batches);
}

// `strategy` at world size 1 on NCCL, 1 and 2 micro-batches: bit for bit "optim"'s, and the golden.
void expect_world_one_nccl_is_optim_and_golden(const char* strategy) {
  const auto golden = golden_on_gpu();
  for (int micro_batches : {1, 2}) {
    const std::string what =
        std::string(strategy) + ", " + std::to_string(micro_batches) + " micro-batch(es), NCCL at world size 1";
    const Trained sharded = train_world_one_nccl(strategy, micro_batches);
    EXPECT_TRUE(sharded.shards_on_cuda) << what;
    expect_identical(sharded.params, train_world_one_nccl(kShardOptim, micro_batches).params, what);
    expect_close(sharded.params, golden, what);
  }
}

}  // namespace

TEST(GpuShardedGrads, OptimGradsWithNcclAtWorldSizeOneIsOptimBitForBitAndMatchesGolden) {
  SKIP_WITHOUT_GPU();
  expect_world_one_nccl_is_optim_and_golden(kShardOptimGrads);
}

// ZeRO-3 (Note [Sharded parameters], grad_buffer/sharded_params.h) on CUDA: each unit's storage is
// released (its bytes freed) after an NCCL all-gather into it, and gathered again on use in backward.
// At one rank the units' bucket edges change no sum, so the params equal "optim"'s bit for bit.
TEST(GpuShardedGrads, OptimGradsParamsWithNcclAtWorldSizeOneIsOptimBitForBitAndMatchesGolden) {
  SKIP_WITHOUT_GPU();
  expect_world_one_nccl_is_optim_and_golden(kShardOptimGradsParams);
}

TEST(GpuShardedGrads, OptimGradsOverGlooWithCudaTensorsOnFourRanksIsOptimBitForBitAndMatchesGolden) {
  SKIP_WITHOUT_GPU();
  const auto golden = golden_on_gpu();
  std::vector<Trained> sharded(4), optim(4), params_sharded(4);
  run_on_mesh({4}, {"dp"}, [&](DeviceMesh& mesh) {
    sharded[mesh.rank()] = train(mesh, kShardOptimGrads, 1);
    optim[mesh.rank()] = train(mesh, kShardOptim, 1);
    params_sharded[mesh.rank()] = train(mesh, kShardOptimGradsParams, 1);
  });
  for (int r = 0; r < 4; ++r) {
    const std::string what = "optim_grads on 4 ranks over Gloo, rank " + std::to_string(r);
    EXPECT_TRUE(sharded[r].shards_on_cuda) << what;
    expect_identical(sharded[r].params, optim[r].params, what);
    expect_close(sharded[r].params, golden, what);
    // Under ZeRO-3 the units move bucket edges, so Gloo may sum some elements in another order: the
    // golden's tolerance, not bit for bit.
    expect_close(params_sharded[r].params, golden,
                 "optim_grads_params on 4 ranks over Gloo, rank " + std::to_string(r));
  }
}

// Two micro-batches a step: every micro-batch takes blocks from the pool and gives them back.
TEST(GpuShardedGrads, NoDeviceAllocationPerStepAfterWarmUp) {
  SKIP_WITHOUT_GPU();
  const Trained sharded = train_world_one_nccl(kShardOptimGrads, 2);
  EXPECT_EQ(sharded.device_allocs_after_warmup, 0)
      << "cudaMalloc calls during steps 2.." << kSteps << " (the pool's blocks must be reused)";
}
