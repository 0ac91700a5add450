// DistributedDataParallel against the golden: the same MLP trained in one process on the whole
// global batch. Ranks are threads with Gloo groups.
//
// Tolerance (fp32): the distributed gradient is the same mean as the golden's, summed in a different
// order (per-rank partial sums, then the DP sum), so each step differs by a few ulps of fp32
// (eps = 1.2e-7) in every gradient. Measured over 20 steps on O(0.1-1) params: max |diff| <= 1.2e-7
// (SGD and Adam, 2 and 4 ranks; each test prints it). We allow 1e-6 absolute + 1e-6 relative: 8x
// the measurement, still ~100x below what one wrong bucket, a missing 1/DP or a skipped micro-batch
// produces (>= 1e-4 after one step here).
#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/mlp.h"
#include "tests/support/rank_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kIn = 12, kHidden = 24, kOut = 6, kBatch = 32;
constexpr uint64_t kSeed = 1234;
constexpr double kFp32Atol = 1e-6, kFp32Rtol = 1e-6;

enum class Opt { kSgd, kAdam };

struct Scenario {
  int world = 2;
  int steps = 20;
  int micro_batches = 1;
  Opt opt = Opt::kSgd;
  bool side_layer_every_third_step = false;  // params unused on 2 of 3 steps
  DdpConfig config;
  bool create_graph = false;       // backward(create_graph=true) on every micro-batch
  bool evaluate_on_rank0 = false;  // rank 0 alone runs no-grad forwards: after zero_grad_buffer(), after the step
  bool grads_in_buffer = false;    // DDP's model runs meshddp::linear_with_grad_in_buffer (the golden: torch's Linear)
};

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, std::vector<torch::Tensor> params) {
  if (opt == Opt::kSgd)
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

bool use_side(const Scenario& s, int step) { return s.side_layer_every_third_step && step % 3 == 0; }

// Rows of micro-batch m of the global batch.
torch::Tensor micro_rows(const torch::Tensor& t, int m, int k) { return shard_rows(t, m, k); }

std::vector<torch::Tensor> train_golden(const Scenario& s) {
  Mlp model = make_mlp(kSeed, kIn, kHidden, kOut, s.side_layer_every_third_step);
  auto opt = make_optimizer(s.opt, model->parameters());
  for (int step = 0; step < s.steps; ++step) {
    opt->zero_grad();
    auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
    for (int m = 0; m < s.micro_batches; ++m) {
      auto out = model->forward(micro_rows(x, m, s.micro_batches), use_side(s, step));
      auto loss = torch::mse_loss(out, micro_rows(y, m, s.micro_batches)) / s.micro_batches;
      loss.backward();
    }
    // meshddp's semantics: a param with no gradient this step has gradient zero.
    for (auto& p : model->parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
    opt->step();
  }
  std::vector<torch::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  return params;
}

// Trains with DDP on s.world ranks; returns rank 0's params (all ranks are checked equal to it).
std::vector<torch::Tensor> train_ddp(const Scenario& s) {
  std::vector<std::vector<torch::Tensor>> per_rank(s.world);
  run_on_mesh({s.world, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    // Different seeds per rank: DDP's broadcast from DP rank 0 must make them agree.
    Mlp model = make_mlp(kSeed + mesh.rank() * 17, kIn, kHidden, kOut, s.side_layer_every_third_step);
    model->grads_in_buffer = s.grads_in_buffer;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", s.config);
    auto opt = make_optimizer(s.opt, model->parameters());
    const int64_t r = mesh.coordinate("dp");
    for (int step = 0; step < s.steps; ++step) {
      ddp.zero_grad_buffer();
      auto [x, y] = make_batch(kSeed, step, kBatch, kIn, kOut);
      if (s.evaluate_on_rank0 && mesh.rank() == 0) {
        torch::NoGradGuard no_grad;  // an evaluation forward at the start of a step, on this rank only
        (void)ddp.forward(x, /*use_side=*/false);
      }
      for (int m = 0; m < s.micro_batches; ++m) {
        ddp.set_is_last_microbatch(m == s.micro_batches - 1);
        auto xm = shard_rows(micro_rows(x, m, s.micro_batches), r, s.world);
        auto ym = shard_rows(micro_rows(y, m, s.micro_batches), r, s.world);
        auto loss = torch::mse_loss(ddp.forward(xm, use_side(s, step)), ym) / s.micro_batches;
        loss.backward({}, /*retain_graph=*/std::nullopt, /*create_graph=*/s.create_graph);
      }
      ddp.finish_grad_sync();
      if (s.grads_in_buffer) {
        // Every weight and bias of the layers this step ran went in place (none under create_graph,
        // or with the feature off), or the test is not testing the in-place path.
        const bool in_place = s.config.gradient_accumulation_fusion && !s.create_graph;
        EXPECT_EQ(ddp.grad_buffer()->stats().grads_written_in_place, in_place ? (use_side(s, step) ? 8 : 6) : 0)
            << "step " << step;
      }
      opt->step();
      if (s.evaluate_on_rank0 && mesh.rank() == 0) {
        torch::NoGradGuard no_grad;  // and one after the step, before the next zero_grad_buffer()
        (void)ddp.forward(x, /*use_side=*/true);
      }
    }
    for (auto& p : model->parameters()) per_rank[mesh.rank()].push_back(p.detach().clone());
  });
  for (int r = 1; r < s.world; ++r) {
    for (size_t i = 0; i < per_rank[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(per_rank[0][i], per_rank[r][i]))
          << "rank " << r << " param " << i << " differs from rank 0";
    }
  }
  return per_rank[0];
}

void expect_matches_golden(const Scenario& s) {
  auto golden = train_golden(s);
  auto ddp = train_ddp(s);
  ASSERT_EQ(golden.size(), ddp.size());
  double max_diff = 0;
  for (size_t i = 0; i < golden.size(); ++i) {
    max_diff = std::max(max_diff, (golden[i] - ddp[i]).abs().max().item<double>());
    EXPECT_TRUE(torch::allclose(ddp[i], golden[i], kFp32Rtol, kFp32Atol))
        << "param " << i << " max |diff| " << (golden[i] - ddp[i]).abs().max().item<double>();
  }
  // Training must have moved the params, or the comparison says nothing.
  Mlp init = make_mlp(kSeed, kIn, kHidden, kOut, s.side_layer_every_third_step);
  EXPECT_GT((init->parameters()[0] - golden[0]).abs().max().item<double>(), 1e-3);
  std::cout << "[ max |ddp - golden| = " << max_diff << " ]" << std::endl;
}

DdpConfig bucket_bytes(size_t bytes) {
  DdpConfig c;
  c.bucket_bytes = bytes;
  return c;
}

}  // namespace

TEST(DistributedDataParallel, SgdMatchesSingleProcessTrainingOnTwoRanks) {
  expect_matches_golden({.world = 2, .opt = Opt::kSgd, .config = bucket_bytes(1024)});
}

TEST(DistributedDataParallel, SgdMatchesSingleProcessTrainingOnFourRanks) {
  expect_matches_golden({.world = 4, .opt = Opt::kSgd, .config = bucket_bytes(1024)});
}

TEST(DistributedDataParallel, AdamMatchesSingleProcessTrainingOnTwoRanks) {
  expect_matches_golden({.world = 2, .opt = Opt::kAdam, .config = bucket_bytes(1024)});
}

TEST(DistributedDataParallel, AdamMatchesSingleProcessTrainingOnFourRanks) {
  expect_matches_golden({.world = 4, .opt = Opt::kAdam, .config = bucket_bytes(1024)});
}

// Each layout variant runs with SGD too: Adam's update barely changes when every gradient is
// scaled, so a lost or doubled 1/DP would pass with Adam alone.
TEST(DistributedDataParallel, MatchesGoldenWithOneParamPerBucket) {
  expect_matches_golden({.world = 4, .opt = Opt::kAdam, .config = bucket_bytes(0)});
  expect_matches_golden({.world = 4, .opt = Opt::kSgd, .config = bucket_bytes(0)});
}

TEST(DistributedDataParallel, MatchesGoldenWithEverythingInOneBucket) {
  expect_matches_golden({.world = 4, .opt = Opt::kAdam, .config = bucket_bytes(size_t{1} << 30)});
  expect_matches_golden({.world = 4, .opt = Opt::kSgd, .config = bucket_bytes(size_t{1} << 30)});
}

TEST(DistributedDataParallel, MatchesGoldenWithOverlapOff) {
  DdpConfig config = bucket_bytes(1024);
  config.overlap_grad_reduce = false;
  expect_matches_golden({.world = 4, .opt = Opt::kAdam, .config = config});
  expect_matches_golden({.world = 4, .opt = Opt::kSgd, .config = config});
}

// backward(create_graph=true) makes AccumulateGrad replace .grad by `.grad + new` out of place; the
// slot must still get each micro-batch's gradient once (not the slot's earlier contents again).
TEST(DistributedDataParallel, MatchesGoldenWithCreateGraphAndFourMicroBatches) {
  expect_matches_golden(
      {.world = 2, .micro_batches = 4, .opt = Opt::kSgd, .config = bucket_bytes(1024), .create_graph = true});
  DdpConfig one_param_per_bucket_no_overlap = bucket_bytes(0);
  one_param_per_bucket_no_overlap.overlap_grad_reduce = false;
  expect_matches_golden({.world = 2,
                         .micro_batches = 4,
                         .opt = Opt::kSgd,
                         .config = one_param_per_bucket_no_overlap,
                         .create_graph = true});
}

// With find_unused_parameters, an evaluation forward (no grad) on one rank between steps must not
// mark params ready or launch buckets: it would throw on the next forward, or hang the other ranks.
TEST(DistributedDataParallel, EvaluationForwardOnOneRankBetweenStepsLeavesTheSyncAlone) {
  DdpConfig config = bucket_bytes(1024);
  config.find_unused_parameters = true;
  expect_matches_golden(
      {.world = 2, .opt = Opt::kSgd, .side_layer_every_third_step = true, .config = config, .evaluate_on_rank0 = true});
}

TEST(DistributedDataParallel, MatchesGoldenWithFourAccumulatedMicroBatches) {
  expect_matches_golden({.world = 4, .micro_batches = 4, .opt = Opt::kAdam, .config = bucket_bytes(1024)});
  expect_matches_golden({.world = 2, .micro_batches = 4, .opt = Opt::kSgd, .config = bucket_bytes(0)});
}

TEST(DistributedDataParallel, MatchesGoldenWithAParamUnusedOnSomeSteps) {
  expect_matches_golden(
      {.world = 4, .opt = Opt::kAdam, .side_layer_every_third_step = true, .config = bucket_bytes(1024)});
  DdpConfig no_overlap = bucket_bytes(0);
  no_overlap.overlap_grad_reduce = false;
  expect_matches_golden({.world = 2, .opt = Opt::kSgd, .side_layer_every_third_step = true, .config = no_overlap});
}

TEST(DistributedDataParallel, BroadcastsDpRankZerosParamsAtConstruction) {
  run_on_mesh({4, 1}, {"dp", "tp"}, [](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed + mesh.rank(), kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh);
    Mlp reference = make_mlp(kSeed, kIn, kHidden, kOut);
    for (size_t i = 0; i < reference->parameters().size(); ++i) {
      EXPECT_TRUE(torch::equal(model->parameters()[i], reference->parameters()[i])) << "param " << i;
    }
  });
}

