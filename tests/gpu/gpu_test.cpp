// The GPU path, for a machine with a CUDA device (scripts/gpu_check.sh runs it there). Without one
// every test skips, saying so. Golden: the same model trained in one process on the same GPU.
//   - DDP and ZeRO-1 at world size 1 with NCCL groups;
//   - 4 ranks (threads) sharing the one GPU with Gloo groups and CUDA tensors (NCCL cannot put two
//     ranks on one GPU);
//   - bf16 params with fp32 main grads: the weight-gradient GEMM writes fp32 into the slot (out_dtype);
//   - nothing allocated from the device per step once warm (the caching allocator makes no new
//     cudaMalloc after the first steps: activations reuse its blocks; the flat buffers were made once).
// Tolerance 1e-5: GPU matmuls of different batch shapes (per-rank shards vs the whole batch) sum in
// different orders; fp32, 10 steps.
#include "grad_buffer/grad_buffer.h"
#include "mesh/collectives.h"
#include "mesh/switches.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"
#include "tp/linear_with_grad_in_buffer.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <cstdlib>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 32, kHidden = 64, kOut = 8, kBatch = 64;
constexpr int kSteps = 10;

#define SKIP_WITHOUT_GPU()                                                   \
  if (!torch::cuda::is_available())                                          \
  GTEST_SKIP() << "no CUDA device on this machine: the GPU path is checked " \
                  "by scripts/gpu_check.sh on a GPU machine"

// The goldens' optimizers, and the same for ZeRO-1: SGD with momentum, or AdamW.
std::unique_ptr<torch::optim::Optimizer> torch_optimizer(Mlp& model, bool adamw) {
  if (adamw) {
    return std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                 torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

DistributedOptimizerConfig zero_config(bool adamw) {
  DistributedOptimizerConfig oc;
  if (adamw) {
    oc.kind = OptimizerKind::kAdamW;
    oc.lr = 1e-2;
    oc.weight_decay = 0.01;
  } else {
    oc.kind = OptimizerKind::kSgd;
    oc.lr = 0.05;
    oc.momentum = 0.9;
  }
  return oc;
}

std::vector<torch::Tensor> golden_on_gpu(bool adamw = false) {
  Mlp model = make_mlp(3, kIn, kHidden, kOut);
  model->to(torch::kCUDA);
  auto opt = torch_optimizer(model, adamw);
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    auto [x, y] = make_batch(3, step, kBatch, kIn, kOut);
    torch::mse_loss(model->forward(x.cuda()), y.cuda()).backward();
    opt->step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().cpu());
  return out;
}

// Trains on this rank's shard with DDP (optionally ZeRO-1 with the same optimizer, its param
// all-gathers optionally overlapped with the next forward); returns params on CPU.
std::vector<torch::Tensor> train_rank(DeviceMesh& mesh, bool zero1, int64_t* allocs_after_warmup = nullptr,
                                      bool overlap_param_gather = false, bool adamw = false) {
  Mlp model = make_mlp(3, kIn, kHidden, kOut);
  model->to(torch::kCUDA);
  DdpConfig config;
  config.bucket_bytes = 4096;
  config.use_distributed_optimizer = zero1;
  DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
  std::unique_ptr<torch::optim::Optimizer> plain;
  std::unique_ptr<DistributedOptimizer> zero;
  if (zero1) {
    DistributedOptimizerConfig oc = zero_config(adamw);
    oc.overlap_param_gather = overlap_param_gather;  // fused_step kAuto: the fused kernels on CUDA
    zero = std::make_unique<DistributedOptimizer>(ddp.grad_buffer(), oc);
  } else {
    plain = torch_optimizer(model, adamw);
  }
  const int64_t dp = mesh.size("dp"), r = mesh.coordinate("dp");
  for (int step = 0; step < kSteps; ++step) {
    if (step == 2 && allocs_after_warmup) {
      torch::cuda::synchronize();
      *allocs_after_warmup = -c10::cuda::CUDACachingAllocator::getDeviceStats(0).num_device_alloc;
    }
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(3, step, kBatch, kIn, kOut);
    torch::mse_loss(ddp.forward(shard_rows(x, r, dp).cuda()), shard_rows(y, r, dp).cuda()).backward();
    if (zero) {
      EXPECT_FALSE(zero->step().skipped) << "step " << step;
    } else {
      ddp.finish_grad_sync();
      plain->step();
    }
  }
  if (zero) zero->finish_param_sync();
  torch::cuda::synchronize();
  if (allocs_after_warmup) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    *allocs_after_warmup += stats.num_device_alloc;
  }
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().cpu());
  return out;
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double max_diff = 0;
  for (size_t i = 0; i < a.size(); ++i) max_diff = std::max(max_diff, (a[i] - b[i]).abs().max().item<double>());
  std::cout << "[ max |gpu run - golden| = " << max_diff << " ]" << std::endl;
  EXPECT_LE(max_diff, 1e-5);
}

