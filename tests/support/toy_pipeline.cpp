// The toy 2-stage pipeline with a tied embedding: tests/support/toy_pipeline.h.
#include "tests/support/toy_pipeline.h"

#include "grad_buffer/grad_buffer.h"
#include "mesh/pipeline_groups.h"
#include "optimizer/distributed_optimizer.h"
#include "plugin/pipeline.h"
#include "tests/support/mlp.h"  // shard_rows
#include "tests/support/rank_threads.h"

#include <gtest/gtest.h>

namespace meshddp::test::toy_pipeline {
namespace {
std::mutex init_mutex;
}  // namespace

Stage0 make_stage0() {
  std::lock_guard<std::mutex> lock(init_mutex);
  torch::manual_seed(kSeed);
  return Stage0();
}
Stage1 make_stage1() {
  std::lock_guard<std::mutex> lock(init_mutex);
  torch::manual_seed(kSeed + 1);
  return Stage1();
}

std::pair<torch::Tensor, torch::Tensor> make_tokens(int64_t step, bool ignore) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(kSeed * 7919 + step);
  auto tokens = torch::randint(kVocab, {kBatch, kSeq}, gen);
  auto labels = torch::randint(kVocab, {kBatch, kSeq}, gen);
  if (ignore) {
    auto drop = torch::rand({kBatch, kSeq}, gen) < torch::linspace(0.1, 0.6, kBatch).unsqueeze(1);
    labels = labels.masked_fill(drop, -100);
  }
  return {tokens, labels};
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& labels, bool per_token) {
  namespace F = torch::nn::functional;
  auto options = F::CrossEntropyFuncOptions().ignore_index(-100);
  if (per_token) {
    options.reduction(torch::kSum);
  } else {
    options.reduction(torch::kMean);
  }
  return F::cross_entropy(logits.reshape({-1, kVocab}).to(torch::kFloat), labels.reshape({-1}), options);
}

std::vector<torch::Tensor> golden(bool ignore) {
  Stage0 s0 = make_stage0();
  Stage1 s1 = make_stage1();
  std::vector<torch::Tensor> params{s0->wte->weight, s0->fc0->weight, s0->fc0->bias, s1->fc1->weight, s1->fc1->bias};
  torch::optim::SGD opt(params, torch::optim::SGDOptions(kLr));
  for (int64_t step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [tokens, labels] = make_tokens(step, ignore);
    auto logits = torch::nn::functional::linear(torch::tanh(s1->fc1(s0->forward(tokens))), s0->wte->weight);
    loss_of(logits, labels, /*per_token=*/false).backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : params) out.push_back(p.detach().clone());
  return out;
}

