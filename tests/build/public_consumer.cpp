// A trainer's use of the front end, compiled by tests/build/check_public_headers.py against the
// installed headers only (<meshddp/meshddp.h> and torch): DDP and its config, the ZeRO-1 optimizer
// and OptimizerConfig, the mesh, a TP plan and layers, the pipeline controls, whole-state checkpoints
// (sync and async) and the LR schedule. Compiled, not run (build.cmake_package_consumer_on_2_ranks
// links and runs an installed consumer).
#include <torch/torch.h>

#include <meshddp/meshddp.h>

namespace {

struct Block : torch::nn::Module {
  Block()
      : fc1(register_module("fc1", meshddp::tp::Linear(8, 16))),
        fc2(register_module("fc2", meshddp::tp::Linear(16, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  meshddp::tp::Linear fc1, fc2;
};

}  // namespace

int train_one_step(int64_t dp, int64_t tp) {
  auto mesh = meshddp::DeviceMesh::from_env({dp, tp}, {"dp", "tp"});
  auto model = std::make_shared<Block>();
  meshddp::parallelize(*model, mesh, {{"fc1", meshddp::ColwiseParallel{}}, {"fc2", meshddp::RowwiseParallel{}}});

  meshddp::DdpConfig config;
  config.use_distributed_optimizer = true;
  config.bucket_bytes = meshddp::kDefaultBucketBytes;
  meshddp::DistributedDataParallel<Block> ddp(model, mesh, "dp", config);
  meshddp::OptimizerConfig optimizer_config;  // DistributedOptimizerConfig's other name
  optimizer_config.clip_grad_norm = 1.0;
  meshddp::DistributedOptimizer opt(ddp.grad_buffer(), optimizer_config);
  meshddp::LrScheduleConfig schedule;
  schedule.warmup_steps = 2;
  meshddp::LrScheduler scheduler(schedule);
  scheduler.attach(opt);

  ddp.zero_grad_buffer();
  {
    auto no_sync = ddp.no_sync();
    torch::mse_loss(ddp.forward(torch::randn({4, 8})), torch::zeros({4, 8})).backward();
  }
  torch::mse_loss(ddp.forward(torch::randn({4, 8})), torch::zeros({4, 8})).backward();
  ddp.finish_grad_sync();
  meshddp::StepResult result = opt.step();
  scheduler.step();

  std::vector<meshddp::DdpEngine*> chunks{&ddp};
  meshddp::finalize_model_grads(chunks);

  meshddp::TrainingState state{model.get(), &ddp, &opt, nullptr};
  meshddp::save_checkpoint(state, "ckpt", 1, {{"data_position", int64_t{4}}});
  meshddp::CheckpointSaver saver(state);
  meshddp::CheckpointSaveOptions async;
  async.async_save = true;
  meshddp::AsyncSaveStart started = saver.save("ckpt", 2, {}, async);
  meshddp::AsyncSaveReport report = saver.wait();
  std::optional<meshddp::LoadedCheckpoint> loaded = meshddp::resume_checkpoint(state, "ckpt");
  return result.skipped || report.failed() || started.path.empty() || !loaded ? 1 : 0;
}
