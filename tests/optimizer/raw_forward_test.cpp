// ZeRO-1 with overlapped param all-gathers, read through the raw module (evaluation code that holds
// the model, not the DDP wrapper): its forward on the thread that stepped must see this step's params
// (Note [Raw-module forward after an overlapped step], grad_buffer/param_gather.cpp).
//
// As DistributedOptimizer.ParamAllGatherOverlapsTheNextForwardAndItsResultIsExact, but through the
// module: rank 0 overwrites the parts of its param buffer it does not own with 1e6, launches the
// all-gathers, and runs the module's own forward at once; rank 1 joins the gathers 300 ms later. The
// forward is exact (within 1e-5 of the golden: fp32 sums in another order) only if each op waits for
// its bucket; reading the buffer as it is gives outputs off by ~1e6.
#include "grad_buffer/param_gather.h"
#include "tests/support/rank_threads.h"
#include "tests/support/zero_training.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace meshddp;
using namespace meshddp::test;

TEST(DistributedOptimizer, AForwardThroughTheRawModuleAfterAnOverlappedStepSeesThisStepsParams) {
  ZeroScenario s{.world = 2, .steps = 3, .overlap_param_gather = true, .bucket_bytes = 2048, .hidden = 64};
  Mlp golden_model = trained_zero_golden_model(s);
  auto probe = torch::randn({8, kZeroIn});
  auto expected = golden_model->forward(probe).detach();
  run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    ZeroRank rank(mesh, s, kZeroSeed);
    rank.train(0, s.steps);
    rank.opt->finish_param_sync();
    ParamGather* gather = start_gathers_over_a_poisoned_param_buffer(rank);
    torch::NoGradGuard evaluation;
    auto out = rank.model->forward(probe).detach();  // the module, not rank.ddp
    EXPECT_EQ(gather->pending(), 0) << "the forward read every bucket";
    const double diff = (out - expected).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5) << "rank " << mesh.rank() << ": the raw module's forward read stale params";
  });
}
