// The gradient norm of fp16 gradients on CUDA (common/grad_norm.h): taken in fp32 (linalg_vector_norm
// with an fp32 result dtype, which on CUDA accumulates in fp32 from the fp16 loads), so gradients
// whose every element is finite but whose norm is past fp16's largest value (65504) are clipped, not
// zeroed. World size 1 on NCCL with every collective forced (the norm's sum over the mesh is an NCCL
// all-reduce of a device tensor). Without a CUDA device the test skips, saying so.
// Golden: torch::nn::utils::clip_grad_norm_ on fp32 copies of the same gradients; the fp16 results
// round it once (2^-11 relative), as the CPU test (tests/common/grad_norm_test.cpp).
#include "common/grad_norm.h"
#include "grad_buffer/grad_buffer.h"
#include "mesh/switches.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <cstdlib>

using namespace meshddp;
using namespace meshddp::test;

namespace {

const bool kForceCollectives = (override_switch_for_testing(Switch::kForceCollectives, true), true);

}  // namespace

// Every element 300 in an MLP of 132k params: norm 1.09e5, past fp16's range in each tensor's own dtype.
TEST(GpuGradNorm, Fp16GradientsWhoseNormPassesFp16sRangeAreClippedNotZeroedOnCuda) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine: the GPU path is checked by scripts/gpu_check.sh on a GPU machine";
  }
  ASSERT_TRUE(kForceCollectives);
  setenv("LOCAL_RANK", "0", 1);
  MeshOptions options;
  options.device_type = c10::DeviceType::CUDA;
  options.timeout = kTestTimeout;
  DeviceMesh mesh = DeviceMesh::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, {1}, {"dp"}, options);
  Mlp model = make_mlp(11, 128, 256, 128);
  model->to(torch::kCUDA, torch::kHalf);
  DistributedDataParallel<MlpImpl> ddp(model.ptr(), mesh);
  ddp.zero_grad_buffer();
  ddp.finish_grad_sync();
  GradBufferHandle buffer = ddp.grad_buffer();
  std::vector<torch::Tensor> golden;
  for (int64_t i = 0; i < static_cast<int64_t>(buffer->params().size()); ++i) {
    ASSERT_TRUE(buffer->main_grad(i).is_cuda());
    ASSERT_EQ(buffer->main_grad(i).scalar_type(), torch::kHalf);
    buffer->main_grad(i).fill_(300);
    auto p = buffer->params()[i].param.detach().to(torch::kFloat);
    p.mutable_grad() = buffer->main_grad(i).to(torch::kFloat);
    golden.push_back(p);
  }
  const double want = torch::nn::utils::clip_grad_norm_(golden, 1.0);
  ASSERT_GT(want, 65504.0);
  double got = 0;
  EXPECT_EQ(error_of([&] { got = clip_grad_norm_(buffer, 1.0, /*error_if_nonfinite=*/true); }), "(no error)");
  std::cout << "[ fp16 gradients on CUDA: norm " << got << ", torch on fp32 copies " << want << " ]" << std::endl;
  EXPECT_NEAR(got, want, 1e-3 * want);
  for (size_t i = 0; i < golden.size(); ++i) {
    const auto g = buffer->main_grad(static_cast<int64_t>(i)).to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(g, golden[i].grad(), 1e-3, 0))
        << "param " << i << ": " << g.flatten()[0].item<double>() << " vs "
        << golden[i].grad().flatten()[0].item<double>();
  }
}