// Gradients written in place by the layers' weight-gradient GEMM (meshddp::linear_with_grad_in_buffer)
// against the golden with torch's own Linear: the first micro-batch overwrites the slot (which
// zero_grad_buffer() no longer zeroes), later ones accumulate, and a layer unused on 2 of 3 steps
// (its slot stale after a step that used it, zeroed after one that did not) contributes zeros.
TEST(DistributedDataParallel, MatchesGoldenWithGradientsWrittenInPlaceByTheWeightGradientGemm) {
  expect_matches_golden({.world = 2,
                         .micro_batches = 3,
                         .opt = Opt::kSgd,
                         .side_layer_every_third_step = true,
                         .config = bucket_bytes(1024),
                         .grads_in_buffer = true});
  DdpConfig no_overlap = bucket_bytes(0);
  no_overlap.overlap_grad_reduce = false;
  expect_matches_golden({.world = 4,
                         .opt = Opt::kSgd,
                         .side_layer_every_third_step = true,
                         .config = no_overlap,
                         .grads_in_buffer = true});
  DdpConfig find_unused = bucket_bytes(1024);
  find_unused.find_unused_parameters = true;
  expect_matches_golden({.world = 2,
                         .micro_batches = 2,
                         .opt = Opt::kAdam,
                         .side_layer_every_third_step = true,
                         .config = find_unused,
                         .grads_in_buffer = true});
}

