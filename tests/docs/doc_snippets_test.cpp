// The C++ code blocks of docs/*.md, each inside a test that builds and runs it (or, where it needs a
// model this file does not have, a function that is compiled only). tests/docs/check_doc_snippets.py
// checks that every code line of each block appears, in order, in the file its `<!-- snippet: ... -->`
// marker names: a block edited in the docs must be edited here too, and then it compiles.
#include "common/grad_norm.h"
#include "grad_buffer/grad_buffer.h"
#include "grad_buffer/grad_in_place.h"
#include "mesh/placement.h"
#include "optimizer/distributed_optimizer.h"
#include "optimizer/lr_scheduler.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/training_checkpoint.h"
#include "tests/support/rank_threads.h"
#include "tests/support/temp_dir.h"
#include "tp/linear_with_grad_in_buffer.h"
#include "tp/parallelize.h"
#include "tp/tp_layers.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <meshddp/meshddp.h>  // what the docs' blocks include (an installed consumer's spelling)
#include <string>
#include <sys/stat.h>
#include <unistd.h>

using namespace meshddp;

namespace {

struct Net : torch::nn::Module {
  Net()
      : fc(register_module("fc", torch::nn::Linear(4, 3))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})))),
        head(register_module("head", torch::nn::Linear(3, 1))) {}
  torch::Tensor forward(torch::Tensor x) {
    // docs/reference/cpp_api.md, "Gradients written into the buffer": a layer of your own.
    x = meshddp::linear_with_grad_in_buffer(x, fc->weight, fc->bias);  // instead of fc(x): same math
    return head(torch::tanh(norm(x)));
  }
  torch::nn::Linear fc;
  torch::nn::LayerNorm norm;  // for docs/reference/optimizer.md's "*norm*" group rule
  torch::nn::Linear head;
};

torch::Tensor batch_x() { return torch::linspace(-1, 1, 24).reshape({6, 4}); }
torch::Tensor batch_y() { return torch::linspace(0, 1, 6).reshape({6, 1}); }

// docs/reference/cpp_api.md: an autograd Function of your own writing its weight gradient into the buffer.
struct MatmulWithGradInBuffer : torch::autograd::Function<MatmulWithGradInBuffer> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& w) {
    ctx->save_for_backward({input, w});
    return at::mm(input, w.t());
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &w = saved[1];
    const at::Tensor a = grads[0].t(), b = input;  // dL/dw = grad_out^T @ input
    const at::Tensor grad_input = at::mm(grads[0], w);
    at::Tensor g = meshddp::write_grad_in_place(w, [&](const at::Tensor& slot, bool accumulate) {
      at::Tensor out = slot;  // slot (+)= the gradient, shaped like w
      accumulate ? out.addmm_(a, b) : at::mm_out(out, a, b);
    });
    if (!g.defined()) g = at::mm(a, b);  // not in a buffer (no DDP, fp32 main grads, create_graph): as usual
    return {grad_input, g};              // the gradient of each input of the Function, w's among them
  }
};

}  // namespace

TEST(DocSnippets, ApiGradInBufferLayersTrainUnderDdp) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    torch::manual_seed(0);
    auto model = std::make_shared<Net>();
    meshddp::DistributedDataParallel ddp(model, mesh, "dp");
    ddp.zero_grad_buffer();
    torch::mse_loss(ddp.forward(batch_x()), batch_y()).backward();
    ddp.finish_grad_sync();
    EXPECT_TRUE(model->fc->weight.grad().abs().sum().item<double>() > 0);
    // The Function of one's own, outside DDP: the gradient as usual.
    auto w = torch::ones({3, 4}, torch::requires_grad());
    MatmulWithGradInBuffer::apply(batch_x(), w).sum().backward();
    EXPECT_TRUE(torch::allclose(w.grad(), batch_x().sum(0).expand({3, 4})));
  });
}

TEST(DocSnippets, ApiClipGradNorm) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    torch::manual_seed(0);
    auto model = std::make_shared<Net>();
    meshddp::DistributedDataParallel ddp(model, mesh, "dp");
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    ddp.zero_grad_buffer();
    auto loss = torch::mse_loss(ddp.forward(batch_x()), batch_y());
    // docs/reference/cpp_api.md, "Gradient norm and clipping for plain DDP"
    loss.backward();
    const double norm = meshddp::clip_grad_norm_(ddp.grad_buffer(), /*max_norm=*/1.0);  // norm before clipping
    optimizer.step();
    EXPECT_GT(norm, 0);
  });
}

