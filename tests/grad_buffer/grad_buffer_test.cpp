// GradBuffer on real Gloo groups (ranks as threads): which group it reduces over, when buckets
// launch, in what order, and the errors for misuse.
#include "grad_buffer/grad_buffer.h"

#include "mesh/placement.h"
#include "mesh/switches.h"
#include "tests/support/error_of.h"
#include "tests/support/rank_threads.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdlib>
#include <limits>

using namespace meshddp;
using ::testing::HasSubstr;

using meshddp::test::error_of;

namespace {

// Four params of different sizes, so buckets that were paired wrongly across ranks could not match.
std::vector<NamedParam> make_params(c10::ScalarType dtype = at::kFloat) {
  std::vector<NamedParam> params;
  const std::vector<int64_t> sizes{3, 5, 7, 11};
  for (size_t i = 0; i < sizes.size(); ++i) {
    params.push_back({"layer" + std::to_string(i) + ".weight",
                      at::zeros({sizes[i]}, at::TensorOptions().dtype(dtype)).requires_grad_(true)});
  }
  return params;
}

// Backward of sum_i (value_i * p_i).sum(): param i gets gradient value_i everywhere. The terms are
// built in `order`, which sets the order autograd fires the params' hooks in.
void backward_with_grads(const std::vector<NamedParam>& params, const std::vector<double>& values,
                         const std::vector<size_t>& order) {
  at::Tensor loss;
  for (size_t i : order) {
    auto term = (params[i].param * values[i]).sum();
    loss = loss.defined() ? loss + term : term;
  }
  torch::autograd::backward({loss});
}

GradBufferConfig one_bucket_per_param() {
  GradBufferConfig config;
  config.bucket_bytes = 0;
  return config;
}

}  // namespace

// Rank r writes 2^r into every gradient; after the sync every element must be exactly the mean of
// 2^r over the ranks of this rank's DP group, which no other group gives.
TEST(GradBuffer, ReducesOverTheDpGroupOnlyOnTwoByTwoMesh) {
  test::run_on_mesh({2, 2}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], one_bucket_per_param());
    const double mine = 1 << mesh.rank();
    backward_with_grads(params, std::vector<double>(4, mine), {0, 1, 2, 3});
    buffer.finish_grad_sync();
    double expected = 0;
    for (int64_t r : mesh.group_ranks("dp")) expected += (1 << r) / 2.0;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::all(buffer.main_grad(i) == expected).item<bool>())
          << params[i].name << " on rank " << mesh.rank() << ": " << buffer.main_grad(i) << " expected " << expected;
      EXPECT_TRUE(params[i].param.grad().is_same(buffer.main_grad(i))) << "grad must be the buffer view";
    }
  });
}

TEST(GradBuffer, LaunchesBucketsDuringBackwardWhenOverlapIsOn) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    for (bool overlap : {true, false}) {
      auto params = make_params();
      auto config = one_bucket_per_param();
      config.overlap_grad_reduce = overlap;
      GradBuffer buffer(params, mesh["dp"], config);
      backward_with_grads(params, {1, 2, 3, 4}, {0, 1, 2, 3});
      // Backward has returned, finish_grad_sync() not called: with overlap, every bucket is already launched.
      EXPECT_EQ(buffer.stats().buckets_launched_by_hooks, overlap ? 4 : 0) << "overlap=" << overlap;
      buffer.finish_grad_sync();
      EXPECT_EQ(buffer.stats().buckets_launched, 4);
      EXPECT_TRUE(at::all(buffer.main_grad(3) == 4.0).item<bool>());
    }
  });
}

// The ranks fire their hooks in opposite orders; buckets still launch in index order on both, so
// each bucket meets its twin (a mismatch would pair buckets of different sizes and fail or mix).
TEST(GradBuffer, LaunchesInBucketOrderWhateverOrderHooksFireIn) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], one_bucket_per_param());
    const double scale = 1 << mesh.rank();
    std::vector<size_t> order = mesh.rank() == 0 ? std::vector<size_t>{0, 1, 2, 3} : std::vector<size_t>{3, 2, 1, 0};
    backward_with_grads(params, {1 * scale, 2 * scale, 3 * scale, 4 * scale}, order);
    buffer.finish_grad_sync();
    for (size_t i = 0; i < params.size(); ++i) {
      const double expected = (i + 1) * (1 + 2) / 2.0;
      EXPECT_TRUE(at::all(buffer.main_grad(i) == expected).item<bool>())
          << params[i].name << ": " << buffer.main_grad(i);
    }
  });
}

