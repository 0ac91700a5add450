// The controls a pipeline schedule drives on one DDP chunk (start_grad_sync,
// set_requires_gradient_sync, finish_grad_sync, scale_gradients, broadcast_params) and the split
// backward of zero-bubble schedules, on 2 DP rank threads (Gloo) with the test MLP. The collectives a
// step runs are read from the DP group's launch record (mesh/collective_progress.h:
// recent_collective_labels), the one the hang reports use: a recording of every collective meshddp
// launched on that group, with its label ("all-reduce of gradient bucket b of n (...)").
//
// Golden: the same MLP in one process on the whole batch (mean loss). Tolerance 1e-6 absolute and
// relative (fp32 sums split across 2 ranks and 3 micro-batches differ by a few ulps: 3.7e-8 measured).
#include "grad_buffer/grad_buffer.h"
#include "mesh/collective_progress.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/pipeline.h"
#include "tests/support/error_of.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 6, kHidden = 10, kOut = 3, kBatch = 12, kMicro = 3;
constexpr uint64_t kSeed = 7;
constexpr double kTol = 1e-6;

// One process, whole batch: the gradients of the mean loss.
std::vector<torch::Tensor> golden_grads(int64_t step) {
  Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
  auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
  torch::mse_loss(model->forward(x), y).backward();
  std::vector<torch::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

// Bucket collectives launched on `group` since `since` labels were recorded.
int64_t bucket_collectives(const c10d::ProcessGroup& group, size_t since_total, size_t* total = nullptr) {
  const auto labels = recent_collective_labels(group);
  int64_t n = 0;
  // Labels are numbered "#<launch> ..."; count those after launch number `since_total`.
  for (const auto& label : labels) {
    const auto number = std::stoul(label.substr(1, label.find(' ') - 1));
    if (number > since_total && label.find("gradient bucket") != std::string::npos) ++n;
  }
  if (total) *total = labels.empty() ? 0 : std::stoul(labels.back().substr(1, labels.back().find(' ') - 1));
  return n;
}

size_t launches_so_far(const c10d::ProcessGroup& group) {
  size_t total = 0;
  bucket_collectives(group, 0, &total);
  return total;
}

DdpConfig small_buckets() {
  DdpConfig config;
  config.bucket_bytes = 64;  // several buckets
  return config;
}

void expect_grads_match(DistributedDataParallel<MlpImpl>& ddp, const std::vector<torch::Tensor>& want, int rank) {
  const auto params = ddp.parameters();
  ASSERT_EQ(params.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(params[i].grad(), want[i], kTol, kTol))
        << "param " << i << " on rank " << rank << ": max |diff| "
        << (params[i].grad() - want[i]).abs().max().item<double>();
  }
}

}  // namespace

// A schedule's step: set_requires_gradient_sync(false) for micro-batches 0..M-2, the last one too,
// then start_grad_sync(): no DP collective before the last micro-batch's backward ended, exactly one
// per bucket per step, and the DP mean of the whole batch.
TEST(PipelineControls, SyncHeldUntilStartGradSyncThenOncePerBucket) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    const c10d::ProcessGroup& dp = ddp.dp_group();
    const auto buckets = static_cast<int64_t>(ddp.grad_buffer()->layout().buckets.size());
    ASSERT_GE(buckets, 3);
    for (int64_t step = 0; step < 2; ++step) {
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      x = shard_rows(x, mesh.rank(), 2), y = shard_rows(y, mesh.rank(), 2);
      const size_t before = launches_so_far(dp);
      ddp.set_requires_gradient_sync(false);
      for (int64_t m = 0; m < kMicro; ++m) {
        auto loss = torch::mse_loss(ddp.forward(x.chunk(kMicro)[m]), y.chunk(kMicro)[m]) / kMicro;
        loss.backward();
        EXPECT_EQ(bucket_collectives(dp, before), 0) << "micro-batch " << m << " of step " << step;
      }
      ddp.start_grad_sync();
      EXPECT_EQ(bucket_collectives(dp, before), buckets);
      ddp.finish_grad_sync();
      ddp.finish_grad_sync();  // idempotent: no second launch
      EXPECT_EQ(bucket_collectives(dp, before), buckets) << "step " << step;
      EXPECT_TRUE(ddp.grad_sync_finished());
      expect_grads_match(ddp, golden_grads(step), mesh.rank());
      ddp.set_requires_gradient_sync(true);
    }
  });
}