// The same layers with the feature off, and under create_graph (the gradient must carry its graph):
// their gradients go through autograd, and the result is the same.
TEST(DistributedDataParallel, GradientsInBufferFallBackToAutogradWhenOffOrUnderCreateGraph) {
  DdpConfig off = bucket_bytes(1024);
  off.gradient_accumulation_fusion = false;
  expect_matches_golden({.world = 2,
                         .micro_batches = 2,
                         .opt = Opt::kSgd,
                         .side_layer_every_third_step = true,
                         .config = off,
                         .grads_in_buffer = true});
  expect_matches_golden({.world = 2,
                         .micro_batches = 2,
                         .opt = Opt::kSgd,
                         .config = bucket_bytes(1024),
                         .create_graph = true,
                         .grads_in_buffer = true});
}

// No zeroing pass for slots written in place: zero_grad_buffer() leaves a slot whose gradient a layer
// wrote in place in the last step (it will be overwritten), and zeroes one whose param got none. The
// plain autograd path (torch's Linear) is zeroed, as in Megatron (Note [Slots written in place]).
TEST(DistributedDataParallel, ZeroGradBufferZeroesOnlySlotsThatTheNextGradientWillNotOverwrite) {
  for (const bool in_buffer : {true, false}) {
    run_on_mesh({1, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
      Mlp model = make_mlp(kSeed, kIn, kHidden, kOut, /*with_side=*/true);
      model->grads_in_buffer = in_buffer;
      DistributedDataParallel ddp(model.ptr(), mesh, "dp", bucket_bytes(1024));
      auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
      auto step = [&](bool use_side) {
        ddp.zero_grad_buffer();
        torch::mse_loss(ddp.forward(x, use_side), y).backward();
        ddp.finish_grad_sync();
      };
      step(/*use_side=*/true);
      const auto fc1_grad = ddp.main_grad("fc1.weight").clone();
      const auto side_grad = ddp.main_grad("side.weight").clone();
      ASSERT_GT(fc1_grad.abs().max().item<double>(), 0);
      ASSERT_GT(side_grad.abs().max().item<double>(), 0);
      ddp.zero_grad_buffer();
      if (in_buffer) {
        EXPECT_TRUE(torch::equal(ddp.main_grad("fc1.weight"), fc1_grad))
            << "zeroed a slot that the next step overwrites";
      } else {
        EXPECT_EQ(ddp.main_grad("fc1.weight").abs().max().item<double>(), 0) << "an autograd-filled slot left stale";
      }
      torch::mse_loss(ddp.forward(x, /*use_side=*/true), y).backward();
      ddp.finish_grad_sync();
      EXPECT_TRUE(torch::equal(ddp.main_grad("fc1.weight"), fc1_grad))
          << "same batch and params: overwritten, not added";
      EXPECT_TRUE(torch::equal(ddp.main_grad("side.weight"), side_grad));
      step(/*use_side=*/false);
      EXPECT_EQ(ddp.main_grad("side.weight").abs().max().item<double>(), 0) << "no gradient, yet its stale slot kept";
      ddp.zero_grad_buffer();
      EXPECT_EQ(ddp.main_grad("side.weight").abs().max().item<double>(), 0);
      torch::mse_loss(ddp.forward(x, /*use_side=*/true), y).backward();
      ddp.finish_grad_sync();
      EXPECT_TRUE(torch::equal(ddp.main_grad("fc1.weight"), fc1_grad));
      EXPECT_TRUE(torch::equal(ddp.main_grad("side.weight"), side_grad));
    });
  }
}