TEST(GradBuffer, ParamWithoutGradientContributesZerosAndBlocksNoOne) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], one_bucket_per_param());
    // Rank 1 leaves layer1 out of its loss.
    auto used = mesh.rank() == 0 ? std::vector<size_t>{0, 1, 2, 3} : std::vector<size_t>{0, 2, 3};
    backward_with_grads(params, {2, 2, 2, 2}, used);
    buffer.finish_grad_sync();
    EXPECT_TRUE(at::all(buffer.main_grad(1) == 1.0).item<bool>()) << buffer.main_grad(1);  // (2 + 0) / 2
    EXPECT_TRUE(at::all(buffer.main_grad(0) == 2.0).item<bool>());
  });
}

TEST(GradBuffer, AccumulatesMicroBatchesAndSyncsOnceOnTheLast) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], one_bucket_per_param());
    for (int m = 0; m < 4; ++m) {
      buffer.set_is_last_microbatch(m == 3);
      backward_with_grads(params, std::vector<double>(4, mesh.rank() + m), {0, 1, 2, 3});
      EXPECT_EQ(buffer.stats().buckets_launched, m == 3 ? 4 : 0) << "micro-batch " << m;
    }
    buffer.finish_grad_sync();
    // sum over m of (r + m) = 4r + 6; mean over r in {0, 1} = 8 / 2 = 8.
    EXPECT_TRUE(at::all(buffer.main_grad(2) == 8.0).item<bool>()) << buffer.main_grad(2);
  });
}

TEST(GradBuffer, KeepsFp32MainGradsForBf16ParamsAndReleasesParamGrad) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params(at::kBFloat16);
    GradBufferConfig config;
    config.grad_reduce_in_fp32 = true;
    GradBuffer buffer(params, mesh["dp"], config);
    backward_with_grads(params, std::vector<double>(4, mesh.rank() == 0 ? 1.0 : 2.0), {0, 1, 2, 3});
    buffer.finish_grad_sync();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(buffer.main_grad(i).scalar_type(), at::kFloat);
      EXPECT_FALSE(params[i].param.grad().defined()) << "bf16 grad should be released after the hook";
      EXPECT_TRUE(at::all(buffer.main_grad(i) == 1.5).item<bool>()) << buffer.main_grad(i);
    }
  });
}

TEST(GradBuffer, ErrorNamesParamReportedReadyTwice) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], one_bucket_per_param());
    backward_with_grads(params, {1, 1, 1, 1}, {0, 1, 2, 3});
    auto msg = error_of([&] { backward_with_grads(params, {1, 1, 1, 1}, {3}); });
    EXPECT_THAT(msg, HasSubstr("parameter 'layer3.weight' reported ready twice in one step"));
    EXPECT_THAT(msg, HasSubstr("zero_grad_buffer()"));
    buffer.finish_grad_sync();  // both ranks: keep the group's collectives matched
  });
}

TEST(GradBuffer, ErrorWhenNewStepBeginsBeforeFinishNamesTheWaitingParams) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], one_bucket_per_param());
    backward_with_grads(params, {1, 1, 1, 1}, {0, 2, 3});  // layer1 gets no gradient
    auto msg = error_of([&] { buffer.check_no_sync_pending("DistributedDataParallel::forward"); });
    EXPECT_THAT(msg, HasSubstr("a new step began before finish_grad_sync()"));
    EXPECT_THAT(msg, HasSubstr("'layer1.weight'"));
    EXPECT_THAT(msg, ::testing::Not(HasSubstr("'layer0.weight'")));
    // zero_grad_buffer() while buckets are in flight is refused too.
    auto zero_msg = error_of([&] { buffer.zero_grad_buffer(); });
    EXPECT_THAT(zero_msg, HasSubstr("collective(s) of this step are in flight"));
    buffer.finish_grad_sync();
    buffer.zero_grad_buffer();
    EXPECT_NO_THROW(buffer.check_no_sync_pending("forward"));
  });
}

TEST(GradBuffer, ErrorWhenBackwardRunsAfterFinishWithoutZeroing) {
  test::run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBuffer buffer(params, mesh["dp"], {});
    backward_with_grads(params, {1, 1, 1, 1}, {0, 1, 2, 3});
    buffer.finish_grad_sync();
    auto msg = error_of([&] { backward_with_grads(params, {1, 1, 1, 1}, {0}); });
    EXPECT_THAT(msg, HasSubstr("parameter 'layer0.weight' got a gradient after finish_grad_sync()"));
  });
}