// The last micro-batch with the sync on (its hooks launch buckets during backward), then
// start_grad_sync() for what is left (a param that got no gradient: the side layer): still one
// collective per bucket, and none before the last micro-batch.
TEST(PipelineControls, HooksThenStartGradSyncLaunchEachBucketOnce) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut, /*with_side=*/true);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    const c10d::ProcessGroup& dp = ddp.dp_group();
    const auto buckets = static_cast<int64_t>(ddp.grad_buffer()->layout().buckets.size());
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    x = shard_rows(x, mesh.rank(), 2), y = shard_rows(y, mesh.rank(), 2);
    const size_t before = launches_so_far(dp);
    for (int64_t m = 0; m < kMicro; ++m) {
      ddp.set_requires_gradient_sync(m == kMicro - 1);
      (torch::mse_loss(ddp.forward(x.chunk(kMicro)[m]), y.chunk(kMicro)[m]) / kMicro).backward();
      if (m < kMicro - 1) {
        EXPECT_EQ(bucket_collectives(dp, before), 0);
      }
    }
    EXPECT_LT(ddp.grad_buffer()->stats().buckets_launched, buckets);  // the side layer's bucket waits
    ddp.start_grad_sync();
    ddp.finish_grad_sync();
    EXPECT_EQ(bucket_collectives(dp, before), buckets);
  });
}

// Zero-bubble's split backward: the input gradient first (autograd.grad, graph kept), the weight
// gradients in a later backward call. Nothing is synced by the first; each weight once by the second
// (its bucket launched by the hooks as it completes), and the result is the golden's.
TEST(PipelineControls, SplitBackwardSyncsEachWeightOnce) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    const c10d::ProcessGroup& dp = ddp.dp_group();
    const auto buckets = static_cast<int64_t>(ddp.grad_buffer()->layout().buckets.size());
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    x = shard_rows(x, mesh.rank(), 2).clone().requires_grad_(true), y = shard_rows(y, mesh.rank(), 2);
    const size_t before = launches_so_far(dp);
    auto loss = torch::mse_loss(ddp.forward(x), y);
    const auto input_grad = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true);
    EXPECT_TRUE(input_grad[0].defined());
    EXPECT_EQ(bucket_collectives(dp, before), 0);
    EXPECT_EQ(ddp.grad_buffer()->stats().buckets_launched, 0);
    torch::autograd::backward({loss}, {}, /*retain_graph=*/false, /*create_graph=*/false, ddp.parameters());
    EXPECT_EQ(ddp.grad_buffer()->stats().buckets_launched_by_hooks, buckets);
    ddp.finish_grad_sync();
    EXPECT_EQ(bucket_collectives(dp, before), buckets);
    expect_grads_match(ddp, golden_grads(0), mesh.rank());
  });
}

// A schedule that starts a chunk's sync before its weight-gradient pass is told so, naming the param,
// instead of reducing a bucket whose values change under the collective.
TEST(PipelineControls, GradientAfterStartGradSyncIsNamed) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    auto loss = torch::mse_loss(ddp.forward(shard_rows(x, mesh.rank(), 2)), shard_rows(y, mesh.rank(), 2));
    ddp.start_grad_sync();
    EXPECT_THAT(error_of([&] { loss.backward(); }),
                ::testing::AllOf(::testing::HasSubstr("fc3"), ::testing::HasSubstr("after its bucket was launched"),
                                 ::testing::HasSubstr("start_grad_sync()")));
    ddp.finish_grad_sync();
  });
}