TEST(DocSnippets, OptimizerZero1LoopWithLrSchedule) {
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    torch::manual_seed(0);
    auto model = std::make_shared<Net>();
    auto x = batch_x();
    auto y = batch_y();
    const int64_t steps = 3;
    // docs/reference/optimizer.md
    meshddp::DdpConfig ddp_config;
    ddp_config.use_distributed_optimizer = true;  // pad buckets, reduce-scatter, flat param buffer
    meshddp::DistributedDataParallel ddp(model, mesh, "dp", ddp_config);

    meshddp::DistributedOptimizerConfig opt_config;
    opt_config.kind = meshddp::OptimizerKind::kAdamW;  // or kSgd (momentum)
    opt_config.lr = 3e-4;
    opt_config.weight_decay = 0.1;
    opt_config.groups = {{"*.bias", std::nullopt, 0.0}, {"*norm*", std::nullopt, 0.0}};  // no decay on biases/norms
    opt_config.clip_grad_norm = 1.0;                                                     // 0 = off
    opt_config.overlap_param_gather = true;             // gathers complete during the next forward
    opt_config.fused_step = meshddp::FusedStep::kAuto;  // fused kernels on CUDA, ATen foreach on CPU
    meshddp::DistributedOptimizer opt(ddp.grad_buffer(), opt_config);

    for (int64_t step = 0; step < steps; ++step) {
      ddp.zero_grad_buffer();
      torch::mse_loss(ddp.forward(x), y).backward();  // buckets reduce-scatter during backward
      meshddp::StepResult r = opt.step();             // r.grad_norm, r.clipped, r.skipped + r.report
      EXPECT_FALSE(r.skipped);
    }
    opt.finish_param_sync();  // before evaluation outside ddp.forward / checkpoints

    // docs/reference/cpp_api.md, "LR schedule"
    auto& zero1_optimizer = opt;
    // clang-format off: the lines as docs/reference/cpp_api.md has them
    meshddp::LrScheduleConfig sched_config{.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 100,
                                           .decay_steps = 10000, .decay_style = meshddp::LrDecayStyle::kCosine};
    // clang-format on
    meshddp::LrScheduler schedule(sched_config);
    schedule.attach(zero1_optimizer);  // a DistributedOptimizer, or any torch::optim::Optimizer (AdamW, Adam, SGD, ...)
    for (int64_t step = 0; step < steps; ++step) {
      auto result = zero1_optimizer.step();  // uses schedule.lr()
      if (!result.skipped) schedule.step();  // as Megatron: a skipped step does not advance the schedule
    }
    auto state = schedule.state();  // std::map<std::string, std::string>: step count + every config field
    schedule.load_state(state);     // throws naming a field that differs, unless use_checkpoint_config
    EXPECT_DOUBLE_EQ(schedule.lr(), meshddp::lr_at(sched_config, steps));
  });
}

TEST(DocSnippets, OptimizerInstances) {
  test::run_on_mesh({4}, {"dp"}, [](DeviceMesh& mesh) {
    torch::manual_seed(0);
    auto model = std::make_shared<Net>();
    meshddp::DdpConfig ddp_config;
    // docs/reference/optimizer.md, "Hierarchical ZeRO-1"
    ddp_config.use_distributed_optimizer = true;
    ddp_config.num_distributed_optimizer_instances = 2;  // D = 4: instances {0,1} {2,3}, across {0,2} {1,3}
    meshddp::DistributedDataParallel ddp(model, mesh, "dp", ddp_config);  // a DeviceMesh: it makes the groups
    EXPECT_EQ(ddp.grad_buffer()->groups().dp->getSize(), 2);
  });
}

TEST(DocSnippets, CheckpointsSaveAndLoad) {
  const std::string dir = test::fresh_dir("doc-snippets");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(chdir(dir.c_str()), 0);  // the block writes "ckpt" in the working directory
  test::run_on_mesh({2}, {"dp"}, [](DeviceMesh& mesh) {
    torch::manual_seed(0);
    auto model = std::make_shared<Net>();
    meshddp::DdpConfig config;
    config.use_distributed_optimizer = true;
    meshddp::DistributedDataParallel ddp(model, mesh, "dp", config);
    meshddp::DistributedOptimizer zero1(ddp.grad_buffer(), {});
    const int64_t step = 7, samples_seen = 56;
    const std::string json_text = R"({"lr": 0.001})";
    // docs/reference/checkpoints.md
    meshddp::TrainingState state{model.get(), &ddp, &zero1, nullptr};  // or {model.get(), &ddp, nullptr, &adamw}
    meshddp::save_checkpoint(state, "ckpt", step, {{"data_position", samples_seen}, {"lr_schedule", json_text}});
    // ... later, or in a restarted run:
    meshddp::LoadedCheckpoint c = meshddp::load_checkpoint(state, "ckpt");  // latest complete one, any DP x TP
    int64_t resume_position = std::get<int64_t>(c.values.at("data_position"));
    EXPECT_EQ(c.step, step);
    EXPECT_EQ(resume_position, samples_seen);
  });
  ASSERT_EQ(chdir("/"), 0);
  test::remove_dir(dir);
}

// docs/guide/parallelism.md and docs/guide/parallelism.md declare experts on a model with MoE blocks:
// compiled here (the expert-parallel tests run the same calls on real models).
struct MoeModel : torch::nn::Module {
  torch::nn::ModuleList experts{register_module("experts", torch::nn::ModuleList())};
};

[[maybe_unused]] void declare_experts_as_the_docs_do(at::Tensor param, int64_t ep) {
  meshddp::DdpConfig config;
  std::vector<meshddp::PlanEntry> plan;
  // docs/guide/parallelism.md
  plan.push_back({"blocks.*.moe.experts", meshddp::ExpertParallel{}});
  meshddp::declare_expert_param(param);
  config.expert_parallel_size = ep;  // DdpConfig
}

[[maybe_unused]] void declare_experts_by_plan(std::shared_ptr<MoeModel> model, const DeviceMesh& mesh) {
  // docs/guide/parallelism.md, "Expert parallel"
  for (auto& p : model->experts->parameters()) meshddp::declare_expert_param(p);
  // clang-format off: the lines as docs/guide/parallelism.md has them
    meshddp::parallelize(*model, mesh, {{"blocks.*.moe.experts.*.fc1", meshddp::ColwiseParallel{}},
                                        {"blocks.*.moe.experts.*.fc2", meshddp::RowwiseParallel{}},
                                        {"blocks.*.moe.experts", meshddp::ExpertParallel{}}});
  // clang-format on
  meshddp::DdpConfig config;
  config.expert_parallel_size = 2;                                    // must divide the DP (x CP) size
  meshddp::DistributedDataParallel ddp(model, mesh, {"dp"}, config);  // or {"dp", "cp"}
}