// ZeRO-1 records each bucket's local non-finite count before its collective. On CPU a finite bucket
// sum proves the count is 0 and skips the exact count (bench/ddp_bench found the exact count costly);
// the counts must stay exact: finite values whose sum overflows count 0, Inf and NaN count each.
TEST(GradBuffer, NonFiniteCountsStayExactWhenTheBucketSumOverflows) {
  test::run_on_mesh({1}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    GradBufferConfig config = one_bucket_per_param();
    config.use_distributed_optimizer = true;
    GradBuffer buffer(params, mesh["dp"], config);
    buffer.zero_grad_buffer();
    const double inf = std::numeric_limits<double>::infinity();
    // layer0: 3 x 1.0; layer1: 5 x 3e38 (finite, the sum overflows); layer2: 7 x inf; layer3: 11 x NaN.
    backward_with_grads(params, {1.0, 3e38, inf, std::nan("")}, {0, 1, 2, 3});
    buffer.finish_grad_sync();
    // Buckets are placed walking the params backwards: bucket 0 holds layer3, ..., bucket 3 layer0.
    auto counts = buffer.local_nonfinite_counts();
    ASSERT_EQ(counts.numel(), 4);
    EXPECT_EQ(counts[0].item<int64_t>(), 11);
    EXPECT_EQ(counts[1].item<int64_t>(), 7);
    EXPECT_EQ(counts[2].item<int64_t>(), 0);
    EXPECT_EQ(counts[3].item<int64_t>(), 0);
  });
}

// MESHDDP_DEBUG_SYNC=1 checks every bucket collective's (index, kind, numel, dtype) across the
// group before launching it. Two GradBuffers built on different param lists (DDP's construction
// check would refuse them) launch buckets of different sizes: named, instead of a hang or garbage.
TEST(GradBuffer, DebugSyncModeNamesTheFirstDivergentBucketCollective) {
  override_switch_for_testing(Switch::kDebugSync, true);
  std::vector<std::string> errors(2);
  test::run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    const int64_t n = mesh.rank() == 0 ? 3 : 5;
    auto p = at::zeros({n}).requires_grad_(true);
    GradBufferConfig config;
    GradBuffer buffer({{"w", p}}, mesh["dp"], config);
    errors[mesh.rank()] = error_of([&] {
      torch::autograd::backward({(p * 2).sum()});
      buffer.finish_grad_sync();
    });
  });
  override_switch_for_testing(Switch::kDebugSync, std::nullopt);
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("GradBuffer (MESHDDP_DEBUG_SYNC): the bucket collectives diverge across ranks"));
    EXPECT_THAT(e, HasSubstr("rank 0 launches [bucket index, kind, numel, dtype, comm hook] = "
                             "[0 all-reduce 3 Float none] while rank 1 launches [0 all-reduce 5 Float none]"));
  }
}

// A comm hook registered by hand on one rank only (DdpConfig::comm_hook is agreed at construction;
// register_comm_hook() is a local call): the ranks would reduce different dtypes in one collective.
// MESHDDP_DEBUG_SYNC=1 names the hooks instead.
TEST(GradBuffer, DebugSyncModeNamesACommHookRegisteredOnOneRankOnly) {
  override_switch_for_testing(Switch::kDebugSync, true);
  std::vector<std::string> errors(2);
  test::run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
    auto p = at::zeros({4}).requires_grad_(true);
    GradBuffer buffer({{"w", p}}, mesh["dp"], GradBufferConfig{});
    if (mesh.rank() == 1) buffer.register_comm_hook(std::make_shared<CompressCommHook>(at::kBFloat16));
    errors[mesh.rank()] = error_of([&] {
      torch::autograd::backward({(p * 2).sum()});
      buffer.finish_grad_sync();
    });
  });
  override_switch_for_testing(Switch::kDebugSync, std::nullopt);
  for (const auto& e : errors) {
    EXPECT_THAT(e,
                HasSubstr("= [0 all-reduce 4 Float none] while rank 1 launches [0 all-reduce 4 Float bf16_compress]"));
  }
}

TEST(GradBufferConfig, RejectsAnAbsurdBucketSize) {
  GradBufferConfig config;
  config.bucket_bytes = size_t{1} << 50;
  EXPECT_THAT(error_of([&] { config.validate(); }), HasSubstr("bucket_bytes"));
}

