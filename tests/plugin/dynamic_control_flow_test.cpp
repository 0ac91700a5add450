// Dynamic control flow: a mixture-of-experts-like model whose data routes each rank's samples to a
// different expert, so every rank leaves different params without a gradient. No hang, the same
// collectives in the same order on every rank, gradients equal to the golden's (an expert no
// sample reached has gradient zero), and with find_unused_parameters every bucket still launches
// during backward.
#include "grad_buffer/grad_buffer.h"
#include "plugin/distributed_data_parallel.h"
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

using namespace meshddp;
using namespace meshddp::test;

namespace {

constexpr int64_t kExperts = 4, kIn = 8, kHidden = 16, kBatch = 16;

// Sample i goes to expert argmax(x[i, :kExperts]).
struct MoeImpl : torch::nn::Module {
  MoeImpl() {
    in = register_module("in", torch::nn::Linear(kIn, kHidden));
    for (int64_t e = 0; e < kExperts; ++e) experts->push_back(torch::nn::Linear(kHidden, kHidden));
    register_module("experts", experts);
    out = register_module("out", torch::nn::Linear(kHidden, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(in(x));
    auto route = x.narrow(1, 0, kExperts).argmax(1);
    auto y = torch::zeros_like(h);
    for (int64_t e = 0; e < kExperts; ++e) {
      auto rows = (route == e).nonzero().squeeze(1);
      if (rows.numel() == 0) continue;  // this expert gets no gradient in this step
      y = y.index_add(0, rows, experts[e]->as<torch::nn::Linear>()->forward(h.index_select(0, rows)));
    }
    return out(y);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList experts;
};
TORCH_MODULE(Moe);

Moe make_moe() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(11);
  return Moe();
}

// Global batch: the rows of DP rank r (of 4) all route to expert r % kExperts... except on step 1,
// where every rank routes to expert 0 (experts 1..3 get no gradient anywhere).
std::pair<torch::Tensor, torch::Tensor> batch(int step, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  auto x = torch::randn({kBatch, kIn}, gen);
  auto y = torch::randn({kBatch, 2}, gen);
  const int64_t rows = kBatch / world;
  for (int64_t r = 0; r < world; ++r) x.narrow(0, r * rows, rows).select(1, step == 1 ? 0 : r % kExperts).add_(10.0);
  return {x, y};
}

void check(bool find_unused) {
  constexpr int kWorld = 4, kSteps = 3;
  // Golden gradients per step (params fixed: we check gradients, then apply the same SGD step).
  Moe golden = make_moe();
  std::vector<std::vector<torch::Tensor>> golden_grads;
  {
    torch::optim::SGD opt(golden->parameters(), 0.1);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto [x, y] = batch(step, kWorld);
      torch::mse_loss(golden->forward(x), y).backward();
      golden_grads.emplace_back();
      for (auto& p : golden->parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        golden_grads.back().push_back(p.grad().clone());
      }
      opt.step();
    }
  }
  run_on_mesh({kWorld}, {"dp"}, [&](DeviceMesh& mesh) {
    Moe model = make_moe();
    DdpConfig config;
    config.bucket_bytes = 0;  // one bucket per param: an unused expert sits between used ones
    config.find_unused_parameters = find_unused;
    DistributedDataParallel ddp(model.ptr(), mesh, "dp", config);
    torch::optim::SGD opt(model->parameters(), 0.1);
    const int64_t buckets = static_cast<int64_t>(ddp.grad_buffer()->layout().buckets.size());
    for (int step = 0; step < kSteps; ++step) {
      ddp.zero_grad_buffer();
      auto [x, y] = batch(step, kWorld);
      const int64_t rows = kBatch / kWorld;
      torch::mse_loss(ddp.forward(x.narrow(0, mesh.rank() * rows, rows)), y.narrow(0, mesh.rank() * rows, rows))
          .backward();
      if (find_unused) {
        EXPECT_EQ(ddp.grad_buffer()->stats().buckets_launched, buckets)
            << "every bucket launched before finish_grad_sync()";
      } else if (mesh.rank() == 1) {
        EXPECT_LT(ddp.grad_buffer()->stats().buckets_launched, buckets)
            << "without the walk, unused experts block overlap";
      }
      ddp.finish_grad_sync();
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(torch::allclose(params[i].grad(), golden_grads[step][i], 1e-5, 1e-6))
            << "step " << step << " param " << i << " on rank " << mesh.rank() << " find_unused=" << find_unused;
      }
      opt.step();
    }
  });
}

}  // namespace

TEST(DynamicControlFlow, ExpertsRoutedDifferentlyPerRankGiveGoldenGradsWithoutAGraphWalk) { check(false); }

TEST(DynamicControlFlow, FindUnusedParametersKeepsEveryBucketOverlappedAndExact) { check(true); }