// scale_gradients scales what the optimizer reads, after finish_grad_sync() and between micro-batches,
// and refuses while buckets are being reduced.
TEST(PipelineControls, ScaleGradientsActsOnTheBuffers) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    x = shard_rows(x, mesh.rank(), 2), y = shard_rows(y, mesh.rank(), 2);
    // Micro-batch 0's accumulated gradient scaled by 0 between micro-batches, then micro-batch 1's
    // synced mean scaled by 4 after finish_grad_sync().
    ddp.set_requires_gradient_sync(false);
    (torch::mse_loss(ddp.forward(x.chunk(2)[0]), y.chunk(2)[0]) / 2).backward();
    ddp.scale_gradients(0.0);  // drops micro-batch 0
    ddp.set_requires_gradient_sync(true);
    (torch::mse_loss(ddp.forward(x.chunk(2)[1]), y.chunk(2)[1]) / 2).backward();
    EXPECT_THAT(error_of([&] { ddp.scale_gradients(0.5); }), ::testing::HasSubstr("in flight"));
    ddp.finish_grad_sync();
    ddp.scale_gradients(4.0);  // (g1 / 2) * 4 = 2 * g1
    // Golden: the mean loss of the second half of each rank's rows, times 2.
    Mlp golden = make_mlp(kSeed, kIn, kHidden, kOut);
    std::vector<torch::Tensor> xs, ys;
    for (int64_t r = 0; r < 2; ++r) {
      auto [gx, gy] = make_batch(kSeed, 0, kBatch, kIn, kOut);
      xs.push_back(shard_rows(gx, r, 2).chunk(2)[1]), ys.push_back(shard_rows(gy, r, 2).chunk(2)[1]);
    }
    (torch::mse_loss(golden->forward(torch::cat(xs)), torch::cat(ys)) * 2).backward();
    std::vector<torch::Tensor> want;
    for (auto& p : golden->parameters()) want.push_back(p.grad());
    expect_grads_match(ddp, want, mesh.rank());
    EXPECT_THAT(error_of([&] { ddp.scale_gradients(std::nan("")); }), ::testing::HasSubstr("finite"));
  });
}

// broadcast_params: every DP rank takes DP rank 0's values.
TEST(PipelineControls, BroadcastParamsFromDpRank0) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ddp.parameters()) p.add_(static_cast<double>(mesh.rank() + 1));
    }
    ddp.broadcast_params();
    Mlp want = make_mlp(kSeed, kIn, kHidden, kOut);
    const auto got = ddp.parameters();
    const auto expected = want->parameters();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i] + 1.0)) << i;
  });
}

// With bf16 params and grad_reduce_in_fp32 the optimizer reads fp32 main grads in the buffer and
// param.grad() is released after each hook: scale_gradients must reach the buffer (a scale applied
// to p.grad would change nothing here).
TEST(PipelineControls, ScaleGradientsReachesFp32MainGrads) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    model->to(torch::kBFloat16);
    DdpConfig config = small_buckets();
    config.grad_reduce_in_fp32 = true;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    auto out = ddp.forward(shard_rows(x, mesh.rank(), 2).to(torch::kBFloat16));
    torch::mse_loss(out.to(torch::kFloat), shard_rows(y, mesh.rank(), 2)).backward();
    ddp.finish_grad_sync();
    std::vector<torch::Tensor> before;
    for (const auto& p : ddp.named_parameters()) before.push_back(ddp.main_grad(p.name).clone());
    ddp.scale_gradients(0.25);
    size_t i = 0;
    for (const auto& p : ddp.named_parameters()) {
      const torch::Tensor got = ddp.main_grad(p.name);
      EXPECT_EQ(got.scalar_type(), torch::kFloat);
      EXPECT_GT(before[i].abs().max().item<double>(), 0.0) << p.name;
      EXPECT_TRUE(torch::equal(got, before[i] * 0.25)) << p.name << " was not scaled";
      ++i;
    }
  });
}

// Per-token normalisation chosen on one DP rank only: every rank fails in finalize_model_grads naming
// each rank's choice, instead of one rank all-reducing a token count the other never sends.
TEST(PipelineControls, NumTokensGivenOnSomeRanksOnlyFailsOnEveryRank) {
  run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", small_buckets());
    ddp.zero_grad_buffer();
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    torch::mse_loss(ddp.forward(shard_rows(x, mesh.rank(), 2)), shard_rows(y, mesh.rank(), 2)).backward();
    FinalizeOptions options;
    if (mesh.rank() == 0) options.num_tokens = 6;
    EXPECT_THAT(error_of([&] { finalize_model_grads({&ddp}, options); }),
                ::testing::AllOf(::testing::HasSubstr("1 of 2 data-parallel ranks passed num_tokens"),
                                 ::testing::HasSubstr("DP rank 0: num_tokens, DP rank 1: none")));
  });
}