// A TP-partial gradient must come out as the TP sum of the DP mean: with rank r writing 2^r on a
// 2 x 2 mesh, sum over all ranks / DP size, exactly (no other group gives it); a replicated one as
// the DP mean over its own DP group only. Also in ZeRO-1 mode (the partial bucket is all-reduced,
// the others reduce-scattered), with one bucket per buffer so that each DP rank owns a whole param
// of the replicated bucket: 'layer2' (7 elements at offset 0) on DP rank 0, 'layer0' (3 at offset
// 64) on DP rank 1, of a bucket padded to 128.
TEST(GradBuffer, SumsTpPartialGradientsOverTpAndAveragesOverDpOnTwoByTwoMesh) {
  for (bool zero1 : {false, true}) {
    test::run_on_mesh({2, 2}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      auto params = make_params();
      set_placement(params[1].param, Placement::partial_grad());
      set_placement(params[3].param, Placement::partial_grad());
      GradBufferConfig config = zero1 ? GradBufferConfig{} : one_bucket_per_param();
      config.use_distributed_optimizer = zero1;
      GradBuffer buffer(params, SyncGroups{mesh["dp"], mesh.world(), mesh.coordinate("tp"), 2}, config);
      backward_with_grads(params, std::vector<double>(4, 1 << mesh.rank()), {0, 1, 2, 3});
      buffer.finish_grad_sync();
      const double partial = (1 + 2 + 4 + 8) / 2.0;
      double replicated = 0;
      for (int64_t r : mesh.group_ranks("dp")) replicated += (1 << r) / 2.0;
      int64_t checked = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const bool is_partial = i == 1 || i == 3;
        at::Tensor got = buffer.main_grad(i).reshape({-1});
        if (zero1 && !is_partial) {
          // Reduce-scatter leaves only this rank's shard of a replicated bucket valid: check the
          // param's elements inside it.
          const auto& slot = buffer.layout().slots[i];
          const auto& span = buffer.layout().buckets[slot.bucket];
          const int64_t shard = span.numel() / 2, begin = span.begin + mesh.coordinate("dp") * shard;
          const int64_t lo = std::max(slot.offset, begin), hi = std::min(slot.offset + slot.numel, begin + shard);
          if (hi <= lo) continue;  // owned by the other DP rank
          got = got.narrow(0, lo - slot.offset, hi - lo);
        }
        checked += got.numel();
        EXPECT_TRUE(at::all(got == (is_partial ? partial : replicated)).item<bool>())
            << params[i].name << " on rank " << mesh.rank() << " zero1=" << zero1 << ": " << got;
      }
      // partial params (5 + 11) plus, with ZeRO-1, the replicated param this DP rank owns (7 or 3).
      const int64_t owned = !zero1 ? 3 + 5 + 7 + 11 : 5 + 11 + (mesh.coordinate("dp") == 0 ? 7 : 3);
      EXPECT_EQ(checked, owned) << "rank " << mesh.rank() << " zero1=" << zero1;
    });
  }
}

TEST(GradBuffer, RefusesAnExpertParamWithoutAnExpertDpGroupOrWithATpPartialGradientNamingIt) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    auto params = make_params();
    declare_expert_param(params[2].param);
    EXPECT_THAT(error_of([&] { GradBuffer buffer(params, mesh["dp"], one_bucket_per_param()); }),
                HasSubstr("parameter 'layer2.weight' is an expert param (declare_expert_param / the plan style "
                          "ExpertParallel) but this buffer has no expert-data-parallel group"));
    // With the group (here the DP group itself, as at expert_parallel_size 1): its own buffer and bucket.
    SyncGroups groups{.dp = mesh["dp"], .world = nullptr, .expert_dp = mesh["dp"]};
    GradBuffer buffer(params, groups, one_bucket_per_param());
    EXPECT_TRUE(buffer.is_expert(2));
    EXPECT_FALSE(buffer.is_expert(1));
    EXPECT_NE(buffer.layout().slots[2].buffer, buffer.layout().slots[1].buffer);
    EXPECT_TRUE(buffer.bucket_reduction(buffer.layout().slots[2].bucket).expert);
    auto partial = make_params();
    declare_expert_param(partial[0].param);
    set_placement(partial[0].param, Placement::partial_grad());
    SyncGroups with_tp{.dp = mesh["dp"], .world = mesh.world(), .tp_rank = 0, .tp_size = 2, .expert_dp = mesh["dp"]};
    EXPECT_THAT(error_of([&] { GradBuffer refused(partial, with_tp, one_bucket_per_param()); }),
                HasSubstr("parameter 'layer0.weight' is an expert param whose gradient is partial over TP"));
  });
}
