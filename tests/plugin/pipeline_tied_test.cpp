// The toy 2-stage pipeline with a tied embedding (tests/support/toy_pipeline.h) on CPU: the tied sum
// before and after ZeRO-1's reduce-scatter, per-token normalisation, and ranks that disagree on the
// tied layout or the virtual pipeline size. Tolerance 2e-6 absolute and relative on the params after
// 3 SGD steps (fp32; 1.2e-7 measured); the two copies of the tied weight bit-identical after every step.
#include "mesh/pipeline_groups.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"
#include "tests/support/toy_pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using namespace meshddp::test;
using namespace meshddp::test::toy_pipeline;

TEST(PipelineTied, TwoStagesMatchOneProcess) { run_pipeline({}); }

TEST(PipelineTied, TwoStagesMatchOneProcessZero1) { run_pipeline({/*zero1=*/true, false}); }

// ZeRO-1 where each rank holds only its shard after the reduce-scatter (the bf16 hook writes back the
// shard alone): the tied sum must come before it, since the two stages shard their buffers apart.
// Tolerance 3e-3: the buckets are summed in bf16 (1.1e-3 measured after 3 steps); the copies stay
// bit-identical all the same.
TEST(PipelineTied, TwoStagesMatchOneProcessZero1ShardOnly) { run_pipeline({true, false, "bf16_compress", 3e-3}); }

// Per-token normalisation: each rank's loss is the sum over its valid tokens; finalize_model_grads
// divides by the global count (the last stage's, summed over DP), which equals one process's mean over
// all valid tokens, although the ranks hold different counts.
TEST(PipelineTied, PerTokenNormalisationMatchesOneProcess) { run_pipeline({false, /*per_token=*/true}); }

TEST(PipelineTied, PerTokenNormalisationMatchesOneProcessZero1) { run_pipeline({true, true}); }

// The stages disagree on the tied layout (the last stage did not declare its head): every rank of the
// embedding group fails at construction, naming the setting and each side's value.
TEST(PipelineTied, TiedLayoutsThatDifferFailAtConstruction) {
  run_on_mesh({1, 2}, {"dp", "pp"}, [](DeviceMesh& mesh) {
    std::string error;
    if (mesh.coordinate("pp") == 0) {
      Stage0 s0 = make_stage0();
      declare_tied_across_stages(s0->wte->weight);
      error = error_of([&] { DistributedDataParallel<Stage0Impl> ddp(s0.ptr(), mesh, "dp"); });
    } else {
      Stage1 s1 = make_stage1();
      error = error_of([&] { DistributedDataParallel<Stage1Impl> ddp(s1.ptr(), mesh, "dp"); });
    }
    EXPECT_THAT(error, ::testing::AllOf(::testing::HasSubstr("tied params"), ::testing::HasSubstr("tied-across-stages"),
                                        ::testing::HasSubstr("1"), ::testing::HasSubstr("0")));
  });
}

// Ranks that disagree on the virtual pipeline size fail at construction, naming it and the values.
TEST(PipelineTied, VirtualPipelineSizesThatDifferFailAtConstruction) {
  run_on_mesh({1, 2}, {"dp", "pp"}, [](DeviceMesh& mesh) {
    const int64_t stage = mesh.coordinate("pp");
    DdpConfig config;
    config.virtual_pipeline_size = stage == 0 ? 2 : 1;
    std::string error;
    if (stage == 0) {
      Stage0 s0 = make_stage0();
      error = error_of([&] { DistributedDataParallel<Stage0Impl> ddp(s0.ptr(), mesh, "dp", config); });
    } else {
      Stage1 s1 = make_stage1();
      error = error_of([&] { DistributedDataParallel<Stage1Impl> ddp(s1.ptr(), mesh, "dp", config); });
    }
    EXPECT_THAT(error, ::testing::AllOf(::testing::HasSubstr("virtual_pipeline_size"), ::testing::HasSubstr("2"),
                                        ::testing::HasSubstr("pipeline settings")));
  });
}