// At world size 1 meshddp skips its collectives; this binary forces them (MESHDDP_FORCE_COLLECTIVES,
// mesh/switches.h; set before main) so the NCCL runs exercise the bucket collectives, the param
// all-gather and their stream ordering on the one GPU.
const bool kForceCollectives = (override_switch_for_testing(Switch::kForceCollectives, true), true);

// A 1-D mesh of one rank on GPU 0 with NCCL groups.
DeviceMesh world_one_nccl_mesh() {
  EXPECT_TRUE(kForceCollectives);
  setenv("LOCAL_RANK", "0", 1);
  MeshOptions options;
  options.device_type = c10::DeviceType::CUDA;
  options.timeout = kTestTimeout;
  return DeviceMesh::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, {1}, {"dp"}, options);
}

std::vector<torch::Tensor> run_world_one_nccl(bool zero1, int64_t* allocs = nullptr, bool overlap_param_gather = false,
                                              bool adamw = false) {
  DeviceMesh mesh = world_one_nccl_mesh();
  return train_rank(mesh, zero1, allocs, overlap_param_gather, adamw);
}

}  // namespace

TEST(Gpu, DdpWithNcclAtWorldSizeOneMatchesGolden) {
  SKIP_WITHOUT_GPU();
  expect_close(run_world_one_nccl(false), golden_on_gpu());
}

TEST(Gpu, ZeroOneWithNcclAtWorldSizeOneMatchesGolden) {
  SKIP_WITHOUT_GPU();
  expect_close(run_world_one_nccl(true), golden_on_gpu());
}

// The all-gathers run on NCCL's stream; the next forward's kernels must wait for them (at world size
// 1 the data does not change, so this checks the waits run and NCCL accepts the order, not the data).
TEST(Gpu, ZeroOneWithOverlappedParamGatherWithNcclAtWorldSizeOneMatchesGolden) {
  SKIP_WITHOUT_GPU();
  expect_close(run_world_one_nccl(true, nullptr, /*overlap_param_gather=*/true), golden_on_gpu());
}

// The data check of the same order: Gloo's CUDA all-gather copies each rank's new params back into the
// param buffer on a stream of its own, after the step returns; a forward that did not wait for it
// would read the last step's weights on 3 of 4 ranks and drift from the golden.
TEST(Gpu, ZeroOneWithOverlappedParamGatherOverGlooWithCudaTensorsOnFourRanksMatchesGolden) {
  SKIP_WITHOUT_GPU();
  auto golden = golden_on_gpu();
  std::vector<std::vector<torch::Tensor>> per_rank(4);
  run_on_mesh({4}, {"dp"}, [&](DeviceMesh& mesh) {
    per_rank[mesh.rank()] = train_rank(mesh, /*zero1=*/true, nullptr, /*overlap_param_gather=*/true);
  });
  for (int r = 0; r < 4; ++r) expect_close(per_rank[r], golden);
}

TEST(Gpu, DdpWithGlooAndCudaTensorsOnFourRanksMatchesGolden) {
  SKIP_WITHOUT_GPU();
  auto golden = golden_on_gpu();
  for (bool zero1 : {false, true}) {
    std::vector<std::vector<torch::Tensor>> per_rank(4);
    run_on_mesh({4}, {"dp"}, [&](DeviceMesh& mesh) { per_rank[mesh.rank()] = train_rank(mesh, zero1); });
    for (int r = 0; r < 4; ++r) expect_close(per_rank[r], golden);
  }
}

TEST(Gpu, NoDeviceAllocationPerStepAfterWarmUp) {
  SKIP_WITHOUT_GPU();
  int64_t device_allocs = -1;
  run_world_one_nccl(true, &device_allocs);
  EXPECT_EQ(device_allocs, 0) << "cudaMalloc calls during steps 2.." << kSteps << " (the hot path must reuse memory)";
}

