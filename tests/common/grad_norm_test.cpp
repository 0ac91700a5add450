// meshddp::clip_grad_norm_ (common/grad_norm.h) in one process against torch::nn::utils::clip_grad_norm_
// on the same gradients: the norm, the scaled gradients, and the non-finite cases (error_if_nonfinite
// true: an error naming the param, nothing scaled; false: NaN or 0 gradients, as torch gives).
// The 2x2 DP x TP runs against the one-process golden are in tensor_parallel_test.cpp.
//
// Tolerance: torch sums the per-tensor fp32 norms' squares in fp32 (the norm of the stacked norms),
// meshddp in fp64 (so that the sum over ranks is exact enough to be the same at every mesh shape);
// the norms differ by at most an fp32 rounding of the sum, and the gradients by that in the scale:
// measured 2.0e-8 (norm) and 1.1e-7 (gradients, one fp32 ulp), relative; asserted within 4 fp32 ulps
// (4.8e-7). A wrong coefficient (no clamp, a missing 1e-6) is off by far more.
#include "common/grad_norm.h"

#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;

namespace {

constexpr double kRelTol = 4 * 1.1920929e-7;  // 4 fp32 ulps, relative

// The gradients of one backward of the MLP on one rank, as DDP's buffer holds them.
struct OneRank {
  Mlp model = make_mlp(11, 6, 16, 3);
  std::unique_ptr<DistributedDataParallel<MlpImpl>> ddp;

  explicit OneRank(DeviceMesh& mesh) {
    ddp = std::make_unique<DistributedDataParallel<MlpImpl>>(model.ptr(), mesh);
    ddp->zero_grad_buffer();
    auto [x, y] = make_batch(11, 0, 8, 6, 3);
    torch::mse_loss(ddp->forward(x), y).backward();
    ddp->finish_grad_sync();
  }
  GradBufferHandle buffer() { return ddp->grad_buffer(); }
  // Leaf copies of the params whose .grad() are copies of the buffer's gradients: torch's input.
  std::vector<torch::Tensor> torch_params() {
    std::vector<torch::Tensor> out;
    for (int64_t i = 0; i < static_cast<int64_t>(buffer()->params().size()); ++i) {
      auto p = buffer()->params()[i].param.detach().clone();
      p.mutable_grad() = buffer()->main_grad(i).clone();
      out.push_back(p);
    }
    return out;
  }
};

// max |a - b| / max |b| over every gradient (NaN in the same places counts as equal).
double max_rel_grad_diff(const GradBuffer& buffer, const std::vector<torch::Tensor>& golden) {
  double diff = 0;
  for (size_t i = 0; i < golden.size(); ++i) {
    const auto& got = buffer.main_grad(static_cast<int64_t>(i));
    const auto& want = golden[i].grad();
    EXPECT_TRUE(torch::equal(got.isnan(), want.isnan())) << "param " << i << ": NaN in other places";
    const auto finite = want.isfinite();
    if (!finite.any().item<bool>()) continue;
    const double scale = want.masked_select(finite).abs().max().item<double>();
    const double d = (got - want).masked_select(finite).abs().max().item<double>();
    diff = std::max(diff, scale > 0 ? d / scale : d);
  }
  return diff;
}

}  // namespace

// max_norm below the norm (clipping scales) and above it (nothing changes), as torch does.
TEST(ClipGradNorm, MatchesTorchClipGradNormInOneProcess) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    OneRank r(mesh);
    for (double max_norm : {1e-3, 0.05, 1e6}) {
      OneRank fresh(mesh);
      auto golden = fresh.torch_params();
      const double want = torch::nn::utils::clip_grad_norm_(golden, max_norm);
      const double got = clip_grad_norm_(fresh.buffer(), max_norm);
      EXPECT_NEAR(got, want, kRelTol * want) << "max_norm " << max_norm;
      const double grad_diff = max_rel_grad_diff(fresh.buffer(), golden);
      EXPECT_LE(grad_diff, kRelTol) << "max_norm " << max_norm;
      std::cout << "[ max_norm " << max_norm << ": norm " << got << " vs torch " << want << " (rel "
                << std::abs(got - want) / want << "), max rel grad diff " << grad_diff << " ]" << std::endl;
    }
    EXPECT_THAT(error_of([&] { clip_grad_norm_(r.buffer(), 0.0); }),
                HasSubstr("meshddp::clip_grad_norm_: max_norm must be positive and finite, got 0"));
  });
}

