// check_for_nan_in_grad: a NaN/Inf in one rank's local gradient makes finish_grad_sync() throw on
// every rank (no rank is left waiting in a collective), naming the param, the rank and the step.
#include "grad_buffer/grad_buffer.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <limits>

using namespace meshddp;
using namespace meshddp::test;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

std::vector<NamedParam> three_params() {
  std::vector<NamedParam> params;
  for (int64_t i = 0; i < 3; ++i) {
    params.push_back({"layer" + std::to_string(i) + ".weight", at::zeros({4 + i}).requires_grad_(true)});
  }
  return params;
}

// Backward giving param i the gradient 1 everywhere, except element 0 of param `bad` on rank
// `bad_rank`, which gets `value`.
void backward_with(const std::vector<NamedParam>& params, int rank, int bad_rank, size_t bad, double value) {
  at::Tensor loss;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor weight = at::ones_like(params[i].param);
    if (rank == bad_rank && i == bad) weight[0] = value;
    auto term = (params[i].param * weight).sum();
    loss = loss.defined() ? loss + term : term;
  }
  torch::autograd::backward({loss});
}

}  // namespace

// Step 0 is clean; at step 1 rank 1 puts a NaN in 'layer1.weight'. Every rank throws the same
// error, naming the param, rank 1 and step 1, and not the clean params.
TEST(CheckForNanInGrad, EveryRankThrowsNamingTheParamTheRankAndTheStep) {
  std::vector<std::string> errors(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto params = three_params();
    GradBufferConfig config;
    config.bucket_bytes = 0;  // one bucket per param
    config.check_for_nan_in_grad = true;
    GradBuffer buffer(params, mesh["dp"], config);
    const int rank = static_cast<int>(mesh.rank());
    for (int step = 0; step < 2; ++step) {
      buffer.zero_grad_buffer();
      backward_with(params, rank, /*bad_rank=*/step == 1 ? 1 : -1, 1, std::numeric_limits<double>::quiet_NaN());
      try {
        buffer.finish_grad_sync();
      } catch (const c10::Error& e) {
        errors[rank] = "step " + std::to_string(step) + ": " + e.what_without_backtrace();
      }
    }
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_THAT(errors[r], HasSubstr("step 1: GradBuffer: non-finite gradients at step 1 (check_for_nan_in_grad"));
    EXPECT_THAT(errors[r],
                HasSubstr("rank 1 (DP rank 1): parameter 'layer1.weight' has 1 NaN/Inf gradient value(s) of 5"));
    EXPECT_THAT(errors[r], Not(HasSubstr("layer0")));
    EXPECT_THAT(errors[r], Not(HasSubstr("rank 0 (DP rank 0)")));
  }
}

// Off (the default): the same NaN is reduced silently (the optimizer's business).
TEST(CheckForNanInGrad, IsOffByDefault) {
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto params = three_params();
    GradBuffer buffer(params, mesh["dp"], GradBufferConfig{});
    backward_with(params, static_cast<int>(mesh.rank()), 1, 1, std::numeric_limits<double>::infinity());
    buffer.finish_grad_sync();
    EXPECT_TRUE(std::isinf(buffer.main_grad(1)[0].item<double>()));
  });
}

// fp16 compression: what is sent is the fp16 cast, and a finite fp32 gradient beyond fp16's range
// (1e6 / DP 2 = 5e5 > 65504) becomes Inf there. Counted after the cast, it is reported as any NaN,
// on every rank, naming the param and rank 1 (counted before it, as before, it went unreported and
// the reduced gradient came back Inf). A gradient within range (1e4) is not reported.
TEST(CheckForNanInGrad, CountsWhatFp16CompressionSendsSoAnOverflowOfTheCastIsReported) {
  std::vector<std::string> errors(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto params = three_params();
    GradBufferConfig config;
    config.bucket_bytes = 0;
    config.check_for_nan_in_grad = true;
    config.comm_hook = kFp16CompressHook;
    GradBuffer buffer(params, mesh["dp"], config);
    const int rank = static_cast<int>(mesh.rank());
    for (int step = 0; step < 2; ++step) {
      buffer.zero_grad_buffer();
      backward_with(params, rank, /*bad_rank=*/1, 2, step == 0 ? 1e4 : 1e6);
      try {
        buffer.finish_grad_sync();
      } catch (const c10::Error& e) {
        errors[rank] += "step " + std::to_string(step) + ": " + e.what_without_backtrace();
      }
    }
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_THAT(errors[r], Not(HasSubstr("step 0")));
    EXPECT_THAT(errors[r], HasSubstr("step 1: GradBuffer: non-finite gradients at step 1"));
    EXPECT_THAT(errors[r], HasSubstr("as sent to their collective (after the comm hook's cast, if any)"));
    EXPECT_THAT(errors[r],
                HasSubstr("rank 1 (DP rank 1): parameter 'layer2.weight' has 1 NaN/Inf gradient value(s) of 6"));
    EXPECT_THAT(errors[r], Not(HasSubstr("rank 0 (DP rank 0)")));
  }
}

// fp16_compress on 2 ranks, each sending 1e5 / 2 = 5e4 (finite in fp16, max 65504) for element 0
// of 'layer1.weight': their fp16 SUM overflows to inf. Nothing sent is non-finite, so the reduced
// gradients are counted too (Note [Overflow in the reduction]); every rank throws naming the param
// and the hook (before, the check saw nothing and the inf went on to the optimizer).
TEST(CheckForNanInGrad, ReportsAReducedGradientThatOverflowsInTheCompressionHooksDtype) {
  std::vector<std::string> errors(2);
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto params = three_params();
    GradBufferConfig config;
    config.bucket_bytes = 0;
    config.check_for_nan_in_grad = true;
    config.comm_hook = kFp16CompressHook;
    GradBuffer buffer(params, mesh["dp"], config);
    const int rank = static_cast<int>(mesh.rank());
    buffer.zero_grad_buffer();
    backward_with(params, rank, /*bad_rank=*/rank, 1, 1e5);
    try {
      buffer.finish_grad_sync();
      errors[rank] = "(no error)";
    } catch (const c10::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_THAT(errors[r], HasSubstr("GradBuffer: non-finite gradients at step 0"));
    EXPECT_THAT(errors[r], HasSubstr("every rank sent finite values, but the reduced gradient overflowed in the dtype "
                                     "of comm hook 'fp16_compress'"));
    EXPECT_THAT(errors[r], HasSubstr("parameter 'layer1.weight' has 1 NaN/Inf value(s) of 5 in its reduced gradient"));
    EXPECT_THAT(errors[r], Not(HasSubstr("'layer0.weight'")));
    EXPECT_THAT(errors[r], HasSubstr("Use comm_hook 'bf16_compress'"));
  }
}