// bf16 params with fp32 main grads: linear_with_grad_in_buffer's GEMM writes the weight gradient into
// the fp32 slot from the bf16 operands (at::mm_out / addmm_out with out_dtype, CUDA only), the bias by
// an fp32 sum; two micro-batches, the second accumulating. Reference: the same products in fp32 from
// the bf16 operands cast up (exact products; only the summation order differs: rtol 1e-5).
namespace {
struct Bf16LinearImpl : torch::nn::Module {
  Bf16LinearImpl() {
    torch::manual_seed(11);
    fc = register_module("fc", torch::nn::Linear(64, 32));
    fc->to(torch::kCUDA, torch::kBFloat16);
  }
  torch::Tensor forward(torch::Tensor x) { return linear_with_grad_in_buffer(x, fc->weight, fc->bias); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Bf16Linear);
}  // namespace

TEST(Gpu, Bf16ParamsWithFp32MainGradsAreWrittenInPlaceInFp32) {
  SKIP_WITHOUT_GPU();
  run_on_mesh({1}, {"dp"}, [&](DeviceMesh& mesh) {
    Bf16Linear model;
    DdpConfig config;
    config.grad_reduce_in_fp32 = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    at::Tensor ref_w = torch::zeros({32, 64}, torch::kCUDA), ref_b = torch::zeros({32}, torch::kCUDA);
    ddp.zero_grad_buffer();
    for (int m = 0; m < 2; ++m) {
      torch::manual_seed(200 + m);
      const at::Tensor x = torch::randn({48, 64}, torch::kCUDA).to(torch::kBFloat16);
      ddp.set_is_last_microbatch(m == 1);
      ddp.forward(x).to(torch::kFloat).pow(2).sum().backward();
      const at::Tensor g = (2 * at::linear(x, model->fc->weight.detach(), model->fc->bias.detach()).to(torch::kFloat))
                               .to(torch::kBFloat16);
      ref_w += g.t().to(torch::kFloat).mm(x.to(torch::kFloat));
      ref_b += g.to(torch::kFloat).sum(0);
    }
    ddp.finish_grad_sync();
    EXPECT_EQ(ddp.grad_buffer()->stats().grads_written_in_place, 2) << "weight and bias written into their fp32 slots";
    const at::Tensor w = ddp.main_grad("fc.weight"), b = ddp.main_grad("fc.bias");
    ASSERT_EQ(w.scalar_type(), torch::kFloat);
    const double w_err = ((w - ref_w).abs().max() / ref_w.abs().max()).item<double>();
    const double b_err = ((b - ref_b).abs().max() / ref_b.abs().max()).item<double>();
    std::cout << "[ relative max |diff|: weight " << w_err << ", bias " << b_err << " ]" << std::endl;
    EXPECT_LE(w_err, 1e-5);
    EXPECT_LE(b_err, 1e-5);
  });
}

// Stream order with data that moves at world size 1: on NCCL, wait_collective is a stream wait (the
// host goes on, Note [Waiting on NCCL]). The input of an all-gather into a separate output is written
// by a slow GEMM on the current stream just before the launch, and the output is read on the current
// stream right after the wait. If NCCL's stream did not wait for the GEMM, the output would hold the
// old input (zeros); if the current stream did not wait for NCCL, the read would race NCCL's kernel
// (both become runnable when the GEMM ends) and could see the output's old contents (-1). Five
// rounds, all-gather and reduce-scatter.
TEST(Gpu, NcclWaitOrdersTheCurrentStreamAfterTheCollectiveWithDataThatMoves) {
  SKIP_WITHOUT_GPU();
  DeviceMesh mesh = world_one_nccl_mesh();
  c10d::ProcessGroup& group = *mesh["dp"];
  ASSERT_EQ(group.getBackendType(), c10d::ProcessGroup::BackendType::NCCL);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor a = torch::randn({4096, 4096}, cuda) / 64;
  for (int round = 0; round < 5; ++round) {
    torch::Tensor input = torch::zeros({1 << 20}, cuda);
    torch::Tensor gathered = torch::full({1 << 20}, -1.0, cuda);
    torch::Tensor scattered = torch::full({1 << 20}, -1.0, cuda);
    torch::cuda::synchronize();
    torch::Tensor slow = a;
    for (int k = 0; k < 8; ++k) slow = torch::mm(slow, a);  // ~1 TFLOP in fp32: milliseconds
    input.copy_(slow.flatten().narrow(0, 0, 1 << 20));
    wait_collective(all_gather_into(group, gathered, input, "the ordering test's all-gather"), group, "all-gather");
    wait_collective(reduce_scatter_sum(group, scattered, input.clone(), "the ordering test's reduce-scatter"), group,
                    "reduce-scatter");
    const bool gathered_ok = torch::equal(gathered, input);  // reads on the current stream
    const bool scattered_ok = torch::equal(scattered, input);
    EXPECT_TRUE(gathered_ok) << "round " << round << ": the all-gather's output is not its input";
    EXPECT_TRUE(scattered_ok) << "round " << round << ": the reduce-scatter's output is not its input";
  }
}

// ZeRO-1 with AdamW on CUDA: the DistributedOptimizer steps its shards with the fused AdamW kernel
// (FusedStep::kAuto on CUDA), against torch::optim::AdamW on the whole batch, 10 steps at world size 1
// on NCCL. Tolerance 1e-5 as above (AdamW normalizes the step, so the params move by ~lr per step;
// the kernel is within a few ulps of ATen's per step: FusedStepCuda.*).
TEST(Gpu, ZeroOneWithFusedAdamWOnNcclAtWorldSizeOneMatchesTorchAdamW) {
  SKIP_WITHOUT_GPU();
  expect_close(run_world_one_nccl(true, nullptr, false, /*adamw=*/true), golden_on_gpu(/*adamw=*/true));
}