// A NaN or an Inf in a gradient: with error_if_nonfinite an error that names the param and leaves
// the gradients as they were; without it, the gradients torch's clip_grad_norm_ gives (all NaN for
// a NaN norm; for an Inf norm the coefficient is 0, so 0 everywhere but NaN where the Inf was).
TEST(ClipGradNorm, NonFiniteNormIsHandledAsTorchDoes) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      OneRank r(mesh);
      r.buffer()->main_grad(2).view(-1)[1] = bad;
      const auto before = r.torch_params();
      const std::string msg = error_of([&] { clip_grad_norm_(r.buffer(), 1.0, /*error_if_nonfinite=*/true); });
      EXPECT_THAT(msg, HasSubstr("meshddp::clip_grad_norm_: the total norm of order 2 of the gradients is non-finite"));
      EXPECT_THAT(msg, HasSubstr("Params with non-finite gradients on DP rank 0, TP rank 0: 'fc2.weight'"));
      EXPECT_THAT(error_of([&] { torch::nn::utils::clip_grad_norm_(before, 1.0, 2.0, true); }),
                  HasSubstr("non-finite"));
      EXPECT_EQ(max_rel_grad_diff(r.buffer(), before), 0.0) << "an error must leave the gradients unscaled";

      auto golden = r.torch_params();
      const double want = torch::nn::utils::clip_grad_norm_(golden, 1.0);
      const double got = clip_grad_norm_(r.buffer(), 1.0);
      EXPECT_EQ(std::isnan(got), std::isnan(want));
      EXPECT_EQ(std::isinf(got), std::isinf(want));
      EXPECT_EQ(max_rel_grad_diff(r.buffer(), golden), 0.0) << "bad value " << bad;
    }
  });
}

// The ZeRO-1 buffer holds each rank's shard only: clip_grad_norm_ refuses it and names the way out.
TEST(ClipGradNorm, RefusesTheDistributedOptimizersBuffer) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(11, 6, 16, 3);
    DdpConfig config;
    config.use_distributed_optimizer = true;
    DistributedDataParallel<MlpImpl> ddp(model.ptr(), mesh, "dp", config);
    const std::string msg = error_of([&] { clip_grad_norm_(ddp.grad_buffer(), 1.0); });
    EXPECT_THAT(msg,
                HasSubstr("meshddp::clip_grad_norm_: the grad buffer is sharded for the ZeRO-1 distributed optimizer"));
    EXPECT_THAT(msg, HasSubstr("set DistributedOptimizerConfig::clip_grad_norm instead"));
  });
}

// fp16 gradients whose every element is finite but whose norm is past fp16's largest value (65504):
// every element 300 in an MLP of 132k params: norm 1.09e5 (fc2.weight's alone 76800). torch's clip_grad_norm_ takes
// each tensor's norm in its own dtype, gets Inf and scales every gradient to 0 (or, with error_if_nonfinite, calls the
// finite gradients non-finite); meshddp takes the norm of fp16/bf16 gradients in fp32. The golden is torch on fp32
// copies of the same gradients; the fp16 results round it once (2^-11 relative).
TEST(ClipGradNorm, Fp16GradientsWhoseNormPassesFp16sRangeAreClippedNotZeroed) {
  run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(11, 128, 256, 128);
    model->to(torch::kHalf);
    DistributedDataParallel<MlpImpl> ddp(model.ptr(), mesh);
    ddp.zero_grad_buffer();
    ddp.finish_grad_sync();
    GradBufferHandle buffer = ddp.grad_buffer();
    std::vector<torch::Tensor> golden;
    for (int64_t i = 0; i < static_cast<int64_t>(buffer->params().size()); ++i) {
      buffer->main_grad(i).fill_(300);
      auto p = buffer->params()[i].param.detach().to(torch::kFloat);
      p.mutable_grad() = buffer->main_grad(i).to(torch::kFloat);
      golden.push_back(p);
    }
    const double want = torch::nn::utils::clip_grad_norm_(golden, 1.0);
    ASSERT_GT(want, 65504.0);
    double got = 0;
    EXPECT_EQ(error_of([&] { got = clip_grad_norm_(buffer, 1.0, /*error_if_nonfinite=*/true); }), "(no error)");
    EXPECT_NEAR(got, want, 1e-3 * want);
    for (size_t i = 0; i < golden.size(); ++i) {
      const auto g = buffer->main_grad(static_cast<int64_t>(i)).to(torch::kFloat);
      EXPECT_TRUE(torch::allclose(g, golden[i].grad(), 1e-3, 0))
          << "param " << i << ": " << g.flatten()[0].item<double>() << " vs "
          << golden[i].grad().flatten()[0].item<double>();
    }
  });
}
