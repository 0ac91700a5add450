// meshddp's public API, one include: #include <meshddp/meshddp.h> (C++ package: find_package(meshddp)
// and link meshddp::meshddp; docs/api.md). What is not reachable from here is internal and may change.
// A ZeRO-1 step and a checkpoint, given a module `model` (a std::shared_ptr), `dp`, `tp`, a batch `x`,
// `y` and the `step` (compiled as written, into the test docs.readme_cpp_snippet_runs_on_2_ranks):
//
//   auto mesh = meshddp::DeviceMesh::from_env({dp, tp}, {"dp", "tp"});
//   meshddp::DdpConfig config;
//   config.use_distributed_optimizer = true;  // false: plain DDP, step a torch::optim optimizer instead
//   meshddp::DistributedDataParallel ddp(model, mesh, "dp", config);
//   meshddp::DistributedOptimizer opt(ddp.grad_buffer(), meshddp::DistributedOptimizerConfig{});
//   ddp.zero_grad_buffer();
//   torch::mse_loss(ddp.forward(x), y).backward();
//   ddp.finish_grad_sync();
//   opt.step();
//   meshddp::save_checkpoint(meshddp::TrainingState{&ddp.module(), &ddp, &opt}, "ckpt", step);
#pragma once

#include "meshddp/version.h"

// The mesh and the one checked collective path (for a trainer's own metrics: all-reduce of a loss).
#include "mesh/collectives.h"
#include "mesh/device_mesh.h"
#include "mesh/pipeline_groups.h"

// Data parallelism, the ZeRO-1 optimizer, its LR schedule, whole-training-state checkpoints.
#include "optimizer/distributed_optimizer.h"
#include "optimizer/lr_scheduler.h"
#include "plugin/checkpoint_saver.h"
#include "plugin/distributed_data_parallel.h"
#include "plugin/pipeline.h"
#include "plugin/training_checkpoint.h"

// Tensor parallelism: layers, plans, the linear that writes its weight gradient into the buffer, and
// the gradient norm and clipping over DP x TP (plain DDP); the all-to-all of expert parallelism.
#include "tp/expert_parallel.h"
#include "tp/grad_norm.h"
#include "tp/linear_with_grad_in_buffer.h"
#include "tp/parallelize.h"
#include "tp/tp_functions.h"
#include "tp/tp_layers.h"