// Code outside meshddp that adds into a param's .grad before autograd's first gradient of the step
// (torch's pipelining weight pass does `.grad += dw`; Megatron-style layers accumulate into main_grad)
// keeps its addition: the slot was zeroed, so autograd's gradient is added to it, not written over it.
TEST(DistributedDataParallel, AGradientAddedIntoGradBeforeBackwardIsKept) {
  run_on_mesh({1, 1}, {"dp", "tp"}, [&](DeviceMesh& mesh) {
    Mlp model = make_mlp(kSeed, kIn, kHidden, kOut);
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", bucket_bytes(1024));
    auto [x, y] = make_batch(kSeed, 0, kBatch, kIn, kOut);
    for (int step = 0; step < 2; ++step) {
      ddp.zero_grad_buffer();
      torch::mse_loss(ddp.forward(x), y).backward();
      ddp.finish_grad_sync();
    }
    const torch::Tensor grad = ddp.main_grad("fc1.weight").clone();
    ddp.zero_grad_buffer();
    torch::Tensor g = model->named_parameters()["fc1.weight"].grad();
    const torch::Tensor extra = torch::full_like(grad, 0.5);
    g.add_(extra);  // before this step's backward: a split-backward weight pass, or main_grad.add_
    torch::mse_loss(ddp.forward(x), y).backward();
    ddp.finish_grad_sync();
    EXPECT_TRUE(torch::allclose(ddp.main_grad("fc1.weight"), grad + extra, 0, 1e-6))
        << "the addition made before backward was lost: max |diff| "
        << (ddp.main_grad("fc1.weight") - grad - extra).abs().max().item<double>();
  });
}