void run_pipeline(const RunOptions& run) {
  const auto want = golden(run.per_token);
  run_on_mesh({kDp, 2}, {"dp", "pp"}, [&](DeviceMesh& mesh) {
    const int64_t stage = mesh.coordinate("pp"), dp_rank = mesh.coordinate("dp");
    auto& pp = *mesh["pp"];
    DdpConfig config;
    config.bucket_bytes = 1 << 20;  // one bucket per buffer
    config.use_distributed_optimizer = run.zero1;
    config.comm_hook = run.comm_hook;
    Stage0 s0{nullptr};
    Stage1 s1{nullptr};
    std::unique_ptr<DdpEngine> ddp;
    if (stage == 0) {
      s0 = make_stage0();
      s0->to(run.device);
      declare_tied_across_stages(s0->wte->weight);
      ddp = std::make_unique<DistributedDataParallel<Stage0Impl>>(s0.ptr(), mesh, "dp", config);
    } else {
      s1 = make_stage1();  // its lm_head starts from other values: construction broadcasts stage 0's wte
      s1->to(run.device);
      declare_tied_across_stages(s1->lm_head->weight);
      ddp = std::make_unique<DistributedDataParallel<Stage1Impl>>(s1.ptr(), mesh, "dp", config);
    }
    std::unique_ptr<DistributedOptimizer> zero1;
    std::unique_ptr<torch::optim::SGD> sgd;
    if (run.zero1) {
      DistributedOptimizerConfig oc;
      oc.kind = OptimizerKind::kSgd;
      oc.lr = kLr;
      zero1 = std::make_unique<DistributedOptimizer>(ddp->grad_buffer(), oc);
    } else {
      sgd = std::make_unique<torch::optim::SGD>(ddp->parameters(), torch::optim::SGDOptions(kLr));
    }
    ddp->check_tied_params_identical();
    for (int64_t step = 0; step < kSteps; ++step) {
      ddp->zero_grad_buffer();
      auto [tokens, labels] = make_tokens(step, run.per_token);
      tokens = shard_rows(tokens, dp_rank, kDp).to(run.device),
      labels = shard_rows(labels, dp_rank, kDp).to(run.device);
      std::vector<c10::intrusive_ptr<c10d::Work>> sends;
      if (stage == 0) {
        auto* d = static_cast<DistributedDataParallel<Stage0Impl>*>(ddp.get());
        std::vector<torch::Tensor> outs;
        for (int64_t m = 0; m < kMicro; ++m) {
          outs.push_back(d->forward(tokens.chunk(kMicro)[m]));
          std::vector<torch::Tensor> send{outs.back().detach().to(torch::kCPU).contiguous()};
          sends.push_back(pp.send(send, 1, 0));
        }
        for (int64_t m = 0; m < kMicro; ++m) {
          std::vector<torch::Tensor> grad{torch::empty(outs[m].sizes())};
          pp.recv(grad, 1, 0)->wait();
          ddp->set_requires_gradient_sync(m == kMicro - 1);
          outs[m].backward(grad[0].to(run.device));
        }
      } else {
        auto* d = static_cast<DistributedDataParallel<Stage1Impl>*>(ddp.get());
        for (int64_t m = 0; m < kMicro; ++m) {
          std::vector<torch::Tensor> h{torch::empty({kBatch / kDp / kMicro, kSeq, kHidden})};
          pp.recv(h, 0, 0)->wait();
          auto input = h[0].to(run.device).requires_grad_(true);
          auto loss = loss_of(d->forward(input), labels.chunk(kMicro)[m], run.per_token);
          ddp->set_requires_gradient_sync(m == kMicro - 1);
          (run.per_token ? loss : loss / kMicro).backward();
          std::vector<torch::Tensor> grad{input.grad().to(torch::kCPU).contiguous()};
          sends.push_back(pp.send(grad, 0, 0));
        }
      }
      for (auto& w : sends) w->wait();
      FinalizeOptions options;
      if (run.per_token) {
        options.num_tokens = stage == 1 ? (labels != -100).sum().item<int64_t>() : 0;  // the last stage's counts
        options.pp_group = mesh["pp"];
      }
      finalize_model_grads({ddp.get()}, options);
      if (zero1) {
        zero1->step();
      } else {
        sgd->step();
      }
      ddp->check_tied_params_identical();  // bit-identical copies after every step
    }
    if (zero1) zero1->finish_param_sync();
    const auto close = [&](const torch::Tensor& on_device, const torch::Tensor& expected, const char* what) {
      const torch::Tensor got = on_device.detach().to(torch::kCPU);
      EXPECT_TRUE(torch::allclose(got, expected, run.tol, run.tol))
          << what << " on stage " << stage << ", DP rank " << dp_rank << ": max |diff| "
          << (got - expected).abs().max().item<double>();
    };
    if (stage == 0) {
      close(s0->wte->weight, want[0], "wte.weight");
      close(s0->fc0->weight, want[1], "fc0.weight");
      close(s0->fc0->bias, want[2], "fc0.bias");
    } else {
      close(s1->lm_head->weight, want[0], "lm_head.weight (tied to wte.weight)");
      close(s1->fc1->weight, want[3], "fc1.weight");
      close(s1->fc1->bias, want[4], "fc1.bias");
    }
  });
}

}  // namespace meshddp::test::toy_pipeline