namespace {

// A rotary-style model: the forward multiplies by two buffers, which autograd saves for backward.
// `table` drifts on DP rank 1 between steps (as running statistics would); `fixed` never changes.
struct Rotated : torch::nn::Module {
  Rotated() {
    w = register_parameter("w", torch::ones({4}));
    table = register_buffer("table", torch::arange(1, 5, torch::kFloat));
    fixed = register_buffer("fixed", torch::full({4}, 0.5f));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * w * table * fixed; }
  torch::Tensor w, table, fixed;
};

int64_t buffer_broadcasts(const c10d::ProcessGroup& group, size_t since_total) {
  int64_t n = 0;
  for (const auto& label : recent_collective_labels(group)) {
    const auto number = std::stoul(label.substr(1, label.find(' ') - 1));
    if (number > since_total && label.find("module buffers") != std::string::npos) ++n;
  }
  return n;
}

}  // namespace

// Note [Module buffers once per step]: 3 micro-batches in 1F1B order (micro-batch 1's forward before
// micro-batch 0's backward), the sync held until the last backward as example 02's schedule does, and
// plain accumulation (all forwards, then the backwards, micro-batches 0..1 under no_sync()), with DP
// rank 1's table drifted before every step. Each step broadcasts the buffers once, before its first
// forward: every micro-batch on both ranks uses DP rank 0's table (the gradient of w is the closed
// form below), no table a pending backward saved is written (PyTorch's rule, a broadcast before each
// forward outside no_sync(), fails there with "modified by an inplace operation"), and the buffer that
// already holds rank 0's values is never written (its version stays).
TEST(PipelineControls, BuffersAreBroadcastOncePerStepBeforeItsFirstForward) {
  for (bool pipelined : {true, false}) {
    run_on_mesh({2}, {"dp"}, [&](DeviceMesh& mesh) {
      auto model = std::make_shared<Rotated>();
      DistributedDataParallel ddp(model, mesh, "dp");
      const c10d::ProcessGroup& dp = ddp.dp_group();
      const auto fixed_version = model->fixed._version();
      for (int64_t step = 0; step < 2; ++step) {
        if (mesh.rank() == 1) model->table.add_(100.0);  // drifted since the last step
        ddp.zero_grad_buffer();
        const size_t before = launches_so_far(dp);
        // Micro-batch m: 2 rows of (rank + 1); loss = sum of the outputs.
        const auto input = torch::full({2, 4}, static_cast<float>(mesh.rank() + 1));
        std::vector<torch::Tensor> losses(kMicro);
        const auto forward = [&](int64_t m) { losses[m] = ddp.forward(input).sum(); };
        const auto backward = [&](int64_t m) {
          if (pipelined) ddp.set_requires_gradient_sync(m == kMicro - 1);
          if (!pipelined && m < kMicro - 1) {
            auto guard = ddp.no_sync();
            losses[m].backward();
          } else {
            losses[m].backward();
          }
        };
        if (pipelined) {
          ddp.set_requires_gradient_sync(false);
          forward(0), forward(1), backward(0), forward(2), backward(1), backward(2);  // 1F1B, one stage's view
        } else {
          for (int64_t m = 0; m < kMicro; ++m) {
            if (m < kMicro - 1) {
              auto guard = ddp.no_sync();
              forward(m);
            } else {
              forward(m);
            }
          }
          for (int64_t m = 0; m < kMicro; ++m) backward(m);
        }
        ddp.finish_grad_sync();
        EXPECT_EQ(buffer_broadcasts(dp, before), 1) << "step " << step << " on rank " << mesh.rank();
        // d/dw of sum(x * w * table * fixed) over kMicro micro-batches of 2 rows, mean over the 2 ranks.
        const auto want = torch::arange(1, 5, torch::kFloat) * 0.5f * (2.0f * kMicro * 1.5f);
        EXPECT_TRUE(torch::allclose(model->w.grad(), want, 0, 0))
            << (pipelined ? "1F1B" : "accumulation") << " step " << step << " rank " << mesh.rank() << ": "
            << model->w.grad() << " vs " << want;
        EXPECT_TRUE(torch::equal(model->table, torch::arange(1, 5, torch::kFloat))) << "rank " << mesh.rank();
        EXPECT_EQ(model->fixed._version(), fixed_version) << "a buffer equal to rank 0's was written";
      }
    });
  }
}
