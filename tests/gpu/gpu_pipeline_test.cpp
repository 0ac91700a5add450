// The data-parallel side of a pipeline on CUDA tensors: the toy 2-stage pipeline with an embedding
// tied across stages (tests/support/toy_pipeline.h) on a dp 2 x pp 2 mesh of rank threads sharing the
// one GPU, Gloo groups (NCCL cannot put two ranks on one GPU, and p2p between stages needs two). The
// stages' params, flat buffers, bucket all-reduces and reduce-scatters, the tied sum over the
// embedding group and per-token normalisation run on CUDA tensors; activations cross stages through
// host memory (Gloo's send/recv takes CPU tensors). Golden: one process on CPU on the whole batch.
// Tolerance 1e-5 (GPU and CPU kernels sum in different orders; fp32, 3 SGD steps); the bf16 shard-only
// hook 3e-3 as on CPU. The tied copies bit-identical after every step, as on CPU.
// Still needs a 2-GPU machine: activations by NCCL send/recv between stages.
#include "tests/support/toy_pipeline.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

using namespace meshddp::test::toy_pipeline;

#define SKIP_WITHOUT_GPU()                                                   \
  if (!torch::cuda::is_available())                                          \
  GTEST_SKIP() << "no CUDA device on this machine: the GPU path is checked " \
                  "by scripts/gpu_check.sh on a GPU machine"

namespace {
RunOptions on_cuda(RunOptions run) {
  run.device = torch::kCUDA;
  run.tol = std::max(run.tol, 1e-5);
  return run;
}
}  // namespace

TEST(GpuPipeline, TiedStagesOnCudaTensorsMatchOneProcess) {
  SKIP_WITHOUT_GPU();
  run_pipeline(on_cuda({}));
}

TEST(GpuPipeline, TiedStagesOnCudaTensorsMatchOneProcessZero1) {
  SKIP_WITHOUT_GPU();
  run_pipeline(on_cuda({.zero1 = true}));
}

// Each rank keeps only its shard after the reduce-scatter: the tied sum must precede it on CUDA too.
TEST(GpuPipeline, TiedStagesOnCudaTensorsMatchOneProcessZero1ShardOnly) {
  SKIP_WITHOUT_GPU();
  run_pipeline(on_cuda({.zero1 = true, .comm_hook = "bf16_compress", .tol = 3e-3}));
}

TEST(GpuPipeline, PerTokenNormalisationOnCudaTensorsMatchesOneProcess) {
  SKIP_WITHOUT_GPU();
  run_pipeline(on_cuda({.zero1 = true, .per_token = true}));
}
